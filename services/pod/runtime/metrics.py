"""The pod's Prometheus metrics: env steps/s, updates/s, latest and best eval return, rounds,
compile seconds, start-up seconds (to the first env step and to the first report).

Served on ``PODIUM_METRICS_PORT`` when it is set (``0`` = any free port; the bound port is
written to ``<PODIUM_POD_DIR>/<pod id>.metrics_port``, since the directory is shared by the
experiment's pods); without it nothing is served. Each pod has its own registry, so tests and
benches can run several pods in one process without clashing names.
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from services.logs import get_logger

log = get_logger(__name__)


class PodMetrics:
    def __init__(self, experiment_id: str, pod_id: str, higher_is_better: bool = True) -> None:
        self.higher_is_better = higher_is_better  # the spec's evaluation: which return is best
        self.registry = CollectorRegistry()
        labels = {"experiment": experiment_id, "pod": pod_id}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        self.env_steps = counter("podium_pod_env_steps", "Env steps trained.")
        self.updates = counter("podium_pod_updates", "Learner updates.")
        self.rounds = counter("podium_pod_rounds", "Rounds finished.")
        self.submissions = counter("podium_pod_submissions", "Results reported to the updater.")
        self.exploits = counter(
            "podium_pod_exploits",
            "Agents replaced by a copy of a better agent of the same pod (population.exploit).",
        )
        self.env_steps_per_s = gauge(
            "podium_pod_env_steps_per_second", "Env steps per second over the last round."
        )
        self.updates_per_s = gauge(
            "podium_pod_updates_per_second", "Updates per second over the last round."
        )
        self.eval_return = gauge("podium_pod_eval_return", "Latest evaluation mean return.")
        # Labelled with the spec's direction: the dashboard's best of an experiment's pods is
        # their max where higher is better, their min where lower is.
        direction = {"higher_is_better": str(higher_is_better).lower()}
        self.best_eval_return = Gauge(
            "podium_pod_best_eval_return",
            "Best evaluation mean return of this pod (higher_is_better: the spec's direction).",
            [*labels, *direction],
            registry=self.registry,
        ).labels(**labels, **direction)
        self.compile_seconds = counter(
            "podium_pod_compile_seconds",
            "Seconds spent compiling (torch.compile: dynamo and inductor) by this pod.",
        )
        self.startup_seconds = Gauge(
            "podium_pod_startup_seconds",
            "Seconds from the pod's process start to a milestone: its first env step "
            "(milestone=first_env_step: start-up, compile included) and its first report "
            "(milestone=first_report).",
            [*labels, "milestone"],
            registry=self.registry,
        )
        self._labels = labels
        self._compiled = 0.0
        self._best: float | None = None
        self.server = None

    def compiled(self, total_seconds: float) -> None:
        """The trainer's compile seconds so far (``Trainer.compile_seconds``)."""
        if total_seconds > self._compiled:
            self.compile_seconds.inc(total_seconds - self._compiled)
            self._compiled = total_seconds

    def started(self, milestone: str, seconds: float) -> None:
        """The pod reached ``milestone`` ``seconds`` after its process started."""
        self.startup_seconds.labels(**self._labels, milestone=milestone).set(seconds)

    def round_done(self, env_steps: int, updates: int, seconds: float) -> None:
        self.rounds.inc()
        self.env_steps.inc(env_steps)
        self.updates.inc(updates)
        if seconds > 0:
            self.env_steps_per_s.set(env_steps / seconds)
            self.updates_per_s.set(updates / seconds)

    def evaluated(self, *means: float) -> None:
        """An evaluation's mean return (a population's members' at once: the best is the pod's)."""
        best = max if self.higher_is_better else min
        mean = best(means)
        self.eval_return.set(mean)
        if self._best is None or best(mean, self._best) != self._best:
            self._best = mean
            self.best_eval_return.set(mean)

    def serve(self, port: int, pod_dir: Path | None, pod_id: str) -> int:
        """Serve /metrics on ``port`` (0 = ephemeral); returns the bound port."""
        self.server, _ = start_http_server(port, registry=self.registry)
        bound = int(self.server.server_port)
        if pod_dir is not None:
            path = Path(pod_dir) / f"{pod_id}.metrics_port"
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(f"{bound}\n")
            os.replace(tmp, path)
        log.info("metrics served", port=bound)
        return bound

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
