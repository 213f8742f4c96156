"""Hostile input and races against the experiments API.

Real Redis (embedded), the real app over its ASGI client, the real reconciler and stand-in pod
processes. Bodies with NaN / Infinity / overflowing literals are sent as raw JSON text, as an
attacker's client would.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.orchestrator.status import ExperimentStatus
from services.orchestrator.store import Store
from tests.orchestrator.conftest import live_pods, spec, wait_for

API = "/api/v1/experiments"


def _raw(body: dict, **literals: str) -> bytes:
    """``body`` as JSON, with each ``"@name"`` string replaced by the literal text given."""
    text = json.dumps(body)
    for name, literal in literals.items():
        text = text.replace(json.dumps(f"@{name}"), literal)
    return text.encode()


def _post_raw(client: TestClient, content: bytes):
    return client.post(API, content=content, headers={"Content-Type": "application/json"})


def _locs(r) -> list[tuple]:
    assert r.status_code == 422, r.text
    return [tuple(e["loc"]) for e in r.json()["detail"]]


def _metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing")


# -- non-finite numbers at any depth -------------------------------------------------
@pytest.mark.parametrize(
    ("change", "literal", "loc"),
    [
        ({"round": {"seconds": "@v"}}, "1e309", ("body", "round", "seconds")),
        ({"round": {"seconds": "@v"}}, "-Infinity", ("body", "round", "seconds")),
        ({"budget": {"wall_time_s": "@v"}}, "Infinity", ("body", "budget", "wall_time_s")),
        ({"target_return": "@v"}, "NaN", ("body", "target_return")),
        ({"algorithms": {"ppo": "@v"}}, "1e309", ("body", "algorithms", "ppo")),
        ({"resources": {"cpu": "@v"}}, "NaN", ("body", "resources", "cpu")),
        (
            {"env": {"name": "CartPole-v1", "kwargs": {"x": "@v"}}},
            "NaN",
            ("body", "env", "kwargs"),
        ),
        (
            {"evaluation": {"env_kwargs": {"x": "@v"}}},
            "Infinity",
            ("body", "evaluation", "env_kwargs"),
        ),
        (
            {"generator": {"strategy": "cem", "options": {"min_std_fraction": "@v"}}},
            "Infinity",
            ("body", "generator", "options"),
        ),
        (
            {"generator": {"strategy": "cem", "options": {"categorical_smoothing": "@v"}}},
            "1e309",
            ("body", "generator", "options"),
        ),
        (
            {"generator": {"strategy": "pbt", "options": {"perturb_factors": ["@v"]}}},
            "Infinity",
            ("body", "generator", "options"),
        ),
        (
            {"generator": {"strategy": "pbt", "options": {"perturb_factors": ["@v"]}}},
            "NaN",
            ("body", "generator", "options"),
        ),
        (
            {"search_space": {"lr": {"type": "uniform", "low": 0, "high": "@v"}}},
            "1e309",
            ("body", "search_space", "lr", "uniform", "high"),
        ),
        (
            {"search_space": {"bs": {"type": "choice", "values": [64, "@v"]}}},
            "NaN",
            ("body", "search_space", "bs", "choice", "values"),
        ),
    ],
)
def test_non_finite_numbers_anywhere_are_422_naming_the_field(
    client: TestClient, change: dict, literal: str, loc: tuple
) -> None:
    r = _post_raw(client, _raw(spec("p1", **change), v=literal))
    assert loc in _locs(r)
    assert "finite" in r.text
    listed = client.get(API)
    assert listed.status_code == 200 and listed.json() == []  # nothing stored, list intact


def _poison(redis_url: str, exp_id: str) -> None:
    """Rewrite a stored spec the way the old code stored ``round.seconds: 1e309`` (as null)."""
    r = redis.Redis.from_url(redis_url)
    key = f"podium:orch:exp:{exp_id}"
    stored = json.loads(r.hget(key, "spec"))
    stored["round"] = {"env_steps": None, "seconds": None}
    r.hset(key, "spec", json.dumps(stored))
    r.close()


def test_a_stored_record_that_no_longer_validates_bricks_nothing(
    client: TestClient, redis_url: str
) -> None:
    bad = client.post(API, json=spec("bad", resources={"cpu": 8})).json()["id"]  # stays pending
    _poison(redis_url, bad)
    client.app.state.reconciler.wake()

    listed = client.get(API)
    assert listed.status_code == 200
    shown = {e["id"]: e for e in listed.json()}
    assert shown[bad]["state"] == "invalid" and "round" in shown[bad]["reason"]
    one = client.get(f"{API}/{bad}")
    assert one.status_code == 200 and one.json()["state"] == "invalid"
    # Listed by the state it shows, and not by the one it was stored in.
    assert [e["id"] for e in client.get(API, params={"state": "invalid"}).json()] == [bad]
    assert client.get(API, params={"state": "pending"}).json() == []
    for action in ("cancel", "pause", "resume"):
        r = client.post(f"{API}/{bad}/{action}")
        assert r.status_code == 409 and "invalid" in r.json()["detail"]

    # Other experiments keep being reconciled: a new one gets its pods.
    good = client.post(API, json=spec("good"))
    assert good.status_code == 201
    good_id = good.json()["id"]
    wait_for(lambda: client.get(f"{API}/{good_id}").json()["state"] == "running")
    assert live_pods(Path(client.app.state.settings.data_dir), good_id)
    wait_for(lambda: _metric(client, "podium_orchestrator_invalid_experiments") == 1)
    assert client.app.state.reconciler.last_error is None
    assert client.get("/readyz").status_code == 200

    assert client.delete(f"{API}/{bad}").status_code == 204
    assert client.get(f"{API}/{bad}").status_code == 404
    wait_for(lambda: _metric(client, "podium_orchestrator_invalid_experiments") == 0)
    assert [e["id"] for e in client.get(API).json()] == [good_id]


def test_invalid_records_are_listed_page_by_page_within_a_bounded_scan(
    client: TestClient, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``?state=invalid`` looks through at most ``INVALID_SCAN`` records a request: a page cut
    short says where to go on, and following the cursors finds every invalid record once."""
    from services.orchestrator import store

    monkeypatch.setattr(store, "INVALID_SCAN", 3)
    ids = [
        client.post(API, json=spec(f"e{i}", resources={"cpu": 8})).json()["id"] for i in range(8)
    ]
    bad = {ids[1], ids[6]}  # old and new, with valid ones between and around
    for exp_id in bad:
        _poison(redis_url, exp_id)
    found, params, pages = [], {"state": "invalid", "limit": 1}, 0
    while True:
        r = client.get(API, params=params)
        assert r.status_code == 200, r.text
        pages += 1
        found += [e["id"] for e in r.json()]
        assert all(e["state"] == "invalid" for e in r.json())
        if "X-Next-Cursor" not in r.headers:
            break
        params["cursor"] = r.headers["X-Next-Cursor"]
    assert sorted(found) == sorted(bad) and pages >= 3  # 8 records, at most 3 read a page
    valid = client.get(API, params={"state": "pending"}).json()
    assert {e["id"] for e in valid} == set(ids) - bad


