"""MuJoCo Warp's Ant and Humanoid, run for real on Warp's CPU device, against gymnasium's.

Needs the ``mjwarp`` extra (``pip install -e '.[mjwarp]'``; warp-lang is a ~150 MB wheel, so it
is not in ``dev``); the tests carry the ``mjwarp`` marker and skip where it is not installed.
The first run compiles Warp's kernels for the CPU (about a minute per model), later runs load
them from Warp's kernel cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mujoco_warp")
pytestmark = pytest.mark.mjwarp

import gymnasium as gym  # noqa: E402

from services.pod.envs import make_env  # noqa: E402
from services.pod.envs.mujoco_warp_env import MjWarpLocomotionEnv, ant, humanoid  # noqa: E402

ONLY_POSITIONS_AND_VELOCITIES = {
    "Ant-v5": {"include_cfrc_ext_in_observation": False},
    "Humanoid-v5": {
        "include_cinert_in_observation": False,
        "include_cvel_in_observation": False,
        "include_qfrc_actuator_in_observation": False,
        "include_cfrc_ext_in_observation": False,
    },
}


def _gymnasium_twin(env: MjWarpLocomotionEnv, gym_id: str, world: int) -> gym.Env:
    """Gymnasium's env with the documented differences switched off, in ``world``'s state."""
    twin = gym.make(gym_id, contact_cost_weight=0.0, **ONLY_POSITIONS_AND_VELOCITIES[gym_id])
    twin = twin.unwrapped
    twin.model.opt.solver = env.mj_model.opt.solver  # Newton for Humanoid (PGS unsupported)
    twin.reset(seed=0)
    twin.set_state(env._qpos[world].double().numpy(), env._qvel[world].double().numpy())
    return twin


def _random_actions(env: MjWarpLocomotionEnv, rng: np.random.Generator) -> np.ndarray:
    space = env.single_action_space
    return rng.uniform(space.low, space.high, (env.num_envs, *space.shape)).astype(np.float32)


def test_ant_transitions_match_gymnasium_before_the_feet_touch_the_floor() -> None:
    # The Ant starts in the air; until its first (frictional) contact the dynamics must agree.
    # With friction MuJoCo Warp's solver differs from MuJoCo's (docs/gpu_physics.md).
    env = ant(2, seed=3)
    obs, _ = env.reset()
    twin = _gymnasium_twin(env, "Ant-v5", world=1)
    np.testing.assert_allclose(obs[1].numpy(), twin._get_obs(), atol=1e-6)
    rng = np.random.default_rng(0)
    for _ in range(2):
        actions = _random_actions(env, rng)
        obs, reward, terminated, truncated, _ = env.step(torch.as_tensor(actions))
        twin_obs, twin_reward, twin_terminated, _, _ = twin.step(actions[1].astype(np.float64))
        assert twin.data.ncon == 0
        np.testing.assert_allclose(obs[1].numpy(), twin_obs, atol=1e-4)
        assert float(reward[1]) == pytest.approx(twin_reward, abs=1e-4)
        assert bool(terminated[1]) == twin_terminated and not truncated.any()
    assert obs.shape == (2, 27) and obs.dtype == torch.float32


def test_humanoid_transitions_match_gymnasium_standing_and_falling() -> None:
    env = humanoid(1, seed=0)
    env.reset()
    twin = _gymnasium_twin(env, "Humanoid-v5", world=0)
    rng = np.random.default_rng(1)
    saw_contact = False
    for _ in range(8):
        actions = _random_actions(env, rng)
        _, reward, terminated, _, info = env.step(torch.as_tensor(actions))
        twin_obs, twin_reward, twin_terminated, _, _ = twin.step(actions[0].astype(np.float64))
        saw_contact |= twin.data.ncon > 0
        np.testing.assert_allclose(info["final_obs"][0].numpy(), twin_obs, atol=1e-3)
        assert float(reward[0]) == pytest.approx(twin_reward, abs=1e-3)
        assert bool(terminated[0]) == twin_terminated
    assert saw_contact, "the comparison must include the feet on the floor"


def test_time_limit_truncates_and_autoreset_starts_a_new_episode() -> None:
    env = ant(3, seed=0, max_episode_steps=2)
    env.reset()
    zero = torch.zeros(3, 8)
    _, r1, _, _, _ = env.step(zero)
    obs, r2, terminated, truncated, info = env.step(zero)
    assert truncated.all() and not terminated.any()
    assert info["episode_length"].tolist() == [2, 2, 2]
    torch.testing.assert_close(info["episode_return"], r1 + r2)
    # The new episode starts near MuJoCo's initial pose; the final observation is elsewhere.
    assert not torch.equal(obs, info["final_obs"])
    assert (obs[:, 0] - 0.75).abs().max() <= 0.1  # torso height: qpos0 z +- reset noise
    assert (env._stats.episode_length == 0).all()
    _, _, _, truncated, _ = env.step(zero)
    assert not truncated.any()


def test_unhealthy_world_terminates_without_healthy_reward_and_restarts() -> None:
    env = ant(3, seed=0)
    env.reset()
    env._qpos[1, 2] = 3.0  # world 1's torso far above Ant's healthy range [0.2, 1.0]
    obs, reward, terminated, truncated, info = env.step(torch.zeros(3, 8))
    assert terminated.tolist() == [False, True, False] and not truncated.any()
    assert info["final_obs"][1, 0] > 1.0 and (obs[1, 0] - 0.75).abs() <= 0.1
    assert info["episode_length"].tolist() == [0, 1, 0]
    # Zero actions: the reward is forward velocity plus 1 while healthy, without the 1 after.
    assert reward[0] > 0.5 and reward[1] < 0.5


def test_same_seed_same_trajectory_and_actions_written_in_place() -> None:
    a, b = ant(2, seed=7), ant(2, seed=7)
    obs_a, _ = a.reset()
    obs_b, _ = b.reset()
    assert torch.equal(obs_a, obs_b)
    actions = torch.full((2, 8), 0.5)
    assert torch.equal(a.step(actions)[0], b.step(actions)[0])
    # The ctrl tensor is the simulator's own memory (no copy between torch and Warp).
    assert torch.equal(a._ctrl, actions)
    assert a._ctrl.data_ptr() == a.data.ctrl.ptr
    with pytest.raises(ValueError, match="NaN"):
        a.step(torch.full((2, 8), float("nan")))


def test_registered_names_build_the_envs() -> None:
    env = make_env("MjWarp-Ant-v0", 2, seed=0)
    assert isinstance(env, MjWarpLocomotionEnv) and env.single_action_space.shape == (8,)
    env = make_env("MjWarp-Humanoid-v0", 1, seed=0)
    assert env.single_observation_space.shape == (45,)
    assert env.single_action_space.high[0] == pytest.approx(0.4)


def test_cuda_graph_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
        ant(1, cuda_graph=True)


def test_building_and_stepping_prints_no_warp_module_lines() -> None:
    """`podium train MjWarp-Ant-v0` printed ~45 lines of "Module ... load on device 'cpu'
    took ... ms (cached)" before its own first line: warp 1.19 has no `config.quiet`."""
    import subprocess
    import sys

    script = (
        "import torch; from services.pod.envs import make_env\n"
        "env = make_env('MjWarp-Ant-v0', 2, seed=0); env.reset(seed=0)\n"
        "env.step(torch.zeros(2, 8))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True
    )
    assert "Module " not in done.stdout + done.stderr, done.stdout[-2000:]
