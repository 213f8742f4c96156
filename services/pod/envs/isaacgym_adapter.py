"""An Isaac Gym task (IsaacGymEnvs' ``VecTask`` interface) as a Podium ``VecEnv``.

``IsaacGymVecEnv(task)`` wraps a task *object*: its buffers already are torch tensors on the
GPU, so nothing is copied to the host. The mapping onto our protocol:

* ``terminated = reset_buf & ~extras["time_outs"]``, ``truncated = reset_buf & time_outs``:
  VecTask sets ``time_outs`` where an episode ended by reaching ``max_episode_length``, which
  is exactly the case that must be bootstrapped.
* Reset timing. A VecTask resets a finished sub-environment inside its *next* ``step`` (in
  ``post_physics_step``, after the physics ran with that step's action), so the first
  observation of the next episode only exists one step later. The adapter reports the end of
  the episode on the step where ``reset_buf`` is set, with ``info["final_obs"]`` = that step's
  observation; ``obs`` for that sub-environment is the same final observation, and the next
  step returns the new episode's first observation. Bootstrapping at the episode's end is
  therefore exact (truncations from ``final_obs``, none after a termination); the step after
  it, which starts from the old final observation and whose action the task's reset
  overrides, is the one imprecise transition, the same one every IsaacGymEnvs trainer sees.
* ``reset()`` sets every ``reset_buf`` and runs one step with zero actions, because a VecTask's
  own ``reset()`` resets nothing (it only returns the observation buffer); after it every
  sub-environment is at the start of an episode.
* Seeding: VecTask tasks draw from torch's global generator (IsaacGymEnvs calls
  ``torch.manual_seed`` in ``set_seed``), so ``reset(seed)`` seeds that global generator.
* Episode return/length bookkeeping is done here, per sub-environment, on the task's device.
* Action checks (shape, finiteness) read a scalar back: one host sync per step on the GPU;
  ``check_actions=False`` turns them off for a trusted training loop.

Plugging in a real IsaacGymEnvs task: names in a spec are looked up in the ``podium.envs``
entry-point group, and a plugin package registers a *factory* there that builds the task and
wraps it::

    # my_isaac_envs/envs.py
    import isaacgym  # noqa: F401
    import isaacgymenvs
    from services.pod.envs.isaacgym_adapter import IsaacGymVecEnv

    def ant(num_envs: int, device: str = "cuda:0", seed: int | None = None) -> IsaacGymVecEnv:
        task = isaacgymenvs.make(
            seed=seed or 0, task="Ant", num_envs=num_envs,
            sim_device=device, rl_device=device, headless=True,
        )
        return IsaacGymVecEnv(task, seed=seed)

    # my_isaac_envs/pyproject.toml
    [project.entry-points."podium.envs"]
    "Isaac-Ant" = "my_isaac_envs.envs:ant"

After ``pip install`` of that package, ``make_env("Isaac-Ant", 4096, device="cuda:0")`` and
specs naming ``Isaac-Ant`` work; ``list_envs()`` shows it. One catch: ``import isaacgym``
raises ``ImportError`` once torch is imported, and a pod imports torch before it resolves env
names. Have the interpreter import Isaac Gym at start-up, e.g. with a one-line
``isaacgym_first.pth`` file in site-packages containing ``import isaacgym`` (site runs
``import`` lines of ``.pth`` files before any user code).
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