def test_readyz_reports_a_reconciler_that_keeps_failing(client: TestClient) -> None:
    rec = client.app.state.reconciler
    real = rec.store
    # The reconciler's own Redis connection is broken (the API's still works).
    rec.store = Store(
        redis.Redis(
            host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
        )
    )
    try:
        r = wait_for(lambda: (x := client.get("/readyz")).status_code == 503 and x)
        body = r.json()
        assert body["status"] == "unavailable" and "passes failed" in body["reconciler"]
        assert "ConnectionError" in body["last_error"]
    finally:
        rec.store = real
    wait_for(lambda: client.get("/readyz").status_code == 200)


# -- stream cursors ------------------------------------------------------------------
def test_event_cursors_beyond_64_bits_are_422(client: TestClient) -> None:
    exp_id = client.post(API, json=spec(resources={"cpu": 8})).json()["id"]
    for after in ("18446744073709551616-0", "0-18446744073709551616", "9" * 30 + "-0", "1-x"):
        r = client.get(f"{API}/{exp_id}/events", params={"after": after})
        assert _locs(r) == [("query", "after")], after
    r = client.get(f"{API}/{exp_id}/events", params={"after": "18446744073709551615-0"})
    assert r.status_code == 200 and r.json() == []


# -- deep or odd env kwargs ----------------------------------------------------------
def test_deeply_nested_kwargs_are_422(client: TestClient) -> None:
    depth = 300
    nested = '{"a":' * depth + "1" + "}" * depth
    body = _raw(spec(env={"name": "CartPole-v1", "kwargs": "@v"}), v=nested)
    r = _post_raw(client, body)
    assert ("body", "env", "kwargs") in _locs(r) and "nested deeper" in r.text
    assert client.get(API).json() == []


