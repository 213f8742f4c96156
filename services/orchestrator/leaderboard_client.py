"""How the orchestrator learns an experiment's progress: the leaderboard, over HTTP only.

The seam is ``ProgressSource``: register an experiment, read its progress (best evaluated score,
best candidate, total env steps the pods reported), delete it. ``LeaderboardProgress`` talks to
the leaderboard service through the shared client:

- ``PUT    /api/v1/experiments/{id}``: register (top_k, generator, algorithms, search space,
  higher_is_better);
- ``GET    /api/v1/experiments/{id}/best``: the best candidate (``score``, ``candidate_id``);
  404 while there is none;
- ``GET    /api/v1/experiments/{id}``: the experiment summary; its ``env_steps`` field (the
  total env steps of every submission the pods made) drives the env-step budget;
- ``DELETE /api/v1/experiments/{id}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.api_client import LeaderboardClient, LeaderboardError
from services.contracts.leaderboard import ExperimentConfig, GeneratorConfig
from services.contracts.spec import ExperimentSpec
from services.logs import get_logger

log = get_logger(__name__)


@dataclass
class Progress:
    best: dict[str, Any] | None = None  # the best candidate as the leaderboard returns it
    env_steps: int | None = None
    #: Pod → the env steps of its decided reports (its agents' together), as far as the
    #: submission log was read before ``env_steps`` was counted (never more than it holds).
    reported: dict[str, int] = field(default_factory=dict)

    @property
    def best_score(self) -> float | None:
        if self.best is None or self.best.get("score") is None:
            return None
        return float(self.best["score"])


def pod_of(reporter: str) -> str:
    """The pod of a reporter: itself, or the pod of a population's agent ``<pod>.m<i>``."""
    return reporter.split(".", 1)[0]


@dataclass
class Reports:
    """What the submission log holds after a cursor, by reporter (a pod, or ``<pod>.m<i>``
    for an agent of a population pod)."""

    #: The greatest common divisor of each one's reports' env steps and the batches they
    #: said (0 when none had any): a pod trains whole batches, so this is a whole number of
    #: them, its batch once it said it.
    batches: dict[str, int]
    #: Each one's last score.
    scores: dict[str, float]
    #: The cursor to read on from.
    cursor: str | None
    #: Every report read (submission id → reporter, env steps), those after the cursor too,
    #: which the next read returns again.
    reports: dict[str, tuple[str, int]] = field(default_factory=dict)


class ProgressSource(Protocol):
    def register(self, experiment_id: str, spec: ExperimentSpec) -> None: ...

    def progress(self, experiment_id: str) -> Progress: ...

    def delete(self, experiment_id: str) -> None: ...

    def reporters(self, experiment_id: str, after: str | None) -> Reports:
        """The decided reports after stream id ``after``."""
        ...


class NoLeaderboard:
    """No leaderboard configured: no scores, so only wall-time and pod budgets can end a run."""

    def register(self, experiment_id: str, spec: ExperimentSpec) -> None:
        return None

    def progress(self, experiment_id: str) -> Progress:
        return Progress()

    def delete(self, experiment_id: str) -> None:
        return None

    def reporters(self, experiment_id: str, after: str | None) -> Reports:
        return Reports({}, {}, after)


def leaderboard_config(spec: ExperimentSpec) -> ExperimentConfig:
    return ExperimentConfig(
        top_k=spec.top_k,
        generator=GeneratorConfig(strategy=spec.generator.strategy, options=spec.generator.options),
        algorithms=spec.algorithms,
        search_space=spec.search_space,
        higher_is_better=spec.evaluation.higher_is_better,
    )


class LeaderboardProgress:
    """``ProgressSource`` over the shared leaderboard client (services/api_client.py), one
    attempt per call: the reconciler asks again on its next pass."""

    def __init__(self, base_url: str, token: str | None, timeout_s: float = 5.0):
        self.client = LeaderboardClient(base_url, token=token, timeout_s=timeout_s, retry_for_s=0)

    def register(self, experiment_id: str, spec: ExperimentSpec) -> None:
        self.client.register(leaderboard_config(spec), experiment_id)

    def progress(self, experiment_id: str) -> Progress:
        best = self.client.best(experiment_id)
        summary = self.client.summary(experiment_id)
        return Progress(
            best=best.model_dump(mode="json") if best is not None else None,
            env_steps=summary.env_steps if summary is not None else None,
        )

    def delete(self, experiment_id: str) -> None:
        self.client.delete(experiment_id)

    def reporters(self, experiment_id: str, after: str | None) -> Reports:
        """From the submission log (``GET …/submissions``): the cursor returned is that of the
        last full page read, since the log gives one for full pages only; the caller keeps the
        union, so the partial page read again next time adds nothing twice."""
        try:
            log_, cursor = self.client.submissions_since(experiment_id, after, page=1000)
        except LeaderboardError as exc:
            if exc.status == 404:
                return Reports({}, {}, after)
            raise
        reports = Reports({}, {}, cursor)
        for sub in log_.submissions:
            # A report's env steps are whole batches: with the batch the pod said, the batch.
            said = sub.batch_env_steps or 0
            pod = sub.pod_id
            reports.batches[pod] = math.gcd(reports.batches.get(pod, 0), sub.env_steps, said)
            reports.scores[pod] = sub.score
            reports.reports[sub.submission_id] = (pod, sub.env_steps)
        return reports

    def close(self) -> None:
        self.client.close()
