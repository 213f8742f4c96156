"""Fixtures: a real Redis (embedded), the real leaderboard over HTTP, the orchestrator app
with the local backend launching real stand-in pod processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from fastapi.testclient import TestClient

from services.leaderboard.app import create_app as create_leaderboard_app
from services.leaderboard.settings import LeaderboardSettings
from services.orchestrator.app import create_app
from services.orchestrator.settings import OrchestratorSettings
from tests.orchestrator.servers import ServerThread

TOKEN = "orchestrator-test-token"
LB_TOKEN = "leaderboard-test-token"
STANDIN = str(Path(__file__).with_name("standin_pod.py"))


@pytest.fixture
def leaderboard(tmp_path: Path, redis_url: str) -> Iterator[ServerThread]:
    """The real leaderboard service over HTTP, on the session's Redis."""
    settings = LeaderboardSettings(
        data_dir=tmp_path / "leaderboard", redis_url=redis_url, api_token=LB_TOKEN
    )
    with ServerThread(create_leaderboard_app(settings)) as srv:
        yield srv


def wait_for(fn: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met in {timeout}s; last value: {last!r}")


def create(client: Any, body: dict[str, Any]) -> str:
    """Submit ``body`` through the orchestrator's API (a TestClient); the experiment's id."""
    r = client.post("/api/v1/experiments", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def spec(name: str = "exp", **over: Any) -> dict[str, Any]:
    """A valid spec for the stand-in pod; ``standin`` configures the stand-in's behaviour."""
    standin = over.pop("standin", {})
    out: dict[str, Any] = {
        "name": name,
        # gymnasium's id: its card lists no arguments, so the stand-in's are not refused.
        "env": {"name": "gym:CartPole-v1", "kwargs": {"standin": standin}},
        "algorithms": {"ppo": 1.0},
        "generator": {"strategy": "pbt"},
        "population": {"min_pods": 1, "max_pods": 2},
        "resources": {"cpu": 1, "gpus": 0, "memory": "1Gi"},
        "round": {"env_steps": 1000},
    }
    out.update(over)
    return out


def live_pods(data_dir: Path, exp_id: str | None = None) -> dict[str, int]:
    """pod id → pid of every stand-in process still running (observed, not asked)."""
    out = {}
    pattern = f"{exp_id or '*'}/pods/*.json"
    for rec_path in (data_dir / "experiments").glob(pattern):
        with contextlib.suppress(OSError, ValueError):
            rec = json.loads(rec_path.read_text())
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(rec["pid"])
                if p.status() != psutil.STATUS_ZOMBIE and STANDIN in " ".join(p.cmdline()):
                    out[rec_path.stem] = rec["pid"]
    return out


def started(data_dir: Path, exp_id: str, pods: dict[str, int]) -> bool:
    """Every pod has installed its SIGTERM handler (it logs a line once it has)."""
    logs = data_dir / "experiments" / exp_id / "pods"
    for pod_id in pods:
        with contextlib.suppress(OSError):
            if "started" in (logs / f"{pod_id}.log").read_text():
                continue
        return False
    return True


def kill_all(data_dir: Path) -> None:
    """Every stand-in pod of this data dir, including one spawned but not yet recorded when
    the orchestrator stopped (found by the PODIUM_POD_DIR its environment carries)."""
    pids = set(live_pods(data_dir).values())
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if STANDIN in " ".join(p.info["cmdline"] or ()) and p.environ().get(
                "PODIUM_POD_DIR", ""
            ).startswith(str(data_dir)):
                pids.add(p.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def make_settings(
    tmp_path: Path, redis_url: str, leaderboard: ServerThread
) -> Iterator[Callable[..., OrchestratorSettings]]:
    def make(**over: Any) -> OrchestratorSettings:
        values: dict[str, Any] = {
            "data_dir": tmp_path,
            "redis_url": redis_url,
            "api_token": TOKEN,
            "backend": "local",
            "capacity_cpu": 4,
            "capacity_gpus": 0,
            "capacity_memory": "64Gi",
            "reconcile_interval_s": 0.1,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.4,
            "crash_loop_limit": 4,
            "pod_healthy_after_s": 30,
            "termination_grace_s": 3,
            "progress_poll_s": 0.05,
            "leaderboard_url": leaderboard.url,
            "leaderboard_token": LB_TOKEN,
            "pod_command": [sys.executable, STANDIN, "{experiment_id}", "{pod_id}"],
        }
        values.update(over)
        return OrchestratorSettings(**values)

    yield make
    kill_all(tmp_path)


@pytest.fixture
def client(
    make_settings: Callable[..., OrchestratorSettings], flush_redis: None
) -> Iterator[TestClient]:
    with TestClient(create_app(make_settings())) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        yield c
