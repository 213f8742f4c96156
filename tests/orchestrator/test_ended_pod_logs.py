"""Ended pods' last log lines outlive the pods: kept with the experiment in
Redis when each pod ends, bounded, served by a restarted orchestrator, deleted with the
experiment. Local backend, real stand-in pod processes, real Redis, the real leaderboard."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import redis
from fastapi.testclient import TestClient

from services.contracts.spec import ExperimentSpec
from services.orchestrator.app import create_app
from services.orchestrator.backends.base import Backend, PodInfo, PodRequest
from services.orchestrator.leaderboard_client import NoLeaderboard
from services.orchestrator.reconciler import Reconciler, last_bytes
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.store import Store
from tests.orchestrator.conftest import TOKEN, spec, wait_for

CRASH = "simulated crash: CUDA error: out of memory"


def _app(settings: OrchestratorSettings) -> TestClient:
    c = TestClient(create_app(settings))
    c.headers["Authorization"] = f"Bearer {TOKEN}"
    return c


def test_ended_pods_last_lines_are_kept_bounded_through_a_restart_and_deleted(
    make_settings: Callable[..., OrchestratorSettings],
    flush_redis: None,
    redis_url: str,
    tmp_path: Path,
) -> None:
    settings = make_settings(ended_pod_logs=3, ended_pod_log_lines=4)
    # Each pod logs a line per report, then crashes: more lines than are kept. (Pods that
    # reported are replaced, not counted as crashing: the pod budget ends the experiment.)
    standin = {"crash_after_reports": 5, "report_interval_s": 0.05, "info_lines": True}
    body = spec(
        population={"min_pods": 1, "max_pods": 1}, budget={"pods_launched": 4}, standin=standin
    )
    with _app(settings) as c:
        exp_id = c.post("/api/v1/experiments", json=body).json()["id"]
        wait_for(
            lambda: c.get(f"/api/v1/experiments/{exp_id}").json()["state"] == "budget_exhausted"
        )
        events = c.get(f"/api/v1/experiments/{exp_id}/events").json()
        failed = [e["pod_id"] for e in events if e["type"] == "pod_failed"]
        assert len(failed) == 4, events
        first = c.get(f"/api/v1/experiments/{exp_id}/ended-pods").json()

    # The newest three of the four pods, in the order they ended, each its last four lines.
    assert [p["pod_id"] for p in first] == failed[1:]
    for p in first:
        assert (p["phase"], p["stopped"], p["reason"]) == ("Failed", False, "exit code 3")
        lines = p["log"].splitlines()
        assert len(lines) == 4 and lines[-1] == CRASH, lines
        assert '"event": "round reported"' in lines[0]
    assert [p["ended_at"] for p in first] == sorted(p["ended_at"] for p in first)

    # Restarted, on another machine (its data dir holds none of the pods' log files): the
    # logs come from the store.
    elsewhere = make_settings(data_dir=tmp_path / "elsewhere", ended_pod_logs=3)
    with _app(elsewhere) as c:
        base = f"/api/v1/experiments/{exp_id}"
        assert c.get(f"{base}/ended-pods").json() == first
        short = c.get(f"{base}/ended-pods", params={"tail": 1}).json()
        assert [p["log"] for p in short] == [CRASH] * 3
        one = c.get(f"{base}/pods/{failed[-1]}/logs", params={"tail": 2})
        assert one.status_code == 200 and one.text.splitlines()[-1] == CRASH
        assert len(one.text.splitlines()) == 2
        dropped = c.get(f"{base}/pods/{failed[0]}/logs")  # beyond the bound: not kept
        assert dropped.status_code == 404
        bad = c.get(f"{base}/ended-pods", params={"tail": 0})
        assert bad.status_code == 422 and "tail" in bad.text
        assert c.get("/api/v1/experiments/nope/ended-pods").status_code == 404

        # Deleted with the experiment.
        r = redis.Redis.from_url(redis_url)
        keys = [f"podium:orch:podlogs:{exp_id}", f"podium:orch:podlogs_order:{exp_id}"]
        assert r.exists(*keys) == 2
        assert c.delete(base).status_code == 204
        wait_for(lambda: r.exists(*keys) == 0)
        r.close()


def test_ended_pod_logs_can_be_turned_off_and_failures_still_say_why(
    make_settings: Callable[..., OrchestratorSettings], flush_redis: None
) -> None:
    settings = make_settings(ended_pod_logs=0, crash_loop_limit=1)
    body = spec(population={"min_pods": 1, "max_pods": 1}, standin={"crash_after_s": 0.1})
    with _app(settings) as c:
        exp_id = c.post("/api/v1/experiments", json=body).json()["id"]
        exp = wait_for(
            lambda: (e := c.get(f"/api/v1/experiments/{exp_id}").json())["state"] == "failed" and e
        )
        assert exp["last_failure"]["log_tail"].splitlines()[-1] == CRASH
        assert CRASH in exp["reason"]
        assert c.get(f"/api/v1/experiments/{exp_id}/ended-pods").json() == []


def test_last_bytes_keeps_whole_lines_within_the_limit() -> None:
    text = "".join(f"line {i:03d} é\n" for i in range(100))  # 12 bytes a line
    assert last_bytes(text, 10_000) == text
    kept = last_bytes(text, 100)
    assert len(kept.encode()) <= 100 and kept.startswith("line ") and kept.endswith("099 é\n")
    assert kept == "".join(f"line {i:03d} é\n" for i in range(92, 100))
    assert last_bytes("x" * 50, 10) == "x" * 10  # one long line: its end


class LingeringBackend(Backend):
    """Pods in memory; a removed pod is listed once more, its log gone, as Kubernetes' pod
    watch shows one (a late MODIFIED event, deletionTimestamp set) after the reconciler
    deleted it, until the DELETED event comes."""

    def __init__(self) -> None:
        super().__init__()
        self.pods: dict[str, PodInfo] = {}
        self.logs: dict[str, str] = {}
        self.lingering: list[PodInfo] = []

    def capacity(self) -> Res:
        return Res(4.0, 0, 64 * 2**30)

    def list_pods(self) -> list[PodInfo]:
        lingering, self.lingering = self.lingering, []
        return [*self.pods.values(), *lingering]

    def create_pod(self, req: PodRequest) -> None:
        self.pods[req.pod_id] = PodInfo(
            req.experiment_id, req.pod_id, "Running", time.time(), req.resources
        )

    def terminate_pod(self, experiment_id: str, pod_id: str, grace_s: float) -> None:
        self.pods[pod_id].terminating = True

    def remove_pod(self, experiment_id: str, pod_id: str) -> None:
        if (pod := self.pods.pop(pod_id, None)) is not None:
            pod.terminating = True  # being deleted
            self.lingering.append(pod)
        self.logs.pop(pod_id, None)

    def pod_log_tail(self, experiment_id: str, pod_id: str, lines: int = 20) -> str:
        return self.logs.get(pod_id, "")


def test_a_handed_in_pod_listed_again_keeps_the_log_it_ended_with(
    make_settings: Callable[..., OrchestratorSettings], redis_url: str, flush_redis: None
) -> None:
    """A pod already handed in but listed again (being deleted, its log gone) is not kept
    again: its kept record still says it crashed, with its last lines, not that it was
    stopped with an empty log."""
    r = redis.Redis.from_url(redis_url)
    store, backend = Store(r), LingeringBackend()
    rec = Reconciler(make_settings(), store, backend, NoLeaderboard())
    body = spec(population={"min_pods": 1, "max_pods": 1})
    exp_id, _ = store.create("linger", ExperimentSpec.model_validate(body))
    try:
        wait_for(lambda: rec.reconcile_once() or backend.pods)
        [pod] = backend.pods.values()
        pod.phase, pod.exit_code, pod.reason = "Failed", 3, "exit code 3"
        backend.logs[pod.pod_id] = CRASH
        rec.reconcile_once()  # handed in: its log kept, the pod removed
        assert [(k.pod_id, k.log, k.stopped) for k in store.pod_logs(exp_id)] == [
            (pod.pod_id, CRASH, False)
        ]
        rec.reconcile_once()  # listed again, terminating, its log gone
        assert [(k.pod_id, k.log, k.stopped) for k in store.pod_logs(exp_id)] == [
            (pod.pod_id, CRASH, False)
        ]
    finally:
        rec.stop()
        r.close()
