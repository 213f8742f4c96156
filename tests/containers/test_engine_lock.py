"""The container tests' engine lock: a second test session on the machine waits for the first
one's Docker engine only so long, then its container tests are skipped with the reason (they
would otherwise each fail at pytest-timeout's limit while the first session holds it)."""

from __future__ import annotations

import fcntl
import time
from pathlib import Path

from tests.containers.conftest import _locked


def test_the_engine_lock_is_given_up_after_its_wait_while_another_session_holds_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "podium-docker.lock"
    with path.open("w") as holder, path.open("w") as waiter:
        fcntl.flock(holder, fcntl.LOCK_EX)  # the other session's engine
        start = time.monotonic()
        assert not _locked(waiter, 1.5)
        assert 1.5 <= time.monotonic() - start < 10
        fcntl.flock(holder, fcntl.LOCK_UN)
        assert _locked(waiter, 1.5)
