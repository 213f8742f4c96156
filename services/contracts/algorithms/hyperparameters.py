"""The checks every reader of a card applies: which hyperparameter names an algorithm takes,
what a population pod can train, what the presets say. Torch-free: the control plane
(services/contracts/spec.py) and the pod (services/pod/runtime/, training/presets.py) call the same
checks.

A spec's ``search_space`` and a generator's hyperparameters are flat names: an algorithm's own
config fields plus its family loop's (the card's ``config`` and ``loop_config``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from services.contracts.algorithms.card import AlgorithmCard, card, card_names, find_card
from services.contracts.envs import env_action_kind
from services.contracts.search_space import WHOLE_RUN, Choice, IntUniform, SearchSpace


class HyperparameterError(ValueError):
    """Hyperparameters or an algorithm a pod cannot train: a name the algorithm does not have,
    an invalid value, an algorithm no pod trains or that the env's action space does not fit.
    A ValueError, so a spec validator raising it is a pydantic validation error (a 422)."""


def hyperparameter_names(algorithm: str) -> frozenset[str] | None:
    """The hyperparameter names ``algorithm`` takes, or None where no card is registered."""
    found = find_card(algorithm)
    return None if found is None else found.hyperparameter_names


def preset_files() -> dict[tuple[str, str], str]:
    """(algorithm, env) → the preset's YAML text, for every preset of every registered card."""
    return {
        (name, env): text
        for name in card_names()
        for env, text in card(name).preset_files().items()
    }


