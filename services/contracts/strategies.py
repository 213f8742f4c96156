"""The generator strategies' options and PBT's decisions: what the leaderboard, the spec and the
pods share about a tournament's rules.

The leaderboard's generator (services/leaderboard/generator.py) runs the strategies; the spec
validates their options at submission; the pods read PBT's ready rule and judge whether a
proposed parent beats their agent. All of it is here, once, so that no pod imports the
leaderboard (and with it the Redis store) to read two option defaults, and so the two halves
of PBT's decision (the generator's truncation and quantile, the pod's ready rule and exploit)
are read in one place.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, Field, FieldSerializationInfo, field_serializer, field_validator

from services import registry
from services.contracts.inputs import InputModel
from services.contracts.leaderboard import Manifest
from services.contracts.search_space import SearchSpace, contains

if TYPE_CHECKING:
    from services.contracts.spec import ExperimentSpec

#: Marks an option that counts the board's candidates (``json_schema_extra``): one above the
#: experiment's ``top_k`` could never be met, and the spec refuses it (``board_counts``).
BOARD_COUNT = {"x-board-count": True}


def board_counts(options: BaseModel) -> dict[str, int]:
    """The set values of ``options``' fields marked ``BOARD_COUNT``."""
    fields = type(options).model_fields
    return {
        name: value
        for name, info in fields.items()
        if info.json_schema_extra == BOARD_COUNT and (value := getattr(options, name)) is not None
    }


# Bounds on options that scale numbers: beyond them a step or a weight overflows a float.
MAX_PERTURB_FACTOR = 1_000.0
MAX_SMOOTHING = 1e6


class StrategyOptions(InputModel):
    """What every strategy takes: the service, not the strategy, seeds the draws with it."""

    seed: int | None = Field(
        default=None,
        description="Make decisions reproducible: a pod's draw is then a function of the "
        "seed, its pod id and the board it sees (each entry's pod, generation and score; "
        "an empty board at the start). Unset: draws are random.",
    )


class PBTOptions(StrategyOptions):
    quantile: float = Field(default=0.25, gt=0, le=1, description="Top share to exploit.")
    perturb_factors: tuple[
        Annotated[float, Field(gt=0, le=MAX_PERTURB_FACTOR, strict=True)], ...
    ] = Field(
        default=(0.8, 1.2),
        strict=False,  # a list becomes the tuple; each item is still a strict float
        min_length=1,
        max_length=64,
        description="Explore's steps: a log-uniform value is multiplied by a factor, a "
        "uniform one moves by (factor - 1) of its range's width (1.2: a fifth of the range "
        "up), an int one is multiplied and rounded.",
    )
    resample_probability: float = Field(default=0.25, ge=0, le=1)
    explore: bool = Field(default=True, description="False: copy hyperparameters as is.")
    min_candidates: int = Field(
        default=1,
        ge=1,
        description="Below this many on the board, start fresh.",
        json_schema_extra=BOARD_COUNT,
    )
    truncation: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Share of the population replaced: a pod that asks with its score "
        "restarts from a parent only if it ranks in this bottom share of the pods of its "
        "algorithm that have an entry on the board (each ranked by its best entry, the "
        "asking one by its current score; a pod pushed off the top K is not counted); "
        "otherwise it is told to keep training. Unset: the algorithm card's default "
        "(PPO 0.25; the others none); none (null) or 1: any pod below the best restarts (the "
        "tournament rule).",
    )
    # Read by the pods (``pod_options``), which decide when to ask for a parent.
    ready_reports: int = Field(
        default=2, ge=1, description="Reports an agent makes before it may be replaced."
    )
    ready_env_steps: int = Field(
        default=16_384,
        ge=0,
        description="Env steps an agent trains before it may be replaced: judged earlier, "
        "scores are mostly evaluation noise.",
    )
    protect_improving: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Readiness judged on improvement: an agent whose score rose by more than "
        "this (in the score's units) since its previous report is not replaced, however far "
        "below the leader it is; it keeps training while it improves. Pick it above the "
        "evaluation noise. Unset: judged on its score alone.",
    )
    exploit_margin: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Exploit's bar: an agent is replaced only by a parent whose score beats "
        "its own by more than this (in the score's units). Above 0 it keeps an agent that is "
        "exploring and scores a little below idle ones (a hard-exploration task's action cost) "
        "from being overwritten by a copy of an idle agent. 0: any better score.",
    )


