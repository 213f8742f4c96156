"""The Isaac Gym adapter maps VecTask's reset timing and time-outs onto the protocol."""

from __future__ import annotations

import math

import pytest
import torch

from services.pod.envs.isaacgym_adapter import IsaacGymVecEnv
from tests.pod.envs.vectask_example import CartpoleVecTask


def test_reset_puts_every_sub_env_at_a_fresh_start() -> None:
    task = CartpoleVecTask(16)
    env = IsaacGymVecEnv(task, seed=0)
    obs, _ = env.reset()
    # IsaacGymEnvs' Cartpole starts positions in ±0.1 and velocities in ±0.25.
    assert (obs[:, [0, 2]].abs() <= 0.1).all() and (obs[:, [1, 3]].abs() <= 0.25).all()
    assert (obs != 0).any(dim=1).all(), "a VecTask's own reset() only returns zeros"
    assert not task.reset_buf.any() and not task.progress_buf.any()


def test_time_outs_are_truncations_and_the_next_step_starts_a_new_episode() -> None:
    limit = 10
    env = IsaacGymVecEnv(CartpoleVecTask(4, max_episode_length=limit), seed=0)
    env.reset()
    zero = torch.zeros(4, 1)
    total = torch.zeros(4)
    # VecTask times out once progress_buf reaches max_episode_length - 1.
    for _ in range(limit - 2):
        _, reward, terminated, truncated, _ = env.step(zero)
        total += reward
        assert not (terminated | truncated).any()
    obs, reward, terminated, truncated, info = env.step(zero)
    total += reward
    assert truncated.all() and not terminated.any()
    assert (info["episode_length"] == limit - 1).all()
    torch.testing.assert_close(info["episode_return"], total)
    assert torch.equal(info["final_obs"], obs)  # the task resets one step late
    obs, _, terminated, truncated, info = env.step(zero)
    assert not (terminated | truncated).any()
    assert (obs[:, [0, 2]].abs() <= 0.1).all(), "the task's reset happened in this step"
    assert (env._stats.episode_length == 1).all()


def test_failure_is_termination_with_the_tasks_penalty() -> None:
    task = CartpoleVecTask(3, max_episode_length=500)
    env = IsaacGymVecEnv(task, seed=1)
    env.reset()
    task.dof_pos[1, 1] = 2.0  # the pole of sub-env 1 is past 90°
    obs, reward, terminated, truncated, info = env.step(torch.zeros(3, 1))
    assert terminated.tolist() == [False, True, False]
    assert not truncated.any()
    assert reward[1] == -2.0
    assert obs[1, 2] > math.pi / 2
    assert info["episode_length"].tolist() == [0, 1, 0]
    assert info["episode_return"][1] == -2.0


def test_returned_tensors_survive_the_tasks_buffer_reuse() -> None:
    env = IsaacGymVecEnv(CartpoleVecTask(4), seed=0)
    env.reset()
    obs, reward, terminated, *_ = env.step(torch.full((4, 1), 0.5))
    kept = (obs.clone(), reward.clone(), terminated.clone())
    env.step(torch.full((4, 1), -0.5))
    assert torch.equal(obs, kept[0]) and torch.equal(reward, kept[1])
    assert torch.equal(terminated, kept[2])


def test_bad_actions_are_rejected() -> None:
    env = IsaacGymVecEnv(CartpoleVecTask(4), seed=0)
    env.reset()
    with pytest.raises(ValueError, match="shape"):
        env.step(torch.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        env.step(torch.full((4, 1), float("nan")))
