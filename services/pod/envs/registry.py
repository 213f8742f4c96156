"""Make a ``VecEnv`` from a registered name.

Resolution, in order:

1. A name in the ``podium.envs`` entry-point group: Podium's torch-native envs (CartPole-v1,
   Pendulum-v1, Acrobot-v1, MountainCarContinuous-v0) and any installed plugin, e.g. an Isaac
   Gym task factory (see ``services.pod.envs.isaacgym_adapter``). The entry point is a class or
   factory called as ``f(num_envs=..., device=..., seed=..., **kwargs)``.
2. ``"envpool:<id>"`` for the EnvPool tasks in ``services.contracts.envpool_tasks``: the
   EnvPool adapter (batched C++ simulation; the ``envpool`` extra).
3. ``"gym:<id>"``, or a bare id registered in gymnasium that is not a Podium name: the
   gymnasium adapter (CPU simulation). ``"gym:CartPole-v1"`` picks gymnasium's CartPole over
   Podium's.

Only registered names resolve; gymnasium's ``"module:Env-v0"`` syntax, which imports a module,
is refused. An unknown name raises ``UnknownEnvError`` (a ``services.registry.UnknownNameError``)
listing the registered names. Keyword arguments are checked against the constructor before
anything is built, so a misspelt option is a ``TypeError`` naming it, not a silent default
(gymnasium envs check their own arguments; the adapter re-raises their error with the id).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import torch

from services import registry
from services.contracts.envpool_tasks import ENVPOOL_PREFIX, ENVPOOL_TASKS
from services.pod.envs.base import VecEnv
from services.pod.envs.gymnasium_adapter import GymnasiumVecEnv

GYM_PREFIX = "gym:"


class UnknownEnvError(registry.UnknownNameError):
    """Unknown env name; the message lists Podium names and says gymnasium ids work too."""

    def __str__(self) -> str:
        refused = (
            " (module:id syntax is not allowed)"
            if ":" in self.name.removeprefix(GYM_PREFIX).removeprefix(ENVPOOL_PREFIX)
            else ""
        )
        return (
            f"{super().__str__()}{refused}; any registered gymnasium id is accepted too, "
            f"as '{GYM_PREFIX}<id>' (e.g. '{GYM_PREFIX}CartPole-v1'), and EnvPool's tasks as "
            f"'{ENVPOOL_PREFIX}<id>' (e.g. '{ENVPOOL_PREFIX}HalfCheetah-v5')"
        )


def list_envs() -> list[str]:
    """Names in the ``podium.envs`` group: built-ins and installed plugins."""
    return registry.names(registry.ENVS)


def _check_kwargs(factory: Callable[..., Any], name: str, keywords: set[str]) -> None:
    """Raise ``TypeError`` naming every keyword ``factory`` does not take."""
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    unknown = sorted(keywords - accepted)
    if unknown:
        raise TypeError(
            f"env {name!r} does not take {', '.join(map(repr, unknown))}; "
            f"it takes {', '.join(sorted(accepted))}"
        )


def make_env(
    name: str,
    num_envs: int,
    device: str | torch.device = "cpu",
    seed: int | None = None,
    **kwargs: Any,
) -> VecEnv:
    """Build ``num_envs`` sub-environments of the env registered as ``name``."""
    if name in list_envs():
        factory = registry.load(registry.ENVS, name, kind="env")
        _check_kwargs(factory, name, {"num_envs", "device", "seed", *kwargs})
        env = factory(num_envs=num_envs, device=device, seed=seed, **kwargs)
        if not isinstance(env, VecEnv):
            raise TypeError(f"env {name!r} built a {type(env).__name__}, not a VecEnv")
        return env
    if name.removeprefix(ENVPOOL_PREFIX) in ENVPOOL_TASKS and name.startswith(ENVPOOL_PREFIX):
        # Imported here: EnvPool is an optional extra and loads every simulator it ships.
        from services.pod.envs.envpool_adapter import EnvPoolVecEnv

        return EnvPoolVecEnv(
            name.removeprefix(ENVPOOL_PREFIX), num_envs, device=device, seed=seed, **kwargs
        )
    gym_id = name.removeprefix(GYM_PREFIX)
    if ":" not in gym_id and gym_id in gym.envs.registry:
        return GymnasiumVecEnv(gym_id, num_envs, device=device, seed=seed, **kwargs)
    raise UnknownEnvError("env", name, list_envs())
