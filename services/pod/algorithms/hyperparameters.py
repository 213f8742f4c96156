"""Which hyperparameter names each algorithm a pod trains takes, importable without torch.

A spec's ``search_space`` and a generator's hyperparameters are flat names. For PPO they are
``PPOConfig`` fields; for an off-policy algorithm they are its own config's fields plus the
off-policy loop's (``ReplayLoopConfig``: ``num_envs``, ``batch_size``, ``buffer_size``,
``learning_starts``, ``updates_per_step``). The control plane (services/contracts/spec.py) and
the pod (services/pod/runtime.py, presets.py) check names with the one set of checks here.
The presets' data (services/pod/presets/<algorithm>/<env>.yaml) is read here too, torch-free,
so the spec check knows what a pod would train with.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel

from services.contracts.envpool_tasks import ENVPOOL_PREFIX
from services.pod.algorithms.offpolicy_config import AGENT_CONFIGS, ReplayLoopConfig
from services.pod.algorithms.portfolio_gradient_config import PortfolioGradientConfig
from services.pod.algorithms.ppo_config import POPULATION_HYPERPARAMETERS, PPOConfig

#: Registered algorithm name → the config models whose fields are its hyperparameters.
HYPERPARAMETER_MODELS: dict[str, tuple[type[BaseModel], ...]] = {
    "ppo": (PPOConfig,),
    **{name: (config, ReplayLoopConfig) for name, config in AGENT_CONFIGS.items()},
    "portfolio_gradient": (PortfolioGradientConfig,),
}


def hyperparameter_names(algorithm: str) -> frozenset[str] | None:
    """The hyperparameter names ``algorithm`` takes, or None for an algorithm a pod does not
    know without importing it (a plugin)."""
    models = HYPERPARAMETER_MODELS.get(algorithm)
    if models is None:
        return None
    return frozenset(name for model in models for name in model.model_fields)


@functools.cache
def preset_files() -> dict[tuple[str, str], str]:
    """(algorithm, env) → the preset's YAML text, for every file shipped."""
    root = resources.files("services.pod") / "presets"
    return {
        (folder.name, item.name.removesuffix(".yaml")): item.read_text()
        for folder in root.iterdir()
        if folder.is_dir()
        for item in folder.iterdir()
        if item.name.endswith(".yaml")
    }


def preset_data(algorithm: str, env: str) -> dict[str, Any]:
    """The preset file's fields for (``algorithm``, ``env``); {} where none ships. An
    ``envpool:<task>`` env reads the preset of ``<task>``: its transitions are the same
    (tests/pod/envs/test_envpool_adapter.py)."""
    files = preset_files()
    text = files.get((algorithm, env)) or files.get((algorithm, env.removeprefix(ENVPOOL_PREFIX)))
    return yaml.safe_load(text) if text else {}


class HyperparameterError(ValueError):
    """Hyperparameters or an algorithm a pod cannot train: a name the algorithm does not have,
    an invalid value, an algorithm no pod trains or that the env's action space does not fit.
    A ValueError, so a spec validator raising it is a pydantic validation error (a 422)."""


def check_hyperparameter_names(
    names: Iterable[str], algorithms: Iterable[str] | None = None
) -> None:
    """Refuse names that none of ``algorithms`` takes (default: any algorithm a pod trains).

    An experiment's search space is shared by its algorithms, so a name is valid when at least
    one of them has it; each pod applies only its own algorithm's names. An algorithm whose
    names are not known without importing it (a plugin) may take any name, so then every name
    is accepted. The spec validator and the pod both call this.
    """
    fields = {a: hyperparameter_names(a) for a in sorted(set(algorithms or HYPERPARAMETER_MODELS))}
    if any(f is None for f in fields.values()):
        return
    known = {a: f for a, f in fields.items() if f is not None}
    unknown = sorted(set(names) - set().union(*known.values()))
    if unknown:
        listing = "; ".join(f"{a}: {', '.join(sorted(f))}" for a, f in known.items())
        raise HyperparameterError(
            f"{', '.join(map(repr, unknown))} not hyperparameters of "
            f"{' or '.join(map(repr, known))}; they are: {listing}"
        )


def check_population(
    size: int,
    algorithms: Iterable[str],
    names: Iterable[str],
    pinned: Iterable[str] = (),
) -> None:
    """Refuse what a population pod (``population.agents_per_pod`` = ``size``) cannot train:
    an algorithm other than PPO, or names (of the search space, or a manifest's) that are not
    ``POPULATION_HYPERPARAMETERS``, since its agents share one network and rollout shape. A
    ``pinned`` name (the search space's one-value choice: every agent gets the same value) is
    a setting the agents share, so any PPO setting may be pinned, e.g. ``sde_sample_freq: 0``
    to train a preset that uses gSDE. The spec validator and the population pod both call
    this."""
    others = sorted(set(algorithms) - {"ppo"})
    if set(algorithms) != {"ppo"}:
        raise HyperparameterError(
            f"population.agents_per_pod = {size}: population pods train PPO only, not "
            f"{', '.join(others)}"
        )
    shared = sorted(set(names) - set(POPULATION_HYPERPARAMETERS) - set(pinned))
    if shared:
        raise HyperparameterError(
            f"population.agents_per_pod = {size}: search_space {', '.join(map(repr, shared))} "
            f"cannot vary within a population (its {size} agents share one network and rollout "
            f"shape); it may vary {', '.join(POPULATION_HYPERPARAMETERS)}, and pin any PPO "
            f"setting with a one-value choice"
        )


#: PPO settings a population pod has no batched form of (gSDE's noise, the KL early stop, which
#: would end one agent's epochs and not the others').
POPULATION_UNSUPPORTED = ("sde_sample_freq", "target_kl")


def check_population_settings(
    env: str, ppo: Mapping[str, Any], pinned: Collection[str] = ()
) -> None:
    """Refuse PPO settings ``ppo`` (what a population pod would train: ``env``'s preset with the
    search space's ``pinned`` names on top) that population pods do not train, naming them,
    where they come from and how to pin them off."""
    used = {k: ppo[k] for k in POPULATION_UNSUPPORTED if ppo.get(k)}
    if used:
        settings = ", ".join(f"ppo.{k} = {v}" for k, v in used.items())
        task = env.removeprefix(ENVPOOL_PREFIX)  # envpool:<task> reads <task>'s preset
        source = (
            "the search space"
            if set(used) <= set(pinned)
            else f"the preset services/pod/presets/ppo/{task}.yaml"
        )
        raise HyperparameterError(
            f"population pods (population.agents_per_pod > 1) train PPO without gSDE and "
            f"target_kl; the config for {env} uses {settings} (from {source}): pin them off "
            f"in the search space (e.g. sde_sample_freq: {{type: choice, values: [0]}}) or "
            f"train one agent per pod"
        )
