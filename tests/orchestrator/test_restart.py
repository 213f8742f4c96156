"""A restarted orchestrator adopts the pods it finds: no duplicates, no orphans.

The orchestrator runs as a real process (``python -m services.orchestrator``) and is killed
with SIGKILL, as a crash or an evicted Kubernetes pod would be.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from services.orchestrator.store import Store
from tests.orchestrator.conftest import (
    LB_TOKEN,
    STANDIN,
    TOKEN,
    kill_all,
    live_pods,
    spec,
    started,
    wait_for,
)
from tests.orchestrator.servers import ServerThread

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Orchestrator:
    def __init__(self, data_dir: Path, redis_url: str, leaderboard_url: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PODIUM_DATA_DIR": str(data_dir),
            "PODIUM_REDIS_URL": redis_url,
            "PODIUM_API_TOKEN": TOKEN,
            "PODIUM_PORT": str(self.port),
            "PODIUM_CAPACITY_CPU": "8",
            "PODIUM_RECONCILE_INTERVAL_S": "0.1",
            "PODIUM_TERMINATION_GRACE_S": "3",
            "PODIUM_PROGRESS_POLL_S": "0.1",
            "PODIUM_LEADERBOARD_URL": leaderboard_url,
            "PODIUM_LEADERBOARD_TOKEN": LB_TOKEN,
            "PODIUM_POD_COMMAND": json.dumps([sys.executable, STANDIN]),
            "PODIUM_LOG_JSON": "1",
        }
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"})

    def start(self, log: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.orchestrator"],
            cwd=ROOT,
            env=self.env,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
        )

        def ready() -> bool:
            try:
                return self.http.get("/readyz").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, timeout=30)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def passes(self) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith("podium_orchestrator_reconcile_seconds_count "):
                return float(line.split()[1])
        return 0.0


@pytest.fixture
def orch(
    tmp_path: Path, redis_url: str, leaderboard: ServerThread, flush_redis: None
) -> Iterator[Orchestrator]:
    o = Orchestrator(tmp_path, redis_url, leaderboard.url)
    yield o
    if o.proc is not None and o.proc.poll() is None:
        o.proc.terminate()
        o.proc.wait(10)
    kill_all(tmp_path)


def test_restart_adopts_pods_without_duplicates_or_orphans(
    orch: Orchestrator, tmp_path: Path, redis_url: str
) -> None:
    log = tmp_path / "orchestrator.log"
    orch.start(log)
    keep = orch.http.post(
        "/api/v1/experiments", json=spec("keep", population={"min_pods": 3, "max_pods": 3})
    ).json()["id"]
    gone = orch.http.post("/api/v1/experiments", json=spec("gone")).json()["id"]
    pods = wait_for(lambda: len(p := live_pods(tmp_path, keep)) == 3 and p)
    wait_for(lambda: started(tmp_path, keep, pods) and live_pods(tmp_path, gone))
    gone_pods = live_pods(tmp_path, gone)
    wait_for(lambda: started(tmp_path, gone, gone_pods))

    orch.kill()
    # While it is down the pods keep training, and one experiment disappears from Redis.
    Store(redis.Redis.from_url(redis_url)).delete(gone)
    assert live_pods(tmp_path, keep) == pods

    orch.start(log)
    first = orch.passes()
    wait_for(lambda: orch.passes() >= first + 10)  # many passes over the adopted pods
    assert live_pods(tmp_path, keep) == pods  # the same processes: adopted, not duplicated
    wait_for(lambda: not live_pods(tmp_path, gone))  # the orphans were stopped ...
    assert all(
        (tmp_path / "experiments" / gone / "pods" / f"{p}.final").exists() for p in gone_pods
    )
    exp = orch.http.get(f"/api/v1/experiments/{keep}").json()
    assert exp["state"] == "running" and exp["progress"]["pods_launched"] == 3
    assert sorted(p["pod_id"] for p in exp["pods"]) == sorted(pods)
    events = orch.http.get(f"/api/v1/experiments/{keep}/events").json()
    assert len([e for e in events if e["type"] == "pod_started"]) == 3

    # An adopted pod that dies is still noticed and replaced.
    victim, pid = sorted(pods.items())[0]
    os.killpg(pid, signal.SIGKILL)
    after = wait_for(lambda: len(p := live_pods(tmp_path, keep)) == 3 and victim not in p and p)
    assert len(set(after) - set(pods)) == 1
    events = orch.http.get(f"/api/v1/experiments/{keep}/events").json()
    assert [e["pod_id"] for e in events if e["type"] == "pod_failed"] == [victim]

    assert orch.http.post(f"/api/v1/experiments/{keep}/cancel").status_code == 202
    wait_for(lambda: not live_pods(tmp_path))
