"""EnvPool behind the env protocol: the registered ids, argument checks, the time limit as
gymnasium applies it, and one-step transitions against gymnasium's MuJoCo envs of the same task
version: equal where EnvPool's own MuJoCo and the installed one agree, within the documented gap
where not (the protocol itself is checked for ``envpool:`` ids in test_env_protocol.py)."""

from __future__ import annotations

import envpool
import gymnasium as gym
import mujoco
import numpy as np
import pytest
import torch
from pydantic import ValidationError

from services.contracts.algorithms.hyperparameters import misfits
from services.contracts.envpool_tasks import (
    ENVPOOL_MUJOCO_VERSION,
    ENVPOOL_TASKS,
    envpool_simulator,
)
from services.contracts.spec import EnvSpec
from services.pod.envs import make_env
from services.pod.envs.envpool_adapter import EnvPoolVecEnv, in_env_order


def test_every_adapted_task_is_in_envpools_registry() -> None:
    assert set(ENVPOOL_TASKS) <= set(envpool.list_all_envs())


def test_each_id_says_which_simulator_runs_it() -> None:
    assert make_env("envpool:Ant-v5", 1).simulator.startswith(f"MuJoCo {ENVPOOL_MUJOCO_VERSION}")
    assert "classic-control" in envpool_simulator("CartPole-v1")
    with pytest.raises(ValueError, match="not an EnvPool task"):
        envpool_simulator("Pong-v5")


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
    # The adapter applies the time limit itself (the pool gets one step more), so it checks it.
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="max_episode_steps"):
            make_env("envpool:Hopper-v5", 2, max_episode_steps=bad)
    assert make_env("envpool:Hopper-v5", 2).max_episode_steps == 1000  # the task's own
    # A task's own option reaches the simulator.
    env = make_env("envpool:Hopper-v5", 2, seed=0, ctrl_cost_weight=0.0)
    env.reset()
    _, reward_free, *_ = env.step(torch.ones(2, 3))
    env = make_env("envpool:Hopper-v5", 2, seed=0)
    env.reset()
    _, reward, *_ = env.step(torch.ones(2, 3))
    torch.testing.assert_close(reward_free - reward, torch.full((2,), 3e-3))


# Per MuJoCo task: (qpos coordinates the observation leaves out, given in EnvPool's info; whether
# the observation clips velocities at ±10, which makes such a state inexact). The rest of qpos
# and all of qvel are observed, so gymnasium's env can be put in exactly EnvPool's state.
_LAYOUT = {
    "HalfCheetah-v5": (1, False),
    "Hopper-v5": (1, True),
    "Walker2d-v5": (1, True),
    "Swimmer-v5": (2, False),
    "InvertedPendulum-v5": (0, False),
    "Ant-v5": (2, False),
    "Humanoid-v5": (2, False),
}
# The largest one-step gap allowed in qpos/qvel between EnvPool (its own MuJoCo 3.6) and
# gymnasium (the installed MuJoCo, 4.0): docs/gpu_physics.md, "EnvPool's MuJoCo is not
# gymnasium's", has the measurements (100,000 other states). The equal tasks differ only
# at rare contact-solver states (HalfCheetah: 9 in 100,000 above 1e-6, at most 1.5e-5); Ant and
# Humanoid differ at most states, so their 99th percentile is bounded too.
_EQUAL_WITHIN = {
    "HalfCheetah-v5": 1e-4,
    "Hopper-v5": 1e-5,
    "Walker2d-v5": 1e-5,
    "Swimmer-v5": 1e-5,
    "InvertedPendulum-v5": 1e-5,
}
# p99 and max of the qpos/qvel gap, max of the reward gap; 100,000 states measured p99 3.1e-3 and
# 1.1e-4, max 1.78 and 0.21, reward 0.006 and 0.086.
_DIFFERENT = {"Ant-v5": (0.01, 3.0, 0.02), "Humanoid-v5": (1e-3, 0.5, 0.2)}


