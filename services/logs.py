"""Structured logging for every Podium service (structlog; no print in services)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from pathlib import Path

import structlog

_configured = False
_log_file: _File | None = None  # the file the last configure opened, closed by the next


class LogTail:
    """The last lines this process logged (``keep_tail``), for a process whose log is lost
    with it (a pod on Kubernetes uploads them before it exits)."""

    def __init__(self, lines: int) -> None:
        self._lines: deque[str] = deque(maxlen=lines)
        self._lock = threading.Lock()

    def add(self, text: str) -> None:
        with self._lock:
            self._lines.extend(line for line in text.splitlines() if line)

    def resize(self, lines: int) -> None:
        with self._lock:
            self._lines = deque(self._lines, maxlen=lines)

    def text(self) -> str:
        with self._lock:
            return "".join(line + "\n" for line in self._lines)


_tail: LogTail | None = None


def keep_tail(lines: int) -> LogTail:
    """From now on, keep the last ``lines`` lines this process logs (every record, structlog's
    and the standard library's, as written)."""
    global _tail
    _tail = LogTail(lines)
    return _tail


def _kept(text: str) -> None:
    if _tail is not None:
        _tail.add(text)


class _Stderr:
    """``sys.stderr`` as it is at each write, not as it was at configure time.

    Test runners, ``typer.testing`` and daemonising code swap ``sys.stderr``; a logger holding
    the old object would write into a closed stream.
    """

    def write(self, text: str) -> int:
        _kept(text)
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _File:
    """A log file, appended to line by line (one write per record, as on stderr)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1, encoding="utf-8")

    def write(self, text: str) -> int:
        _kept(text)
        return self._file.write(text)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def configure(
    level: str | None = None, json: bool | None = None, file: str | Path | None = None
) -> None:
    """Configure structlog (and the standard library's logging) for this process.

    To stderr, JSON lines when stderr is not a terminal (containers, pods) so log shippers can
    parse them, a readable console renderer otherwise; ``PODIUM_LOG_LEVEL`` /
    ``PODIUM_LOG_JSON`` override. With ``file``, JSON lines appended to that file instead: the
    command line keeps its terminal for people (``podium up`` logs to DATA_DIR/podium.log).
    """
    global _configured
    level = (level or os.environ.get("PODIUM_LOG_LEVEL", "INFO")).upper()
    global _log_file
    stream: _Stderr | _File = _Stderr() if file is None else _File(Path(file))
    if _log_file is not None:
        _log_file.close()
    _log_file = stream if isinstance(stream, _File) else None
    if file is not None:
        json = True
    elif json is None:
        env = os.environ.get("PODIUM_LOG_JSON")
        json = env == "1" if env is not None else not sys.stderr.isatty()
    logging.basicConfig(format="%(message)s", stream=stream, level=level, force=True)
    # The web server's loggers go where this process logs: a uvicorn started earlier in the
    # process with its own logging config left handlers on them that would bypass the root.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        server_log = logging.getLogger(name)
        server_log.handlers.clear()
        server_log.propagate = True
        server_log.setLevel(logging.NOTSET)
    renderer = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        # One write per record, newline included (PrintLogger writes the newline apart): a
        # pod's role processes share its stderr, unbuffered in the image, and a line written
        # in two parts can be split by another process's line.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    if not _configured:
        configure()
    return structlog.get_logger(name)
