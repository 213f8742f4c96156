"""Structured logging (services/logs.py): a record is written whole."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator

import pytest
import structlog

from services import logs
from services.logs import configure, get_logger


@pytest.fixture
def restored() -> Iterator[None]:
    """The test configures logging for this process: put back what the others run with."""
    saved, handlers, flag = structlog.get_config(), logging.root.handlers[:], logs._configured
    yield
    structlog.configure(**saved)
    logging.root.handlers[:] = handlers
    logs._configured = flag


class Recorder:
    """A stream that keeps every ``write`` call apart."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_record_is_one_write(monkeypatch: pytest.MonkeyPatch, restored: None) -> None:
    """A pod's role processes share its stderr, unbuffered in the image (PYTHONUNBUFFERED):
    a line written in two parts (the record, then its newline) can be split by another
    process's line, and a JSON-lines reader then fails on "Extra data"."""
    stream = Recorder()
    monkeypatch.setattr(sys, "stderr", stream)
    configure(level="INFO", json=True)
    get_logger("test").info("not needed", role="worker")
    [line] = stream.writes
    assert line.endswith("\n") and json.loads(line)["role"] == "worker"
