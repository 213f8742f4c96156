"""Structured logging for every Podium service (structlog; no print in services)."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


class _Stderr:
    """``sys.stderr`` as it is at each write, not as it was at configure time.

    Test runners, ``typer.testing`` and daemonising code swap ``sys.stderr``; a logger holding
    the old object would write into a closed stream.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog once per process.

    JSON lines when stderr is not a terminal (containers, pods) so log shippers can parse them;
    a readable console renderer otherwise. ``PODIUM_LOG_LEVEL`` / ``PODIUM_LOG_JSON`` override.
    """
    global _configured
    level = (level or os.environ.get("PODIUM_LOG_LEVEL", "INFO")).upper()
    if json is None:
        env = os.environ.get("PODIUM_LOG_JSON")
        json = env == "1" if env is not None else not sys.stderr.isatty()
    logging.basicConfig(format="%(message)s", stream=_Stderr(), level=level, force=True)
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
        logger_factory=structlog.WriteLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    if not _configured:
        configure()
    return structlog.get_logger(name)
