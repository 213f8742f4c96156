"""Ended pods' last log lines outlive the pods (issue 35 item 9): kept with the experiment in
Redis when each pod ends, bounded, served by a restarted orchestrator, deleted with the
experiment. Local backend, real stand-in pod processes, real Redis, the real leaderboard."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import redis
from fastapi.testclient import TestClient

from services.orchestrator.app import create_app
from services.orchestrator.reconciler import last_bytes
from services.orchestrator.settings import OrchestratorSettings
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
    standin = {"crash_after_s": 0.4, "report_interval_s": 0.05, "info_lines": True}
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
