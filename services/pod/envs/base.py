"""The one environment protocol every Podium env follows.

A ``VecEnv`` holds ``num_envs`` sub-environments as torch tensors on one device; every tensor it
takes or returns has the batch dimension first. Its contract:

* ``reset(seed=None) -> (obs, info)`` resets every sub-environment. ``seed`` reseeds the env's
  own ``torch.Generator``: the same seed gives the same trajectories for the same actions.
* ``step(actions) -> (obs, reward, terminated, truncated, info)``:
  - ``obs``: float (num_envs, *obs_shape); ``reward``: float (num_envs,);
    ``terminated`` / ``truncated``: bool (num_envs,), kept apart because bootstrapping needs it
    (a truncated episode is bootstrapped from its final observation, a terminated one is not).
  - Sub-environments that finished are reset *in the same step* (autoreset): ``obs`` already
    holds their first observation of the next episode and ``info["final_obs"]`` the last
    observation of the finished one (equal to ``obs`` where nothing finished).
  - ``info["episode_return"]`` / ``info["episode_length"]``: return and length of the episode
    that just finished, valid where ``terminated | truncated`` (zero elsewhere). Dense tensors,
    no Python lists, so nothing forces a device sync.
* ``single_observation_space`` / ``single_action_space`` are gymnasium spaces of one
  sub-environment; ``observation_space`` / ``action_space`` the batched ones.
* Actions: ``Discrete`` → int64 (num_envs,); ``Box`` → float (num_envs, *action_shape).
  A wrong shape, a wrong dtype or non-finite values raise ``ValueError``.

``TorchVecEnv`` implements the protocol for torch-native dynamics: a subclass writes the physics
(``_reset_envs``, ``_physics_step``, ``_observe``) and inherits validation, time limits, episode
bookkeeping and autoreset.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector.utils import batch_space

Info = dict[str, Any]
StepResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Info]


class VecEnv(ABC):
    """Protocol of a batched environment (see module docstring)."""

    num_envs: int
    device: torch.device
    single_observation_space: gym.Space
    single_action_space: gym.Space
    max_episode_steps: int | None = None
    #: Name in the registry (e.g. "CartPole-v1"); informational.
    spec_id: str = ""

    @property
    def observation_space(self) -> gym.Space:
        return batch_space(self.single_observation_space, self.num_envs)

    @property
    def action_space(self) -> gym.Space:
        return batch_space(self.single_action_space, self.num_envs)

    @property
    def is_discrete(self) -> bool:
        return isinstance(self.single_action_space, gym.spaces.Discrete)

    @abstractmethod
    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, Info]: ...

    @abstractmethod
    def step(self, actions: torch.Tensor) -> StepResult: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (subprocesses, simulators); a no-op for pure-torch envs."""

    def validate_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """Check shape/dtype/finiteness; return actions on this env's device.

        Raising here, rather than letting NaN propagate into the state, is what keeps a bad
        action from silently corrupting every later step of that sub-environment.
        """
        if not isinstance(actions, torch.Tensor):
            raise ValueError(f"actions must be a torch.Tensor, got {type(actions).__name__}")
        space = self.single_action_space
        if isinstance(space, gym.spaces.Discrete):
            if actions.shape != (self.num_envs,):
                raise ValueError(
                    f"expected discrete actions of shape ({self.num_envs},), got "
                    f"{tuple(actions.shape)}"
                )
            if actions.dtype.is_floating_point or actions.dtype == torch.bool:
                raise ValueError(f"discrete actions must be integers, got {actions.dtype}")
            actions = actions.to(self.device)
            if bool(((actions < 0) | (actions >= space.n)).any()):
                raise ValueError(f"discrete actions must lie in [0, {space.n - 1}]")
            return actions
        expected = (self.num_envs, *space.shape)
        if tuple(actions.shape) != expected:
            raise ValueError(f"expected actions of shape {expected}, got {tuple(actions.shape)}")
        if not actions.dtype.is_floating_point:
            raise ValueError(f"continuous actions must be floating point, got {actions.dtype}")
        actions = actions.to(self.device)
        if not bool(torch.isfinite(actions).all()):
            raise ValueError("actions contain NaN or inf")
        return actions


class TorchVecEnv(VecEnv):
    """Base of the torch-native envs: validation, time limit, bookkeeping, autoreset.

    Subclasses keep their state in tensors of shape (num_envs, ...) on ``self.device`` and
    implement three methods:

    * ``_reset_envs(mask)``: sample new initial states for sub-environments where ``mask``.
    * ``_physics_step(actions) -> (reward, terminated)``: advance every sub-environment.
    * ``_observe() -> obs``: current observation of every sub-environment.
    """

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int | None = None,
        seed: int | None = None,
        check_actions: bool = True,
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.num_envs = int(num_envs)
        self.device = torch.device(device)
        self.dtype = dtype
        if max_episode_steps is not None:
            self.max_episode_steps = int(max_episode_steps)
        # On CUDA the finiteness check costs a host sync per step; it can be turned off there.
        self.check_actions = check_actions
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(
            seed if seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        )
        self._episode_return = torch.zeros(num_envs, device=self.device, dtype=dtype)
        self._episode_length = torch.zeros(num_envs, device=self.device, dtype=torch.int64)
        self._all = torch.ones(num_envs, device=self.device, dtype=torch.bool)

    # -- to implement ----------------------------------------------------------------------
    @abstractmethod
    def _reset_envs(self, mask: torch.Tensor) -> None: ...

    @abstractmethod
    def _physics_step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def _observe(self) -> torch.Tensor: ...

    # -- helpers for subclasses ------------------------------------------------------------
    def _uniform(self, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
        u = torch.rand(shape, generator=self.generator, device=self.device, dtype=self.dtype)
        return low + (high - low) * u

    # -- protocol --------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, Info]:
        if seed is not None:
            self.generator.manual_seed(int(seed))
        self._reset_envs(self._all)
        self._episode_return.zero_()
        self._episode_length.zero_()
        return self._observe(), {}

    def step(self, actions: torch.Tensor) -> StepResult:
        if self.check_actions:
            actions = self.validate_actions(actions)
        reward, terminated = self._physics_step(actions)
        self._episode_return += reward
        self._episode_length += 1
        if self.max_episode_steps is not None:
            truncated = (self._episode_length >= self.max_episode_steps) & ~terminated
        else:
            truncated = torch.zeros_like(terminated)
        done = terminated | truncated
        final_obs = self._observe()
        zero = torch.zeros((), device=self.device)
        info: Info = {
            "final_obs": final_obs,
            "episode_return": torch.where(done, self._episode_return, zero.to(self.dtype)),
            "episode_length": torch.where(done, self._episode_length, zero.long()),
        }
        # Reset finished sub-environments without a host sync: resetting under a mask keeps
        # shapes static, so this runs the same on CPU and inside a CUDA graph.
        self._reset_envs(done)
        self._episode_return.masked_fill_(done, 0)
        self._episode_length.masked_fill_(done, 0)
        obs = self._observe()
        return obs, reward, terminated, truncated, info