#: PBTOptions' names that only the leaderboard's pods and generator read: a population pod's
#: own PBT judges every agent at every decision, from the pod's scores, with no board.
_BOARD_ONLY = {
    "ready_reports": "there are no reports between a pod's decisions",
    "min_candidates": "every agent of the pod is a candidate",
    "protect_improving": "the pod ranks recent scores, not their rise between reports",
}


class PopulationExploit(InputModel):
    """PBT among the agents of one population pod (Fast PBT, Flajolet et al. 2022): every
    ``every_env_steps`` env steps the pod ranks its agents, copies the top ``quantile``'s
    weights, optimiser state and (off-policy) replay into the bottom ``truncation`` share and
    explores their hyperparameters over the search space, between iterations, in place (no
    compile, no leaderboard round trip). The leaderboard's strategy still seeds new pods across
    pods (``generator``)."""

    every_env_steps: int = Field(
        ge=1,
        le=10**12,
        description="Env steps each agent trains between two of the pod's decisions.",
    )
    growth: float = Field(
        default=1.0,
        ge=1.0,
        le=16.0,
        allow_inf_nan=False,
        description="Each interval between decisions is this times the one before. 2, with "
        "pbt {truncation: 0.5, quantile: 0.5, explore: false}, is successive halving inside the "
        "pod: at each rung the worse half stops and its slots train copies of the better half "
        "for twice as long.",
    )
    by: Literal["train_return", "evaluation"] = Field(
        default="train_return",
        description="What agents are ranked on: the mean return of their training episodes "
        "that ended since the last decision (free), or an evaluation of every agent (the "
        "experiment's evaluation episodes, deterministic actions).",
    )
    pbt: PBTOptions = Field(
        default_factory=lambda: PBTOptions(truncation=0.25, ready_env_steps=0),
        description="The leaderboard PBT's options (quantile, truncation, perturb_factors, "
        "resample_probability, explore, exploit_margin, ready_env_steps, seed), one "
        "implementation. Default: the worst quarter replaced at each decision (truncation "
        "0.25), an agent judged from its first decision (ready_env_steps 0).",
    )

    @field_validator("pbt", mode="before")
    @classmethod
    def _pod_options(cls, value: Any) -> Any:
        if isinstance(value, dict):
            if unusable := sorted(set(value) & set(_BOARD_ONLY)):
                raise ValueError(
                    "; ".join(
                        f"{name} does not apply here: {_BOARD_ONLY[name]}" for name in unusable
                    )
                )
            # Unset, the in-pod defaults hold (a quarter replaced, judged at once).
            value = {"truncation": 0.25, "ready_env_steps": 0, **value}
        return value

    @field_serializer("pbt")
    def _pod_options_only(self, value: PBTOptions, info: FieldSerializationInfo) -> dict[str, Any]:
        # The options a pod reads: the board's own, even at their defaults, would be refused
        # when the stored spec is read again.
        return value.model_dump(mode=info.mode, exclude=set(_BOARD_ONLY))


class CEMOptions(StrategyOptions):
    elite: int | None = Field(
        default=None,
        ge=2,
        description="How many of the top to fit; default all (top K).",
        json_schema_extra=BOARD_COUNT,
    )
    min_elite: int = Field(
        default=2, ge=2, description="Below this, sample the space.", json_schema_extra=BOARD_COUNT
    )
    min_std_fraction: float = Field(
        default=0.02, ge=0, le=1, description="Std floor, as a fraction of each range."
    )
    categorical_smoothing: float = Field(
        default=1.0,
        ge=0,
        le=MAX_SMOOTHING,
        description="Pseudo-count added to each categorical value's count in the elite.",
    )
    init: Literal["fresh", "best"] = Field(
        default="fresh", description="Fresh weights, or the best candidate's."
    )


