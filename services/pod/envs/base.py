"""The one environment protocol every Podium env follows.

A ``VecEnv`` holds ``num_envs`` sub-environments as torch tensors on one device; every tensor it
takes or returns has the batch dimension first. Its contract:

* ``reset(seed=None, groups=1) -> (obs, info)`` resets every sub-environment. ``seed`` reseeds
  the env's own random generator: the same seed gives the same trajectories for the same actions.
  ``groups``: the sub-environments as that many equal slices, each starting as the first does
  (a population's agents evaluated on the same episodes).
* ``step(actions) -> (obs, reward, terminated, truncated, info)``:
  - ``obs``: float32 (num_envs, *obs_shape); ``reward``: float (num_envs,);
    ``terminated`` / ``truncated``: bool (num_envs,), kept apart because bootstrapping needs it
    (a truncated episode is bootstrapped from its final observation, a terminated one is not).
    An episode that terminates on its last allowed step counts as terminated, not truncated.
  - Sub-environments that finished are reset *in the same step* (autoreset): ``obs`` already
    holds their first observation of the next episode and ``info["final_obs"]`` the last
    observation of the finished one (equal to ``obs`` where nothing finished; when no
    sub-environment finished it may be the very same tensor, so treat both as read-only).
  - ``info["episode_return"]`` / ``info["episode_length"]``: return and length of the episode
    that just finished, valid where ``terminated | truncated`` (zero elsewhere). Dense tensors,
    no Python lists, so nothing forces a device sync.
  - ``info["episode_score"]`` (optional): where an episode is judged by something other than
    its return (a trading env's Sharpe ratio), that score, valid where an episode finished;
    evaluators rank by it instead of the return.
  - Every returned tensor is new: the env never writes into a tensor it handed out, so a
    rollout buffer may keep references.
* ``single_observation_space`` / ``single_action_space`` are gymnasium spaces of one
  sub-environment; ``observation_space`` / ``action_space`` the batched ones.
* Actions: ``Discrete`` → int32 or int64 (num_envs,); ``Box`` → float (num_envs, *action_shape).
  ``validate_actions`` raises ``ValueError`` on a wrong shape, a wrong dtype, out-of-range
  discrete actions or non-finite values. Actions are detached: the env never builds an
  autograd graph through the policy's output.

``TorchVecEnv`` implements the protocol for the torch-native envs, over their functional envs.
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from types import EllipsisType
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector.utils import batch_space

from services.pod.envs.functional import FunctionalEnv

Info = dict[str, Any]
StepResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Info]


def check_num_envs(num_envs: object) -> int:
    """``num_envs`` as an int >= 1 (numpy integers accepted), else ``ValueError``."""
    try:
        n = operator.index(num_envs)  # type: ignore[arg-type]
    except TypeError:
        n = 0
    if isinstance(num_envs, bool) or n < 1:
        raise ValueError(f"num_envs must be an integer >= 1, got {num_envs!r}")
    return n


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

    @abstractmethod
    def reset(self, seed: int | None = None, groups: int = 1) -> tuple[torch.Tensor, Info]: ...

    @abstractmethod
    def step(self, actions: torch.Tensor) -> StepResult: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (subprocesses, simulators); a no-op for pure-torch envs."""

    def validate_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """Check shape/dtype/range/finiteness; return detached actions on this env's device. Raising
        here, not letting NaN into the state, keeps a bad action from silently corrupting its
        sub-environment's later steps. The checks read a scalar or two: free on CPU, a host sync on
        CUDA (``check_actions=False`` turns them off once a training loop is known sound)."""
        if not isinstance(actions, torch.Tensor):
            raise ValueError(f"actions must be a torch.Tensor, got {type(actions).__name__}")
        actions = actions.detach()
        space = self.single_action_space
        if isinstance(space, gym.spaces.Discrete):
            if actions.shape != (self.num_envs,):
                raise ValueError(
                    f"expected discrete actions of shape ({self.num_envs},), got "
                    f"{tuple(actions.shape)}"
                )
            # The torch-native envs index with the actions, which torch allows only in these
            # two types; every env refuses the others, so a policy behaves the same on all.
            if (t := actions.dtype) not in (torch.int32, torch.int64):
                raise ValueError(f"discrete actions must be integers (int32 or int64), got {t}")
            actions = actions.to(self.device)
            low, high = torch.aminmax(actions)
            if int(low) < space.start or int(high) >= space.start + space.n:
                raise ValueError(
                    f"discrete actions must lie in [{space.start}, {space.start + space.n - 1}]"
                )
            return actions
        expected = (self.num_envs, *space.shape)
        if tuple(actions.shape) != expected:
            raise ValueError(f"expected actions of shape {expected}, got {tuple(actions.shape)}")
        if not actions.dtype.is_floating_point:
            raise ValueError(f"continuous actions must be floating point, got {actions.dtype}")
        actions = actions.to(self.device)
        # One reduction in the common case; the sum of finite values can still overflow to
        # inf, so only a non-finite sum triggers the exact (slower) element-wise check.
        if not math.isfinite(float(actions.sum())) and not bool(torch.isfinite(actions).all()):
            raise ValueError("actions contain NaN or inf")
        return actions