def preset_data(
    algorithm: str, env: str, layers: Iterable[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """The preset file's fields for (``algorithm``, ``env``), for the run that ``layers``
    (settings put on top of it by the caller) describe: their ``num_envs`` selects the
    preset's large-batch section from its threshold on (docs/presets.md). {} where none
    ships."""
    found = find_card(algorithm)
    return {} if found is None else found.layered_preset(env, layers)


def check_hyperparameter_names(
    names: Iterable[str], algorithms: Iterable[str] | None = None
) -> None:
    """Refuse names that none of ``algorithms`` takes (default: any algorithm a pod trains).

    An experiment's search space is shared by its algorithms, so a name is valid when at least one
    of them has it; each pod applies only its own algorithm's names. The spec validator and the pod
    both call this."""
    fields = {a: hyperparameter_names(a) for a in sorted(set(algorithms or card_names()))}
    if any(f is None for f in fields.values()):
        return  # an algorithm without a card is refused by name elsewhere
    known = {a: f for a, f in fields.items() if f is not None}
    unknown = sorted(set(names) - set().union(*known.values()))
    if unknown:
        valid = sorted(set().union(*known.values()))
        # What the reader most likely meant comes first, and the names quoted from the input
        # are short: an API error is cut to a few hundred characters, the list at its end.
        guesses = [
            f"{name[:64]!r}: did you mean {', '.join(map(repr, close))}?"
            for name in unknown[:3]
            if (close := difflib.get_close_matches(name, valid, n=2, cutoff=0.6))
        ]
        shown = ", ".join(repr(name[:64]) for name in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        listing = "; ".join(f"{a}: {', '.join(sorted(f))}" for a, f in known.items())
        raise HyperparameterError(
            f"{shown}{more} not hyperparameters of {' or '.join(map(repr, known))}"
            + (f" ({'; '.join(guesses)})" if guesses else "")
            + f"; `podium algorithms --names` lists them: {listing}"
        )


@cache
def _field(algorithm: str, name: str) -> FieldInfo | None:
    """``algorithm``'s setting ``name`` (its config's or its loop's field), None if none."""
    found = find_card(algorithm)
    models = (found.config, found.loop_config) if found else ()
    return next((m.model_fields[name] for m in models if m and name in m.model_fields), None)


@cache
def _field_check(algorithm: str, name: str) -> TypeAdapter[Any] | None:
    """The validator of ``algorithm``'s setting ``name`` (its type and bounds; None where it
    has none), built once: a spec is validated on every read of it."""
    if (info := _field(algorithm, name)) is None:
        return None
    return TypeAdapter(
        Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    )


def whole_run_settings(space: SearchSpace, algorithms: Iterable[str]) -> list[str]:
    """The names ``space`` may set true whose field, in any of ``algorithms``, is marked
    ``WHOLE_RUN`` (services/contracts/search_space.py)."""
    return sorted(
        name
        for name, dist in space.items()
        if isinstance(dist, Choice)
        and True in dist.values
        and any((f := _field(a, name)) and f.json_schema_extra == WHOLE_RUN for a in algorithms)
    )


def check_hyperparameter_values(space: SearchSpace, algorithms: Iterable[str]) -> None:
    """Refuse a search space that can draw a value the pods' configs refuse: each choice, each
    range's bounds and a fractional point inside it (a ``uniform`` range over an integer
    setting), checked against the field of every one of ``algorithms`` that has the name,
    with its type and bounds (not the config's cross-field checks: a pod still refuses those
    at start)."""
    for name, dist in space.items():
        if isinstance(dist, Choice):
            points = list(dist.values)
        elif isinstance(dist, IntUniform) or dist.low == dist.high:
            points = [dist.low, dist.high]
        else:
            points = [dist.low, dist.high, dist.low + 0.123456789 * (dist.high - dist.low)]
        for algorithm in sorted(set(algorithms)):
            if (check := _field_check(algorithm, name)) is None:
                continue
            for value in points:
                try:
                    check.validate_python(value)
                except ValidationError as exc:
                    problem = exc.errors()[0]["msg"]
                    if not isinstance(dist, Choice) and value not in (dist.low, dist.high):
                        problem += " (an integer setting: draw it with int_uniform)"
                    raise HyperparameterError(
                        f"search_space.{name} may draw {value!r}, which {algorithm} refuses: "
                        f"{problem}"
                    ) from None


def _population_cards(size: int, algorithms: Iterable[str]) -> list[AlgorithmCard]:
    cards = [card(a) for a in sorted(set(algorithms))]
    single = [c.name for c in cards if c.population is None]
    if single:
        can = sorted(card(c).label for c in card_names() if card(c).population is not None)
        raise HyperparameterError(
            f"population.agents_per_pod = {size}: population pods train "
            f"{' and '.join(can) or 'no algorithm'} only, not {', '.join(single)}"
        )
    return cards


def check_population(
    size: int,
    algorithms: Iterable[str],
    names: Iterable[str],
    pinned: Iterable[str] = (),
) -> None:
    """Refuse what a population pod (``population.agents_per_pod`` = ``size``) cannot train:
    an algorithm whose card has no population, or names (of the search space, or a
    manifest's) that its population cannot vary, since its agents share one network and
    rollout shape. A ``pinned`` name (the search space's one-value choice: every agent gets the
    same value) is a setting the agents share, so any setting may be pinned, e.g.
    ``sde_sample_freq: 0`` to train a preset that uses gSDE. The spec validator and the
    population pod both call this."""
    for found in _population_cards(size, algorithms):
        assert found.population is not None
        varied = found.population.hyperparameters
        shared = sorted(set(names) - set(varied) - set(pinned))
        if shared:
            raise HyperparameterError(
                f"population.agents_per_pod = {size}: search_space "
                f"{', '.join(map(repr, shared))} cannot vary within a population (its {size} "
                f"agents share one network and rollout shape); it may vary "
                f"{', '.join(varied)}, and pin any {found.name} setting with a one-value choice"
            )


def misfits(env: str, algorithms: list[str]) -> list[str]:
    """The algorithms among ``algorithms`` that cannot train on ``env``, each with the reason:
    an algorithm made for other envs (its card's ``envs``), or one whose action kinds do not
    include the env's (not checked where the env's kind or the algorithm's card is unknown)."""
    kind = env_action_kind(env)
    out = []
    for name in algorithms:
        found = find_card(name)
        if found is None:
            continue
        if found.envs is not None and env not in found.envs:
            out.append(
                f"cannot train {name} on {env}: {name} trains {' or '.join(found.envs)} only"
            )
        elif kind is not None and kind not in found.action_kinds:
            out.append(
                f"cannot train {name} on {env}: {name} trains "
                f"{' or '.join(sorted(found.action_kinds))} actions, {env} has {kind} actions"
            )
    return out
