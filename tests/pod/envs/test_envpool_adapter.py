"""EnvPool behind the env protocol: the registered ids, argument checks, and transitions equal
to gymnasium's MuJoCo envs of the same task version (the protocol itself is checked for
``envpool:`` ids in test_env_protocol.py)."""

from __future__ import annotations

import envpool
import gymnasium as gym
import numpy as np
import pytest
import torch
from pydantic import ValidationError

from services.contracts.action_spaces import misfits
from services.contracts.envpool_tasks import ENVPOOL_TASKS
from services.contracts.spec import EnvSpec
from services.pod.envs import make_env
from services.pod.envs.envpool_adapter import EnvPoolVecEnv, in_env_order


def test_every_adapted_task_is_in_envpools_registry() -> None:
    assert set(ENVPOOL_TASKS) <= set(envpool.list_all_envs())


def test_the_spec_accepts_envpool_tasks_and_refuses_others() -> None:
    assert EnvSpec(name="envpool:HalfCheetah-v5").name == "envpool:HalfCheetah-v5"
    for bad in ("envpool:Pong-v5", "envpool:os:system", "envpool:"):
        with pytest.raises(ValidationError, match="envpool:<id>"):
            EnvSpec(name=bad)
    # The action-space kind is known through the prefix: DQN cannot train a MuJoCo task.
    assert misfits("envpool:HalfCheetah-v5", ["dqn"])
    assert not misfits("envpool:HalfCheetah-v5", ["sac", "ppo"])


def test_arguments_are_checked_and_the_adapters_own_settings_refused() -> None:
    with pytest.raises(TypeError, match="'reset_noise_scal'"):
        make_env("envpool:Hopper-v5", 2, reset_noise_scal=0.1)
    with pytest.raises(TypeError, match="'base_path'"):
        make_env("envpool:Hopper-v5", 2, base_path="/tmp")
    with pytest.raises(ValueError, match="not an EnvPool task"):
        EnvPoolVecEnv("Pong-v5", 2)
    # A task's own option reaches the simulator.
    env = make_env("envpool:Hopper-v5", 2, seed=0, ctrl_cost_weight=0.0)
    env.reset()
    _, reward_free, *_ = env.step(torch.ones(2, 3))
    env = make_env("envpool:Hopper-v5", 2, seed=0)
    env.reset()
    _, reward, *_ = env.step(torch.ones(2, 3))
    torch.testing.assert_close(reward_free - reward, torch.full((2,), 3e-3))


# Tasks whose observation holds all of qpos except the root's x (given in info) and all of qvel,
# so gymnasium's env can be put in exactly EnvPool's state.
_SAME_TASKS = {"HalfCheetah-v5": 9, "Hopper-v5": 6, "Walker2d-v5": 9}


@pytest.mark.parametrize("task", list(_SAME_TASKS))
def test_transitions_match_gymnasiums_mujoco_env(task: str) -> None:
    """Each step starts gymnasium's env from EnvPool's state: contacts make both chaotic, so
    free-running trajectories drift apart by float rounding (EnvPool builds its own MuJoCo);
    one-step transitions must agree tightly."""
    nq = _SAME_TASKS[task]
    pool = envpool.make_gymnasium(task, num_envs=1, seed=5)
    obs, info = pool.reset()
    ref = gym.make(task).unwrapped
    ref.reset(seed=0)
    actions = np.random.default_rng(0).uniform(-1, 1, size=(300, *ref.action_space.shape))
    compared = 0
    for t, action in enumerate(actions):
        qvel = obs[0, nq - 1 :]
        # Hopper and Walker2d clip velocities in the observation; such a state is not exact.
        exact = bool(np.all(np.abs(qvel) < 10))
        if exact:
            ref.set_state(np.concatenate([info["x_position"], obs[0, : nq - 1]]), qvel)
        obs, reward, terminated, truncated, info = pool.step(
            action[None], np.zeros(1, dtype=np.int32)
        )
        if exact:
            compared += 1
            ref_obs, ref_reward, ref_terminated, _, _ = ref.step(action)
            np.testing.assert_allclose(obs[0], ref_obs, rtol=1e-6, atol=1e-6, err_msg=f"t={t}")
            np.testing.assert_allclose(reward[0], ref_reward, rtol=1e-6, atol=1e-6)
            assert bool(terminated[0]) == ref_terminated
        if terminated[0] or truncated[0]:
            # EnvPool's reset step (its action is ignored), then go on from the new episode.
            obs, _, _, _, info = pool.step(action[None], np.zeros(1, dtype=np.int32))
    assert compared >= 50


def test_an_envpool_task_reads_its_gymnasium_tasks_preset_and_trains() -> None:
    """``podium train envpool:HalfCheetah-v5`` starts from HalfCheetah-v5's preset (the same
    task) and runs PPO through the EnvPool adapter: a few updates, a finite evaluation."""
    from services.pod.fit import train
    from services.pod.presets import preset, train_config

    ours, theirs = preset("ppo", "envpool:HalfCheetah-v5"), preset("ppo", "HalfCheetah-v5")
    assert ours.pop("env") == "envpool:HalfCheetah-v5"
    theirs.pop("env")
    assert ours == theirs and ours["target_return"] is not None
    config = train_config(
        "envpool:HalfCheetah-v5",
        [
            {
                "seed": 0,
                "total_env_steps": 4096,
                "eval_every_steps": 4096,
                "eval_episodes": 1,
                "env_kwargs": {"max_episode_steps": 100},
            }
        ],
    )
    assert config.ppo.num_steps == 256 and config.ppo.update_epochs == 10
    result = train(config)
    assert result.history[-1]["env_steps"] >= 4096
    assert result.best is not None and np.isfinite(result.best.mean)


def test_rows_returned_out_of_env_order_are_put_back_in_order() -> None:
    # EnvPool's threads return rows in the order the envs finish; row k belongs to env_id[k].
    # A 3-cycle, not a swap: a swap is its own inverse and hides an inverted permutation.
    env_id = np.array([2, 0, 1], dtype=np.int32)
    obs = np.array([[20.0, 21.0], [0.0, 1.0], [10.0, 11.0]])  # env 2's row first, ...
    np.testing.assert_array_equal(
        in_env_order(obs, env_id), [[0.0, 1.0], [10.0, 11.0], [20.0, 21.0]]
    )
    np.testing.assert_array_equal(in_env_order(np.array([7, 5, 6]), env_id), [5, 6, 7])
    in_order = np.arange(3)
    assert in_env_order(obs, in_order) is obs