#: The built-in strategies' options, by the entry point that registers them (pyproject.toml):
#: read without importing the leaderboard. A plugin strategy's options are its class's own.
BUILTIN_OPTIONS: dict[str, type[StrategyOptions]] = {
    "services.leaderboard.generator:RandomGenerator": StrategyOptions,
    "services.leaderboard.generator:PBTGenerator": PBTOptions,
    "services.leaderboard.generator:CEMGenerator": CEMOptions,
}


def options_model(strategy: str) -> type[BaseModel]:
    """The options model of the strategy registered as ``strategy`` (UnknownNameError if none):
    a built-in's from ``BUILTIN_OPTIONS``, a plugin's from its registered class."""
    target = registry.entry_point(registry.GENERATORS, strategy, kind="generator strategy").value
    if target in BUILTIN_OPTIONS:
        return BUILTIN_OPTIONS[target]
    options = getattr(registry.load(registry.GENERATORS, strategy), "Options", None)
    if not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise registry.PluginError(
            f"generator strategy {strategy!r} declares no Options model (a Strategy subclass "
            "names its options' pydantic model as Options)"
        )
    return options


# -- PBT's decision: the generator's half -------------------------------------------------------
class Ranked(Protocol):
    """A board entry as PBT's decisions see it."""

    @property
    def pod_id(self) -> str: ...

    @property
    def score(self) -> float: ...


R = TypeVar("R", bound=Ranked)


def parents(candidates: Sequence[R], quantile: float) -> list[R]:
    """Truncation selection: the top ``quantile`` of ``candidates`` (best first; at least one)."""
    n = max(1, math.ceil(quantile * len(candidates)))
    return list(candidates[:n])


def in_bottom(
    candidates: Sequence[Ranked],
    pod_id: str,
    score: float,
    truncation: float,
    higher_is_better: bool = True,
) -> bool:
    """Whether the pod ``pod_id``, now scoring ``score``, is in the bottom ``truncation`` share
    of the pods on the board (``candidates``, best first; each pod ranked by its best entry).
    Protecting the rest keeps a slow starter alive until it has shown what it learns."""
    standing: dict[str, float] = {}
    for c in candidates:  # best first: each pod's best entry
        standing.setdefault(c.pod_id, c.score)
    standing[pod_id] = score
    sign = 1.0 if higher_is_better else -1.0
    above = sum(sign * s > sign * score for s in standing.values())
    replaced = max(1, math.ceil(truncation * len(standing)))
    return above >= len(standing) - replaced


@dataclass(frozen=True)
class _Entry:
    pod_id: str
    score: float


def population_exploits(
    scores: Sequence[float],
    options: PBTOptions,
    rng: random.Random,
    higher_is_better: bool = True,
) -> list[tuple[int, int]]:
    """PBT's decision for a population scored all at once (a population pod's agents, whose
    board is every agent's current score): ``(agent, parent)`` for each agent that restarts from a
    parent, by the rules the leaderboard and its pods apply: an agent is replaced if it is in the
    bottom ``truncation`` share (``in_bottom``; unset: any agent below the best), by a parent drawn
    uniformly from the top ``quantile`` (``parents``), and only if that parent beats it by more than
    ``exploit_margin`` (``parent_is_better``'s bar). Worst agent first: copied in that order, a
    parent that is replaced too is copied from before it is overwritten."""
    sign = 1.0 if higher_is_better else -1.0
    order = sorted(range(len(scores)), key=lambda i: -sign * scores[i])  # best first, stable
    board = [_Entry(str(i), scores[i]) for i in order]
    pairs = []
    for i in reversed(order):
        if options.truncation is not None and not in_bottom(
            board, str(i), scores[i], options.truncation, higher_is_better
        ):
            continue
        parent = int(rng.choice(parents(board, options.quantile)).pod_id)
        if sign * (scores[parent] - scores[i]) > options.exploit_margin:
            pairs.append((i, parent))
    return pairs


