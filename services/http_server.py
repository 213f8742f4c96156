"""The HTTP server both services run under: uvicorn, with bounds on slow and idle clients.

uvicorn bounds none of these by itself: a connection that never sends a request, a request
head sent a few bytes at a time, or a body that stalls after its first bytes holds its socket
(a file descriptor) for ever; enough of them exhaust the process's open-file limit and the
service accepts no one (measured: 1,224 idle connections under a limit of 1,024 made both
services of ``podium up`` unreachable). ``ClientLimits`` (settings ``PODIUM_HTTP_*``, see
services/settings.py and docs/reliability.md) is enforced by a subclass of uvicorn's own HTTP
protocol class, so the parser, keep-alive and flow control stay uvicorn's:

- a request head (request line and headers) must arrive whole within ``header_timeout_s`` of
  the connection opening or of the previous response, and be at most ``max_header_bytes``;
- a request body must make progress: no ``body_timeout_s`` without a byte, and, once it has
  taken longer than that, an average of at least ``min_body_rate`` bytes/s. Time the server is
  not reading (the app is busy, flow control paused reading, or the client waits for
  ``100 Continue``) does not count against the client;
- an idle keep-alive connection is closed after ``keep_alive_s`` (uvicorn's own timer);
- a client must read its answers: once the server's writes to it stall (its socket's buffers
  full), no ``send_timeout_s`` without it reading a byte, and, once stalled longer than that, an
  average of at least ``min_send_rate`` bytes/s; else the connection is dropped (aborted: what
  the server still had to write is discarded, so the socket goes at once);
- at most ``max_pipelined`` requests per connection ahead of their answers: a client pipelining
  more gets the first ones answered, then the connection closes (each pipelined request holds
  memory until it is answered, and a client that never reads would have them all held);
- at most ``max_connections`` connections per service: one more closes the connection that has
  waited longest for a request head (idle or half-sent: it has given the server nothing to
  do), else the one whose client has left its answers unread longest, or, when every
  connection is busy with a request, is answered 503 and closed.

A client too slow with its head or body is answered 408 (431 for an oversized head) and
disconnected; a connection that never sent a byte is just closed.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import resource
import struct
import termios
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from services.logs import get_logger

if TYPE_CHECKING:
    from types import FrameType

    from services.settings import PodiumSettings

log = get_logger(__name__)

# Without a setting, each service takes at most this share of the open-file limit for client
# connections: ``podium up`` runs two services in one process, and Redis clients, pod logs and
# checkpoint files need descriptors too.
_FD_SHARE = 4
_MAX_DEFAULT_CONNECTIONS = 4096


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _MAX_DEFAULT_CONNECTIONS
    return max(16, min(_MAX_DEFAULT_CONNECTIONS, soft // _FD_SHARE))


@dataclass(frozen=True)
class ClientLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    min_body_rate: int = 1024
    keep_alive_s: float = 5.0
    max_connections: int = 256
    max_header_bytes: int = 64 << 10
    send_timeout_s: float = 30.0
    min_send_rate: int = 1024
    max_pipelined: int = 16

    @classmethod
    def from_settings(cls, settings: PodiumSettings) -> ClientLimits:
        return cls(
            header_timeout_s=settings.http_header_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            min_body_rate=settings.http_min_body_rate,
            keep_alive_s=settings.http_keep_alive_s,
            max_connections=settings.http_max_connections or default_max_connections(),
            max_header_bytes=settings.http_max_header_bytes,
            send_timeout_s=settings.http_send_timeout_s,
            min_send_rate=settings.http_min_send_rate,
            max_pipelined=settings.http_max_pipelined,
        )

    @property
    def tick_s(self) -> float:
        """How often a connection checks its deadlines (a timeout fires up to this late)."""
        return min(1.0, self.header_timeout_s / 4, self.body_timeout_s / 4, self.send_timeout_s / 4)


def _raw_response(status: int, reason: str, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _CountingTransport:
    """A connection's transport that counts the bytes written to it: what its client has read
    (or the kernel holds for it) is what was written less what is still buffered here."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.written = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)
        self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


#: Answers a connection may have written and its client not yet read before the server starts
#: on its next pipelined request (uvicorn's own write high-water mark).
PIPELINE_UNSENT_LIMIT = 64 << 10
#: How soon a connection whose pipelined requests wait for its client to read looks again
#: (then twice as late each time, up to a second).
PIPELINE_RECHECK_S = 0.05


