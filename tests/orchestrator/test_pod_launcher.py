"""The local backend's pod launcher (services/pod/runtime/launcher.py): CPU pods of the default
command start as forks of one process that imported torch once, and are what a new interpreter would
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
from services.pod.runtime.launcher import POD_PROCESS_NAME
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


def create(backend: LocalBackend, pod: str, spec: str = SPEC) -> None:
    """Pod ``pod`` of experiment e1 (CartPole's spec, a leaderboard nobody serves)."""
    backend.create_pod(PodRequest("e1", pod, spec, Res(1, 0, 1 << 30), UNREACHABLE))


def assert_bad_input_ends_with_exit_2(backend: LocalBackend, data_dir: Path, pod: str) -> None:
    """A pod of a bad spec ends as ``python -m services.pod`` does: exit 2 and its message."""
    create(backend, pod, "{}")
    rec = wait_for(lambda: ended(data_dir, "e1", pod))
    assert rec["exit_code"] == 2
    assert "bad input" in backend.pod_log_tail("e1", pod, 50)


@pytest.fixture(autouse=True)
def kill_recorded_pods(tmp_path: Path) -> Iterator[None]:
    """Whatever a test leaves running: a forked pod's environment in /proc is its launcher's,
    so the conftest's cleanup (which looks for PODIUM_POD_DIR there) would miss it."""
    yield
    for path in tmp_path.glob("experiments/*/pods/*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError):
            os.killpg(json.loads(path.read_text())["pid"], signal.SIGKILL)


@pytest.fixture
def launching_backend(
    make_settings: Callable[..., OrchestratorSettings],
) -> Iterator[Callable[[], LocalBackend]]:
    """Local backends of the default pod command (so with a launcher), closed after the test."""
    made: list[LocalBackend] = []

    def make() -> LocalBackend:
        made.append(LocalBackend(make_settings(pod_command=None)))
        assert made[-1].launcher is not None
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def test_a_cpu_pod_is_a_fork_of_the_launcher_in_its_own_session_and_its_exit_is_recorded(
    tmp_path: Path,
    launching_backend: Callable[[], LocalBackend],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PODIUM_LEADERBOARD_TOKEN", "hunter2")  # the orchestrator's secret
    backend = launching_backend()
    create(backend, "p1")
    pid = record(tmp_path, "e1", "p1")["pid"]
    # Its own group as soon as the backend knows its pid (a signal may follow at once).
    assert os.getpgid(pid) == pid
    pod = psutil.Process(pid)
    assert pod.ppid() == backend.launcher.pid
    assert pod.name() == POD_PROCESS_NAME
    # A fork's /proc environ is its launcher's: the platform's secrets are not in it.
    assert b"hunter2" not in Path(f"/proc/{pid}/environ").read_bytes()
    # It runs the pod: its log is the pod's structured log.
    wait_for(lambda: "leaderboard unavailable" in backend.pod_log_tail("e1", "p1", 50))
    os.killpg(pid, signal.SIGKILL)
    rec = wait_for(lambda: ended(tmp_path, "e1", "p1"))
    assert (rec["exit_code"], rec["reason"]) == (-9, "killed by SIGKILL")

    assert_bad_input_ends_with_exit_2(backend, tmp_path, "p2")


def test_requests_that_arrive_together_are_all_answered(tmp_path: Path) -> None:
    # The reconciler creates an experiment's pods in parallel; a buffered read of the
    # launcher's stdin once left all but the first of such requests unread (the fourth pod
    # of a four-pod experiment never started). Each pod here dies of its own signal, so a
    # pid or an exit code handed to the wrong request shows. Not SIGHUP or SIGQUIT: under
    # nohup, or as a background job of a script, they are ignored, and a pod inherits that
    # as a new interpreter would (it would not die, and the test would hang).
    launcher = PodLauncher()
    signals = [signal.SIGKILL, signal.SIGALRM, signal.SIGVTALRM, signal.SIGUSR1, signal.SIGUSR2]
    launched: dict[int, LaunchedPod] = {}
    env = {"PATH": os.environ["PATH"], "PODIUM_SPEC": SPEC, **UNREACHABLE}

    def launch(i: int) -> None:
        argv = ["--experiment", "e1", "--pod-id", f"p{i}"]
        launched[i] = launcher.launch(argv, env, str(tmp_path / f"p{i}.log"))

    try:
        threads = [threading.Thread(target=launch, args=(i,)) for i in range(len(signals))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PodLauncher.ANSWER_TIMEOUT_S + 30)
        assert sorted(launched) == list(range(len(signals)))
        for i, sig in enumerate(signals):
            # The launcher answers once the pod leads its process group, before the pod has
            # opened its log: the log may not exist yet.
            log = tmp_path / f"p{i}.log"
            wait_for(lambda log=log: log.exists() and "leaderboard unavailable" in log.read_text())
            os.kill(launched[i].pid, sig)
        assert [launched[i].wait() for i in range(len(signals))] == [-s for s in signals]
    finally:
        for pod in launched.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.pid, signal.SIGKILL)
        launcher.close()


def test_without_its_launcher_the_backend_starts_pods_as_new_interpreters(
    tmp_path: Path, launching_backend: Callable[[], LocalBackend]
) -> None:
    backend = launching_backend()
    backend.launcher._proc.kill()  # the launcher dies
    backend.launcher._proc.wait()
    assert_bad_input_ends_with_exit_2(backend, tmp_path, "p1")


def test_closing_the_backend_leaves_the_launchers_pods_running(
    tmp_path: Path, launching_backend: Callable[[], LocalBackend]
) -> None:
    backend = launching_backend()
    create(backend, "p1")
    pid = record(tmp_path, "e1", "p1")["pid"]
    assert backend.launcher is not None
    launcher = backend.launcher.pid
    backend.close()
    assert not psutil.pid_exists(launcher)
    assert psutil.Process(pid).is_running()
    # A new orchestrator's backend adopts it from its record.
    [pod] = launching_backend().list_pods()
    assert (pod.pod_id, pod.phase) == ("p1", "Running")


def test_a_pod_whose_launcher_died_ends_with_an_unknown_status(
    tmp_path: Path, launching_backend: Callable[[], LocalBackend]
) -> None:
    backend = launching_backend()
    create(backend, "p1")
    pid = record(tmp_path, "e1", "p1")["pid"]
    backend.launcher._proc.kill()  # its pods run on, no longer anyone's children
    backend.launcher._proc.wait()
    assert psutil.Process(pid).is_running()
    os.killpg(pid, signal.SIGKILL)
    rec = wait_for(lambda: ended(tmp_path, "e1", "p1"))
    assert rec["exit_code"] is None
    assert "status unknown" in rec["reason"]


def test_a_launcher_that_hangs_is_killed_and_pods_start_as_new_interpreters(
    tmp_path: Path,
    launching_backend: Callable[[], LocalBackend],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(PodLauncher, "ANSWER_TIMEOUT_S", 2.0)
    backend = launching_backend()
    launcher = backend.launcher
    launcher._ready.wait(PodLauncher.READY_TIMEOUT_S)
    os.kill(launcher.pid, signal.SIGSTOP)  # hangs: reads no request, answers nothing
    create(backend, "p1")
    assert launcher._proc.wait(10) == -signal.SIGKILL
    pid = record(tmp_path, "e1", "p1")["pid"]
    assert "services.pod" in psutil.Process(pid).cmdline()  # a new interpreter
    wait_for(lambda: "leaderboard unavailable" in backend.pod_log_tail("e1", "p1", 50))
    os.killpg(pid, signal.SIGKILL)
    rec = wait_for(lambda: ended(tmp_path, "e1", "p1"))
    assert rec["exit_code"] == -9
