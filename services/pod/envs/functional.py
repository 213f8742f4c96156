"""Environments as pure functions over explicit state: the one definition of each env's physics.

A ``FunctionalEnv`` holds an env kind's constants (tensors on one device, made once) and three
pure functions of tensors of any leading shape (``...``: one sub-environment, N, or P agents' N):

* ``init(u) -> state``: initial states from uniforms ``u`` in [0, 1), (..., reset_uniforms),
  drawn by the caller (a ``torch.Generator`` in the vector env, a counter-based draw in a
  compiled loop, where no generator may enter).
* ``observe(state) -> obs``: float32 (..., obs_dim), a new tensor.
* ``step(state, action) -> (state, reward, terminated)``: one step's physics, out of place.

``vector_step`` adds what every env shares: the episode's return and length, the time limit (a
truncation; an episode that terminates on its last allowed step counts as terminated), and the
same-step autoreset (finished sub-environments restart from ``init(reset_u)``, their final
observation kept). The vector envs (services/pod/envs/base.py ``TorchVecEnv``) and the compiled
training loops (services/pod/roles/worker.py) both run it, so an env's physics exists once.

Static shapes, no host reads, no generators, no Python branches on tensor values: what
``torch.compile`` captures whole and a CUDA graph replays.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import gymnasium as gym
import torch


class EnvCarry(NamedTuple):
    """What a vector of sub-environments carries from step to step: the physics' state
    (..., state_dim), and the running episode's return (..., ) and length (..., ) int64."""

    state: torch.Tensor
    ep_return: torch.Tensor
    ep_length: torch.Tensor


class EnvStep(NamedTuple):
    """One step of ``vector_step``: the observation after the autoreset, the reward, both
    endings, the final observation of an episode that ended (the observation elsewhere), and
    the finished episodes' return, length and score (zero where none finished; the score is
    the return unless the env scores episodes otherwise)."""

    obs: torch.Tensor
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    final_obs: torch.Tensor
    episode_return: torch.Tensor
    episode_length: torch.Tensor
    episode_score: torch.Tensor


class FunctionalEnv(ABC):
    """An env kind's constants and pure functions (see the module docstring)."""

    #: Registered name (e.g. "CartPole-v1").
    name: str = ""
    state_dim: int
    #: Uniforms one reset draws per sub-environment.
    reset_uniforms: int
    single_observation_space: gym.spaces.Box
    single_action_space: gym.Space

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int | None = None,
    ) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_episode_steps = max_episode_steps

    @property
    def obs_dim(self) -> int:
        return int(self.single_observation_space.shape[0])

    def const(self, value: float | list[float]) -> torch.Tensor:
        """A constant of the physics on the env's device (made once: a host-to-device copy
        inside the step could not be captured in a CUDA graph)."""
        return torch.tensor(value, device=self.device, dtype=self.dtype)

    def uniform_start(self, low: list[float], span: list[float]) -> None:
        """``init``'s default: initial states uniform in the box [low, low + span]."""
        self._low, self._span = self.const(low), self.const(span)

    def init(self, u: torch.Tensor) -> torch.Tensor:
        """The initial state from uniforms ``u`` (..., reset_uniforms); ``uniform_start``'s box."""
        return torch.addcmul(self._low, self._span, u)

    def observe(self, state: torch.Tensor) -> torch.Tensor:
        """The observation of ``state``: by default the state itself, as float32."""
        return state.to(torch.float32, copy=True)

    @abstractmethod
    def step(
        self, state: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def episode_score(self, state: torch.Tensor, length: torch.Tensor) -> torch.Tensor | None:
        """How a finished episode is judged where not by its return (a trading account's
        Sharpe ratio), from the state it ended in and its length; None: by its return."""
        return None

    def start(self, u: torch.Tensor) -> EnvCarry:
        """Fresh episodes from uniforms ``u`` (..., reset_uniforms)."""
        state = self.init(u)
        lead = state.shape[:-1]
        ep_return = torch.zeros(lead, device=state.device, dtype=self.dtype)
        ep_length = torch.zeros(lead, device=state.device, dtype=torch.int64)
        return EnvCarry(state, ep_return, ep_length)


def vector_step(
    env: FunctionalEnv, carry: EnvCarry, action: torch.Tensor, reset_u: torch.Tensor
) -> tuple[EnvCarry, EnvStep]:
    """One step of every sub-environment with bookkeeping, time limit and same-step autoreset
    (module docstring); ``reset_u`` (..., reset_uniforms): uniforms read only where episodes end."""
    state, reward, terminated = env.step(carry.state, action)
    ep_return = carry.ep_return + reward
    ep_length = carry.ep_length + 1
    done = terminated
    if env.max_episode_steps is not None:
        done = done | (ep_length >= env.max_episode_steps)
    truncated = done & ~terminated
    final_obs = env.observe(state)
    score = env.episode_score(state, ep_length)
    state = torch.where(done.unsqueeze(-1), env.init(reset_u), state)
    out = EnvStep(
        obs=env.observe(state),
        reward=reward,
        terminated=terminated,
        truncated=truncated,
        final_obs=final_obs,
        episode_return=ep_return * done,
        episode_length=ep_length * done,
        episode_score=(ep_return if score is None else score) * done,
    )
    zero = torch.zeros((), dtype=ep_return.dtype, device=ep_return.device)
    return EnvCarry(state, torch.where(done, zero, ep_return), ep_length.masked_fill(done, 0)), out
