"""Prometheus metrics of the leaderboard, one CollectorRegistry per app.

Labels stay bounded: experiment ids (as many as experiments), strategy and decision names,
outcomes, HTTP route *templates* (not raw paths) — never candidate or submission ids.
Top score and board size are read from Redis at scrape time, so they are right whichever
replica served the writes.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.contracts.leaderboard import SubmissionResponse


class LeaderboardMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.top_score = Gauge(
            "podium_leaderboard_top_score", "Best score on the board.", ["experiment"], registry=r
        )
        self.size = Gauge(
            "podium_leaderboard_size", "Candidates on the board.", ["experiment"], registry=r
        )
        self.algorithm_top_score = Gauge(
            "podium_leaderboard_algorithm_top_score",
            "Best score on the board of each algorithm of the experiment (an ensemble's).",
            ["experiment", "algorithm"],
            registry=r,
        )
        self.rank_score = Gauge(
            "podium_leaderboard_rank_score",
            "Score at each of the best ranks (rank <= metrics_top_ranks).",
            ["experiment", "rank"],
            registry=r,
        )
        self.submissions = Counter(
            "podium_leaderboard_submissions",
            "Submissions by outcome (inserted, rejected, duplicate).",
            ["experiment", "outcome"],
            registry=r,
        )
        self.evictions = Counter(
            "podium_leaderboard_evictions", "Candidates evicted.", ["experiment"], registry=r
        )
        self.decisions = Counter(
            "podium_leaderboard_generator_decisions",
            "Generator decisions by strategy.",
            ["experiment", "strategy", "decision"],
            registry=r,
        )
        self.latency = Histogram(
            "podium_leaderboard_request_duration_seconds",
            "HTTP request latency by route template.",
            ["method", "route", "status"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=r,
        )

    def record_submission(self, experiment: str, response: SubmissionResponse) -> None:
        if response.duplicate:
            outcome = "duplicate"
        else:
            outcome = "inserted" if response.accepted else "rejected"
        self.submissions.labels(experiment, outcome).inc()
        if response.evicted and not response.duplicate:
            self.evictions.labels(experiment).inc(len(response.evicted))

    def record_decision(self, experiment: str, strategy: str, decision: str) -> None:
        self.decisions.labels(experiment, strategy, decision).inc()

    def set_board(
        self,
        experiment: str,
        size: int,
        scores: list[float],
        by_algorithm: dict[str, float] | None = None,
    ) -> None:
        """Board gauges: its size, the best-first scores of its top ranks and each
        algorithm's best (at scrape time)."""
        self.size.labels(experiment).set(size)
        best = by_algorithm or {}
        for algorithm, score in best.items():
            self.algorithm_top_score.labels(experiment, algorithm).set(score)
        for labels in self._children(self.algorithm_top_score):
            if labels[0] == experiment and labels[1] not in best:
                self.algorithm_top_score.remove(*labels)
        if scores:
            self.top_score.labels(experiment).set(scores[0])
        elif (experiment,) in self._children(self.top_score):
            self.top_score.remove(experiment)
        for i, s in enumerate(scores, start=1):
            self.rank_score.labels(experiment, str(i)).set(s)
        for labels in self._children(self.rank_score):
            if labels[0] == experiment and int(labels[1]) > len(scores):
                self.rank_score.remove(*labels)

    def _by_experiment(self) -> tuple[Any, ...]:
        """The metrics whose first label is the experiment."""
        return (self.top_score, self.size, self.evictions, self.rank_score,
                self.algorithm_top_score, self.submissions, self.decisions)  # fmt: skip

    def experiments(self) -> set[str]:
        """The experiments this replica has series of."""
        return {labels[0] for m in self._by_experiment() for labels in self._children(m)}

    def forget(self, experiment: str) -> None:
        """Drop a deleted experiment's series."""
        for metric in self._by_experiment():
            for labels in self._children(metric):
                if labels[0] == experiment:
                    metric.remove(*labels)

    @staticmethod
    def _children(metric: Any) -> set[tuple[str, ...]]:
        with metric._lock:
            return set(metric._metrics)


class LatencyMiddleware:
    """Times every request, labelled by the matched route template, never the raw path."""

    def __init__(self, app: ASGIApp, metrics: LeaderboardMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path_format", None) or getattr(route, "path", None)
            self.metrics.latency.labels(
                scope["method"], template or "unmatched", str(status)
            ).observe(time.perf_counter() - start)