def _kernel_unsent(fd: int) -> int:
    """Bytes in a TCP socket's send queue its peer has not acknowledged (Linux ``SIOCOUTQ``;
    0 where the system has no such call): what a client that does not read leaves there."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except (OSError, AttributeError):
        return 0


# Phases of a connection, as the deadlines see them.
_HEAD, _BODY, _SERVER = "head", "body", "server"


class LimitedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools, or h11 without it) with ``ClientLimits`` enforced.

    Each connection checks its phase every ``tick_s``: waiting for a request head, receiving a
    body the app is waiting for, or the server's turn (no deadline: the app may take its time).
    The phase is read from uvicorn's own request cycle (``self.cycle``), so nothing of the
    parsing is re-implemented; a new cycle object is a new request, hence a new deadline.
    """

    limits: ClassVar[ClientLimits] = ClientLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._out = _CountingTransport(transport)
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        self._held: asyncio.TimerHandle | None = None  # pipelined requests wait for a read
        super().connection_made(self._out)
        self._timer: asyncio.TimerHandle | None = None
        self._received = 0  # bytes since the connection opened
        self._head_bytes = 0  # bytes received while no request was under way
        self._last_data = time.monotonic()
        self._phase: tuple[Any, str] = (None, _HEAD)
        self._phase_start = self._last_data
        self._phase_received = 0
        # While the client leaves answers unread: since when, bytes it had read then, and
        # when it last read any (None: the server's writes are not stalled).
        self._stalled_since: float | None = None
        self._stall_sent = self._sent = 0
        self._read_at = 0.0
        self._pipeline_full = False  # past max_pipelined: what else arrives is not read
        if len(self.connections) > self.limits.max_connections and not self._evict_one():
            log.warning("connection limit reached", limit=self.limits.max_connections)
            self._close(503, "Service Unavailable", "too many connections; retry")
            return
        self._timer = self.loop.call_later(self.limits.tick_s, self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_timer", None) is not None:
            self._timer.cancel()
            self._timer = None
        if getattr(self, "_held", None) is not None:
            self._held.cancel()
            self._held = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._pipeline_full:
            return  # the connection closes after the requests kept: the rest is not served
        self._received += len(data)
        self._last_data = time.monotonic()
        if self._awaiting_head():
            self._head_bytes += len(data)
        pipeline = getattr(self, "pipeline", None)
        if pipeline is None or data.count(b"\r\n\r\n") < self.limits.max_pipelined - len(pipeline):
            super().data_received(data)
        else:
            self._feed_heads(data)
        if not self._awaiting_head():
            self._head_bytes = 0  # a head arrived whole: a request is under way
        elif self._head_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
            # httptools has no bound on a head's size (h11 has, set from the same limit).
            self._close(431, "Request Header Fields Too Large", "request head too large")

    def _feed_heads(self, data: bytes) -> None:
        """Parse ``data`` a request head at a time, and stop once ``max_pipelined`` requests are
        queued: httptools parses every request of a read at once (a read of 256 KiB holds
        thousands of pipelined GETs), so bounding the queue after the parse would bound
        neither the time nor the memory spent on it."""
        pos = 0
        while pos < len(data) and not self._pipeline_full and not self.transport.is_closing():
            end = data.find(b"\r\n\r\n", pos)
            end = len(data) if end < 0 else end + 4
            super().data_received(data[pos:end])
            pos = end
            self._bound_pipeline()

    def _bound_pipeline(self) -> None:
        """Keep at most ``max_pipelined`` requests (the one under way included); the last one
        kept closes the connection once answered. (httptools parses every request a read holds
        at once, queueing the pipelined ones in ``self.pipeline``, newest first; h11 parses one
        at a time and has no queue.)"""
        pipeline = getattr(self, "pipeline", None)
        keep = self.limits.max_pipelined - 1  # queued behind the one under way
        if not pipeline or len(pipeline) <= keep:
            return
        while len(pipeline) > keep:
            pipeline.popleft()
        last = pipeline[0][0] if pipeline else self.cycle
        last.keep_alive = False
        self._pipeline_full = True
        log.info(
            "client pipelined too many requests; closing after the first ones",
            limit=self.limits.max_pipelined,
            client=self._client_name(),
        )

    # -- phases --------------------------------------------------------------------------------
    def _awaiting_head(self) -> bool:
        # uvicorn's own test for "between requests" (see its ``shutdown``).
        return self.cycle is None or self.cycle.response_complete

    def _current_phase(self) -> str:
        if self._awaiting_head():
            return _HEAD
        cycle = self.cycle
        client_owes_body = cycle.more_body and not cycle.response_started
        if (
            client_owes_body
            and not self.flow.read_paused
            and not getattr(cycle, "waiting_for_100_continue", False)
        ):
            return _BODY
        return _SERVER

    def _unsent(self) -> int:
        """Bytes written for the client that it has not read: buffered here or in the kernel."""
        return self.transport.get_write_buffer_size() + (
            _kernel_unsent(self._fd) if self._fd >= 0 else 0
        )

    def on_response_complete(self) -> None:
        """uvicorn's, except that a pipelined request waits while the client has not read what
        was written for the ones before it: a client that pipelines and never reads would
        otherwise have every request it sent answered into the socket's buffers, a few
        megabytes and as many answers' CPU per connection."""
        pipeline = getattr(self, "pipeline", None)
        if not pipeline or self.transport.is_closing() or self._unsent() <= PIPELINE_UNSENT_LIMIT:
            super().on_response_complete()
            return
        self.pipeline = deque()  # uvicorn's own bookkeeping, without starting the next one
        super().on_response_complete()
        self._unset_keepalive_if_required()  # not idle: requests are waiting
        self.flow.pause_reading()
        self.pipeline = pipeline
        self._held = self.loop.call_later(PIPELINE_RECHECK_S, self._release_pipelined, 1)

    def _release_pipelined(self, waits: int) -> None:
        self._held = None
        if self.transport.is_closing() or not self.pipeline:
            return
        if self._unsent() > PIPELINE_UNSENT_LIMIT:
            # Looked at again soon, then less and less often (at most every second): a client
            # that reads is answered at once, one that does not costs the server nothing.
            delay = min(1.0, PIPELINE_RECHECK_S * 2**waits)
            self._held = self.loop.call_later(delay, self._release_pipelined, waits + 1)
            return
        self.flow.resume_reading()
        cycle, app = self.pipeline.pop()
        self._start_asgi_task(cycle, app)

    def _send_stalled(self, now: float) -> bool:
        """Whether the client has left its answers unread past the limits (see the module
        docstring); sampled at each check."""
        pending = self._unsent()
        if not pending:
            self._stalled_since = None
            return False
        sent = self._out.written - pending
        if self._stalled_since is None:
            self._stalled_since, self._read_at = now, now
            self._stall_sent = self._sent = sent
            return False
        if sent > self._sent:
            self._sent, self._read_at = sent, now
        limits = self.limits
        elapsed = now - self._stalled_since
        rate = (sent - self._stall_sent) / elapsed if elapsed else 0.0
        too_slow = elapsed > limits.send_timeout_s and rate < limits.min_send_rate
        return now - self._read_at > limits.send_timeout_s or too_slow

    def _check(self) -> None:
        self._timer = None
        now = time.monotonic()
        if self._send_stalled(now):
            self._abort("answers left unread")
            return
        if self.transport.is_closing():
            if self._unsent():
                # Closed, but what is buffered must still reach the client: until it does,
                # the socket stays open, so its reading stays bounded.
                self._timer = self.loop.call_later(self.limits.tick_s, self._check)
            return
        phase = (self.cycle, self._current_phase())
        if phase[0] is not self._phase[0] or phase[1] != self._phase[1]:
            self._phase, self._phase_start, self._phase_received = phase, now, self._received
        elapsed = now - self._phase_start
        limits = self.limits
        if phase[1] == _HEAD and elapsed > limits.header_timeout_s:
            if self._received == self._phase_received:
                self._drop("no request")  # nothing sent: nobody to answer
                return
            self._close(408, "Request Timeout", "request head not received in time")
            return
        if phase[1] == _BODY:
            idle = now - max(self._last_data, self._phase_start)
            rate = (self._received - self._phase_received) / elapsed if elapsed else 0.0
            too_slow = elapsed > limits.body_timeout_s and rate < limits.min_body_rate
            if idle > limits.body_timeout_s or too_slow:
                self._close(408, "Request Timeout", "request body not received in time")
                return
        self._timer = self.loop.call_later(limits.tick_s, self._check)

    # -- closing -------------------------------------------------------------------------------
    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for a request head, else the one that
        has left its answers unread longest; False if none. Runs on every connection past the
        limit, so a flood of them is one pass over the connections each, with no system call
        but where every connection is busy."""
        now = time.monotonic()
        oldest: LimitedHTTPProtocol | None = None
        longest: LimitedHTTPProtocol | None = None
        busy: list[LimitedHTTPProtocol] = []
        for c in self.connections:
            if c is self or not isinstance(c, LimitedHTTPProtocol) or c.transport.is_closing():
                continue
            if c._stalled_since is not None or c.transport.get_write_buffer_size():
                if longest is None or (c._stalled_since or now) < (longest._stalled_since or now):
                    longest = c
            elif c._awaiting_head():
                if oldest is None or c._phase_start < oldest._phase_start:
                    oldest = c
            else:
                busy.append(c)
        if oldest is not None:
            oldest._drop("connection limit reached; closed the longest waiting")
            return True
        if longest is None:
            # Not seen stalled yet: what they have not read may all be in the kernel's buffers.
            longest = next((c for c in busy if _kernel_unsent(c._fd) > 0), None)
        if longest is None:
            return False
        longest._abort("connection limit reached; dropped the longest unread")
        return True

    def _drop(self, why: str) -> None:
        log.info("client connection closed", reason=why, client=self._client_name())
        self.transport.close()

    def _abort(self, why: str) -> None:
        """Drop the connection and whatever is buffered for it (``close`` would keep the
        socket until a client that does not read had read it all)."""
        log.info("client connection dropped", reason=why, client=self._client_name())
        self.transport.abort()

    def _close(self, status: int, reason: str, detail: str) -> None:
        """Answer ``status`` (only if no response is under way on this connection) and close."""
        log.info(
            "client connection closed", status=status, reason=detail, client=self._client_name()
        )
        cycle = self.cycle
        # Not after an answer whose request is still arriving (a 401 or 413 sent before its
        # body was read): the client would take a second answer for its next request's.
        between_requests = cycle is None or (cycle.response_complete and not cycle.more_body)
        if between_requests or not cycle.response_started:
            self.transport.write(_raw_response(status, reason, detail))
        self.transport.close()

    def _client_name(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"


def limited_protocol(limits: ClientLimits) -> type[LimitedHTTPProtocol]:
    """``LimitedHTTPProtocol`` bound to ``limits`` (one class per server: two services in one
    process may have different limits)."""
    return type("LimitedHTTPProtocol", (LimitedHTTPProtocol,), {"limits": limits})


def server_config(app: Any, settings: PodiumSettings, **options: Any) -> uvicorn.Config:
    """The uvicorn configuration of a Podium service, client limits from ``settings``;
    ``options`` are further ``uvicorn.Config`` arguments (host, port, log_level, …)."""
    limits = ClientLimits.from_settings(settings)
    return uvicorn.Config(
        app,
        http=limited_protocol(limits),
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float works
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **options,
    )


class BoundedServer(uvicorn.Server):
    """uvicorn's server whose stop has a deadline: ``stop_limit_s`` after the first SIGTERM or
    SIGINT the process exits (1), logging it, whatever its shutdown still awaits: a service asked
    to stop must stop (a leaderboard's shutdown has hung for good under load, every signal but
    SIGKILL ignored, with no request in flight)."""

    def __init__(self, config: uvicorn.Config, stop_limit_s: float) -> None:
        super().__init__(config)
        self.stop_limit_s = stop_limit_s
        self._deadline: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._deadline is None:
            self._deadline = threading.Timer(self.stop_limit_s, self._give_up)
            self._deadline.daemon = True  # a shutdown that ends in time ends the process
            self._deadline.start()

    def _give_up(self) -> None:
        log.error("shutdown did not finish in time: exiting", limit_s=self.stop_limit_s)
        os._exit(1)


def serve(app: Any, settings: PodiumSettings, stop_limit_s: float = 60.0, **options: Any) -> None:
    """Serve ``app`` on ``settings.host``:``settings.port`` until a signal stops it (within
    ``stop_limit_s`` of the signal: ``BoundedServer``)."""
    options.setdefault("host", getattr(settings, "host", "127.0.0.1"))
    options.setdefault("port", getattr(settings, "port", 8000))
    options.setdefault("log_config", None)  # structlog (services.logs) is the process's logging
    BoundedServer(server_config(app, settings, **options), stop_limit_s).run()
