"""The container tests' engine lock: a second test session on the machine waits for the first
one's Docker engine only so long, then its container tests are skipped with the reason (they
would otherwise each fail at pytest-timeout's limit while the first session holds it)."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

import pytest

from tests.containers.conftest import _locked


def test_the_engine_lock_waits_for_the_other_session_and_gives_up_while_it_holds_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "podium-docker.lock"
    with path.open("w") as holder, path.open("w") as waiter:
        fcntl.flock(holder, fcntl.LOCK_EX)  # the other session's engine
        assert not _locked(waiter, 1.5)  # held for the whole wait: given up
        # Released during the wait: taken, and now held against the other session.
        threading.Timer(1.0, fcntl.flock, (holder, fcntl.LOCK_UN)).start()
        assert _locked(waiter, 60.0)
        with pytest.raises(BlockingIOError):
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
