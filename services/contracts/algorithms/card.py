"""The algorithm card: one torch-free description per algorithm, found by registered name.

A card says everything the control plane, the CLI and a pod's trunk need to know of an
algorithm before any of it is imported: its hyperparameters (``config``, the algorithm's own,
and ``loop_config``, its family's loop's), the action kinds it trains, the envs it is made for,
its *family* (which trainer trains it: services/pod/training/trainer.py maps family and number
of agents to a trainer), which hyperparameters may differ between the agents of one population
pod, and where its presets are. Cards are registered under the entry-point group
``podium.algorithm_cards``, built-ins exactly as plugins, so no spec or request can make Podium
import a module of its choosing.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel

from services import registry
from services.contracts.envpool_tasks import ENVPOOL_PREFIX
from services.contracts.envs import ActionKind

#: gymnasium's own env of an id a built-in env also has (services/pod/envs/registry.py).
GYM_PREFIX = "gym:"

#: A preset's section for accelerator-sized runs (docs/presets.md): the fields it holds replace
#: the preset's when the run's ``num_envs`` is at least the section's ``min_num_envs``.
LARGE_BATCH = "large_batch"
#: The section's budget rules, per env: the run field each sets, ``num_envs`` times the value.
#: At large batches PPO's progress is counted in updates, not in samples, so a fixed number of
#: updates (a budget per env) holds at any env count where a fixed env-step budget does not.
PER_ENV_FIELDS = {
    "total_env_steps_per_env": "total_env_steps",
    "eval_every_steps_per_env": "eval_every_steps",
}

#: The families the built-in trainers train (services/pod/training/): a plugin may declare any
#: other family and register its trainer under ``podium.trainers`` by the family's name.
ON_POLICY = "on_policy"
OFF_POLICY = "off_policy"


@dataclass(frozen=True)
class PopulationCard:
    """How a population pod (``population.agents_per_pod`` = P > 1) trains P agents of the
    algorithm in one process: the hyperparameter names that may differ between its agents
    (per-agent tensors; everything else shapes the networks or the rollout, which they share)."""

    hyperparameters: tuple[str, ...]


@dataclass(frozen=True)
class AlgorithmCard:
    """What one algorithm is, torch-free (see the module docstring)."""

    name: str
    family: str
    #: The algorithm's own hyperparameters: the run config's field named after the algorithm.
    config: type[BaseModel]
    action_kinds: tuple[ActionKind, ...]
    #: The family loop's hyperparameters, top-level fields of the run config (off-policy:
    #: batch size, replay); a search space names them beside the algorithm's own.
    loop_config: type[BaseModel] | None = None
    #: The only envs (a spec's ``env.name``) it trains; None: any env of its action kinds.
    envs: tuple[str, ...] | None = None
    #: None: one agent per pod.
    population: PopulationCard | None = None
    #: The package whose ``presets/<env>.yaml`` files are its presets (None: it has none).
    presets_package: str | None = None
    #: The leaderboard PBT's ``truncation`` where a spec leaves it unset (the share of the pods
    #: replaced at a decision; services/contracts/strategies.py). None: any pod below the best.
    pbt_truncation: float | None = None
    #: How people write its name ("PPO"); default: the registered name.
    label: str = ""
    summary: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", self.name)

    @property
    def hyperparameter_names(self) -> frozenset[str]:
        models = (self.config, self.loop_config) if self.loop_config else (self.config,)
        return frozenset(name for model in models for name in model.model_fields)

    def preset_files(self) -> dict[str, str]:
        """Env name → the preset's YAML text, for every preset the card ships."""
        return {} if self.presets_package is None else dict(_preset_texts(self.presets_package))

    def preset(self, env: str, num_envs: int | None = None) -> dict[str, Any]:
        """The preset's fields for ``env`` for a run of ``num_envs`` sub-environments; {} where
        none ships. From the preset's ``large_batch.min_num_envs`` on, its ``large_batch``
        section is layered on top (``large_batch_layer``); below it, or with ``num_envs``
        None, the preset as its file says. An ``envpool:<task>`` env reads the preset of
        ``<task>``: its transitions are the same (tests/pod/envs/test_envpool_adapter.py); so
        does ``gym:<id>``, the very env ``<id>`` names where no built-in env has that name."""
        data = self._preset_file(env)
        section = data.pop(LARGE_BATCH, None)
        layer = large_batch_layer(section, num_envs) if section else {}
        return merge(data, layer)

    def large_batch_from(self, env: str) -> int | None:
        """The ``num_envs`` from which ``env``'s preset switches to its large-batch section;
        None where it has none."""
        section = self._preset_file(env).get(LARGE_BATCH)
        return None if not section else int(section["min_num_envs"])

    def _preset_file(self, env: str) -> dict[str, Any]:
        files = self.preset_files()
        task = env.removeprefix(ENVPOOL_PREFIX).removeprefix(GYM_PREFIX)
        text = files.get(env) or files.get(task)
        return copy.deepcopy(_parsed(text)) if text else {}

    def num_envs(self, settings: Mapping[str, Any]) -> int | None:
        """The sub-environments a run of ``settings`` (a preset with layers on top) steps: the
        algorithm's own ``num_envs`` (PPO) or its loop's (off-policy), else the default; None
        where the value is not an integer (the config's validation names it)."""
        own = settings.get(self.name)
        if isinstance(own, Mapping) and "num_envs" in own:
            value = own["num_envs"]
        elif "num_envs" in settings:
            value = settings["num_envs"]
        else:
            models = (self.config, self.loop_config)
            fields = [
                m.model_fields["num_envs"] for m in models if m and "num_envs" in m.model_fields
            ]
            value = fields[0].default if fields else None
        return _as_count(value)

    def layered_preset(self, env: str, layers: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
        """``env``'s preset for the run the ``layers`` describe (their ``num_envs`` picks the
        large-batch section or not), without the layers themselves: a caller puts them on top,
        so that what a user sets explicitly always wins over the preset."""
        layers = list(layers)
        return self.preset(env, self.num_envs(merge(self.preset(env), *layers)))


def _as_count(value: object) -> int | None:
    """``value`` as the integer pydantic would read it (4096, 4096.0, "4096"), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def large_batch_layer(section: Mapping[str, Any], num_envs: int | None) -> dict[str, Any]:
    """A preset's ``large_batch`` section as a layer for a run of ``num_envs`` envs: {} below
    its ``min_num_envs`` (or with ``num_envs`` None), else its fields with each budget rule of
    ``PER_ENV_FIELDS`` turned into its run field (the value times ``num_envs``)."""
    threshold = int(section["min_num_envs"])
    if num_envs is None or num_envs < threshold:
        return {}
    layer = {k: v for k, v in section.items() if k != "min_num_envs" and k not in PER_ENV_FIELDS}
    for rule, name in PER_ENV_FIELDS.items():
        if rule in section:
            layer[name] = int(section[rule]) * num_envs
    # The small preset's env steps to its target say nothing of an accelerator's batch: a run
    # of the section is expected to use its budget.
    if "total_env_steps" in layer:
        layer.setdefault("expected_env_steps", layer["total_env_steps"])
    return layer


def merge(base: Mapping[str, Any], *layers: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with each layer on top; nested mappings merge key by key."""

    def two(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(low)
        for key, value in high.items():
            below = out.get(key)
            both = isinstance(below, Mapping) and isinstance(value, Mapping)
            out[key] = two(below, value) if both else value
        return out

    return functools.reduce(two, layers, dict(base))


def layered_algorithm(layers: Iterable[Mapping[str, Any]]) -> str:
    """The algorithm a run made of ``layers`` (merged in order) trains; PPO when none names one."""
    return str(merge({"algorithm": "ppo"}, *layers)["algorithm"])


@functools.cache
def _preset_texts(package: str) -> dict[str, str]:
    """The YAML files in ``package``'s ``presets/``, read once per process: every spec check
    and every pod config reads them, and package data does not change while it runs."""
    root = resources.files(package) / "presets"
    if not root.is_dir():
        return {}
    return {
        item.name.removesuffix(".yaml"): item.read_text()
        for item in root.iterdir()
        if item.name.endswith(".yaml")
    }


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> dict[str, Any]:
    """A preset's YAML parsed once per process: every config a pod builds (each PBT copy
    inside a population pod too) reads its preset, and parsing it took most of a decision.
    Callers get a deep copy (they layer onto it)."""
    return yaml.safe_load(text) or {}


class CardError(ValueError):
    """A name registered as an algorithm card whose object is not an ``AlgorithmCard``."""


def card_names() -> list[str]:
    """The algorithms a pod can train: those with a registered card."""
    return registry.names(registry.ALGORITHM_CARDS)


def card(name: str) -> AlgorithmCard:
    """The card registered as ``name`` (``registry.UnknownNameError`` when none is)."""
    found = registry.load(registry.ALGORITHM_CARDS, name, kind="algorithm card")
    if not isinstance(found, AlgorithmCard) or found.name != name:
        what = f"named {found.name!r}" if isinstance(found, AlgorithmCard) else type(found).__name__
        raise CardError(
            f"the algorithm card registered as {name!r} is not an AlgorithmCard named {name!r} "
            f"({what}; services/contracts/algorithms/card.py)"
        )
    return found


def find_card(name: str) -> AlgorithmCard | None:
    """``card(name)``, or None where no card is registered under ``name``."""
    try:
        return card(name)
    except registry.UnknownNameError:
        return None