def test_lone_surrogates_in_kwargs_are_422(client: TestClient) -> None:
    for kwargs in ('{"x": "\\ud800"}', '{"\\udfff": 1}', '{"x": ["ok", {"y": "a\\ud83d"}]}'):
        body = _raw(spec(env={"name": "CartPole-v1", "kwargs": "@v"}), v=kwargs)
        r = _post_raw(client, body)
        assert ("body", "env", "kwargs") in _locs(r) and "surrogate" in r.text, kwargs
    assert client.get(API).json() == []


# -- atomic transitions --------------------------------------------------------------
def test_cancel_then_pause_then_resume_stays_cancelled(client: TestClient) -> None:
    d = Path(client.app.state.settings.data_dir)
    exp_id = client.post(API, json=spec(population={"min_pods": 2, "max_pods": 2})).json()["id"]
    wait_for(lambda: len(live_pods(d, exp_id)) == 2)
    assert client.post(f"{API}/{exp_id}/cancel").status_code == 202
    for action in ("pause", "resume", "pause", "resume"):
        r = client.post(f"{API}/{exp_id}/{action}")
        assert r.status_code == 409 and "cancelled" in r.json()["detail"], r.text
    assert client.post(f"{API}/{exp_id}/cancel").status_code == 202  # idempotent
    wait_for(lambda: client.get(f"{API}/{exp_id}").json()["result"])
    assert client.get(f"{API}/{exp_id}").json()["state"] == "cancelled"
    wait_for(lambda: not live_pods(d, exp_id))


def test_concurrent_random_transitions_never_undo_an_accepted_cancel(client: TestClient) -> None:
    d = Path(client.app.state.settings.data_dir)
    exp_id = client.post(API, json=spec(population={"min_pods": 2, "max_pods": 3})).json()["id"]
    wait_for(lambda: live_pods(d, exp_id))
    rng = random.Random(12)
    actions = [rng.choice(["pause", "resume", "resume", "pause", "cancel"]) for _ in range(200)]

    def act(action: str) -> tuple[str, int]:
        return action, client.post(f"{API}/{exp_id}/{action}").status_code

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(act, actions))
    assert {code for _, code in answers} <= {202, 409}
    accepted_cancels = [a for a, code in answers if a == "cancel" and code == 202]
    assert accepted_cancels
    exp = wait_for(lambda: (e := client.get(f"{API}/{exp_id}").json())["result"] and e)
    assert exp["state"] == "cancelled"
    wait_for(lambda: not live_pods(d, exp_id))
    assert not client.get(f"{API}/{exp_id}").json()["pods"]


def test_an_ended_experiment_stays_ended_in_the_store(client: TestClient) -> None:
    store: Store = client.app.state.store
    exp_id = client.post(API, json=spec(resources={"cpu": 8})).json()["id"]
    assert client.post(f"{API}/{exp_id}/cancel").status_code == 202
    wait_for(lambda: client.get(f"{API}/{exp_id}").json()["state"] == "cancelled")
    # A status write from a stale reader (it saw the experiment before it ended) is refused.
    assert store.set_status(exp_id, ExperimentStatus(state="running")) is False
    assert client.get(f"{API}/{exp_id}").json()["state"] == "cancelled"


