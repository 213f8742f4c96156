"""Slow and idle clients against real service processes over real sockets.

Each service runs as its own process the way it is deployed: ``podium up`` (both services in
one process) and ``python -m services.leaderboard`` / ``python -m services.orchestrator`` (the
containers' command), with small limits set through the ``PODIUM_HTTP_*`` settings so that the
deadlines pass in about a second. The clients are plain sockets: a request head or body sent
a few bytes at a time, nothing at all (slow-loris), or requests pipelined by a client that
never reads the answers."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from services.cli.platform import read_session
from tests.leaderboard.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
PODIUM_UP = [sys.executable, "-m", "services.cli", "up"]
TOKEN = "slow-clients-token"
TIMEOUT_S = 1.0  # header and body timeouts, keep-alive
# A deadline fires up to a quarter of itself late (the check's period); the rest is slack for a
# loaded 2-core machine. Before the limits existed nothing was ever closed.
CLOSED_WITHIN_S = TIMEOUT_S * 1.25 + 2.0
LIMITS = {
    "PODIUM_HTTP_HEADER_TIMEOUT_S": str(TIMEOUT_S),
    "PODIUM_HTTP_BODY_TIMEOUT_S": str(TIMEOUT_S),
    "PODIUM_HTTP_KEEP_ALIVE_S": str(TIMEOUT_S),
    "PODIUM_HTTP_MIN_BODY_RATE": "1024",
    "PODIUM_HTTP_MAX_CONNECTIONS": "32",
    "PODIUM_HTTP_SEND_TIMEOUT_S": str(TIMEOUT_S),
}


def service_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODIUM_") and k != "REDIS_URL"}
    env.update(PODIUM_DATA_DIR=str(data_dir), PODIUM_API_TOKEN=TOKEN, PODIUM_LOG_LEVEL="WARNING")
    env.update(extra)
    return env


def wait_ready(proc: subprocess.Popen, urls: Callable[[], list[str] | None]) -> list[str]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the service exited"
        found = urls()
        if found:
            try:
                if all(httpx.get(f"{u}/readyz", timeout=2).status_code == 200 for u in found):
                    return found
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    raise AssertionError("the service did not become ready")


@dataclass
class Served:
    url: str
    post_path: str  # a route with a JSON body
    pid: int  # the process serving it
    data_dir: Path


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_up(
    data_dir: Path, preexec: Callable[[], None] | None = None, **extra: str
) -> tuple[subprocess.Popen, list[str]]:
    """``podium up`` on ephemeral ports; returns the process and (orchestrator, leaderboard)."""
    proc = subprocess.Popen(
        [*PODIUM_UP, "--data-dir", str(data_dir), "--port", "0", "--leaderboard-port", "0"],
        cwd=ROOT,
        env=service_env(data_dir, **extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=preexec,
    )

    def urls() -> list[str] | None:
        s = read_session(data_dir)
        return [s["orchestrator_url"], s["leaderboard_url"]] if s else None

    return proc, wait_ready(proc, urls)


def start_module(module: str, data_dir: Path, **extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env=service_env(data_dir, PODIUM_PORT=str(port), **extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    return proc, wait_ready(proc, lambda: [url])[0]


SERVICES = ["up-orchestrator", "up-leaderboard", "leaderboard-process", "orchestrator-process"]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    root = tmp_path_factory.mktemp("slow-clients")
    procs: list[subprocess.Popen] = []
    try:
        up, (orch, lb) = start_up(root / "up", **LIMITS)
        procs.append(up)
        lb_proc, lb_url = start_module("services.leaderboard", root / "lb", **LIMITS)
        procs.append(lb_proc)
        orch_proc, orch_url = start_module(
            "services.orchestrator", root / "orch", PODIUM_LEADERBOARD_URL=lb_url, **LIMITS
        )
        procs.append(orch_proc)
        yield {
            "up-orchestrator": Served(orch, "/api/v1/experiments", up.pid, root / "up"),
            "up-leaderboard": Served(lb, "/api/v1/experiments/e1", up.pid, root / "up"),
            "leaderboard-process": Served(
                lb_url, "/api/v1/experiments/e1", lb_proc.pid, root / "lb"
            ),
            "orchestrator-process": Served(
                orch_url, "/api/v1/experiments", orch_proc.pid, root / "orch"
            ),
        }
    finally:
        for proc in procs:
            _stop(proc)


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=5)


def head(served: Served, method: str = "PUT", length: int = 5000) -> bytes:
    method = "POST" if served.post_path.endswith("/experiments") else method
    host = urlsplit(served.url).netloc
    return (
        f"{method} {served.post_path} HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


@dataclass
class Outcome:
    closed_after_s: float | None  # None: still open when the client gave up
    answer: bytes


def trickle(
    socks: list[socket.socket], piece: bytes, every_s: float, give_up_s: float
) -> list[Outcome]:
    """Send ``piece`` on each open socket every ``every_s`` (nothing if empty) and read whatever
    comes back, until every socket is closed by the server or ``give_up_s`` passes."""
    start = time.monotonic()
    answers = {s: b"" for s in socks}
    closed: dict[socket.socket, float] = {}
    next_send = start + every_s
    for s in socks:
        s.setblocking(False)
    while len(closed) < len(socks) and time.monotonic() - start < give_up_s:
        open_ = [s for s in socks if s not in closed]
        readable, _, _ = select.select(open_, [], [], 0.05)
        for s in readable:
            try:
                data = s.recv(65536)
            except (ConnectionResetError, BlockingIOError):
                data = b""
            if data:
                answers[s] += data
            else:
                closed[s] = time.monotonic() - start
        if piece and time.monotonic() >= next_send:
            next_send += every_s
            for s in open_:
                if s not in closed:
                    try:
                        s.send(piece)
                    except OSError:
                        closed[s] = time.monotonic() - start
    for s in socks:
        s.close()
    return [Outcome(closed.get(s), answers[s]) for s in socks]


def status_of(answer: bytes) -> int | None:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


@pytest.mark.parametrize("service", SERVICES)
def test_idle_and_half_sent_heads_are_cut_off(deployed: dict[str, Served], service: str) -> None:
    served = deployed[service]
    idle = [connect(served.url) for _ in range(5)]
    outcomes = trickle(idle, b"", 0.3, CLOSED_WITHIN_S + 3)
    # A connection that never sent a byte is closed without an answer.
    assert all(o.closed_after_s is not None for o in outcomes), outcomes
    assert max(o.closed_after_s for o in outcomes) < CLOSED_WITHIN_S  # type: ignore[type-var]
    assert all(o.answer == b"" for o in outcomes)

    # A head sent a header line at a time, never finished: 408, then closed.
    half = [connect(served.url) for _ in range(5)]
    for s in half:
        s.sendall(head(served).split(b"\r\n", 1)[0] + b"\r\n")
    outcomes = trickle(half, b"X-Slow: 1\r\n", 0.3, CLOSED_WITHIN_S + 3)
    assert all(o.closed_after_s is not None for o in outcomes), outcomes
    assert max(o.closed_after_s for o in outcomes) < CLOSED_WITHIN_S  # type: ignore[type-var]
    assert all(status_of(o.answer) == 408 for o in outcomes), outcomes


@pytest.mark.parametrize("service", SERVICES)
def test_a_stalled_or_trickled_body_is_answered_408(
    deployed: dict[str, Served], service: str
) -> None:
    served = deployed[service]
    # 60 of 5,000 declared bytes, then nothing.
    stalled = connect(served.url)
    stalled.sendall(head(served) + b'{"name": "' + b"a" * 50)
    # A byte every 0.3 s: never idle for the timeout, but far below the minimum rate.
    trickled = connect(served.url)
    trickled.sendall(head(served) + b'{"name": "')
    (s_out,) = trickle([stalled], b"", 0.3, CLOSED_WITHIN_S + 3)
    (t_out,) = trickle([trickled], b"a", 0.3, TIMEOUT_S * 2 + CLOSED_WITHIN_S + 3)
    assert s_out.closed_after_s is not None and s_out.closed_after_s < CLOSED_WITHIN_S, s_out
    assert status_of(s_out.answer) == 408 and b"body" in s_out.answer
    assert t_out.closed_after_s is not None, t_out
    assert status_of(t_out.answer) == 408


@pytest.mark.parametrize("service", SERVICES)
def test_idle_keep_alive_is_closed_and_busy_clients_are_not(
    deployed: dict[str, Served], service: str
) -> None:
    served = deployed[service]
    # A client making a request every 0.4 s for two timeouts and sending a body in two parts
    # 0.5 s apart is never cut off.
    with httpx.Client(base_url=served.url, timeout=10) as client:
        start = time.monotonic()
        while time.monotonic() - start < 2 * TIMEOUT_S:
            assert client.get("/livez").status_code == 200
            time.sleep(0.4)
    s = connect(served.url)
    body = b'{"not": "a valid request"}'
    s.sendall(head(served, length=len(body)) + body[:5])
    time.sleep(0.5)
    s.sendall(body[5:])
    s.settimeout(10)
    answer = s.recv(65536)
    assert status_of(answer) == 422, answer  # answered on its merits
    # Then idle on the kept-alive connection: closed after the keep-alive time.
    (out,) = trickle([s], b"", 0.3, CLOSED_WITHIN_S + 3)
    assert out.closed_after_s is not None and out.closed_after_s < CLOSED_WITHIN_S, out


def test_more_connections_than_the_limit_evict_the_idle_ones(
    deployed: dict[str, Served],
) -> None:
    served = deployed["up-leaderboard"]
    flood = [connect(served.url) for _ in range(100)]  # the limit is 32
    try:
        # A new client still gets through (the longest idle connections made room), at once.
        assert httpx.get(f"{served.url}/livez", timeout=2).status_code == 200
        time.sleep(0.3)
        open_ = [s for s in flood if not select.select([s], [], [], 0)[0]]
        assert len(open_) <= 32
    finally:
        for s in flood:
            s.close()


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def test_idle_connections_past_the_open_file_limit_leave_both_services_reachable(
    tmp_path: Path,
) -> None:
    """The measured outage: with the open-file limit at 1,024, 1,224 idle unauthenticated
    connections made both services of ``podium up`` unreachable. Default limits here (the
    header timeout, 10 s, is longer than the test: the connection limit must do it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    proc, (orch, lb) = start_up(tmp_path / "data", preexec=_low_fd_limit)
    flood: list[socket.socket] = []
    try:
        for url in (orch, lb):
            flood += [connect(url) for _ in range(1224)]
        for url in (orch, lb):
            assert httpx.get(f"{url}/livez", timeout=5).status_code == 200
            assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    finally:
        for s in flood:
            s.close()
        _stop(proc)


def test_an_oversized_head_is_431(deployed: dict[str, Served]) -> None:
    served = deployed["leaderboard-process"]
    s = connect(served.url)
    s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
    s.sendall(b"X-Big: " + b"a" * (100 << 10) + b"\r\n")  # the default limit is 64 KiB
    (out,) = trickle([s], b"", 0.3, 5)
    assert status_of(out.answer) == 431 and out.closed_after_s is not None, out


# -- clients that do not read their answers ------------------------------------------------------
ATTACKERS = 100  # against a limit of 32 connections
NORMAL_REQUESTS = 67


def never_reading(url: str, path: str, headers: str = "", pipelined: int = 1500) -> socket.socket:
    """A connection that pipelines ``pipelined`` GETs of ``path`` and never reads an answer
    (a small receive buffer: the server's writes stall after a few answers)."""
    parts = urlsplit(url)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    s.connect((parts.hostname, parts.port))
    request = f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{headers}\r\n".encode()
    s.setblocking(False)
    with contextlib.suppress(BlockingIOError):  # what the server does not read stays here
        s.send(request * pipelined)
    return s


def normal_requests(url: str, path: str, n: int = NORMAL_REQUESTS) -> list[float | None]:
    """``n`` GETs of ``path``, each on a new connection: seconds to a 200 (None: none in 1 s)."""
    times: list[float | None] = []
    for _ in range(n):
        start = time.monotonic()
        try:
            r = httpx.get(url + path, timeout=1.0, headers={"Authorization": f"Bearer {TOKEN}"})
            took = time.monotonic() - start
            times.append(took if r.status_code == 200 and took <= 1.0 else None)
        except httpx.HTTPError:
            times.append(None)
        time.sleep(0.02)
    return times


@pytest.mark.parametrize("service", SERVICES)
def test_clients_that_never_read_their_answers_lock_nobody_out(
    deployed: dict[str, Served], service: str
) -> None:
    """The measured lock-out: connections that pipelined GETs of the 41 KB OpenAPI document and
    never read were never closed (a writing server had no deadline, and only connections
    waiting for a head could be evicted): no other client was answered, and each connection
    held every request it had pipelined (4,400 connections: 0.73 -> 3.56 GB)."""
    served = deployed[service]
    proc = psutil.Process(served.pid)
    rss_before = proc.memory_info().rss
    attackers = [never_reading(served.url, "/api/v1/openapi.json") for _ in range(ATTACKERS)]
    try:
        time.sleep(0.5)
        times = normal_requests(
            served.url, "/api/v1/experiments" if "orch" in service else "/livez"
        )
        grown = proc.memory_info().rss - rss_before
    finally:
        for s in attackers:
            s.close()
    answered = [t for t in times if t is not None]
    assert len(answered) >= 0.95 * len(times), f"{len(answered)}/{len(times)} answered in 1 s"
    assert grown < 100 << 20, f"RSS grew by {grown >> 20} MiB"


def _blob_descriptors(pid: int, blobs: Path) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            n += os.readlink(fd).startswith(str(blobs))
    return n


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")
def test_slow_downloads_lock_nobody_out_and_aborted_ones_close_their_files(
    deployed: dict[str, Served],
) -> None:
    """300 downloads of a 4 MB candidate file that were never read: 0 of 227 other requests
    answered in 120 s; once aborted, the leaderboard kept each one's blob file open until its
    next garbage collection."""
    from tests.leaderboard.conftest import experiment, multipart, result

    served = deployed["leaderboard-process"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    api = f"{served.url}/api/v1/experiments/slow-dl"
    assert httpx.put(api, json=experiment(), headers=auth).status_code in (200, 201)
    files = {"actor": os.urandom(4 << 20)}
    r = httpx.post(
        f"{api}/submissions", files=multipart(result("s0", 1.0, files), files), headers=auth
    )
    assert r.status_code == 200, r.text
    path = f"/api/v1/experiments/slow-dl/candidates/{r.json()['candidate_id']}/files/actor"
    blobs = served.data_dir / "blobs"
    proc = psutil.Process(served.pid)
    headers = f"Authorization: Bearer {TOKEN}\r\n"
    attackers = [never_reading(served.url, path, headers, pipelined=4) for _ in range(ATTACKERS)]
    try:
        time.sleep(0.5)
        times = normal_requests(served.url, "/livez")
    finally:
        for s in attackers:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # a reset: the download is aborted
    answered = [t for t in times if t is not None]
    assert len(answered) >= 0.95 * len(times), f"{len(answered)}/{len(times)} answered in 1 s"
    deadline = time.monotonic() + 3
    while _blob_descriptors(proc.pid, blobs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _blob_descriptors(proc.pid, blobs) == 0


def test_a_client_that_pipelines_and_reads_gets_its_answers_up_to_the_bound(
    deployed: dict[str, Served],
) -> None:
    """Pipelining is served, in order, as long as the client reads; past the bound (16) the
    connection closes after the 16th answer instead of queueing without end."""
    served = deployed["leaderboard-process"]
    host = urlsplit(served.url).netloc
    for sent, answered in ((5, 5), (40, 16)):
        s = connect(served.url)
        s.sendall(f"GET /api/v1/openapi.json HTTP/1.1\r\nHost: {host}\r\n\r\n".encode() * sent)
        (out,) = trickle([s], b"", 0.3, 10)
        assert out.answer.count(b"HTTP/1.1 200 OK") == answered, (sent, out.closed_after_s)
        if sent > answered:
            assert out.closed_after_s is not None  # closed after its last answer


HANGING_SHUTDOWN = """
import asyncio, contextlib, sys
from fastapi import FastAPI
from services.http_server import serve
from services.settings import PodiumSettings

@contextlib.asynccontextmanager
async def lifespan(app):
    print("ready", flush=True)
    yield
    await asyncio.Event().wait()  # a shutdown that never ends

serve(FastAPI(lifespan=lifespan), PodiumSettings(), stop_limit_s=2.0, port=int(sys.argv[1]),
      log_level="warning", timeout_graceful_shutdown=1)
"""


def test_a_service_whose_shutdown_hangs_still_stops(tmp_path: Path) -> None:
    """A leaderboard once ignored SIGTERM and SIGINT for minutes, its shutdown hung: the
    service's stop has a deadline (the process exits 1 and says so)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HANGING_SHUTDOWN, str(free_port())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(15)
        assert proc.wait(timeout=30) == 1
        assert "shutdown did not finish in time: exiting" in (
            proc.stderr.read() if proc.stderr else ""
        )
    finally:
        proc.kill()
