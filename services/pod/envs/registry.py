"""Make a ``VecEnv`` from a registered name, resolved in order:

1. A name in the ``podium.envs`` entry-point group: Podium's torch-native envs (CartPole-v1,
   Pendulum-v1, Acrobot-v1, MountainCarContinuous-v0) and any installed plugin, e.g. an Isaac
   Lab task factory (``services.pod.envs.isaaclab_adapter.isaaclab_task``): a class or factory
   called as ``f(num_envs=..., device=..., seed=..., **kwargs)``.
2. ``"envpool:<id>"`` for the EnvPool tasks in ``services.contracts.envpool_tasks``: the
   EnvPool adapter (batched C++ simulation; the ``envpool`` extra).
3. ``"gym:<id>"``, or a bare id registered in gymnasium that is not a Podium name: the
   gymnasium adapter (CPU simulation). ``"gym:CartPole-v1"`` picks gymnasium's CartPole over
   Podium's.

Only registered names resolve; gymnasium's ``"module:Env-v0"`` syntax, which imports a module,
is refused; an unknown name raises ``UnknownEnvError`` listing the registered names. Keyword
arguments are checked against the constructor before anything is built, so a misspelt option is
a ``TypeError`` naming it, not a silent default (gymnasium envs check their own arguments; the
adapter re-raises their error with the id).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import torch

from services import registry
from services.contracts.envpool_tasks import ENVPOOL_PREFIX, ENVPOOL_TASKS
from services.pod.envs.base import TorchVecEnv, VecEnv
from services.pod.envs.functional import FunctionalEnv
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


def _accepted(factory: Callable[..., Any]) -> set[str] | None:
    """The keywords ``factory`` takes (None: any). A functional env's vector env passes what
    it does not take itself on to its functional env, which names the rest."""
    params = inspect.signature(factory).parameters.values()
    names = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return names
    functional = getattr(factory, "functional", None)
    if isinstance(factory, type) and issubclass(factory, TorchVecEnv) and functional:
        rest = _accepted(functional)
        return None if rest is None else names | rest
    return None


def _check_kwargs(factory: Callable[..., Any], name: str, keywords: set[str]) -> None:
    """Raise ``TypeError`` naming every keyword ``factory`` does not take."""
    accepted = _accepted(factory)
    unknown = sorted(keywords - accepted) if accepted is not None else []
    if unknown:
        raise TypeError(
            f"env {name!r} does not take {', '.join(map(repr, unknown))}; "
            f"it takes {', '.join(sorted(accepted or ()))}"
        )


_FUNCTIONAL: dict[str, FunctionalEnv] = {}


def is_functional(name: str) -> bool:
    """Whether the env registered as ``name`` is a functional env's vector env (without
    building it): a ``TorchVecEnv`` whose steps are its functional env's alone (a subclass
    that overrides ``step`` or ``reset`` has behaviour the functional env lacks)."""
    if name not in list_envs():
        return False
    factory = registry.load(registry.ENVS, name, kind="env")
    if not (isinstance(factory, type) and issubclass(factory, TorchVecEnv)):
        return False
    return factory.step is TorchVecEnv.step and factory.reset is TorchVecEnv.reset


def functional_env(
    name: str, device: str | torch.device = "cpu", **kwargs: Any
) -> FunctionalEnv | None:
    """The functional env (services/pod/envs/functional.py) of the env registered as ``name`` with
    ``kwargs``, or None for a host-stepped env. One object per name, device and arguments in a
    process: compiled programs take it as a constant, and an equal one must meet their guards."""
    key = json.dumps([name, str(torch.device(device)), kwargs], sort_keys=True, default=repr)
    if key not in _FUNCTIONAL:
        env = make_env(name, 1, device=device, **kwargs)
        env.close()
        if not isinstance(env, TorchVecEnv):
            return None
        _FUNCTIONAL[key] = env.fn
    return _FUNCTIONAL[key]


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
