"""The generator: where a new pod starts (algorithm, hyperparameters, weights).

Strategies are found by registered name in the ``podium.generators`` entry-point group, so a
plugin adds one without touching Podium and no request can make the service import code. The
built-ins:

- ``random``: fresh weights, hyperparameters sampled from the search space;
- ``pbt``: population-based training. *Exploit* by truncation selection (the parent is drawn
  uniformly from the top ``quantile`` of the board; its weights are copied), then *explore*: each
  searched hyperparameter is resampled with ``resample_probability``, otherwise stepped with
  one of ``perturb_factors`` in its own scale (services/contracts/search_space.py: a log-uniform
  one is multiplied, a uniform one moves by (factor - 1) of its range) and clamped to its bounds (a
  categorical one moves to a neighbour). With ``truncation``, a pod asking with its score is
  told to ``keep`` unless it is among the worst;
- ``cem``: cross-entropy method. A Gaussian (mean, covariance) is fitted to the numeric
  hyperparameters of the top K (in log space for log-uniform ones), new ones are drawn from it;
  categorical ones from the elite's smoothed frequencies.

An experiment may list several algorithms with weights (an ensemble): each new pod asks for
the one the orchestrator gave it (its weight's share of the pods), else one is drawn by weight,
and a strategy only ever sees, and copies from, candidates of that algorithm.

Why one file of this size: the three built-in strategies are short and share the context,
proposal and lease code of the service that runs them; a strategy read beside that code is
read whole.
"""

from __future__ import annotations

import abc
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ValidationError

from services import registry
from services.contracts.algorithms.card import find_card
from services.contracts.leaderboard import (
    Experiment,
    GenerateRequest,
    Manifest,
    ManifestCheckpoint,
    ManifestFile,
)
from services.contracts.search_space import NUMERIC, Choice, SearchSpace, contains, sample_space
from services.contracts.spec import describe_errors
from services.contracts.strategies import (
    CEMOptions,
    PBTOptions,
    StrategyOptions,
    explore,
    in_bottom,
    parents,
)
from services.leaderboard.metrics import LeaderboardMetrics
from services.leaderboard.store import (
    InvalidConfigError,
    LeaderboardStore,
    StoreBusyError,
    UnknownAlgorithmError,
    parse_experiment,
)
from services.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class CandidateView:
    """What a strategy may know about a candidate on the board."""

    candidate_id: str
    algorithm: str
    hyperparameters: dict[str, Any]
    generation: int
    score: float
    files: dict[str, str] = field(default_factory=dict)  # name -> sha256
    pod_id: str = ""  # the pod (or population member) that reported it


@dataclass
class Context:
    experiment_id: str
    algorithm: str
    search_space: SearchSpace
    # Candidates of ``algorithm`` on the board, best first.
    candidates: list[CandidateView]
    top_k: int
    rng: random.Random
    # Who asks, and (when it asks whether to restart) its current score.
    pod_id: str = ""
    score: float | None = None
    higher_is_better: bool = True


@dataclass
class Proposal:
    decision: str  # fresh | exploit | explore | cem | keep
    hyperparameters: dict[str, Any]
    parent: CandidateView | None = None
    # Extra lineage fields (e.g. which hyperparameters explore changed), JSON-encoded strings.
    details: dict[str, str] = field(default_factory=dict)


class Strategy(abc.ABC):
    """A generator strategy; subclasses declare their options as a pydantic model."""

    name: ClassVar[str]

    # The options models are contracts (services/contracts/strategies.py): the spec and the
    # pods read them without importing the leaderboard.
    Options: ClassVar[type[BaseModel]] = StrategyOptions

    def __init__(self, options: dict[str, Any] | None = None):
        self.options = self.Options.model_validate(options or {})

    @abc.abstractmethod
    def propose(self, ctx: Context) -> Proposal: ...


class RandomGenerator(Strategy):
    name = "random"

    def propose(self, ctx: Context) -> Proposal:
        return Proposal("fresh", sample_space(ctx.search_space, ctx.rng))


