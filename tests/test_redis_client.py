"""services.redis_client: the embedded Redis persists under data_dir, is shared with a second
process, is left running while another client uses it, and survives stop/start and kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from services import redis_client
from services.settings import PodiumSettings

SECOND_PROCESS = """
import sys
from services import redis_client
from services.settings import PodiumSettings
s = PodiumSettings(data_dir=sys.argv[1])
r = redis_client.connect(s)
r.rpush("seen-by", "child")
print(redis_client.server_url(s), r.get("k").decode())
r.close()
print(redis_client.stop(s, wait_s=0.1))  # the parent is still connected: must not stop
"""


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PodiumSettings:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("PODIUM_REDIS_URL", raising=False)
    s = PodiumSettings(data_dir=tmp_path / "data")
    yield s
    redis_client.stop(s, force=True)


def server_pid(s: PodiumSettings) -> int:
    db = Path(s.data_dir) / redis_client.EMBEDDED_SUBDIR / redis_client.DB_FILENAME
    registry = json.loads(db.with_name(db.name + ".settings").read_text())
    return int(Path(registry["pidfile"]).read_text())


def test_embedded_shared_between_processes_and_persistent(settings: PodiumSettings) -> None:
    r = redis_client.connect(settings)
    r.set("k", "v")
    url = redis_client.server_url(settings)
    assert url.startswith("unix://")
    out = subprocess.run(
        [sys.executable, "-c", SECOND_PROCESS, str(settings.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PODIUM_LOG_LEVEL": "WARNING"},
    )
    assert out.returncode == 0, out.stderr
    child_url, value, stopped = out.stdout.split()
    assert (child_url, value, stopped) == (url, "v", "False")
    assert r.lrange("seen-by", 0, -1) == [b"child"]  # same server

    pid = server_pid(settings)
    # Our own client still connected: stop refuses unless forced.
    assert redis_client.stop(settings, wait_s=0.1) is False
    r.close()
    assert redis_client.stop(settings) is True
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    assert (Path(settings.data_dir) / "redis" / "appendonly.aof").exists()

    r = redis_client.connect(settings)  # a fresh server on the same files
    assert r.get("k") == b"v" and r.lrange("seen-by", 0, -1) == [b"child"]
    r.close()


def test_kill_9_loses_no_acknowledged_write(settings: PodiumSettings) -> None:
    r = redis_client.connect(settings)
    for i in range(100):
        r.set(f"k{i}", i)
    pid = server_pid(settings)
    r.close()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = redis_client.connect(settings)
    assert [int(r.get(f"k{i}")) for i in range(100)] == list(range(100))
    r.close()


def test_async_and_external_url(settings: PodiumSettings, monkeypatch) -> None:
    import asyncio

    async def roundtrip() -> bytes:
        client = redis_client.connect_async(settings)
        await client.set("a", "1")
        value = await client.get("a")
        await client.aclose()
        return value

    assert asyncio.run(roundtrip()) == b"1"
    # With REDIS_URL set, that server is used and nothing embedded is started or stopped.
    url = redis_client.server_url(settings)
    monkeypatch.setenv("REDIS_URL", url)
    external = PodiumSettings(data_dir=settings.data_dir / "elsewhere")
    assert redis_client.server_url(external) == url
    r = redis_client.connect(external)
    assert r.get("a") == b"1"
    r.close()
    assert redis_client.stop(external) is False
    assert not (settings.data_dir / "elsewhere").exists()


WORKER = """
import sys, time
from pathlib import Path
from services import redis_client
from services.settings import PodiumSettings
s = PodiumSettings(data_dir=sys.argv[1])
r = redis_client.connect(s)
r.incr("workers")
while int(r.get("workers")) < 2:  # both connected before either stops
    time.sleep(0.01)
r.close()
print(redis_client.stop(s))
"""


def test_workers_stopping_together_stop_the_server(settings: PodiumSettings) -> None:
    """uvicorn workers sharing the embedded server all stop at once: the last one out stops
    it (they do not wait on each other), so no server is left behind."""
    env = {**os.environ, "PODIUM_LOG_LEVEL": "WARNING"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(settings.data_dir)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert ["True"] in outs  # someone stopped it
    db = Path(settings.data_dir) / redis_client.EMBEDDED_SUBDIR / redis_client.DB_FILENAME
    assert not redis_client._running_elsewhere(db)
    r = redis_client.connect(settings)  # restarts with the data
    assert int(r.get("workers")) == 2
    r.close()


def test_errors_are_described_with_redis_own_message(settings: PodiumSettings) -> None:
    """redis-py 8 renders a server error as "server:ResponseError" alone; health and
    log messages must carry what Redis said."""
    r = redis_client.connect(settings)
    try:
        with pytest.raises(redis.ResponseError) as caught:
            r.execute_command("PODIUM-NO-SUCH-COMMAND")
    finally:
        r.close()
    text = redis_client.describe_error(caught.value)
    assert text.startswith("ResponseError: ") and "unknown command" in text.lower(), text
    assert redis_client.describe_error(redis.ConnectionError()) == "ConnectionError"
