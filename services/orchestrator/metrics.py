"""Prometheus metrics of the orchestrator (served at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PODS_CREATED = Counter("podium_orchestrator_pods_created_total", "Training pods created.")
PODS_FAILED = Counter("podium_orchestrator_pods_failed_total", "Training pods that failed.")
PODS_TERMINATED = Counter(
    "podium_orchestrator_pods_terminated_total", "Training pods asked to stop (scale-in, end)."
)
PODS_LIVE = Gauge("podium_orchestrator_pods_live", "Training pods holding resources.")
EXPERIMENTS = Gauge("podium_orchestrator_experiments", "Experiments by state.", ["state"])
RECONCILE_SECONDS = Histogram(
    "podium_orchestrator_reconcile_seconds",
    "Duration of one reconcile pass.",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
RECONCILE_ERRORS = Counter("podium_orchestrator_reconcile_errors_total", "Failed passes.")
INVALID_EXPERIMENTS = Gauge(
    "podium_orchestrator_invalid_experiments",
    "Stored experiments that no longer validate, skipped by the last reconcile pass "
    "(shown as 'invalid' by the API; delete them).",
)
