"""Least privilege: a pod never receives the platform token. It gets a
credential scoped to its experiment (services/contracts/credentials.py) that works on that
experiment's pod routes of the leaderboard only; the orchestrator refuses it.

Local backend here (a real pod process reporting its environment, the real leaderboard over
HTTP); the Kubernetes backend's Secret is tested in test_kubernetes.py."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from services.contracts.credentials import pod_token
from services.orchestrator.app import create_app
from services.orchestrator.backends.base import PodRequest
from services.orchestrator.backends.local import LocalBackend
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import OrchestratorSettings
from tests.leaderboard.conftest import experiment, result
from tests.orchestrator.conftest import LB_TOKEN, TOKEN, wait_for
from tests.orchestrator.servers import ServerThread

DUMP_ENV = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


def test_a_local_pod_gets_its_experiments_credential_and_no_platform_secret(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_settings: Callable[..., OrchestratorSettings],
    leaderboard: ServerThread,
    flush_redis: None,
) -> None:
    # What the orchestrator's own process holds, which its pods used to inherit.
    monkeypatch.setenv("PODIUM_API_TOKEN", TOKEN)
    monkeypatch.setenv("PODIUM_LEADERBOARD_TOKEN", LB_TOKEN)
    monkeypatch.setenv("REDIS_URL", "redis://:hunter2@redis:6379/0")
    out = tmp_path / "pod-env.json"
    settings = make_settings(pod_command=[sys.executable, "-c", DUMP_ENV, str(out)])
    backend = LocalBackend(settings)
    try:
        env = {"PODIUM_LEADERBOARD_URL": leaderboard.url, "PODIUM_API_TOKEN": LB_TOKEN}
        backend.create_pod(PodRequest("e1", "p1", '{"name": "e1"}', Res(1, 0, 1 << 30), env))
        pod_env = wait_for(
            lambda: out.exists() and out.stat().st_size and json.loads(out.read_text())
        )
    finally:
        backend.close()
    credential = pod_env["PODIUM_API_TOKEN"]
    assert credential == pod_token(LB_TOKEN, "e1")
    assert not {TOKEN, LB_TOKEN} & set(pod_env.values())
    assert not {"REDIS_URL", "PODIUM_LEADERBOARD_TOKEN"} & set(pod_env)

    lb = httpx.Client(base_url=f"{leaderboard.url}/api/v1", timeout=30)
    admin = {"Authorization": f"Bearer {LB_TOKEN}"}
    pod = {"Authorization": f"Bearer {credential}"}
    for exp in ("e1", "e2"):
        assert lb.put(f"/experiments/{exp}", json=experiment(), headers=admin).status_code == 201
    # What a pod does, on its own experiment.
    assert (
        lb.post("/experiments/e1/generate", json={"pod_id": "p1"}, headers=pod).status_code == 200
    )
    assert lb.post("/experiments/e1/submissions", json=result("s1", 1.0), headers=pod).json()[
        "accepted"
    ]
    # Everything else: 403, and nothing changed.
    for method, path, body in [
        ("GET", "/experiments/e1/leaderboard", None),
        ("GET", "/experiments", None),
        ("PUT", "/experiments/e1", experiment(top_k=1)),
        ("DELETE", "/experiments/e1", None),
        ("POST", "/experiments/e2/generate", {"pod_id": "p1"}),
        ("POST", "/experiments/e2/submissions", result("s2", 5.0)),
    ]:
        r = lb.request(method, path, json=body, headers=pod)
        assert r.status_code == 403, (method, path, r.text)
    board = lb.get("/experiments/e1/leaderboard", headers=admin).json()
    assert board["stats"]["top_k"] == 4 and len(board["candidates"]) == 1
    assert lb.get("/experiments/e2/leaderboard", headers=admin).json()["candidates"] == []
    # A forged or foreign credential is no credential: 401.
    for forged in (credential[:-2] + "xx", pod_token("another-platform", "e1")):
        r = lb.post(
            "/experiments/e1/generate",
            json={"pod_id": "p"},
            headers={"Authorization": f"Bearer {forged}"},
        )
        assert r.status_code == 401
    lb.close()

    # The orchestrator refuses it.
    with TestClient(create_app(settings)) as orch:
        for method, path in [("GET", "/api/v1/experiments"), ("DELETE", "/api/v1/experiments/x")]:
            assert orch.request(method, path, headers=pod).status_code == 401
