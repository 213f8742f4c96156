"""EnvPool's batched C++ envs (MuJoCo locomotion, classic control) as a Podium ``VecEnv``,
registered as ``envpool:<task id>`` for the ids in ``services.contracts.envpool_tasks``.

EnvPool's episode semantics differ from the protocol's and are converted here: a finished
sub-environment is reset in the same step (EnvPool resets it on the next call), the time limit is
applied here so that an episode that ends at the limit is terminated, not truncated, and
``reset(seed)`` rebuilds the pool. Which MuJoCo simulates the tasks (EnvPool's own, not the
installed one) and these conversions in full: docs/gpu_physics.md, "The EnvPool adapter".
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from services import machine
from services.contracts.envpool_tasks import ENVPOOL_PREFIX, ENVPOOL_TASKS, envpool_simulator
from services.pod.envs.base import EpisodeStats, Info, StepResult, VecEnv, check_num_envs

# Pool settings the adapter owns: batching and seeding are how it implements the protocol, and
# ``base_path`` names a directory to load models from, which no request may choose.
_RESERVED = {
    "num_envs",
    "batch_size",
    "seed",
    "env_seed",
    "max_num_players",
    "base_path",
    "gym_reset_return_info",
}


def in_env_order(batch: np.ndarray, env_id: np.ndarray) -> np.ndarray:
    """Rows of ``batch`` put in env-id order: EnvPool returns row k for env ``env_id[k]``
    (in the order the envs finished, which with threads need not be 0, 1, ...)."""
    if np.array_equal(env_id, np.arange(len(env_id))):
        return batch
    out = np.empty_like(batch)
    out[env_id] = batch
    return out


def _envpool() -> Any:
    try:
        import envpool
    except ImportError as e:  # pragma: no cover - the extra is in dev; the message is for users
        raise ImportError(
            "EnvPool envs need the envpool extra: pip install 'podium[envpool]'"
        ) from e
    return envpool


class EnvPoolVecEnv(VecEnv):
    """``envpool.make_gymnasium(task_id, num_envs=...)`` behind the Podium protocol."""

    def __init__(
        self,
        task_id: str,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int | None = None,
        num_threads: int | None = None,
        check_actions: bool = True,
        **env_kwargs: Any,
    ):
        if task_id not in ENVPOOL_TASKS:
            raise ValueError(
                f"{task_id!r} is not an EnvPool task Podium adapts; known: "
                f"{', '.join(ENVPOOL_TASKS)}"
            )
        self.num_envs = check_num_envs(num_envs)
        self.task_id = task_id
        self.spec_id = f"{ENVPOOL_PREFIX}{task_id}"
        #: What simulates the task: EnvPool's own MuJoCo for the MuJoCo ids.
        self.simulator = envpool_simulator(task_id)
        self.device = torch.device(device)
        self.check_actions = check_actions
        envpool = _envpool()
        config = envpool.make_spec(task_id).config
        accepted = set(config._fields) - _RESERVED
        if unknown := sorted(set(env_kwargs) - accepted):
            raise TypeError(
                f"env {self.spec_id!r} does not take {', '.join(map(repr, unknown))}; "
                f"it takes {', '.join(sorted(accepted | {'num_envs', 'seed', 'device'}))}"
            )
        # One C++ thread per CPU the pod may use (its cores, at most its quota), at most one per
        # sub-environment: more threads than envs only add hand-offs, past a quota they are
        # throttled, and EnvPool's own default (0) takes every core of a shared machine.
        if num_threads is None:
            num_threads = max(1, min(self.num_envs, math.ceil(machine.cpus())))
        self._num_threads = num_threads
        limit = env_kwargs.pop("max_episode_steps", config.max_episode_steps)
        if isinstance(limit, bool) or not isinstance(limit, int | np.integer) or limit < 1:
            raise ValueError(f"max_episode_steps must be an integer >= 1, got {limit!r}")
        self.max_episode_steps = int(limit)
        self._env_kwargs = env_kwargs
        self._seed = seed if seed is not None else int(np.random.SeedSequence().entropy % 2**31)
        self.pool = self._make_pool(self._seed)
        spec = self.pool.spec
        obs_space, act_space = spec.observation_space, spec.action_space
        if not isinstance(obs_space, gym.spaces.Box):
            raise ValueError(f"unsupported observation space {obs_space}: only Box is supported")
        self.single_observation_space = gym.spaces.Box(
            obs_space.low.astype(np.float32), obs_space.high.astype(np.float32), dtype=np.float32
        )
        if isinstance(act_space, gym.spaces.Box):
            self._act_dtype = act_space.dtype
        elif isinstance(act_space, gym.spaces.Discrete):
            self._act_dtype = np.int32
        else:
            raise ValueError(f"unsupported action space {act_space}")
        self.single_action_space = act_space
        self._all_ids = np.arange(self.num_envs, dtype=np.int32)
        self._stats = EpisodeStats(self.num_envs, self.device, torch.float64)

    def _make_pool(self, seed: int, groups: int = 1) -> Any:
        self._groups = groups  # EnvPool seeds env i with seeds[i]: each group its first's
        return _envpool().make_gymnasium(
            self.task_id,
            num_envs=self.num_envs,
            batch_size=self.num_envs,
            seed=[int(seed) + i for i in range(self.num_envs // groups)] * groups,
            num_threads=self._num_threads,
            # One step past the limit, which the adapter applies itself (module docstring).
            max_episode_steps=self.max_episode_steps + 1,
            **self._env_kwargs,
        )

    def _to_obs(self, obs: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(obs, dtype=np.float32)).to(self.device)

    def reset(self, seed: int | None = None, groups: int = 1) -> tuple[torch.Tensor, Info]:
        if seed is not None or groups != self._groups:
            self._seed = self._seed if seed is None else seed
            self.pool.close()
            self.pool = self._make_pool(self._seed, groups)
        obs, info = self.pool.reset()
        self._stats.reset()
        return self._to_obs(in_env_order(obs, info["env_id"])), {}

    def step(self, actions: torch.Tensor) -> StepResult:
        if self.check_actions:
            actions = self.validate_actions(actions)
        act = actions.detach().cpu().numpy().astype(self._act_dtype, copy=False)
        obs, reward, terminated, _, info = self.pool.step(act, self._all_ids)
        ids = info["env_id"]
        obs = in_env_order(obs, ids)
        # The pool's limit is one step later, so its ``terminated`` is the task's own and the
        # time limit is ours; termination wins when both hold (no bootstrap from a fall).
        term = in_env_order(np.asarray(terminated, dtype=bool), ids)
        trunc = (in_env_order(info["elapsed_step"], ids) >= self.max_episode_steps) & ~term
        reward = in_env_order(np.asarray(reward, dtype=np.float64), ids)
        done = term | trunc
        obs_t = self._to_obs(obs)
        if done.any():
            finished = np.flatnonzero(done).astype(np.int32)
            # A reset (of a subset: defined in sync mode, as here), not EnvPool's step after
            # done, since an episode cut at our limit is not done in the pool.
            first, reset_info = self.pool.reset(finished)
            fresh = obs.copy()
            fresh[reset_info["env_id"]] = first
            next_obs = self._to_obs(fresh)
        else:
            next_obs = obs_t
        # float32 like every Podium env's rewards; the episode sums stay float64.
        reward_t = torch.from_numpy(reward).to(self.device, torch.float32)
        info = self._stats.step(reward_t, torch.from_numpy(done).to(self.device), obs_t)
        term_t = torch.from_numpy(term).to(self.device)
        trunc_t = torch.from_numpy(trunc).to(self.device)
        return next_obs, reward_t, term_t, trunc_t, info

    def close(self) -> None:
        self.pool.close()
