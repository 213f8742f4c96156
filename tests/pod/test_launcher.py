"""services/pod/runtime/launcher.py's fork, in this process: the pid it hands out already leads its
own process group, as a Popen with ``start_new_session`` returns only after the child's setsid."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from services.pod.runtime import launcher


def test_the_pid_is_handed_out_after_the_pod_leads_its_own_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_setsid = os.setsid

    def slow_setsid() -> int:  # a child that is slow to get there (a loaded machine)
        time.sleep(1.0)
        return real_setsid()

    monkeypatch.setattr(os, "setsid", slow_setsid)  # the fork inherits the patch
    request = {
        "argv": ["--experiment", "e1", "--pod-id", "p1"],
        "env": {},
        "log": str(tmp_path / "log"),
    }
    pid = launcher._fork(request, channels=[])
    try:
        # A signal to its group right away (the backend's stop) must find the group.
        assert os.getpgid(pid) == pid
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 2  # the pod ran: no pod environment, bad input


def test_a_pods_start_up_counts_from_its_fork() -> None:
    """A pod's start-up seconds (its log's ``pod.first_env_step``) count from its process's
    start: psutil's create time was up to a second earlier than the fork (boot time in whole
    seconds), so every pod's start-up read that much longer than it was."""
    from services.pod.__main__ import process_start

    read_r, read_w = os.pipe()
    before = time.time()
    pid = os.fork()
    if pid == 0:
        os.write(read_w, repr(process_start()).encode())
        os._exit(0)
    os.close(read_w)
    started = float(os.read(read_r, 64))
    os.close(read_r)
    os.waitpid(pid, 0)
    # The kernel counts a process's start in clock ticks (10 ms) and the uptime in 10 ms.
    assert before - 0.03 <= started <= time.time(), (started - before, started)
