"""Which hyperparameter names each algorithm a pod trains takes, importable without torch.

A spec's ``search_space`` and a generator's hyperparameters are flat names. For PPO they are
``PPOConfig`` fields; for an off-policy algorithm they are its own config's fields plus the
off-policy loop's (``ReplayLoopConfig``: ``num_envs``, ``batch_size``, ``buffer_size``,
``learning_starts``, ``updates_per_step``). The control plane (services/contracts/spec.py) and
the pod (services/pod/runtime.py, presets.py) check names with the one set of checks here.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel

from services.pod.algorithms.offpolicy_config import AGENT_CONFIGS, ReplayLoopConfig
from services.pod.algorithms.ppo_config import POPULATION_HYPERPARAMETERS, PPOConfig

#: Registered algorithm name → the config models whose fields are its hyperparameters.
HYPERPARAMETER_MODELS: dict[str, tuple[type[BaseModel], ...]] = {
    "ppo": (PPOConfig,),
    **{name: (config, ReplayLoopConfig) for name, config in AGENT_CONFIGS.items()},
}


def hyperparameter_names(algorithm: str) -> frozenset[str] | None:
    """The hyperparameter names ``algorithm`` takes, or None for an algorithm a pod does not
    know without importing it (a plugin)."""
    models = HYPERPARAMETER_MODELS.get(algorithm)
    if models is None:
        return None
    return frozenset(name for model in models for name in model.model_fields)


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
