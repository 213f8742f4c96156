"""Fixtures shared by the pod tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pod.harness import Leaderboard


@pytest.fixture
def leaderboard(tmp_path: Path) -> Iterator[Leaderboard]:
    """The real leaderboard app (uvicorn thread, embedded Redis) on a free port."""
    lb = Leaderboard(tmp_path / "lb").start()
    yield lb
    lb.stop()
