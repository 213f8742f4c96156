"""The local backend starts its pods with the orchestrator's ``pod_malloc`` preloaded
(services/malloc.py): the pod launcher (so every pod forked from it) and pods started as new
interpreters; a pod logs the allocator it runs with. Real pods, a real launcher; a copy of zlib
named like tcmalloc where this machine has no real allocator (tests/test_malloc.py says why).
The same pods are told how MKL picks its kernels (``pod_mkl_dispatch``)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from services.malloc import AllocatorError, find_allocator, mapped_libraries
from services.orchestrator.backends.base import PodRequest
from services.orchestrator.backends.local import LocalBackend
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import OrchestratorSettings
from tests.orchestrator.conftest import spec, wait_for
from tests.orchestrator.test_pod_launcher import (
    create,
    kill_recorded_pods,  # noqa: F401 (autouse here too: whatever a test leaves running)
    record,
)
from tests.test_malloc import LIBZ, needs_libz

REAL = find_allocator()


def maps(pid: int, library: Path) -> bool:
    return any(p.exists() and os.path.samefile(p, library) for p in mapped_libraries(pid))


def started_line(backend: LocalBackend, pod: str) -> dict | None:
    """The pod's "pod started" log record, once it has logged it."""
    for line in backend.pod_log_tail("e1", pod, 200).splitlines():
        if '"pod started"' in line:
            return json.loads(line)
    return None


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    """A real shared library named like tcmalloc (a copy of zlib, which has no malloc)."""
    assert LIBZ is not None
    (tmp_path / "lib").mkdir()
    return Path(shutil.copyfile(LIBZ, tmp_path / "lib" / "libtcmalloc_minimal.so.4"))


@pytest.fixture
def backends(
    make_settings: Callable[..., OrchestratorSettings],
) -> Iterator[Callable[..., LocalBackend]]:
    made: list[LocalBackend] = []

    def make(**over: object) -> LocalBackend:
        made.append(LocalBackend(make_settings(**over)))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


@needs_libz
def test_the_launcher_and_its_forked_pods_run_with_pod_malloc(
    backends: Callable[..., LocalBackend], stand_in: Path
) -> None:
    backend = backends(pod_command=None, pod_malloc=str(stand_in))
    assert backend.launcher is not None
    launcher = backend.launcher.pid
    wait_for(lambda: maps(launcher, stand_in))
    create(backend, "p1")
    pid = record(backend.root.parent, "e1", "p1")["pid"]
    assert psutil.Process(pid).ppid() == backend.launcher.pid  # a fork
    assert maps(pid, stand_in)
    # It logs the allocator that serves its malloc: zlib serves none, so the system's.
    line = wait_for(lambda: started_line(backend, "p1"), timeout=60)
    assert line["malloc"] == "system"
    assert Path(line["malloc_library"]).name.startswith("libc")


@needs_libz
def test_a_pod_started_as_a_new_interpreter_runs_with_pod_malloc(
    backends: Callable[..., LocalBackend], stand_in: Path
) -> None:
    backend = backends(pod_malloc=str(stand_in))  # the stand-in pod command: a new process
    assert backend.launcher is None
    backend.create_pod(PodRequest("e1", "p1", json.dumps(spec()), Res(1, 0, 1 << 30), {}))
    pid = record(backend.root.parent, "e1", "p1")["pid"]
    wait_for(lambda: maps(pid, stand_in))
    assert psutil.Process(pid).environ()["LD_PRELOAD"] == str(stand_in)


@needs_libz
def test_auto_preloads_what_it_finds_and_system_nothing(
    backends: Callable[..., LocalBackend], stand_in: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", str(stand_in.parent))  # where auto looks first
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    for choice, pod in (("auto", "p1"), ("system", "p2")):
        backend = backends(pod_malloc=choice)
        request = PodRequest("e1", pod, json.dumps(spec()), Res(1, 0, 1 << 30), {})
        backend.create_pod(request)
        process = psutil.Process(record(backend.root.parent, "e1", pod)["pid"])
        assert process.environ().get("LD_PRELOAD") == (str(stand_in) if choice == "auto" else None)


@needs_libz
def test_auto_leaves_an_allocator_the_orchestrator_was_started_with_to_its_pods(
    backends: Callable[..., LocalBackend], stand_in: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The user preloaded jemalloc (a stand-in) into the orchestrator; auto would find tcmalloc.
    chosen = Path(shutil.copyfile(stand_in, stand_in.parent / "libjemalloc.so.2"))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(stand_in.parent))
    monkeypatch.setenv("LD_PRELOAD", str(chosen))
    backend = backends(pod_malloc="auto")
    assert backend.malloc_library is None
    backend.create_pod(PodRequest("e1", "p1", json.dumps(spec()), Res(1, 0, 1 << 30), {}))
    process = psutil.Process(record(backend.root.parent, "e1", "p1")["pid"])
    assert process.environ()["LD_PRELOAD"] == str(chosen)


def test_a_pod_malloc_that_is_no_library_stops_the_backend_naming_the_setting(
    backends: Callable[..., LocalBackend], tmp_path: Path
) -> None:
    with pytest.raises(AllocatorError, match=r"PODIUM_POD_MALLOC \(pod_malloc\): .* not exist"):
        backends(pod_malloc=str(tmp_path / "libtcmalloc_minimal.so.4"))


@pytest.mark.skipif(REAL is None, reason="no tcmalloc or jemalloc on this machine")
def test_with_auto_a_forked_pod_runs_with_and_logs_the_real_allocator(
    backends: Callable[..., LocalBackend],
) -> None:
    assert REAL is not None and REAL.library is not None
    backend = backends(pod_command=None, pod_malloc="auto")
    create(backend, "p1")
    line = wait_for(lambda: started_line(backend, "p1"), timeout=60)
    assert line["malloc"] == REAL.name
    assert os.path.samefile(line["malloc_library"], REAL.library)


def test_pods_and_the_launcher_are_told_pod_mkl_dispatch(
    backends: Callable[..., LocalBackend],
) -> None:
    """Read before torch in each pod process (services/pod/mkl_dispatch.py), so it must be in
    the environment a pod, or the launcher it is forked from, starts with."""
    forked = backends(pod_command=None, pod_mkl_dispatch="vendor")
    assert forked.launcher is not None
    launcher = psutil.Process(forked.launcher.pid)
    assert launcher.environ()["PODIUM_POD_MKL_DISPATCH"] == "vendor"
    backend = backends(pod_mkl_dispatch="vendor")  # the stand-in pod command: a new process
    backend.create_pod(PodRequest("e1", "p1", json.dumps(spec()), Res(1, 0, 1 << 30), {}))
    process = psutil.Process(record(backend.root.parent, "e1", "p1")["pid"])
    assert process.environ()["PODIUM_POD_MKL_DISPATCH"] == "vendor"