# -- idempotency keys after a delete -------------------------------------------------
def test_an_idempotency_key_is_free_again_once_its_experiment_is_deleted(
    client: TestClient,
) -> None:
    h = {"Idempotency-Key": "nightly-7"}
    first = client.post(API, json=spec("nightly", resources={"cpu": 8}), headers=h).json()["id"]
    assert client.post(API, json=spec("nightly", resources={"cpu": 8}), headers=h).json()["id"] == (
        first
    )
    assert client.delete(f"{API}/{first}").status_code == 204
    again = client.post(API, json=spec("nightly", resources={"cpu": 8}), headers=h)
    assert again.status_code == 201, again.text
    second = again.json()["id"]
    assert second != first and "Idempotent-Replayed" not in again.headers
    assert client.get(f"{API}/{second}").status_code == 200
    # Once the first is gone for good, its clean-up does not free the key of the second.
    wait_for(lambda: client.app.state.store.get(first) is None)
    replay = client.post(API, json=spec("nightly", resources={"cpu": 8}), headers=h)
    assert replay.json()["id"] == second and replay.headers["Idempotent-Replayed"] == "true"


# -- pages -----------------------------------------------------------------------------
def test_the_list_pages_newest_first_with_a_cursor(client: TestClient) -> None:
    ids = [
        client.post(API, json=spec(f"e{i}", resources={"cpu": 8})).json()["id"] for i in range(5)
    ]
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        r = client.get(API, params=params)
        assert r.status_code == 200 and len(r.json()) <= 2
        seen += [e["id"] for e in r.json()]
        pages += 1
        cursor = r.headers.get("X-Next-Cursor")
        if cursor is None:
            break
        assert r.headers["Link"].endswith('rel="next"') and "cursor=" in r.headers["Link"]
    assert seen == ids[::-1] and pages == 3
    assert [e["id"] for e in client.get(API, params={"state": "pending", "limit": 3}).json()] == (
        ids[::-1][:3]
    )
    assert client.delete(f"{API}/{ids[2]}").status_code == 204
    assert [e["id"] for e in client.get(API).json()] == [ids[4], ids[3], ids[1], ids[0]]
    for bad in ("nope", "inf:abc", "1.5:", "x" * 200):
        assert _locs(client.get(API, params={"cursor": bad})) == [("query", "cursor")]
    assert _locs(client.get(API, params={"limit": 0})) == [("query", "limit")]


def test_pages_step_past_experiments_created_at_the_same_instant(
    client: TestClient, redis_url: str
) -> None:
    store: Store = client.app.state.store
    ids = [
        client.post(API, json=spec(f"t{i}", resources={"cpu": 8})).json()["id"] for i in range(5)
    ]
    r = redis.Redis.from_url(redis_url)
    for i in ids:  # every one at the same creation time
        r.zadd("podium:orch:experiments", {i: 1000.0})
        r.hset(f"podium:orch:exp:{i}", "created_at", "1000.0")
    r.close()
    seen, cursor = [], None
    while True:
        page, cursor = store.page(2, cursor)
        seen += [e.id for e in page]
        if cursor is None:
            break
    assert sorted(seen) == sorted(ids) and len(seen) == 5


def test_records_written_before_the_indexes_existed_are_indexed_at_start_up(
    client: TestClient, redis_url: str
) -> None:
    store: Store = client.app.state.store
    done = client.post(API, json=spec("done", resources={"cpu": 8})).json()["id"]
    waiting = client.post(API, json=spec("waiting", resources={"cpu": 8})).json()["id"]
    assert client.post(f"{API}/{done}/cancel").status_code == 202
    wait_for(lambda: client.get(f"{API}/{done}").json()["result"])
    # The layout of the code before: no per-state sets, no active set, no state field.
    r = redis.Redis.from_url(redis_url)
    r.delete(*r.keys("podium:orch:state:*"), "podium:orch:active", "podium:orch:index_version")
    for i in (done, waiting):
        r.hdel(f"podium:orch:exp:{i}", "state")
    r.close()
    assert store.page(10, state="cancelled")[0] == [] and store.active() == []
    store.migrate()
    assert [e.id for e in store.page(10, state="cancelled")[0]] == [done]
    assert [e.id for e in store.page(10, state="pending")[0]] == [waiting]
    assert [e.id for e in store.active()] == [waiting]  # the cancelled one is finalized
