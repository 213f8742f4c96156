"""The local backend's pod launcher (services/pod/launcher.py): CPU pods of the default command
start as forks of one process that imported torch once, and are what a new interpreter would
be to the backend: own session, own log, exit code recorded. Real pods, a real launcher."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from services.orchestrator.backends.base import PodRequest
from services.orchestrator.backends.local import LocalBackend
from services.orchestrator.backends.pod_launcher import LaunchedPod, PodLauncher
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import OrchestratorSettings
from tests.orchestrator.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
SPEC = json.dumps(yaml.safe_load((ROOT / "examples/cartpole.yaml").read_text()))
# Nothing listens there: the pod keeps retrying the leaderboard, alive until it is stopped.
UNREACHABLE = {"PODIUM_LEADERBOARD_URL": "http://127.0.0.1:9"}


def record(data_dir: Path, exp: str, pod: str) -> dict:
    return json.loads((data_dir / "experiments" / exp / "pods" / f"{pod}.json").read_text())


def ended(data_dir: Path, exp: str, pod: str) -> dict | None:
    rec = record(data_dir, exp, pod)
    return rec if rec.get("ended") is not None else None


@pytest.fixture(autouse=True)
def kill_recorded_pods(tmp_path: Path) -> Iterator[None]:
    """Whatever a test leaves running: a forked pod's environment in /proc is its launcher's,
    so the conftest's cleanup (which looks for PODIUM_POD_DIR there) would miss it."""
    yield
    for path in tmp_path.glob("experiments/*/pods/*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError):
            os.killpg(json.loads(path.read_text())["pid"], signal.SIGKILL)


def test_a_cpu_pod_is_a_fork_of_the_launcher_in_its_own_session_and_its_exit_is_recorded(
    tmp_path: Path, make_settings: Callable[..., OrchestratorSettings]
) -> None:
    backend = LocalBackend(make_settings(pod_command=None))
    assert backend.launcher is not None
    try:
        backend.create_pod(PodRequest("e1", "p1", SPEC, Res(1, 0, 1 << 30), UNREACHABLE))
        pid = record(tmp_path, "e1", "p1")["pid"]
        pod = psutil.Process(pid)
        assert pod.ppid() == backend.launcher.pid
        assert pod.name() == "podium-pod"
        assert os.getpgid(pid) == pid  # its own group: the backend signals the group
        # It runs the pod: its log is the pod's structured log.
        wait_for(lambda: "leaderboard unavailable" in backend.pod_log_tail("e1", "p1", 50))
        os.killpg(pid, signal.SIGKILL)
        rec = wait_for(lambda: ended(tmp_path, "e1", "p1"))
        assert (rec["exit_code"], rec["reason"]) == (-9, "killed by SIGKILL")

        # Bad input: exit code 2 and its message, as from `python -m services.pod`.
        backend.create_pod(PodRequest("e1", "p2", "{}", Res(1, 0, 1 << 30), UNREACHABLE))
        rec = wait_for(lambda: ended(tmp_path, "e1", "p2"))
        assert rec["exit_code"] == 2
        assert "bad input" in backend.pod_log_tail("e1", "p2", 50)
    finally:
        backend.close()


def test_requests_that_arrive_together_are_all_answered() -> None:
    # The reconciler creates an experiment's pods in parallel; a buffered read of the
    # launcher's stdin once left all but the first of such requests unread (the fourth pod
    # of a four-pod experiment never started).
    launcher = PodLauncher()
    launched: list[LaunchedPod] = []

    def launch(i: int) -> None:
        argv = ["--experiment", "e1", "--pod-id", f"p{i}"]
        launched.append(launcher.launch(argv, {"PATH": os.environ["PATH"]}, os.devnull))

    try:
        threads = [threading.Thread(target=launch, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PodLauncher.ANSWER_TIMEOUT_S + 30)
        assert len(launched) == 6
        assert [pod.wait() for pod in launched] == [2] * 6  # each refused its (empty) env
    finally:
        launcher.close()


def test_without_its_launcher_the_backend_starts_pods_as_new_interpreters(
    tmp_path: Path, make_settings: Callable[..., OrchestratorSettings]
) -> None:
    backend = LocalBackend(make_settings(pod_command=None))
    assert backend.launcher is not None
    try:
        backend.launcher._proc.kill()  # the launcher dies
        backend.launcher._proc.wait()
        backend.create_pod(PodRequest("e1", "p1", "{}", Res(1, 0, 1 << 30), UNREACHABLE))
        rec = wait_for(lambda: ended(tmp_path, "e1", "p1"))
        assert rec["exit_code"] == 2
        assert "bad input" in backend.pod_log_tail("e1", "p1", 50)
    finally:
        backend.close()


def test_closing_the_backend_leaves_the_launchers_pods_running(
    tmp_path: Path, make_settings: Callable[..., OrchestratorSettings]
) -> None:
    backend = LocalBackend(make_settings(pod_command=None))
    backend.create_pod(PodRequest("e1", "p1", SPEC, Res(1, 0, 1 << 30), UNREACHABLE))
    pid = record(tmp_path, "e1", "p1")["pid"]
    assert backend.launcher is not None
    launcher = backend.launcher.pid
    backend.close()
    assert not psutil.pid_exists(launcher)
    assert psutil.Process(pid).is_running()
    # A new orchestrator's backend adopts it from its record.
    again = LocalBackend(make_settings(pod_command=None))
    try:
        [pod] = again.list_pods()
        assert (pod.pod_id, pod.phase) == ("p1", "Running")
    finally:
        again.close()
