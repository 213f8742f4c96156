"""A restarted orchestrator adopts the pods it finds: no duplicates, no orphans.

The orchestrator runs as a real process (``python -m services.orchestrator``) and is killed
with SIGKILL, as a crash or an evicted Kubernetes pod would be.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from services.contracts.spec import ExperimentSpec
from services.orchestrator.backends.base import Backend, PodInfo, PodRequest
from services.orchestrator.leaderboard_client import Progress, Reports
from services.orchestrator.reconciler import Reconciler
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.status import ExperimentStatus
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


# -- a crash between creating pods and recording them --------------------------------------------


class MemoryBackend(Backend):
    """Pods in memory, created by one reconciler and adopted by the next (the same object, as
    the same processes are found again); a stopped pod exits 0 at once."""

    def __init__(self, on_create: Callable[[PodInfo], None] = lambda p: None) -> None:
        super().__init__()
        self.pods: dict[str, PodInfo] = {}
        self.on_create = on_create

    def capacity(self) -> Res:
        return Res(8.0, 0, 64 * 2**30)

    def list_pods(self) -> list[PodInfo]:
        return [dataclasses.replace(p) for p in self.pods.values()]

    def create_pod(self, req: PodRequest) -> None:
        pod = PodInfo(req.experiment_id, req.pod_id, "Running", time.time(), req.resources)
        self.on_create(pod)
        self.pods[req.pod_id] = pod

    def terminate_pod(self, experiment_id: str, pod_id: str, grace_s: float) -> None:
        pod = self.pods[pod_id]
        pod.terminating, pod.phase, pod.exit_code, pod.reason = True, "Succeeded", 0, "exit code 0"

    def remove_pod(self, experiment_id: str, pod_id: str) -> None:
        self.pods.pop(pod_id, None)

    def pod_log_tail(self, experiment_id: str, pod_id: str, lines: int = 20) -> str:
        return ""


class Board:
    """The leaderboard as the reconciler sees it: registrations, and a best score."""

    def __init__(self) -> None:
        self.registered: list[str] = []
        self.score: float | None = None

    def register(self, experiment_id: str, spec: ExperimentSpec) -> None:
        self.registered.append(experiment_id)

    def progress(self, experiment_id: str) -> Progress:
        best = None if self.score is None else {"score": self.score, "candidate_id": "c1"}
        return Progress(best=best, env_steps=0)

    def delete(self, experiment_id: str) -> None:
        return None

    def reporters(self, experiment_id: str, after: str | None) -> Reports:
        return Reports({}, {}, after)


class DyingStore(Store):
    """The store of an orchestrator that is SIGKILLed: once ``dead``, nothing more is
    written (the pass that created the pods never records them)."""

    dead = False

    def set_status(self, exp_id: str, status: ExperimentStatus) -> bool:
        return False if self.dead else super().set_status(exp_id, status)

    def event(self, exp_id: str, type_: str, message: str, pod_id: str | None = None) -> None:
        if not self.dead:
            super().event(exp_id, type_, message, pod_id)

    def pod_launched(self, exp_id: str, pod_id: str, type_: str, message: str) -> bool:
        return False if self.dead else super().pod_launched(exp_id, pod_id, type_, message)


def test_pods_created_by_an_orchestrator_killed_before_it_recorded_them_are_adopted(
    tmp_path: Path, redis_url: str, flush_redis: None
) -> None:
    """An orchestrator killed in the pass that registered the experiment and created its
    pods, after the pods started and before the pass saved its status (so the stored status
    says unregistered, no pods launched, and one pod has no start event): the restarted one
    adopts the pods, records them once each, reads the leaderboard and ends the experiment at
    its target. It used to never read the progress (registration was only ever retried when
    pods were to be created, and the adopted pods were the target): the experiment ran on
    until its wall-time budget with every pod reporting the target score (e2e
    test_a_restarted_orchestrator_resumes_without_duplicate_pods, under load)."""
    settings = OrchestratorSettings(
        data_dir=tmp_path,
        redis_url=redis_url,
        reconcile_interval_s=0.05,
        progress_poll_s=0.05,
        create_concurrency=1,  # pod 1 is created, and its event written, before pod 2
        termination_grace_s=3,
    )
    r = redis.Redis.from_url(redis_url)
    first = DyingStore(r)
    created: list[str] = []

    def create(pod: PodInfo) -> None:
        if created:  # the second pod: the first one's event is written meanwhile
            time.sleep(0.3)
            first.dead = True  # killed as soon as the backend has made it
        created.append(pod.pod_id)

    backend, board = MemoryBackend(create), Board()
    body = spec(population={"min_pods": 2, "max_pods": 2}, target_return=475.0)
    exp_id, _ = first.create("crash", ExperimentSpec.model_validate(body))
    crashed = Reconciler(settings, first, backend, board)
    try:
        wait_for(lambda: crashed.reconcile_once() or len(backend.pods) == 2, timeout=10)
    finally:
        crashed.stop()
    stored = first.get(exp_id).status  # type: ignore[union-attr]
    assert (stored.registered, stored.pods_launched, stored.pods) == (False, 0, [])
    assert [e["pod_id"] for e in first.events(exp_id) if e["type"] == "pod_started"] == [created[0]]
    assert board.registered == [exp_id]

    store = Store(r)
    rec = Reconciler(settings, store, backend, board)
    try:
        rec.reconcile_once()
        assert sorted(backend.pods) == sorted(created)  # adopted, none created
        board.score = 500.0  # the pods reach the target
        wait_for(
            lambda: rec.reconcile_once() or store.get(exp_id).status.result,  # type: ignore[union-attr]
            timeout=10,
        )
    finally:
        rec.stop()
    status = store.get(exp_id).status  # type: ignore[union-attr]
    assert status.state == "succeeded", status
    assert status.pods_launched == 2 and status.result.pods_launched == 2  # type: ignore[union-attr]
    events = store.events(exp_id)
    assert sorted(e["pod_id"] for e in events if e["type"] == "pod_started") == sorted(created)
    assert sorted(e["pod_id"] for e in events if e["type"] == "pod_stopped") == sorted(created)
    assert not backend.pods
    r.close()


def test_a_launch_is_recorded_once_with_its_event_and_counted_from_an_older_record(
    redis_url: str, flush_redis: None
) -> None:
    r = redis.Redis.from_url(redis_url)
    store = Store(r)
    exp_id, _ = store.create("launches", ExperimentSpec.model_validate(spec()))
    # A record from before launches were counted with the store: its status has the count.
    store.set_status(exp_id, ExperimentStatus(state="running", pods_launched=7))
    assert store.get(exp_id).launched == 0  # type: ignore[union-attr]
    assert store.pod_launched(exp_id, "p1", "pod_started", "pod started")
    assert not store.pod_launched(exp_id, "p1", "pod_started", "pod started")  # once
    assert store.pod_launched(exp_id, "p2", "pod_replaced", "replaces failed pod p0")
    assert store.get(exp_id).launched == 9  # type: ignore[union-attr]
    assert [(e["type"], e["pod_id"]) for e in store.events(exp_id)] == [
        ("pod_started", "p1"),
        ("pod_replaced", "p2"),
    ]
    store.delete(exp_id)
    assert not store.pod_launched(exp_id, "p3", "pod_started", "pod started")  # gone
    assert not r.keys("*launched*") and not r.keys(f"*events:{exp_id}")
    r.close()
