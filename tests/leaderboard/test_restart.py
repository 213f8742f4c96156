"""Stop the service and its embedded Redis, start again from the same data dir: the leaderboard
and its lineage are intact — after a clean stop and after both processes are killed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from services.checkpoint_store import STAGING_LOCK_RACE_S
from services.redis_client import DB_FILENAME, EMBEDDED_SUBDIR
from tests.leaderboard.conftest import AUTH, TOKEN, experiment, free_port, multipart, result


class Service:
    """``python -m services.leaderboard`` as its own process."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "PODIUM_DATA_DIR": str(data_dir),
            "PODIUM_PORT": str(self.port),
            "PODIUM_API_TOKEN": TOKEN,
            "PODIUM_LOG_LEVEL": "WARNING",
        }
        env.pop("REDIS_URL", None)
        env.pop("PODIUM_REDIS_URL", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "services.leaderboard"], env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, "service exited"
            assert time.monotonic() < deadline, "service did not become ready"
            time.sleep(0.1)
        self.http = httpx.Client(base_url=f"{self.url}/api/v1", headers=AUTH, timeout=30)

    def redis_pid(self) -> int:
        registry = self.data_dir / EMBEDDED_SUBDIR / f"{DB_FILENAME}.settings"
        return int(Path(json.loads(registry.read_text())["pidfile"]).read_text())

    def state(self) -> tuple[list, dict, list]:
        board = self.http.get("/experiments/e/leaderboard").json()["candidates"]
        lineage = self.http.get("/experiments/e/lineage").json()
        exp = self.http.get("/experiments/e").json()
        log = self.http.get("/experiments/e/submissions").json()
        return board, lineage, [exp, log]

    def stop(self) -> None:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert self.proc.wait(timeout=30) in (0, -signal.SIGTERM)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def populate(svc: Service) -> None:
    svc.http.put("/experiments/e", json=experiment(top_k=3))
    parent = None
    for i, s in enumerate([1.0, 4.0, 2.0, 5.0, 3.0]):
        files = {"actor": f"actor {i}".encode()}
        r = svc.http.post(
            "/experiments/e/submissions",
            files=multipart(result(f"s{i}", s, files, parent_id=parent), files),
        )
        parent = r.json()["candidate_id"]
    svc.http.post("/experiments/e/generate", json={"pod_id": "p"})


@pytest.fixture
def data(tmp_path: Path) -> Iterator[Path]:
    """The data dir; whatever a failing test left running on it is killed afterwards."""
    data = tmp_path / "data"
    yield data
    for proc in psutil.process_iter(["cmdline", "environ"]):
        with contextlib.suppress(psutil.Error):
            env = proc.info["environ"] or {}
            if env.get("PODIUM_DATA_DIR") == str(data):
                proc.kill()
    with contextlib.suppress(OSError, ValueError, KeyError):
        registry = data / EMBEDDED_SUBDIR / f"{DB_FILENAME}.settings"
        pid = int(Path(json.loads(registry.read_text())["pidfile"]).read_text())
        os.kill(pid, signal.SIGKILL)


def test_restart_keeps_leaderboard_and_lineage(data: Path) -> None:
    svc = Service(data)
    populate(svc)
    before = svc.state()
    assert [c["score"] for c in before[0]] == [5.0, 4.0, 3.0]
    assert [s["score"] for s in before[2][1]["submissions"]] == [1.0, 4.0, 2.0, 5.0, 3.0]
    pid = svc.redis_pid()
    svc.stop()
    assert gone(pid)  # the embedded Redis stopped with the service

    svc = Service(data)
    try:
        assert svc.redis_pid() != pid
        assert svc.state() == before
        # Idempotency records survived too.
        r = svc.http.post("/experiments/e/submissions", json=result("s1", 99.0))
        assert r.json()["duplicate"] is True
        # Downloads work after the restart.
        best = before[0][0]
        got = svc.http.get(best["files"]["actor"]["download_path"].removeprefix("/api/v1"))
        assert got.content == b"actor 3"

        # A crash: kill both processes without any shutdown; the AOF has every acknowledged write.
        svc.http.post("/experiments/e/submissions", json=result("s9", 10.0))
        after_write = svc.state()
        pid = svc.redis_pid()
        svc.proc.kill()
        os.kill(pid, signal.SIGKILL)
        svc.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        svc.http.close()
        if svc.proc.poll() is None:
            svc.proc.kill()
    svc = Service(data)
    try:
        assert svc.state() == after_write
        assert svc.state()[0][0]["score"] == 10.0
    finally:
        svc.stop()


def test_a_leaderboard_killed_mid_upload_sweeps_its_partial_file_at_start_up(data: Path) -> None:
    """The partial file of an upload cut by a crash stayed for an hour
    (STAGING_MAX_AGE_S); a leaderboard that keeps crashing during uploads filled its volume."""
    svc = Service(data)
    staging = data / "blobs" / ".staging"
    stop = threading.Event()
    try:
        assert svc.http.put("/experiments/e", json=experiment()).status_code == 201
        boundary = "b0undary"
        files = {"actor": b"never sent whole"}
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="result"\r\n'
            f"Content-Type: application/json\r\n\r\n{json.dumps(result('s', 1.0, files))}\r\n"
            f'--{boundary}\r\nContent-Disposition: form-data; name="actor"; '
            'filename="actor"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()

        def endless() -> Iterator[bytes]:
            yield head
            while not stop.is_set():
                yield b"x" * 65536
                time.sleep(0.005)

        def upload() -> None:
            with contextlib.suppress(httpx.HTTPError):
                svc.http.post(
                    "/experiments/e/submissions",
                    content=endless(),
                    headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
                )

        uploader = threading.Thread(target=upload, daemon=True)
        uploader.start()
        deadline = time.monotonic() + 30
        while not [p for p in staging.glob(".upload-*") if p.stat().st_size > 1 << 20]:
            assert time.monotonic() < deadline, "the upload never reached the staging directory"
            time.sleep(0.05)
        pid = svc.redis_pid()
        svc.proc.kill()  # a crash mid-upload: no clean-up code runs
        os.kill(pid, signal.SIGKILL)
        svc.proc.wait(timeout=10)
    finally:
        stop.set()
        svc.http.close()
        if svc.proc.poll() is None:
            svc.proc.kill()
    uploader.join(timeout=30)
    partial = list(staging.glob(".upload-*"))
    assert partial and partial[0].stat().st_size > 1 << 20
    # Past the guard for a writer that has created its file but not yet locked it.
    time.sleep(max(0.0, STAGING_LOCK_RACE_S - (time.time() - partial[0].stat().st_mtime)) + 0.1)

    svc = Service(data)
    try:
        assert list(staging.glob(".upload-*")) == []
        # Uploads work as before.
        r = svc.http.post(
            "/experiments/e/submissions", files=multipart(result("s", 1.0, files), files)
        )
        assert r.status_code == 200 and r.json()["accepted"], r.text
    finally:
        svc.stop()