def _one_step_gaps(task: str, seed: int, steps: int, n: int = 16) -> tuple[np.ndarray, ...]:
    """One step of EnvPool's ``task`` and of gymnasium's from the same states: per compared
    state, the largest gap in qpos/qvel and in the reward, and whether ``terminated`` agrees.

    EnvPool's pool runs ``n`` episodes under random actions; before each step, gymnasium's env
    ``i`` is put in sub-environment ``i``'s state. One gymnasium env per sub-environment: MuJoCo
    warm-starts its solver from the env's previous step, which then is the same trajectory's.
    Ant's and Humanoid's forward reward is left out of the reward gap: they read the torso's
    position as MuJoCo left it at the start of the last substep, which ``set_state`` refreshes,
    so that term differs by the method, not the simulator (their velocities are in qvel)."""
    drop, clipped = _LAYOUT[task]
    pool = envpool.make_gymnasium(task, num_envs=n, seed=seed)
    refs = [gym.make(task).unwrapped for _ in range(n)]
    for ref in refs:
        ref.reset(seed=seed)
    nq, nv = refs[0].model.nq, refs[0].model.nv
    n_pos = nq - drop
    low, high = refs[0].action_space.low, refs[0].action_space.high
    rng = np.random.default_rng(seed)
    ids = np.arange(n, dtype=np.int32)
    obs, info = pool.reset()
    resetting = np.zeros(n, dtype=bool)  # EnvPool's next step of a finished env is its reset
    state_gap, reward_gap, same_end = [], [], []
    for _ in range(steps):
        actions = rng.uniform(low, high, size=(n, *low.shape))
        next_obs, reward, terminated, truncated, next_info = pool.step(actions, ids)
        assert np.array_equal(next_info["env_id"], ids)
        for i, ref in enumerate(refs):
            qvel = obs[i, n_pos : n_pos + nv]
            if resetting[i] or (clipped and np.any(np.abs(qvel) >= 10)):
                continue
            root = [info[key][i] for key in ("x_position", "y_position")[:drop]]
            ref.set_state(np.concatenate([root, obs[i, :n_pos]]), qvel)
            ref_obs, ref_reward, ref_terminated, _, ref_info = ref.step(actions[i])
            state_gap.append(np.abs(next_obs[i, : n_pos + nv] - ref_obs[: n_pos + nv]).max())
            if task in _DIFFERENT:
                forward = next_info["reward_forward" if task == "Ant-v5" else "reward_linvel"][i]
                reward_gap.append(
                    abs(reward[i] - forward - ref_reward + ref_info["reward_forward"])
                )
            else:
                reward_gap.append(abs(reward[i] - ref_reward) / max(1.0, abs(ref_reward)))
            same_end.append(bool(terminated[i]) == ref_terminated)
        resetting = terminated | truncated
        obs, info = next_obs, next_info
    pool.close()
    return np.array(state_gap), np.array(reward_gap), np.array(same_end)


@pytest.mark.parametrize("task", list(_LAYOUT))
def test_one_step_from_many_states_matches_gymnasium_where_the_simulators_agree(task: str) -> None:
    """``envpool:<task>`` against ``gym:<task>`` in one install, from 2,000+ states of several
    seeds (not those the docs measured). Where the installed MuJoCo is EnvPool's own, every task
    agrees to rounding; otherwise the equal tasks stay within their documented gap and Ant and
    Humanoid are another simulator: they differ at most states, within the documented bounds.
    (The CI test this replaces compared one seed at 1e-6, which other seeds fail.)"""
    gaps = []
    # Seeds until 2,000 states: Walker2d's random walks reach the clipped velocities often.
    while sum(len(g[0]) for g in gaps) < 2000 and len(gaps) < 20:
        gaps.append(_one_step_gaps(task, seed=len(gaps), steps=40))
    state, reward, same_end = (np.concatenate(x) for x in zip(*gaps, strict=True))
    assert len(state) >= 2000
    # EnvPool's rewards are float32: 1e-6 of the reward is its rounding.
    assert reward.max() <= (_DIFFERENT[task][2] if task in _DIFFERENT else 1e-6), reward.max()
    if mujoco.__version__ == ENVPOOL_MUJOCO_VERSION:
        assert state.max() <= 1e-6
    elif task in _EQUAL_WITHIN:
        assert state.max() <= _EQUAL_WITHIN[task], f"{(state > 1e-6).sum()} gaps > 1e-6"
        assert same_end.all()
    else:
        p99, largest, _ = _DIFFERENT[task]
        # Not rare outliers: the typical state differs (equal tasks: median ~1e-16).
        assert np.median(state) > 1e-8, "same as gymnasium's now: update the docs and bounds"
        assert np.quantile(state, 0.99) <= p99 and state.max() <= largest


