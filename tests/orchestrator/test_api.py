"""The experiments API: auth, probes, metrics, idempotency and every bad-input case."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.orchestrator.conftest import spec


def _errors(r) -> list[dict]:
    assert r.status_code == 422, r.text
    return r.json()["detail"]


def _locs(r) -> list[tuple]:
    return [tuple(e["loc"]) for e in _errors(r)]


def test_auth_is_required_on_the_api_but_not_on_probes(client: TestClient) -> None:
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        r = client.get("/api/v1/experiments", headers=headers)
        assert r.status_code == 401
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/livez", headers={"Authorization": ""}).status_code == 200
    assert client.get("/readyz", headers={"Authorization": ""}).json() == {"status": "ok"}
    assert client.get("/api/v1/openapi.json").json()["info"]["title"] == "Podium orchestrator"


def test_readyz_is_503_when_redis_is_unreachable(client: TestClient) -> None:
    import redis

    client.app.state.redis = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"


def test_api_is_503_when_redis_is_down(client: TestClient) -> None:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from services.orchestrator.store import Store

    real = client.app.state.store
    client.app.state.store = Store(
        redis.Redis(
            host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
        )
    )
    try:
        r = client.post("/api/v1/experiments", json=spec("down"))
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "nothing was changed" in r.json()["detail"]
        assert client.get("/api/v1/experiments").status_code == 503
    finally:
        client.app.state.store = real
    assert client.get("/api/v1/experiments").status_code == 200


def test_pod_logs_endpoint(client: TestClient) -> None:
    from tests.orchestrator.conftest import wait_for

    exp_id = client.post("/api/v1/experiments", json=spec("logs")).json()["id"]
    pods = wait_for(lambda: client.get(f"/api/v1/experiments/{exp_id}").json()["pods"])
    pod_id = pods[0]["pod_id"]

    def text() -> str | None:
        r = client.get(f"/api/v1/experiments/{exp_id}/pods/{pod_id}/logs", params={"tail": 5})
        return r.text if r.status_code == 200 else None

    assert f"pod {pod_id} of {exp_id} started" in wait_for(text)
    assert client.get(f"/api/v1/experiments/{exp_id}/pods/nosuchpod/logs").status_code == 404
    assert client.get(f"/api/v1/experiments/{exp_id}/pods/..%2Fx/logs").status_code in (404, 422)
    r = client.get(f"/api/v1/experiments/{exp_id}/pods/{pod_id}/logs", params={"tail": 0})
    assert r.status_code == 422
    assert client.get(f"/api/v1/experiments/nope/pods/{pod_id}/logs").status_code == 404


def test_metrics_count_created_pods(client: TestClient) -> None:
    from tests.orchestrator.conftest import wait_for

    def created() -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith("podium_orchestrator_pods_created_total "):
                return float(line.split()[1])
        raise AssertionError("metric missing")

    before = created()
    client.post("/api/v1/experiments", json=spec(population={"min_pods": 2, "max_pods": 2}))
    wait_for(lambda: created() >= before + 2)


def test_create_get_list_and_filter(client: TestClient) -> None:
    r = client.post("/api/v1/experiments", json=spec("one"))
    assert r.status_code == 201
    body = r.json()
    assert r.headers["Location"] == f"/api/v1/experiments/{body['id']}"
    assert body["name"] == "one" and body["state"] == "pending"
    assert body["spec"]["env"]["name"] == "gym:CartPole-v1"
    got = client.get(f"/api/v1/experiments/{body['id']}").json()
    assert got["id"] == body["id"]
    assert [e["id"] for e in client.get("/api/v1/experiments").json()] == [body["id"]]
    assert client.get("/api/v1/experiments", params={"state": "failed"}).json() == []


def test_concurrent_retries_with_one_key_create_one_experiment(client: TestClient) -> None:
    from concurrent.futures import ThreadPoolExecutor

    before = len(client.get("/api/v1/experiments").json())
    h = {"Idempotency-Key": "race-1"}
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda _: client.post("/api/v1/experiments", json=spec("race"), headers=h),
                range(16),
            )
        )
    assert {r.status_code for r in answers} == {201}
    assert len({r.json()["id"] for r in answers}) == 1  # every retry sees the one experiment
    assert len(client.get("/api/v1/experiments").json()) == before + 1


def test_idempotency_key_returns_the_first_experiment(client: TestClient) -> None:
    h = {"Idempotency-Key": "ci-run-42"}
    a = client.post("/api/v1/experiments", json=spec("ci"), headers=h)
    b = client.post("/api/v1/experiments", json=spec("ci"), headers=h)
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] == b.json()["id"] and b.headers["Idempotent-Replayed"] == "true"
    assert len(client.get("/api/v1/experiments").json()) == 1
    c = client.post("/api/v1/experiments", json=spec("other"), headers=h)
    assert c.status_code == 409 and a.json()["id"] in c.json()["detail"]


def test_unknown_ids_are_404(client: TestClient) -> None:
    for method, path in [
        ("get", "/api/v1/experiments/nope"),
        ("post", "/api/v1/experiments/nope/cancel"),
        ("post", "/api/v1/experiments/nope/pause"),
        ("post", "/api/v1/experiments/nope/resume"),
        ("delete", "/api/v1/experiments/nope"),
        ("get", "/api/v1/experiments/nope/events"),
    ]:
        assert getattr(client, method)(path).status_code == 404, path


@pytest.mark.parametrize(
    ("change", "loc", "needle"),
    [
        ({"name": "Not A DNS Name"}, ("body", "name"), "DNS-1123"),
        ({"name": None}, ("body", "name"), ""),
        ({"bogus": 1}, ("body", "bogus"), "Extra inputs"),
        ({"env": {"name": "CartPole-v1", "seed": 1}}, ("body", "env", "seed"), "Extra"),
        ({"algorithms": {}}, ("body", "algorithms"), "at least 1"),
        ({"algorithms": {"ppo": 0}}, ("body", "algorithms"), "> 0"),
        ({"population": {"min_pods": 3, "max_pods": 2}}, ("body", "population"), "min_pods"),
        ({"population": {"min_pods": 0}}, ("body", "population", "min_pods"), ""),
        ({"resources": {"memory": "lots"}}, ("body", "resources", "memory"), "quantity"),
        ({"resources": {"cpu": -1}}, ("body", "resources", "cpu"), ""),
        ({"round": {"env_steps": 10, "seconds": 5}}, ("body", "round"), "exactly one"),
        ({"round": {}}, ("body", "round"), "exactly one"),
        ({"budget": {"total_env_steps": 0}}, ("body", "budget", "total_env_steps"), ""),
        (
            {"search_space": {"lr": {"type": "log_uniform", "low": 0, "high": 1}}},
            ("body", "search_space", "lr", "log_uniform"),
            "low > 0",
        ),
        ({"priority": 5000}, ("body", "priority"), ""),
    ],
)
def test_invalid_spec_is_422_naming_the_field(
    client: TestClient, change: dict, loc: tuple, needle: str
) -> None:
    r = client.post("/api/v1/experiments", json=spec(**change))
    errors = _errors(r)
    assert loc in [tuple(e["loc"]) for e in errors], errors
    assert needle in " ".join(e["msg"] for e in errors)
    assert client.get("/api/v1/experiments").json() == []


@pytest.mark.parametrize(
    ("change", "loc", "listed"),
    [
        ({"env": {"name": "Nope-v0"}}, ("body", "env", "name"), "CartPole-v1"),
        ({"env": {"name": "os:system"}}, ("body", "env", "name"), "module:id syntax"),
        ({"env": {"name": "gym:evil.module:Env-v0"}}, ("body", "env", "name"), "not allowed"),
        ({"algorithms": {"ppo": 1, "a2c": 1}}, ("body", "algorithms"), "'a2c'; known: "),
        ({"generator": {"strategy": "mystery"}}, ("body", "generator", "strategy"), "pbt"),
    ],
)
def test_unknown_names_are_422_listing_known_names(
    client: TestClient, change: dict, loc: tuple, listed: str
) -> None:
    r = client.post("/api/v1/experiments", json=spec(**change))
    errors = _errors(r)
    assert loc in [tuple(e["loc"]) for e in errors]
    msg = " ".join(e["msg"] for e in errors)
    assert "known" in msg and listed in msg


def test_gymnasium_ids_are_accepted_by_registered_id(client: TestClient) -> None:
    r = client.post("/api/v1/experiments", json=spec(env={"name": "gym:MountainCar-v0"}))
    assert r.status_code == 201, r.text


def test_resources_over_server_limits_are_422(client: TestClient, make_settings) -> None:
    s = client.app.state.settings
    s.max_pod_gpus = 0  # a server that runs no GPU pods
    r = client.post(
        "/api/v1/experiments",
        json=spec(
            resources={"cpu": s.max_pod_cpu + 1, "gpus": 1, "memory": "1Ti"},
            population={"min_pods": 1, "max_pods": s.max_pods_per_experiment + 1},
        ),
    )
    assert set(_locs(r)) == {
        ("body", "resources", "cpu"),
        ("body", "resources", "gpus"),
        ("body", "resources", "memory"),
        ("body", "population", "max_pods"),
    }


def test_a_pod_trains_on_one_gpu_so_more_are_422(client: TestClient) -> None:
    """A pod trains on one device: a second GPU would be reserved and never used."""
    r = client.post("/api/v1/experiments", json=spec(resources={"gpus": 2}))
    assert _locs(r) == [("body", "resources", "gpus")]


def test_bad_query_parameters_are_422(client: TestClient) -> None:
    assert _locs(client.get("/api/v1/experiments", params={"state": "exploded"})) == [
        ("query", "state")
    ]
    exp_id = client.post("/api/v1/experiments", json=spec()).json()["id"]
    r = client.get(f"/api/v1/experiments/{exp_id}/events", params={"after": "x; DROP"})
    assert _locs(r) == [("query", "after")]


def test_actions_on_an_ended_experiment_are_409(client: TestClient) -> None:
    from tests.orchestrator.conftest import wait_for

    exp_id = client.post("/api/v1/experiments", json=spec()).json()["id"]
    accepted = client.post(f"/api/v1/experiments/{exp_id}/cancel")
    # The answer says what was asked: its state is the reconciler's, a pass behind.
    assert accepted.status_code == 202 and accepted.json()["intent"] == "cancel"
    wait_for(lambda: client.get(f"/api/v1/experiments/{exp_id}").json()["state"] == "cancelled")
    assert client.post(f"/api/v1/experiments/{exp_id}/cancel").status_code == 202  # idempotent
    for action in ("pause", "resume"):
        r = client.post(f"/api/v1/experiments/{exp_id}/{action}")
        assert r.status_code == 409 and "cancelled" in r.json()["detail"]


def test_events_page_with_after(client: TestClient) -> None:
    from tests.orchestrator.conftest import wait_for

    exp_id = client.post(
        "/api/v1/experiments", json=spec(population={"min_pods": 2, "max_pods": 2})
    ).json()["id"]
    events = wait_for(
        lambda: len(e := client.get(f"/api/v1/experiments/{exp_id}/events").json()) >= 3 and e
    )
    assert [e["type"] for e in events[:3]] == ["scaled", "pod_started", "pod_started"]
    rest = client.get(
        f"/api/v1/experiments/{exp_id}/events", params={"after": events[0]["id"], "limit": 1}
    ).json()
    assert rest == events[1:2]


def test_malformed_bodies_and_headers_are_422(client: TestClient) -> None:
    r = client.post(
        "/api/v1/experiments", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"
    r = client.post("/api/v1/experiments", json=[spec()])
    assert _locs(r) == [("body",)]
    # A spec sent as a form (curl -d's default) or as text is not read as JSON: the 422 says so.
    form = client.post("/api/v1/experiments", content=json.dumps(spec()),
                       headers={"Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert _locs(form) == [("body",)]
    assert "send it as JSON: Content-Type: application/json" in form.json()["detail"][0]["msg"]
    assert "Content-Type" not in r.json()["detail"][0]["msg"]  # JSON, only of the wrong shape
    r = client.post("/api/v1/experiments", json=spec(), headers={"Idempotency-Key": "k" * 500})
    assert _locs(r) == [("header", "idempotency-key")]
    # An empty key was taken as none: the retry it was meant for made a second experiment.
    r = client.post("/api/v1/experiments", json=spec(), headers={"Idempotency-Key": ""})
    assert _locs(r) == [("header", "idempotency-key")]
    assert client.get("/api/v1/experiments").json() == []
