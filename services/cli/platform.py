"""The embedded platform: the whole of Podium on this machine, in one process.

``Platform`` starts, in order, the leaderboard (which starts the embedded Redis under
``data_dir``, or uses ``REDIS_URL``), then the orchestrator with the local backend, configured
with the leaderboard's URL; both share the Redis and one API token. Each app is served by
uvicorn in a thread of this process (pods are separate process groups started by the
orchestrator), so there is one thing to stop and nothing to orphan: ``stop`` halts the
reconciler, sends every pod SIGTERM (each makes its final report to the leaderboard, which is
still up) and waits for them, then shuts the orchestrator and the leaderboard down; the
leaderboard's shutdown saves and stops the embedded Redis.

While it runs, ``<data_dir>/platform.json`` (mode 0600) holds the URLs and the token so that
``podium status`` and friends in another terminal find it; a lock file keeps a second platform
off the same data directory (one orchestrator per Redis is assumed).

Ports: the defaults are 8000 (orchestrator) and 8001 (leaderboard); a busy port falls back to
an ephemeral one (pass ``strict_ports=True`` to refuse instead). Other orchestrator settings
come from ``PODIUM_*`` environment variables as usual, or ``orchestrator_overrides``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from services import malloc
from services.http_server import server_config
from services.logs import get_logger
from services.settings import PodiumSettings

log = get_logger(__name__)

SESSION_FILE = "platform.json"
LOCK_FILE = "platform.lock"
DEFAULT_ORCHESTRATOR_PORT = 8000
DEFAULT_LEADERBOARD_PORT = 8001
#: The embedded orchestrator's pace (a cluster's default: 2 s each): on one machine with a few
#: experiments a reconcile pass and a progress poll every half second cost little, and an
#: experiment ends (and `podium run` returns) within about that long of the report that met
#: its target.
EMBEDDED_PACE = {"reconcile_interval_s": 0.5, "progress_poll_s": 0.5}


class PlatformError(RuntimeError):
    """The platform could not start (port refused, data directory in use, service failed)."""


def new_token() -> str:
    return secrets.token_urlsafe(24)


def bind_listener(host: str, port: int, strict: bool = False) -> socket.socket:
    """A listening socket on ``port``, or on an ephemeral port when that one is busy."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in (port, 0) if port else (0,):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
        except OSError as e:
            sock.close()
            if e.errno != errno.EADDRINUSE or strict or candidate == 0:
                raise PlatformError(f"cannot listen on {host}:{candidate}: {e.strerror}") from e
            log.info("port busy; using an ephemeral port", port=candidate)
            continue
        sock.listen(2048)
        return sock
    raise AssertionError("unreachable")  # pragma: no cover


def url_of(sock: socket.socket, host: str) -> str:
    """The URL a client uses for a listener bound to ``host`` (a wildcard: this machine)."""
    url_host = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):
        url_host = "127.0.0.1"
    return f"http://{url_host}:{sock.getsockname()[1]}"