def explore(
    hyperparameters: dict[str, Any], space: SearchSpace, options: PBTOptions, rng: random.Random
) -> tuple[dict[str, Any], dict[str, str]]:
    """PBT's explore of a parent's ``hyperparameters`` over ``space`` (the generator's, and a
    population pod's among its agents): each searched name is resampled with
    ``resample_probability``, else stepped with one of ``perturb_factors`` in its own scale
    (services/contracts/search_space.py); a name the parent lacks, or holds outside the space,
    is sampled. Returns the new values and how each name got its value."""
    out = dict(hyperparameters)
    how: dict[str, str] = {}
    for name, dist in space.items():
        if name not in out or not contains(dist, out[name]):
            out[name], how[name] = dist.sample(rng), "sampled"
        elif rng.random() < options.resample_probability:
            out[name], how[name] = dist.sample(rng), "resampled"
        else:
            out[name] = dist.perturb(out[name], rng, options.perturb_factors)
            how[name] = "perturbed"
    return out, how


# -- PBT's decision: the pod's half -------------------------------------------------------------
class Judged(Protocol):
    """An agent in training as PBT judges it (the pod's lineage record)."""

    @property
    def rank(self) -> int | None: ...

    @property
    def reports(self) -> int: ...

    @property
    def env_steps_at_start(self) -> int: ...

    @property
    def score(self) -> float | None: ...

    @property
    def candidate_id(self) -> str | None: ...

    @property
    def previous_score(self) -> float | None: ...


#: The ``pbt`` options a pod reads itself: when to ask for a parent, and when to take it.
POD_OPTIONS = ("ready_reports", "ready_env_steps", "protect_improving", "exploit_margin")


def pod_options(spec: ExperimentSpec) -> PBTOptions:
    """The generator's ``POD_OPTIONS``, checked by the options model, their defaults where
    unset (``PBTOptions``, the one place they are stated); the others stay at defaults."""
    given = spec.generator.options
    return PBTOptions.model_validate({k: given[k] for k in POD_OPTIONS if given.get(k) is not None})


def ready_rule(spec: ExperimentSpec) -> tuple[int, int]:
    """PBT's "ready": the reports and env steps an agent needs since it was built before it is
    judged, and may be replaced by a better parent: the generator's ``ready_reports`` /
    ``ready_env_steps`` options, else their defaults. Judged earlier, scores are evaluation
    noise: with 2,048-step rounds (one Pendulum update) and no such rule,
    bench/tournament_quality.py saw whole populations copy each other in circles while
    independent pods solved the task."""
    options = pod_options(spec)
    return options.ready_reports, options.ready_env_steps


def is_improving(agent: Judged, margin: float, higher_is_better: bool = True) -> bool:
    """Whether ``agent``'s last score beat its previous one (both since it was built) by more
    than ``margin``."""
    if agent.score is None or agent.previous_score is None:
        return False
    rise = agent.score - agent.previous_score
    return (rise if higher_is_better else -rise) > margin


def is_ready(
    agent: Judged,
    env_steps: int,
    ready_reports: int,
    ready_env_steps: int,
    improving_margin: float | None = None,
    higher_is_better: bool = True,
) -> bool:
    """Whether PBT should judge ``agent`` now (``env_steps``: its learner's count): not the
    best there is (rank 1), trained long enough since it was built, and (with
    ``improving_margin``, the ``protect_improving`` option) not still improving: a strong
    learner that starts slowly is not replaced by a copy of an early leader."""
    return (
        agent.rank != 1
        and agent.reports >= ready_reports
        and env_steps - agent.env_steps_at_start >= ready_env_steps
        and not (
            improving_margin is not None and is_improving(agent, improving_margin, higher_is_better)
        )
    )


def parent_is_better(
    manifest: Manifest, agent: Judged, higher_is_better: bool, margin: float = 0.0
) -> bool:
    """Whether the generator's proposed parent (``manifest``) scored better than ``agent`` by
    more than ``margin`` (PBT's exploit; ``exploit_margin``); an agent not scored yet loses to
    any parent."""
    parent_id, parent_score = manifest.parent_id, manifest.parent_score
    if parent_id is None or parent_id == agent.candidate_id or parent_score is None:
        return False
    own = agent.score
    if own is None:
        return True
    return (parent_score - own if higher_is_better else own - parent_score) > margin
