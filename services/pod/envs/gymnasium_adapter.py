"""Any registered gymnasium env as a Podium ``VecEnv`` (CPU simulation, torch tensors out).

``gymnasium.make_vec`` runs ``num_envs`` copies in this process ("sync") or in subprocesses
("async") with gymnasium's same-step autoreset, which is what our protocol needs: the step that
ends an episode already returns the next episode's first observation and hands over the final
one. Arrays become torch tensors on ``device``; episode bookkeeping is done here.

Only ids in ``gymnasium.envs.registry`` are accepted, and the spec object is passed to gymnasium
rather than the string: gymnasium would import the module named in a ``"module:Env-v0"`` id, and
no request may cause an import.

Spaces: ``Box`` and ``Discrete`` actions; ``Box`` observations (cast to float32) and
``Discrete`` observations (one-hot float32, so every Podium policy sees a float vector). Any
other space raises ``ValueError`` at construction.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import EpisodeStats, Info, StepResult, VecEnv, check_num_envs

VECTORIZATION_MODES = ("sync", "async")
# Arguments of gymnasium.make_vec that are not env constructor arguments; a caller could pass
# callables or vectorizer options through them, so they are not accepted as env kwargs.
_RESERVED_KWARGS = {"id", "num_envs", "vectorization_mode", "vector_kwargs", "wrappers"}


def gymnasium_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """The registered spec for ``env_id``; ``ValueError`` for anything else (no imports)."""
    if ":" in env_id:
        raise ValueError(
            f"gymnasium id {env_id!r} uses module:id syntax, which would import a module; "
            "only ids already in gymnasium's registry are accepted"
        )
    spec = gym.envs.registry.get(env_id)
    if spec is None:
        raise ValueError(f"{env_id!r} is not a registered gymnasium id")
    return spec


class GymnasiumVecEnv(VecEnv):
    """``gymnasium.make_vec(env_id, num_envs)`` behind the Podium protocol."""

    def __init__(
        self,
        env_id: str,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int | None = None,
        vectorization_mode: str = "sync",
        check_actions: bool = True,
        **env_kwargs: Any,
    ):
        spec = gymnasium_spec(env_id)
        num_envs = check_num_envs(num_envs)
        if vectorization_mode not in VECTORIZATION_MODES:
            raise ValueError(
                f"vectorization_mode must be one of {VECTORIZATION_MODES}, "
                f"got {vectorization_mode!r}"
            )
        if reserved := sorted(_RESERVED_KWARGS & env_kwargs.keys()):
            raise TypeError(f"not accepted as env arguments: {', '.join(reserved)}")
        self.spec_id = f"gym:{env_id}"
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.check_actions = check_actions
        try:
            self.env = gym.make_vec(
                spec,
                num_envs=num_envs,
                vectorization_mode=vectorization_mode,
                vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
                **env_kwargs,
            )
        except TypeError as e:
            raise TypeError(f"gymnasium env {env_id!r} rejected its arguments: {e}") from e
        try:
            self._setup_spaces(self.env.single_observation_space, self.env.single_action_space)
        except ValueError:
            self.env.close()
            raise
        self.max_episode_steps = env_kwargs.get("max_episode_steps", spec.max_episode_steps)
        self._seed = seed
        self._stats = EpisodeStats(num_envs, self.device, dtype=torch.float64)

    def _setup_spaces(self, obs_space: gym.Space, act_space: gym.Space) -> None:
        if isinstance(obs_space, gym.spaces.Box):
            self._obs_onehot = 0
            self.single_observation_space = gym.spaces.Box(
                obs_space.low.astype(np.float32),
                obs_space.high.astype(np.float32),
                dtype=np.float32,
            )
        elif isinstance(obs_space, gym.spaces.Discrete):
            self._obs_onehot = int(obs_space.n)
            self._obs_start = int(obs_space.start)
            self.single_observation_space = gym.spaces.Box(
                0.0, 1.0, shape=(obs_space.n,), dtype=np.float32
            )
        else:
            raise ValueError(
                f"unsupported observation space {obs_space}: only Box and Discrete are supported"
            )
        if not isinstance(act_space, gym.spaces.Box | gym.spaces.Discrete):
            raise ValueError(
                f"unsupported action space {act_space}: only Box and Discrete are supported"
            )
        self.single_action_space = act_space

    def _to_obs(self, obs: np.ndarray) -> torch.Tensor:
        if self._obs_onehot:
            index = torch.as_tensor(np.asarray(obs, dtype=np.int64) - self._obs_start)
            onehot = torch.nn.functional.one_hot(index, self._obs_onehot)
            return onehot.to(device=self.device, dtype=torch.float32)
        return torch.as_tensor(np.asarray(obs, dtype=np.float32)).to(self.device)

    def reset(self, seed: int | None = None, groups: int = 1) -> tuple[torch.Tensor, Info]:
        # A seed given at construction applies to the first reset, as with TorchVecEnv.
        if seed is None:
            seed, self._seed = self._seed, None
        if seed is None and groups > 1:  # alike needs a seed: a fresh one
            seed = int(np.random.SeedSequence().entropy % 2**31)
        # A seed per sub-environment (an int seeds sub-environment i with seed + i): each group
        # gets its first's.
        seeds = None if seed is None else [seed + i for i in range(self.num_envs // groups)]
        obs, _ = self.env.reset(seed=seeds and seeds * groups)
        self._stats.reset()
        return self._to_obs(obs), {}

    def step(self, actions: torch.Tensor) -> StepResult:
        if self.check_actions:
            actions = self.validate_actions(actions)
        act = actions.detach().cpu().numpy()
        if isinstance(self.single_action_space, gym.spaces.Box):
            act = act.astype(self.single_action_space.dtype, copy=False)
        obs, reward, terminated, truncated, infos = self.env.step(act)
        obs_t = self._to_obs(obs)
        reward_t = torch.as_tensor(np.asarray(reward, dtype=np.float32)).to(self.device)
        term = np.asarray(terminated, dtype=bool)
        # Termination wins when both are set, as in TorchVecEnv (no bootstrapping either way).
        trunc = np.asarray(truncated, dtype=bool) & ~term
        term_t = torch.as_tensor(term).to(self.device)
        trunc_t = torch.as_tensor(trunc).to(self.device)
        final_obs = obs_t
        if (term | trunc).any():
            final = obs.copy()
            for i in np.flatnonzero(infos["_final_obs"]):
                final[i] = infos["final_obs"][i]
            final_obs = self._to_obs(final)
        info = self._stats.step(reward_t, term_t | trunc_t, final_obs)
        return obs_t, reward_t, term_t, trunc_t, info

    def close(self) -> None:
        self.env.close()