def test_an_envpool_task_reads_its_gymnasium_tasks_preset_and_trains() -> None:
    """``podium train envpool:HalfCheetah-v5`` starts from HalfCheetah-v5's preset (the same
    task) and runs PPO through the EnvPool adapter: a few updates, a finite evaluation."""
    from services.pod.training.fit import train
    from services.pod.training.presets import preset, train_config

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


# (nq, whether the observation leaves out the root's x): with these, a gymnasium env can be put
# in the state an EnvPool observation shows (x does not change the dynamics of these tasks).
_STATE_LAYOUT = {
    "Hopper-v5": (6, True),
    "Walker2d-v5": (9, True),
    "InvertedPendulum-v5": (2, False),
}


def _gym_twin(task: str, envpool_env: EnvPoolVecEnv, obs: torch.Tensor, limit: int):
    """``gym:<task>`` with ``limit`` whose sub-environments start where ``envpool_env``'s do."""
    nq, drops_x = _STATE_LAYOUT[task]
    twin = make_env(f"gym:{task}", envpool_env.num_envs, seed=0, max_episode_steps=limit)
    twin.reset()
    o = obs.double().numpy()
    n_pos = nq - drops_x
    for i, sub in enumerate(twin.env.envs):
        sub.unwrapped.set_state(np.concatenate([[0.0] * drops_x, o[i, :n_pos]]), o[i, n_pos:])
    return twin


def _first_episode_flags(task: str, limit: int, n: int = 16) -> list[tuple[np.ndarray, ...]]:
    """Per step of the first episodes, for the sub-environments whose first episode is still
    running: their ids, EnvPool's (terminated, truncated) and gymnasium's, as (k, 2) arrays."""
    env = make_env(f"envpool:{task}", n, seed=0, max_episode_steps=limit)
    obs, _ = env.reset()
    twin = _gym_twin(task, env, obs, limit)
    space = env.single_action_space
    low, high = torch.as_tensor(space.low), torch.as_tensor(space.high)
    g = torch.Generator().manual_seed(0)
    running = np.ones(n, dtype=bool)
    steps = []
    while running.any():
        actions = low + (high - low) * torch.rand((n, *space.shape), generator=g)
        _, _, term, trunc, _ = env.step(actions)
        _, _, gym_term, gym_trunc, _ = twin.step(actions)
        ours, theirs = torch.stack([term, trunc], 1), torch.stack([gym_term, gym_trunc], 1)
        steps.append((np.flatnonzero(running), ours.numpy()[running], theirs.numpy()[running]))
        running &= ~(ours.any(1) | theirs.any(1)).numpy()
    env.close()
    twin.close()
    return steps


@pytest.mark.parametrize("task", list(_STATE_LAYOUT))
def test_an_episode_that_terminates_on_its_last_allowed_step_is_terminated(task: str) -> None:
    """EnvPool flags every episode that reaches its limit as truncated, even one whose last step
    fell: the learner would bootstrap from a fallen state. Gymnasium's env (the same physics,
    started in the same states) is the reference; the limit is set to the step at which one of
    the first episodes terminates, so some end before it, some on it and the rest are cut."""
    free = _first_episode_flags(task, limit=1000)
    ends = sorted(t for t, (_, _, theirs) in enumerate(free, 1) for _ in theirs[theirs[:, 0]])
    limit = ends[len(ends) // 2]
    steps = _first_episode_flags(task, limit)
    assert len(steps) == limit
    _, _, last = steps[-1]
    assert last[:, 0].any() and last[:, 1].any(), "the limit must both end and cut episodes"
    for t, (ids, ours, theirs) in enumerate(steps, 1):
        for i, a, b in zip(ids, ours.tolist(), theirs.tolist(), strict=True):
            assert a == b, f"step {t} of {limit}, env {i}: envpool {a}, gymnasium {b}"