class PBTGenerator(Strategy):
    name = "pbt"

    Options = PBTOptions
    options: PBTOptions

    def parents(self, candidates: list[CandidateView]) -> list[CandidateView]:
        """Truncation selection: the top ``quantile`` (at least one)."""
        return parents(candidates, self.options.quantile)

    def truncation(self, algorithm: str) -> float | None:
        """The options' ``truncation``, else the default of the algorithm's card."""
        if "truncation" in self.options.model_fields_set:
            return self.options.truncation
        found = find_card(algorithm)
        return found.pbt_truncation if found is not None else None

    def propose(self, ctx: Context) -> Proposal:
        if len(ctx.candidates) < self.options.min_candidates:
            return Proposal("fresh", sample_space(ctx.search_space, ctx.rng))
        truncation = self.truncation(ctx.algorithm)
        if (
            truncation is not None
            and ctx.score is not None
            and not in_bottom(
                ctx.candidates, ctx.pod_id, ctx.score, truncation, ctx.higher_is_better
            )
        ):
            return Proposal("keep", {})
        parent = ctx.rng.choice(self.parents(ctx.candidates))
        if not self.options.explore:
            return Proposal("exploit", dict(parent.hyperparameters), parent)
        hyper, how = explore(parent.hyperparameters, ctx.search_space, self.options, ctx.rng)
        return Proposal("explore", hyper, parent, {"explore": json.dumps(how, sort_keys=True)})


@dataclass
class GaussianFit:
    """The elite's mean and covariance in each numeric hyperparameter's sampling coordinate."""

    names: list[str]
    mean: np.ndarray
    covariance: np.ndarray


def _unit_row(space: SearchSpace, names: list[str], h: dict[str, Any]) -> list[float] | None:
    """``h`` in sampling coordinates, or None if it lacks a name or holds a value outside the
    space (non-numeric, non-finite, out of bounds: a hand-made report): one odd submission must
    not stop (or steer) the fit."""
    if not all(n in h and contains(space[n], h[n]) for n in names):
        return None
    row = [float(space[n].to_unit(h[n])) for n in names]
    return row if all(math.isfinite(x) for x in row) else None


def fit_gaussian(
    space: SearchSpace, elite: list[dict[str, Any]], min_std_fraction: float = 0.0
) -> GaussianFit:
    names = [n for n, d in space.items() if isinstance(d, NUMERIC)]
    rows = [row for h in elite if (row := _unit_row(space, names, h)) is not None]
    x = np.asarray(rows, dtype=float).reshape(len(rows), len(names))
    mean = x.mean(axis=0) if len(rows) else np.zeros(len(names))
    cov = np.cov(x, rowvar=False, ddof=0).reshape(len(names), len(names)) if len(rows) > 1 else None
    if cov is None:
        cov = np.zeros((len(names), len(names)))
    # A floor on the spread keeps CEM exploring instead of collapsing onto one point.
    floor = np.array([(min_std_fraction * space[n].unit_range()) ** 2 for n in names])
    cov = cov + np.diag(floor)
    return GaussianFit(names, mean, cov)


class CEMGenerator(Strategy):
    name = "cem"

    Options = CEMOptions
    options: CEMOptions

    def propose(self, ctx: Context) -> Proposal:
        elite = ctx.candidates[: self.options.elite or len(ctx.candidates)]
        if len(elite) < self.options.min_elite:
            return Proposal("fresh", sample_space(ctx.search_space, ctx.rng))
        hyper = sample_space(ctx.search_space, ctx.rng)  # names the Gaussian does not cover
        fit = fit_gaussian(
            ctx.search_space, [c.hyperparameters for c in elite], self.options.min_std_fraction
        )
        usable = sum(
            _unit_row(ctx.search_space, fit.names, c.hyperparameters) is not None for c in elite
        )
        if fit.names and usable >= self.options.min_elite:
            np_rng = np.random.default_rng(ctx.rng.getrandbits(64))
            draw = np_rng.multivariate_normal(fit.mean, fit.covariance, method="eigh")
            for name, x in zip(fit.names, draw, strict=True):
                hyper[name] = ctx.search_space[name].from_unit(float(x))
        for name, dist in ctx.search_space.items():
            if isinstance(dist, Choice):
                weights = [
                    self.options.categorical_smoothing
                    + sum(1 for c in elite if c.hyperparameters.get(name) == v)
                    for v in dist.values
                ]
                if sum(weights) > 0:
                    hyper[name] = ctx.rng.choices(dist.values, weights=weights)[0]
        parent = elite[0] if self.options.init == "best" else None
        return Proposal("cem", hyper, parent, {"fit_size": str(len(elite))})


