"""An Isaac Lab task (``DirectRLEnv`` / ``ManagerBasedRLEnv``) as a Podium ``VecEnv``, and
``isaaclab_task``, the ``podium.envs`` factory for a task id registered in gymnasium (it starts
Isaac Sim headless once; nothing from a spec is imported).

Isaac Lab resets finished sub-environments inside ``step`` and never returns their last
observation, so ``info["final_obs"]`` is the next episode's first: a time-out is bootstrapped
from it. The mapping in full and the plugin example: docs/gpu_physics.md, "Isaac Lab adapter".
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import EpisodeStats, Info, StepResult, VecEnv, check_num_envs
from services.pod.envs.gymnasium_adapter import gymnasium_spec

_REQUIRED = ("num_envs", "device", "single_observation_space", "single_action_space")
#: The Isaac Sim app, started on the first Isaac Lab task made in this process.
_APP: Any = None


def _box(space: Any, what: str) -> gym.spaces.Box:
    if not isinstance(space, gym.spaces.Box):
        raise ValueError(f"unsupported {what} space {space!r}: only Box spaces are supported")
    return gym.spaces.Box(
        space.low.astype(np.float32), space.high.astype(np.float32), dtype=np.float32
    )


class IsaacLabVecEnv(VecEnv):
    """An Isaac Lab RL env (or a gymnasium wrapper of one) behind the Podium protocol."""

    def __init__(self, env: gym.Env, seed: int | None = None, check_actions: bool = True):
        base = env.unwrapped
        if missing := [name for name in _REQUIRED if not hasattr(base, name)]:
            raise TypeError(
                f"{type(base).__name__} is not an Isaac Lab RL env: missing {', '.join(missing)}"
            )
        obs_space = base.single_observation_space
        if not isinstance(obs_space, gym.spaces.Dict) or "policy" not in obs_space.spaces:
            raise ValueError(f"expected a Dict observation space with 'policy', got {obs_space}")
        self.env = env
        self.num_envs = check_num_envs(base.num_envs)
        self.device = torch.device(base.device)
        self.single_observation_space = _box(obs_space["policy"], "observation")
        self.single_action_space = _box(base.single_action_space, "action")
        length = getattr(base, "max_episode_length", None)
        self.max_episode_steps = int(length) if length is not None else None
        spec = getattr(base, "spec", None)
        self.spec_id = spec.id if spec is not None else type(base).__name__
        self.check_actions = check_actions
        self._seed = seed
        self._stats = EpisodeStats(self.num_envs, self.device)

    def _policy_obs(self, obs: Any) -> torch.Tensor:
        policy = obs.get("policy") if isinstance(obs, dict) else None
        if not isinstance(policy, torch.Tensor):
            raise ValueError("an Isaac Lab env must return a tensor under obs['policy']")
        return policy.to(torch.float32, copy=True)

    def reset(self, seed: int | None = None, groups: int = 1) -> tuple[torch.Tensor, Info]:
        # Isaac Lab draws every scene's start from one generator: ``groups`` start apart.
        if seed is None:
            seed, self._seed = self._seed, None
        obs, _ = self.env.reset(seed=seed)
        self._stats.reset()
        return self._policy_obs(obs), {}

    def step(self, actions: torch.Tensor) -> StepResult:
        actions = self.validate_actions(actions) if self.check_actions else actions.detach()
        obs_dict, rew, term, trunc, _ = self.env.step(actions)
        obs = self._policy_obs(obs_dict)
        reward = rew.to(torch.float32, copy=True)
        terminated = term.to(torch.bool, copy=True)
        truncated = trunc.to(torch.bool) & ~terminated
        # Isaac Lab does not return the finished episode's last observation (module docstring).
        info = self._stats.step(reward, terminated | truncated, final_obs=obs)
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        self.env.close()


def _start_isaac_lab(device: str) -> None:
    """Start Isaac Sim headless (once) and register Isaac Lab's tasks in gymnasium."""
    try:
        app_launcher = importlib.import_module("isaaclab.app")
    except ImportError as e:
        raise ImportError(
            "Isaac Lab is not installed (pip install isaaclab[isaacsim,all], see "
            f"docs/gpu_physics.md): {e}"
        ) from e
    global _APP
    if _APP is None:
        _APP = app_launcher.AppLauncher(headless=True, device=device).app
    importlib.import_module("isaaclab_tasks")


def make_isaaclab_env(
    task_id: str,
    num_envs: int,
    device: str | torch.device = "cuda:0",
    seed: int | None = None,
    check_actions: bool = True,
) -> IsaacLabVecEnv:
    """Build the Isaac Lab task registered in gymnasium as ``task_id`` (no other imports)."""
    num_envs = check_num_envs(num_envs)
    device = str(device)
    if ":" not in task_id and task_id not in gym.envs.registry:
        _start_isaac_lab(device)
    spec = gymnasium_spec(task_id)
    if "env_cfg_entry_point" in spec.kwargs:
        parse_cfg = importlib.import_module("isaaclab_tasks.utils")
        cfg = parse_cfg.parse_env_cfg(task_id, device=device, num_envs=num_envs)
        env = gym.make(spec, cfg=cfg)
    else:  # a task without Isaac Lab's config (the stand-in): sizes as constructor arguments
        env = gym.make(spec, num_envs=num_envs, device=device)
    return IsaacLabVecEnv(env, seed=seed, check_actions=check_actions)


def isaaclab_task(task_id: str) -> Callable[..., IsaacLabVecEnv]:
    """A ``podium.envs`` factory for the Isaac Lab task ``task_id``."""
    factory = functools.partial(make_isaaclab_env, task_id)
    factory.__doc__ = f"Isaac Lab's {task_id} behind the Podium env protocol."
    return factory


# The paper's locomotion tasks (Isaac Lab's direct and manager-based versions).
ant_direct = isaaclab_task("Isaac-Ant-Direct-v0")
humanoid_direct = isaaclab_task("Isaac-Humanoid-Direct-v0")
ant = isaaclab_task("Isaac-Ant-v0")
humanoid = isaaclab_task("Isaac-Humanoid-v0")
