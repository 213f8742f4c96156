"""An Isaac Gym task (IsaacGymEnvs' ``VecTask`` interface) as a Podium ``VecEnv``.

``IsaacGymVecEnv(task)`` wraps a task *object* whose buffers already are torch tensors on the
GPU. ``terminated`` / ``truncated`` come from ``reset_buf`` and ``extras["time_outs"]``; a VecTask
resets a finished sub-environment inside its *next* step, so the step that ends an episode
returns its final observation as ``obs`` and ``info["final_obs"]``, and ``reset()`` forces a
reset of every sub-environment with one zero-action step. The mapping in full, seeding, and how
a plugin registers a real IsaacGymEnvs task: docs/gpu_physics.md, "Isaac Gym adapter".
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import EpisodeStats, Info, StepResult, VecEnv

_REQUIRED = ("num_envs", "step", "reset", "reset_buf", "observation_space", "action_space")


def _box(space: Any, what: str) -> gym.spaces.Box:
    """A gymnasium Box from the task's Box (IsaacGymEnvs uses the older ``gym`` package)."""
    low, high = getattr(space, "low", None), getattr(space, "high", None)
    if low is None or high is None or getattr(space, "n", None) is not None:
        raise ValueError(f"unsupported {what} space {space!r}: only Box spaces are supported")
    return gym.spaces.Box(
        np.asarray(low, dtype=np.float32), np.asarray(high, dtype=np.float32), dtype=np.float32
    )


class IsaacGymVecEnv(VecEnv):
    """A VecTask-style task object behind the Podium protocol (see module docstring)."""

    def __init__(self, task: Any, seed: int | None = None, check_actions: bool = True):
        missing = [name for name in _REQUIRED if not hasattr(task, name)]
        if missing:
            raise TypeError(
                f"{type(task).__name__} does not implement the VecTask interface: "
                f"missing {', '.join(missing)}"
            )
        self.task = task
        self.num_envs = int(task.num_envs)
        self.device = torch.device(getattr(task, "rl_device", None) or task.device)
        self.single_observation_space = _box(task.observation_space, "observation")
        self.single_action_space = _box(task.action_space, "action")
        length = getattr(task, "max_episode_length", None)
        self.max_episode_steps = int(length) if length is not None else None
        self.spec_id = type(task).__name__
        self.check_actions = check_actions
        self._seed = seed
        self._stats = EpisodeStats(self.num_envs, self.device)

    def _zero_actions(self) -> torch.Tensor:
        return torch.zeros((self.num_envs, *self.single_action_space.shape), device=self.device)

    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, Info]:
        if seed is None:
            seed, self._seed = self._seed, None
        if seed is not None:
            torch.manual_seed(seed)
        self.task.reset_buf[:] = 1
        obs_dict, _, _, _ = self.task.step(self._zero_actions())
        self._stats.reset()
        return obs_dict["obs"].to(torch.float32, copy=True), {}

    def step(self, actions: torch.Tensor) -> StepResult:
        actions = self.validate_actions(actions) if self.check_actions else actions.detach()
        obs_dict, rew, reset, extras = self.task.step(actions)
        # The task reuses its buffers on the next step, so everything handed out is a copy.
        obs = obs_dict["obs"].to(torch.float32, copy=True)
        reward = rew.to(torch.float32, copy=True)
        done = reset.to(self.device) != 0
        time_outs = extras.get("time_outs")
        if time_outs is None:
            truncated = torch.zeros_like(done)
        else:
            truncated = done & (time_outs.to(self.device) != 0)
        terminated = done & ~truncated
        info = self._stats.step(reward, done, final_obs=obs)
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        close = getattr(self.task, "close", None)
        if callable(close):
            close()