class ThreadedServer:
    """One ASGI app served by uvicorn in a thread, on a socket we bound ourselves (see
    ``bind_listener``); the benchmarks use it too."""

    def __init__(
        self,
        name: str,
        app: Any,
        sock: socket.socket,
        host: str,
        settings: PodiumSettings | None = None,
    ):
        self.name = name
        self.app = app
        self.sock = sock
        self.url = url_of(sock, host)
        # The service's own bounds on slow and idle clients (services.http_server).
        config = server_config(
            app,
            settings or PodiumSettings(),
            log_config=None,  # structlog (services.logs) is the process's logging
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{name}", daemon=True
        )

    def start(self, timeout: float = 60.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise PlatformError(f"the {self.name} failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise PlatformError(f"the {self.name} did not start within {timeout:g}s")
            time.sleep(0.02)

    @property
    def started(self) -> bool:
        return bool(self.server.started)

    def request_stop(self) -> None:
        """Ask the server to shut down (its lifespan's shutdown runs), without waiting."""
        self.server.should_exit = True

    def stop(self, timeout: float = 15.0) -> None:
        self.request_stop()
        if self.thread.is_alive():
            self.thread.join(timeout)
        with contextlib.suppress(OSError):
            self.sock.close()


class Platform:
    """The embedded platform as a context manager::

        with Platform(data_dir="data") as p:
            print(p.orchestrator_url, p.leaderboard_url, p.token)

    ``token=None`` makes a random token for the session; ``open_api=True`` runs without one
    (single-user local mode).
    """

    def __init__(
        self,
        data_dir: str | Path = "data",
        host: str = "127.0.0.1",
        orchestrator_port: int = DEFAULT_ORCHESTRATOR_PORT,
        leaderboard_port: int = DEFAULT_LEADERBOARD_PORT,
        token: str | None = None,
        open_api: bool = False,
        strict_ports: bool = False,
        orchestrator_overrides: dict[str, Any] | None = None,
    ):
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.orchestrator_port = orchestrator_port
        self.leaderboard_port = leaderboard_port
        self.token: str | None = None if open_api else (token or new_token())
        self.strict_ports = strict_ports
        self.overrides = dict(orchestrator_overrides or {})
        self._lock_fd: int | None = None
        self._leaderboard: ThreadedServer | None = None
        self._orchestrator: ThreadedServer | None = None
        self._stopped = False
        #: The pods' malloc in a user's words, once started (the local backend's; else "").
        self.pods_malloc = ""

    # -- URLs ----------------------------------------------------------------------------------
    @property
    def orchestrator_url(self) -> str:
        assert self._orchestrator is not None, "platform not started"
        return self._orchestrator.url

    @property
    def leaderboard_url(self) -> str:
        assert self._leaderboard is not None, "platform not started"
        return self._leaderboard.url

    @property
    def session_file(self) -> Path:
        return self.data_dir / SESSION_FILE

    def orchestrator_settings(self, leaderboard_url: str) -> Any:
        from services.orchestrator.settings import OrchestratorSettings

        values: dict[str, Any] = {
            "data_dir": self.data_dir,
            "backend": "local",
            "api_token": self.token,
            "api_token_file": None,
            "leaderboard_url": leaderboard_url,
            "leaderboard_token": self.token,
            "host": self.host,
        }
        values.update(self.overrides)
        settings = OrchestratorSettings(**values)
        # An operator's PODIUM_* wins; the pace is validated as any setting is.
        pace = {k: v for k, v in EMBEDDED_PACE.items() if k not in settings.model_fields_set}
        return OrchestratorSettings(**values, **pace) if pace else settings

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Platform:
        from services.orchestrator.backends import make_backend

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        backend = None
        try:
            lb_sock = bind_listener(self.host, self.leaderboard_port, self.strict_ports)
            orch_sock = bind_listener(self.host, self.orchestrator_port, self.strict_ports)
            settings = self.orchestrator_settings(url_of(lb_sock, self.host))
            settings.port = orch_sock.getsockname()[1]
            # The backend first: the local one starts its pod launcher, whose imports (seconds
            # of torch) then overlap the services' start instead of following it, and the
            # first pod starts that much sooner.
            backend = make_backend(settings)
            if settings.backend == "local":  # it preloads the pods' malloc; others say nothing
                library = getattr(backend, "malloc_library", None)
                self.pods_malloc = malloc.describe(settings.pod_malloc, library)
            from services.leaderboard.app import create_app as leaderboard_app
            from services.leaderboard.settings import LeaderboardSettings
            from services.orchestrator.app import create_app as orchestrator_app

            lb_settings = LeaderboardSettings(
                data_dir=self.data_dir,
                api_token=self.token,
                api_token_file=None,
                host=self.host,
                port=lb_sock.getsockname()[1],
            )
            self._leaderboard = ThreadedServer(
                "leaderboard", leaderboard_app(lb_settings), lb_sock, self.host, lb_settings
            )
            self._orchestrator = ThreadedServer(
                "orchestrator",
                orchestrator_app(settings, backend=backend),
                orch_sock,
                self.host,
                settings,
            )
            self._leaderboard.start()
            self._orchestrator.start()
            self._wait_ready()
            self._write_session()
        except BaseException:
            if backend is not None and not (self._orchestrator and self._orchestrator.started):
                backend.close()  # the orchestrator's shutdown closes it once it has started
            self.stop()
            raise
        log.info(
            "platform started",
            orchestrator=self.orchestrator_url,
            leaderboard=self.leaderboard_url,
            data_dir=str(self.data_dir),
        )
        return self

    def _wait_ready(self, timeout: float = 30.0) -> None:
        assert self._leaderboard is not None and self._orchestrator is not None
        deadline = time.monotonic() + timeout
        for srv in (self._leaderboard, self._orchestrator):
            while True:
                try:
                    if httpx.get(f"{srv.url}/readyz", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise PlatformError(f"the {srv.name} is not ready at {srv.url}/readyz")
                time.sleep(0.05)

    def healthy(self) -> bool:
        """Both services are still serving (a crashed server thread means no)."""
        servers = (self._leaderboard, self._orchestrator)
        return all(s is not None and s.thread.is_alive() for s in servers)

    def stop_pods(self, timeout: float | None = None) -> int:
        """Stop the reconciler (nothing new starts) and every pod, gracefully; returns how many
        pods were running. Pods get SIGTERM (final report, then exit) and SIGKILL after the
        orchestrator's termination grace."""
        if self._orchestrator is None or not self._orchestrator.started:
            return 0
        state = self._orchestrator.app.state
        reconciler = getattr(state, "reconciler", None)
        backend = getattr(state, "backend", None)
        if reconciler is None or backend is None:
            return 0
        reconciler.stop()
        grace = state.settings.termination_grace_s
        live = [p for p in backend.list_pods() if p.live]
        for p in live:
            backend.terminate_pod(p.experiment_id, p.pod_id, grace)
        if live:
            log.info("stopping pods", pods=len(live), grace_s=grace)
        deadline = time.monotonic() + (timeout if timeout is not None else grace + 10.0)
        while time.monotonic() < deadline and any(p.live for p in backend.list_pods()):
            time.sleep(0.05)
        left = [p.pod_id for p in backend.list_pods() if p.live]
        if left:
            log.warning("pods still running after the grace period", pods=left)
        return len(live)

    def stop(self) -> None:
        """Stop every pod, then the orchestrator and the leaderboard (and Redis). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.stop_pods()
        finally:
            servers = [s for s in (self._orchestrator, self._leaderboard) if s is not None]
            # Both at once: each one's shutdown gives the embedded Redis's other clients a
            # moment to leave before it decides who stops the server, so one after the other
            # the orchestrator would wait that moment for a leaderboard still serving.
            for server in servers:
                server.request_stop()
            for server in servers:
                server.stop()
            self._stop_redis()
            with contextlib.suppress(OSError):
                self.session_file.unlink(missing_ok=True)
            self._unlock()
            log.info("platform stopped", data_dir=str(self.data_dir))

    def _stop_redis(self) -> None:
        # The leaderboard's shutdown stops the embedded Redis when it is the last client; this
        # covers a leaderboard that never started (the orchestrator may have started Redis).
        from services import redis_client
        from services.settings import PodiumSettings

        with contextlib.suppress(Exception):
            redis_client.stop(PodiumSettings(data_dir=self.data_dir))

    def __enter__(self) -> Platform:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- session file and lock -----------------------------------------------------------------
    def _lock(self) -> None:
        path = self.data_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            other = read_session(self.data_dir)
            where = f" (orchestrator {other['orchestrator_url']})" if other else ""
            raise PlatformError(
                f"another Podium platform is running on {self.data_dir}{where}; use it "
                "(podium status / podium submit) or choose another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
            self._lock_fd = None

    def _write_session(self) -> None:
        data = {
            "orchestrator_url": self.orchestrator_url,
            "leaderboard_url": self.leaderboard_url,
            "token": self.token,
            "pid": os.getpid(),
            "data_dir": str(self.data_dir),
        }
        tmp = self.session_file.with_name(f".{SESSION_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.session_file)


def read_session(data_dir: str | Path) -> dict[str, Any] | None:
    """The running embedded platform's URLs and token for ``data_dir``, or None when no live
    platform wrote one."""
    path = Path(data_dir) / SESSION_FILE
    try:
        data = json.loads(path.read_text())
        pid = int(data["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # left behind by a platform that was killed
    except PermissionError:
        pass
    return data