def load_strategy(name: str, options: dict[str, Any]) -> Strategy:
    """The strategy registered as ``name``; raises UnknownNameError, ValidationError (its
    options) or PluginError (it cannot be loaded or built: a plugin's code may raise anything)."""
    cls = registry.load(registry.GENERATORS, name, kind="generator strategy")
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise registry.PluginError(f"generator strategy {name!r} is not a Strategy subclass")
    try:
        return cls(options)
    except ValidationError:
        raise
    except Exception as e:
        raise registry.PluginError(f"generator strategy {name!r} cannot be built: {e!r}") from e


def choose_algorithm(weights: dict[str, float], rng: random.Random) -> str:
    names = sorted(n for n, w in weights.items() if w > 0)
    return rng.choices(names, weights=[weights[n] for n in names])[0]


def candidate_view(candidate_id: str, h: dict[str, str]) -> CandidateView:
    return CandidateView(
        candidate_id=candidate_id,
        algorithm=h["algorithm"],
        hyperparameters=json.loads(h["hyperparameters"]),
        generation=int(h["generation"]),
        score=float(h["score"]),
        files=json.loads(h.get("files", "{}")),
        pod_id=h.get("pod_id", ""),
    )


def download_path(experiment_id: str, candidate_id: str, name: str) -> str:
    return f"/api/v1/experiments/{experiment_id}/candidates/{candidate_id}/files/{name}"


def file_location(experiment_id: str, candidate_id: str, name: str) -> dict[str, str]:
    """A training file's ``uri`` and ``download_path``: both the API path (relative to the
    leaderboard's URL). Where the checkpoint store keeps it (a server path, a bucket) is never
    shown: clients fetch through the API, which checks their token and sends the digest."""
    path = download_path(experiment_id, candidate_id, name)
    return {"uri": path, "download_path": path}


