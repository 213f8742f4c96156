"""Structured logging (services/logs.py): a record is written whole."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from services import logs
from services.logs import configure, get_logger


@pytest.fixture
def restored() -> Iterator[None]:
    """The test configures logging for this process: put back what the others run with."""
    saved, handlers, flag = structlog.get_config(), logging.root.handlers[:], logs._configured
    yield structlog.configure(**saved)
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


def test_a_log_file_takes_json_lines_and_the_terminal_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restored: None
) -> None:
    """``podium up`` logs to a file so its terminal shows only the banner."""
    stream = Recorder()
    monkeypatch.setattr(sys, "stderr", stream)
    path = tmp_path / "data" / "podium.log"
    configure(level="INFO", file=path)
    get_logger("test").info("platform started", port=1)
    logging.getLogger("uvicorn.error").warning("from the standard library")
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["event"] == "platform started" and len(lines) == 2
    assert stream.writes == []
