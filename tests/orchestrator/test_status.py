"""The experiment status is typed (services/orchestrator/status.py) yet stored as before: a
status written by an older orchestrator (a plain JSON object) loads, and the API shows it."""

from __future__ import annotations

import json

import redis
from fastapi.testclient import TestClient

from services.contracts.spec import ExperimentSpec
from services.orchestrator.status import ExperimentStatus
from services.orchestrator.store import PREFIX, Store
from tests.orchestrator.conftest import spec

#: A status exactly as the orchestrator wrote it while the status was a dict.
OLD_STATUS = {
    "state": "budget_exhausted",
    "reason": "env-step budget spent: 4096 >= 4096",
    "pods_launched": 3,
    "desired_pods": 2,
    "registered": True,
    "started_at": 1700000000.5,
    "finished_at": 1700000100.25,
    "finalized": True,
    "env_steps": 4096,
    "best": {"candidate_id": "c1", "score": 12.5},
    "consecutive_failures": 1,
    "last_failure_at": 1700000050.0,
    "next_launch_at": 1700000050.1,
    "to_replace": ["p3"],
    "allowances": {"p2": 2048},
    "last_failure": {"pod_id": "p3", "reason": "Error (exit code 3)", "log_tail": "boom\n"},
    "pods": [
        {
            "pod_id": "p2",
            "phase": "Terminating",
            "created_at": 1700000001.0,
            "reason": None,
            "algorithm": "ppo",
        }
    ],
    "result": {
        "state": "budget_exhausted",
        "reason": "env-step budget spent: 4096 >= 4096",
        "best": {"candidate_id": "c1", "score": 12.5},
        "env_steps": 4096,
        "pods_launched": 3,
        "finished_at": 1700000100.25,
    },
}


def _store_old_record(r: redis.Redis, exp_id: str, status: dict) -> None:
    body = ExperimentSpec.model_validate(spec("old")).model_dump_json()
    r.hset(
        f"{PREFIX}exp:{exp_id}",
        mapping={
            "spec": body,
            "created_at": "1700000000.0",
            "intent": "run",
            "status": json.dumps(status),
            "state": status.get("state", "pending"),
        },
    )
    r.zadd(f"{PREFIX}experiments", {exp_id: 1700000000.0})


def test_an_old_format_status_loads_and_is_stored_back_unchanged(client: TestClient) -> None:
    store: Store = client.app.state.store
    _store_old_record(store.r, "old1", OLD_STATUS)
    exp = store.get("old1")
    assert exp is not None and exp.invalid is None
    s = exp.status
    assert s.state == "budget_exhausted" and s.finalized and s.registered
    assert s.best_score == 12.5 and s.env_steps == 4096 and s.allowances == {"p2": 2048}
    assert s.last_failure is not None and s.last_failure.log_tail == "boom\n"
    assert s.pods[0].algorithm == "ppo" and s.result is not None and s.result.pods_launched == 3
    # Written back, it is the same JSON object (an older orchestrator reads it as before).
    assert json.loads(s.to_json()) == OLD_STATUS
    # The API shows it with the shape it always had.
    body = client.get("/api/v1/experiments/old1").json()
    assert body["state"] == "budget_exhausted" and body["best_score"] == 12.5
    assert body["last_failure"] == OLD_STATUS["last_failure"]
    assert body["result"] == OLD_STATUS["result"]
    assert body["pods"] == OLD_STATUS["pods"]
    assert body["desired_pods"] == 2 and body["progress"]["pods_launched"] == 3


def test_a_minimal_old_status_loads_with_defaults(client: TestClient) -> None:
    store: Store = client.app.state.store
    # The first status ever written (create), plus a key no version knows of.
    _store_old_record(store.r, "old2", {"state": "pending", "pods_launched": 0, "future": 1})
    exp = store.get("old2")
    assert exp is not None and exp.invalid is None
    assert exp.status.pods == [] and exp.status.best is None and exp.status.desired_pods == 0
    body = client.get("/api/v1/experiments/old2").json()
    assert body["state"] == "pending" and body["pods"] == [] and body["result"] is None


def test_a_status_of_the_wrong_shape_shows_the_record_as_invalid(client: TestClient) -> None:
    store: Store = client.app.state.store
    _store_old_record(store.r, "bad", {"state": "running", "pods_launched": "many"})
    exp = store.get("bad")
    assert exp is not None and exp.invalid and "pods_launched" in exp.invalid
    body = client.get("/api/v1/experiments/bad").json()
    assert body["state"] == "invalid" and "pods_launched" in body["reason"]


def test_a_new_status_stores_only_what_was_set() -> None:
    status = ExperimentStatus(state="pending", reason="waiting", pods_launched=0)
    status.registered = True
    assert json.loads(status.to_json()) == {
        "state": "pending",
        "reason": "waiting",
        "pods_launched": 0,
        "registered": True,
    }
    assert json.loads(ExperimentStatus().to_json()) == {"state": "pending"}


def test_an_ended_experiment_wants_no_pods(client: TestClient) -> None:
    # `podium status` of an ended experiment said "pods 0 running, 2 wanted".
    from tests.orchestrator.conftest import wait_for

    body = spec("ends", population={"min_pods": 2, "max_pods": 2})
    exp_id = client.post("/api/v1/experiments", json=body).json()["id"]
    wait_for(lambda: client.get(f"/api/v1/experiments/{exp_id}").json()["desired_pods"] == 2)
    assert client.post(f"/api/v1/experiments/{exp_id}/cancel").status_code == 202
    exp = wait_for(
        lambda: (e := client.get(f"/api/v1/experiments/{exp_id}").json())["result"] and e
    )
    assert exp["state"] == "cancelled" and exp["pods"] == []
    assert exp["desired_pods"] == 0