class GeneratorService:
    """Answers ``POST /experiments/{id}/generate``: pick an algorithm, run the experiment's
    strategy on that algorithm's candidates, lease the parent's files, log the decision."""

    def __init__(
        self,
        store: LeaderboardStore,
        metrics: LeaderboardMetrics,
        lease_ttl_s: float,
    ):
        self.store, self.metrics, self.lease_ttl_s = store, metrics, lease_ttl_s
        self._strategies: dict[str, Strategy] = {}
        self.rng = random.Random()

    def request_rng(
        self, seed: int | None, pod_id: str, board: list[CandidateView]
    ) -> random.Random:
        """The random stream of one request. Seeded, it depends only on the seed, the pod and
        the board (pods, generations, scores), not on the experiment's id or on ids drawn at
        random: two experiments with one seed start their pods alike (paired benchmark arms)
        and answer alike while their boards hold the same reports, and a pod asking again of
        an unchanged board gets the same answer."""
        if seed is None:
            return self.rng
        # Candidate ids are random: the board is described by what the pods reported.
        fingerprint = ";".join(f"{c.pod_id}/{c.generation}={c.score!r}" for c in board)
        return random.Random(f"{seed}/{pod_id}/{fingerprint}")

    def strategy(self, exp: Experiment) -> Strategy:
        key = json.dumps([exp.generator.strategy, exp.generator.options], sort_keys=True)
        if key not in self._strategies:
            try:
                strategy = load_strategy(exp.generator.strategy, exp.generator.options)
            except ValidationError as e:
                problems = [f"generator.options.{line.strip()}" for line in describe_errors(e)]
                raise InvalidConfigError(exp.experiment_id, problems) from e
            except (registry.UnknownNameError, registry.PluginError) as e:
                raise InvalidConfigError(exp.experiment_id, [f"generator.strategy: {e}"]) from e
            self._strategies[key] = strategy
        return self._strategies[key]

    async def generate(self, experiment_id: str, req: GenerateRequest) -> Manifest:
        # A parent evicted between the read and the lease is retried with a fresh read.
        for _ in range(5):
            raw_config, rows = await self.store.top(experiment_id)
            exp = parse_experiment(experiment_id, raw_config)
            strategy = self.strategy(exp)
            views = [candidate_view(cid, h) for cid, h in rows]
            # A plugin's options model need not have a seed (nor be Strategy.Options).
            seed = getattr(getattr(strategy, "options", None), "seed", None)
            rng = self.request_rng(seed if isinstance(seed, int) else None, req.pod_id, views)
            if req.algorithm is not None:
                if exp.algorithms.get(req.algorithm, 0) <= 0:
                    raise UnknownAlgorithmError(
                        f"algorithm {req.algorithm!r} is not in this experiment's ensemble "
                        f"({', '.join(sorted(exp.algorithms))})"
                    )
                algorithm = req.algorithm
            else:
                algorithm = choose_algorithm(exp.algorithms, rng)
            ctx = Context(
                experiment_id=experiment_id,
                algorithm=algorithm,
                search_space=exp.search_space,
                candidates=[v for v in views if v.algorithm == algorithm],
                top_k=exp.top_k,
                rng=rng,
                pod_id=req.pod_id,
                score=req.score,
                higher_is_better=exp.higher_is_better,
            )
            try:
                proposal = strategy.propose(ctx)
            except Exception as e:  # a plugin's: every pod would retry it until the budget ends
                log.error("generator strategy failed", strategy=strategy.name, exc_info=True)
                what = f"generator.strategy {strategy.name!r} failed to propose: {e!r}"
                raise InvalidConfigError(experiment_id, [what]) from e
            manifest = await self._record(experiment_id, req, strategy, algorithm, proposal)
            if manifest is not None:
                self.metrics.record_decision(experiment_id, strategy.name, proposal.decision)
                return manifest
        raise StoreBusyError("the parents chosen kept being evicted meanwhile; retry")

    async def _record(
        self,
        experiment_id: str,
        req: GenerateRequest,
        strategy: Strategy,
        algorithm: str,
        p: Proposal,
    ) -> Manifest | None:
        common = {
            "pod_id": req.pod_id,
            "strategy": strategy.name,
            "algorithm": algorithm,
            "hyperparameters": json.dumps(p.hyperparameters, sort_keys=True),
            **p.details,
        }
        if p.parent is None:
            if p.decision != "keep":  # asked every round by every pod: not worth a log line
                await self.store.log_event(experiment_id, {"event": p.decision, **common})
            return Manifest(
                experiment_id=experiment_id,
                pod_id=req.pod_id,
                algorithm=algorithm,
                hyperparameters=p.hyperparameters,
                parent_id=None,
                generation=0,
                checkpoint="fresh",
                decision=p.decision,
                strategy=strategy.name,
            )
        parent = p.parent
        events = [[("event", "exploit"), ("parent_id", parent.candidate_id), *common.items()]]
        if p.decision != "exploit":
            events.append(
                [("event", p.decision), ("parent_id", parent.candidate_id), *common.items()]
            )
        leased = await self.store.lease(
            experiment_id,
            parent.candidate_id,
            list(parent.files.values()),
            req.pod_id,
            self.lease_ttl_s,
            events,
        )
        if leased is None:
            return None
        lease_id, expires = leased
        files = {
            name: ManifestFile(
                sha256=sha, **file_location(experiment_id, parent.candidate_id, name)
            )
            for name, sha in parent.files.items()
        }
        return Manifest(
            experiment_id=experiment_id,
            pod_id=req.pod_id,
            algorithm=algorithm,
            hyperparameters=p.hyperparameters,
            parent_id=parent.candidate_id,
            parent_score=parent.score,
            generation=parent.generation + 1,
            checkpoint=ManifestCheckpoint(candidate_id=parent.candidate_id, files=files),
            decision=p.decision,
            strategy=strategy.name,
            lease_id=lease_id,
            lease_expires_at=expires,
        )
