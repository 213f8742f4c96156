"""Name → implementation lookup through entry points.

Everything a spec or request can name (environments, algorithms, generator strategies) is found
here by *registered name*; nothing from user input is ever used as a module path. Listing names
reads package metadata only, so the control plane can validate names without importing torch;
only ``load`` imports the implementation.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

ENVS = "podium.envs"
# An env's card (services/contracts/envs.py, torch-free), registered beside the env itself.
ENV_CARDS = "podium.env_cards"
ALGORITHMS = "podium.algorithms"
# An algorithm's card (services/contracts/algorithms/card.py, torch-free), registered beside the
# algorithm itself so that the control plane can tell, without importing torch, what it trains.
ALGORITHM_CARDS = "podium.algorithm_cards"
# A family's trainer (services/pod/training/trainer.py), by the family's name.
TRAINERS = "podium.trainers"
GENERATORS = "podium.generators"


class UnknownNameError(LookupError):
    """A name that is not registered; the message lists the known names."""

    def __init__(self, kind: str, name: str, known: list[str]):
        self.kind, self.name, self.known = kind, name, known
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(known) or '(none)'}")


class PluginError(ValueError):
    """A registered name whose implementation cannot be loaded (its module fails to import, or
    lacks what the entry point names): the message names the entry point and the cause. A
    ``ValueError``: a spec naming it is refused (422), a pod exits as bad input."""


def _entry_points(group: str) -> dict[str, EntryPoint]:
    # Scanning the installed distributions' metadata costs milliseconds and every spec
    # validation needs several groups: scan once per process, again only when sys.path
    # changes (a plugin directory added at run time).
    return _scan(group, tuple(sys.path))


@lru_cache(maxsize=32)
def _scan(group: str, path: tuple[str, ...]) -> dict[str, EntryPoint]:
    """The group's entry points found on ``path`` (part of the key only)."""
    return {ep.name: ep for ep in entry_points(group=group)}


def names(group: str) -> list[str]:
    return sorted(_entry_points(group))


def load(group: str, name: str, kind: str | None = None) -> Any:
    ep = entry_point(group, name, kind)
    try:
        return ep.load()
    except Exception as exc:  # a plugin's import runs its code: any error, named as its
        raise PluginError(
            f"{kind or group} {name!r} (registered as {ep.value} in {group}) cannot be "
            f"loaded: {type(exc).__name__}: {exc}"
        ) from exc


def entry_point(group: str, name: str, kind: str | None = None) -> EntryPoint:
    """The entry point registered as ``name``, not loaded: its ``value`` says what it names."""
    eps = _entry_points(group)
    if name not in eps:
        raise UnknownNameError(kind or group.rsplit(".", 1)[-1].rstrip("s"), name, sorted(eps))
    return eps[name]
