"""The container tests' engine lock: a second test session on the machine waits for the first
one's Docker engine only so long, then its container tests are skipped with the reason (they
would otherwise each fail at pytest-timeout's limit while the first session holds it). A
session that takes the lock stops an engine a killed session left on the data-root."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.containers import conftest
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


def test_an_engine_a_killed_session_left_on_the_data_root_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its session gone (the lock free), a dockerd on the data-root kept the next session's
    engine from starting, and every container test skipped; one on another root is not ours."""
    root, other = tmp_path / "data-root", tmp_path / "other-root"
    monkeypatch.setattr(conftest, "DATA_ROOT", root)
    run_dir = tmp_path / "podium-dockerd-left"
    (run_dir / "exec").mkdir(parents=True)

    def dockerd(data_root: Path) -> subprocess.Popen[bytes]:
        """A process whose command line is a dockerd's (argv[0], --data-root, --exec-root)."""
        argv = ["/usr/sbin/dockerd", "-c", "import time; time.sleep(120)", "--data-root",
                str(data_root), "--exec-root", str(run_dir / "exec")]  # fmt: skip
        return subprocess.Popen(argv, executable=sys.executable)

    left, theirs = dockerd(root), dockerd(other)
    try:
        conftest._stop_orphaned_engines()
        assert left.wait(30) is not None
        assert theirs.poll() is None
        assert not run_dir.exists()
    finally:
        for proc in (left, theirs):
            proc.kill()
            proc.wait()
