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
