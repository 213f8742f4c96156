"""Run configs from presets: tuned starting points per algorithm and env, kept as data.

A preset is one YAML file per algorithm and env, as rl-baselines3-zoo keeps them:
``services/contracts/algorithms/<algorithm>/presets/<env>.yaml`` (package data), holding run-config
fields (the budget, evaluation cadence, the off-policy loop's fields) and, under the algorithm's
name, its hyperparameters. An env without a file for the algorithm trains with the config's
defaults. Both ways of training layer on the same preset:

* ``podium train``: preset ← ``--config FILE.yaml`` ← each ``--set`` (``train_config``);
* a pod: preset ← the trainer's pod defaults ← the spec's run fields ← the generator's
  hyperparameters (``pod_config``).

A preset tuned for a CPU's few envs may also hold a ``large_batch`` section for accelerator-sized
runs: when the layers on top set ``num_envs`` at or above its ``min_num_envs``, the section's
fields replace the preset's, and its budgets per env scale with ``num_envs``; what the layers
set still wins (services/contracts/algorithms/card.py, docs/presets.md).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from services.contracts.algorithms.card import layered_algorithm, merge
from services.contracts.algorithms.hyperparameters import (
    HyperparameterError,
    check_hyperparameter_names,
    preset_data,
)
from services.contracts.envs import target_return
from services.contracts.spec import ExperimentSpec, describe_errors
from services.pod.training.trainer import RunConfig, algorithm_card, trainer_class


def preset(algorithm: str, env: str, layers: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The preset for (``algorithm``, ``env``), with the env's solve threshold (its env card's,
    ``target_return``; an ``envpool:`` or ``gym:`` task has its task's) as target, for
    the run that ``layers`` describe (the caller puts them on top): from the preset's
    ``large_batch.min_num_envs`` on, their ``num_envs`` selects its large-batch section
    (docs/presets.md). An ``envpool:<task>`` env reads the preset of ``<task>``: its transitions
    are the same (tests/pod/envs/test_envpool_adapter.py)."""
    data = preset_data(algorithm, env, layers)
    return {"algorithm": algorithm, "env": env, "target_return": target_return(env), **data}


def train_config(env: str, layers: Iterable[Mapping[str, Any]] = ()) -> RunConfig:
    """``podium train``'s config: the preset of the algorithm the layers name (default PPO)
    for ``env``, with the layers on top. Raises ``ValidationError`` naming a bad field,
    ``HyperparameterError`` for an algorithm no trainer trains."""
    layers = list(layers)
    algorithm = layered_algorithm(layers)
    config_class = trainer_class(algorithm).config_class
    return config_class.model_validate(merge(preset(algorithm, env, layers), *layers))


def pod_config(
    spec: ExperimentSpec,
    hyperparameters: dict[str, Any],
    seed: int,
    device: str = "cpu",
    threads: int = 1,
    algorithm: str | None = None,
) -> RunConfig:
    """The preset for ``algorithm`` (default: the spec's one) and env, the trainer's pod
    defaults, the pod's run fields, then the generator's hyperparameters the algorithm has on
    top (a name only another algorithm of the spec has is ignored; one none has is an error)."""
    if algorithm is None:
        if len(spec.algorithms) != 1:
            raise HyperparameterError(
                f"the spec lists several algorithms ({', '.join(spec.algorithms)}): name one"
            )
        [algorithm] = spec.algorithms
    trainer = trainer_class(algorithm)
    check_hyperparameter_names(hyperparameters, {*spec.algorithms, algorithm})
    # The agent's own names go under its config; the rest are the trainer's (e.g. the
    # off-policy loop's batch and replay settings).
    own = set(algorithm_card(algorithm).config.model_fields)
    names = own | set(trainer.loop_hyperparameters)
    agent = {k: v for k, v in hyperparameters.items() if k in own}
    loop = {k: v for k, v in hyperparameters.items() if k in names - own}
    layers = (trainer.pod_defaults, loop, {algorithm: agent})
    base = merge(preset(algorithm, spec.env.name, layers), *layers)
    base.pop("target_return", None)  # the orchestrator ends the experiment, not the pod
    if spec.budget.total_env_steps:
        base["total_env_steps"] = spec.budget.total_env_steps
    try:
        return trainer.config_class.model_validate(
            {
                **base,
                "env_kwargs": {**base.get("env_kwargs", {}), **spec.env.kwargs},
                "eval_episodes": spec.evaluation.episodes,
                "eval_env_kwargs": spec.evaluation.env_kwargs,
                "device": device,
                "seed": seed,
                "eval_seed": eval_seed(spec),
                "torch_threads": threads,
            }
        )
    except ValidationError as exc:
        fields = "; ".join(line.strip() for line in describe_errors(exc))
        raise HyperparameterError(f"invalid hyperparameters: {fields}") from exc


def eval_seed(spec: ExperimentSpec) -> int:
    """Every pod of an experiment evaluates on the same start states, so that scores compare
    agents rather than luck of the draw (Pendulum's start angle alone moves a return by ~100)."""
    if spec.evaluation.seed is not None:
        return spec.evaluation.seed
    return zlib.crc32(f"eval:{spec.name}".encode()) % (2**31)