class EpisodeStats:
    """Per-sub-environment return and length of the running episodes, on the env's device: how
    the adapters of other simulators keep the protocol's ``episode_return`` /
    ``episode_length``. ``dtype``: the sum's (float64 where host rewards come in float64)."""

    def __init__(
        self, num_envs: int, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> None:
        self.episode_return = torch.zeros(num_envs, device=device, dtype=dtype)
        self.episode_length = torch.zeros(num_envs, device=device, dtype=torch.int64)

    def reset(self) -> None:
        self.episode_return.zero_()
        self.episode_length.zero_()

    def step(self, reward: torch.Tensor, done: torch.Tensor, final_obs: torch.Tensor) -> Info:
        """Add a step; the step's ``info`` (return/length where ``done``, zero elsewhere, in
        ``reward``'s dtype); restart the finished episodes' sums."""
        self.episode_return += reward
        self.episode_length += 1
        info: Info = {
            "final_obs": final_obs,
            "episode_return": (self.episode_return * done).to(reward.dtype),
            "episode_length": self.episode_length * done,
        }
        self.episode_return.masked_fill_(done, 0)
        self.episode_length.masked_fill_(done, 0)
        return info


class TorchVecEnv(VecEnv):
    """The vector env of a functional env (services/pod/envs/functional.py), whose physics it
    runs with validation, episode bookkeeping, time limit and autoreset, drawing the resets
    from a ``torch.Generator``. A subclass names its functional env (``functional``) and passes
    the env's own keyword arguments on to it. ``state`` is the (num_envs, state_dim) tensor of
    ``dtype``, written in place (never rebound). Observations are float32 whatever the
    simulation dtype (as gymnasium's); rewards are in the simulation dtype (``float64`` mode
    exists so equality tests against gymnasium can be tight).

    On a CPU, where reading a flag costs nothing, finished sub-environments are reset by index
    and only when there are any; on other devices the reset is masked over all of them, which
    needs no host sync.
    """

    functional: type[FunctionalEnv]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "functional" in cls.__dict__:
            cls.spec_id = cls.functional.name

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int | EllipsisType | None = ...,
        seed: int | None = None,
        check_actions: bool = True,
        **env_kwargs: Any,
    ):
        """``max_episode_steps``: the time limit, None for none, ``...`` the functional env's
        own; ``env_kwargs``: the functional env's other settings (Pendulum's ``g``, …)."""
        num_envs = check_num_envs(num_envs)
        if max_episode_steps is not ...:
            env_kwargs["max_episode_steps"] = max_episode_steps
        self.fn = self.functional(device=device, dtype=dtype, **env_kwargs)
        self.num_envs = num_envs
        self.device = self.fn.device
        self.dtype = dtype
        self.state_dim = self.fn.state_dim
        self.single_observation_space = self.fn.single_observation_space
        self.single_action_space = self.fn.single_action_space
        # On CUDA the action checks cost a host sync per step; they can be turned off there.
        self.check_actions = check_actions
        self._host_reads_free = self.device.type == "cpu"
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(
            seed if seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        )
        self._state = torch.zeros(num_envs, self.state_dim, device=self.device, dtype=dtype)
        self._episode_return = torch.zeros(num_envs, device=self.device, dtype=dtype)
        self._episode_length = torch.zeros(num_envs, device=self.device, dtype=torch.int64)
        #: The last step's state before its autoreset (where episodes ended): a new tensor per step.
        self.final_state = self._state

    def __getattr__(self, name: str) -> Any:
        """The functional env's constants and settings (``env.g``, a market's prices)."""
        if name == "fn":
            raise AttributeError(name)
        return getattr(self.fn, name)

    @property
    def max_episode_steps(self) -> int | None:  # type: ignore[override]
        """Time limit in steps (None: no limit); episodes reaching it are truncated."""
        return self.fn.max_episode_steps

    @max_episode_steps.setter
    def max_episode_steps(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or operator.index(value) < 1):
            raise ValueError(f"max_episode_steps must be an integer >= 1 or None, got {value!r}")
        self.fn.max_episode_steps = None if value is None else operator.index(value)

    @property
    def state(self) -> torch.Tensor:
        """The simulation state, (num_envs, state_dim); write into it, never rebind it."""
        return self._state

    def initial_state(self, n: int) -> torch.Tensor:
        """Fresh initial states for ``n`` sub-environments, drawn from the env's generator."""
        # Drawn a column at a time: the first uniforms of n resets are the same draws whatever
        # the env's other settings ask for after them (a trading env's start days with and
        # without a stock order to shuffle).
        u = torch.rand(
            (self.fn.reset_uniforms, n), generator=self.generator, device=self.device,
            dtype=self.dtype,
        )  # fmt: skip
        return self.fn.init(u.T)

    def observe(self, state: torch.Tensor) -> torch.Tensor:
        return self.fn.observe(state)

    # -- protocol --------------------------------------------------------------------------
    def reset(self, seed: int | None = None, groups: int = 1) -> tuple[torch.Tensor, Info]:
        if seed is not None:
            self.generator.manual_seed(int(seed))
        self.state.copy_(self.initial_state(self.num_envs // groups).repeat(groups, 1))
        self._episode_return.zero_()
        self._episode_length.zero_()
        return self.observe(self.state), {}

    def step(self, actions: torch.Tensor) -> StepResult:
        if self.check_actions:
            actions = self.validate_actions(actions)
        else:
            actions = actions.detach().to(self.device)
        fn = self.fn
        new, reward, terminated = fn.step(self.state, actions)
        self._episode_return += reward
        self._episode_length += 1
        done = terminated
        if fn.max_episode_steps is not None:
            done = done | (self._episode_length >= fn.max_episode_steps)
        truncated = done & ~terminated
        final_obs = fn.observe(new)
        info: Info = {
            "final_obs": final_obs,
            "episode_return": self._episode_return * done,
            "episode_length": self._episode_length * done,
        }
        score = fn.episode_score(new, self._episode_length)
        if score is not None:
            info["episode_score"] = score * done
        self.final_state = new
        self.state.copy_(new)
        if self._host_reads_free:
            envs = done.nonzero().squeeze(1)
            if not envs.numel():
                return final_obs, reward, terminated, truncated, info
            self.state[envs] = self.initial_state(envs.numel())
        else:
            fresh = self.initial_state(self.num_envs)
            self.state.copy_(torch.where(done.unsqueeze(1), fresh, self.state))
        self._episode_return.masked_fill_(done, 0)
        self._episode_length.masked_fill_(done, 0)
        return fn.observe(self.state), reward, terminated, truncated, info
