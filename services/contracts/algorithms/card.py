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

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel

from services import registry
from services.contracts.action_spaces import ActionKind
from services.contracts.envpool_tasks import ENVPOOL_PREFIX

#: The families the built-in trainers train (services/pod/training/): a plugin may declare any
#: other family and register its trainer under ``podium.trainers`` by the family's name.
ON_POLICY = "on_policy"
OFF_POLICY = "off_policy"


@dataclass(frozen=True)
class PopulationCard:
    """How a population pod (``population.agents_per_pod`` = P > 1) trains P agents of the
    algorithm in one process: the hyperparameter names that may differ between its agents
    (per-agent tensors; everything else shapes the networks or the rollout, which they share)
    and the settings it has no batched form of (refused when set)."""

    hyperparameters: tuple[str, ...]
    #: Setting name → what it turns on (for the refusal's message).
    unsupported: Mapping[str, str] = field(default_factory=dict)


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

    def preset(self, env: str) -> dict[str, Any]:
        """The preset's fields for ``env``; {} where none ships. An ``envpool:<task>`` env
        reads the preset of ``<task>``: its transitions are the same
        (tests/pod/envs/test_envpool_adapter.py)."""
        files = self.preset_files()
        text = files.get(env) or files.get(env.removeprefix(ENVPOOL_PREFIX))
        return yaml.safe_load(text) if text else {}


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


class CardError(ValueError):
    """A name registered as an algorithm card whose object is not an ``AlgorithmCard``."""


def card_names() -> list[str]:
    """The algorithms a pod can train: those with a registered card."""
    return registry.names(registry.ALGORITHM_CARDS)


def card(name: str) -> AlgorithmCard:
    """The card registered as ``name`` (``registry.UnknownNameError`` when none is)."""
    found = registry.load(registry.ALGORITHM_CARDS, name, kind="algorithm card")
    if not isinstance(found, AlgorithmCard) or found.name != name:
        raise CardError(
            f"the algorithm card registered as {name!r} is not an AlgorithmCard named {name!r} "
            f"(services/contracts/algorithms/card.py)"
        )
    return found


def find_card(name: str) -> AlgorithmCard | None:
    """``card(name)``, or None where no card is registered under ``name``."""
    try:
        return card(name)
    except registry.UnknownNameError:
        return None
