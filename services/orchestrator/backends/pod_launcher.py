"""The local backend's pod launcher: CPU pods forked from a process that imported torch once.

``PodLauncher`` runs ``python -m services.pod.runtime.launcher``
(services/pod/runtime/launcher.py, where the
why and the line protocol are) as a child of the orchestrator and asks it for pods. What the
backend gets back is a ``LaunchedPod``: a pid and a ``wait()`` for the exit code, as a
``subprocess.Popen`` would give. The launcher starts importing when the backend is built, so
that by the time the first experiment's pods are scheduled it is usually ready.

When the launcher cannot start, dies, refuses a request or does not answer in time (then it is
killed: a launcher that hangs must not hold pod creation), ``launch`` raises
``LauncherUnavailableError`` and the backend starts that pod as a new interpreter instead: the
launcher only ever makes pods start sooner. The launcher's environment is the orchestrator's
without the platform's secrets: a fork's ``/proc/<pid>/environ`` is its launcher's. It starts
with the pods' allocator preloaded (``pod_malloc``, services/malloc.py): a forked pod runs with
its launcher's malloc, whatever its own environment says. A pod
whose launcher died before it ended has an exit status nobody can read (it is no longer
anyone's child); its ``wait()`` returns None once the process is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil

from services.contracts.credentials import PLATFORM_SECRETS
from services.logs import get_logger
from services.malloc import preload

log = get_logger(__name__)


class LauncherUnavailableError(RuntimeError):
    """The launcher cannot start this pod; start it as a new interpreter."""


class LaunchedPod:
    """A pod the launcher forked: its pid and, once it ends, its exit code."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._ended = threading.Event()
        self._code: int | None = None

    def _exited(self, code: int | None) -> None:
        self._code = code
        self._ended.set()

    def wait(self) -> int | None:
        """The exit code (negative: the signal that killed it); None if it is unknowable."""
        self._ended.wait()
        if self._code is None:  # the launcher died first: wait for the process itself
            with contextlib.suppress(psutil.Error):
                psutil.Process(self.pid).wait()
        return self._code


class PodLauncher:
    """One ``services.pod.runtime.launcher`` process and the pods it started."""

    READY_TIMEOUT_S = 120.0  # importing torch on a loaded machine; then fall back
    ANSWER_TIMEOUT_S = 30.0  # a fork answers in milliseconds: longer means the launcher hangs

    def __init__(
        self,
        python: str = sys.executable,
        malloc_library: Path | None = None,
        mkl_dispatch: str = "auto",
    ) -> None:
        """``malloc_library``: the allocator preloaded into the launcher (services/malloc.py
        ``resolve`` of ``pod_malloc``), so into every pod forked from it (a fork keeps its
        parent's allocator); None: the system's malloc. ``mkl_dispatch``: the pods'
        ``PODIUM_POD_MKL_DISPATCH`` (a fork keeps what its launcher's import chose)."""
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._next_id = 0
        # Request id -> (answered, answer); the reader puts the LaunchedPod into the answer.
        self._pending: dict[int, tuple[threading.Event, dict[str, Any]]] = {}
        self._pods: dict[int, LaunchedPod] = {}  # running, by pid
        self._ready = threading.Event()
        self._gone = threading.Event()
        self._closing = False
        env = preload(
            {k: v for k, v in os.environ.items() if k not in PLATFORM_SECRETS}, malloc_library
        )
        env["PODIUM_POD_MKL_DISPATCH"] = mkl_dispatch
        self._proc = subprocess.Popen(
            [python, "-m", "services.pod.runtime.launcher"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            encoding="utf-8",
            start_new_session=True,  # a Ctrl-C to the orchestrator's group is not for it
        )
        self._reader = threading.Thread(target=self._read, name="pod-launcher", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("ready"):
                self._ready.set()
            elif "exit_code" in message:  # always after the answer that announced the pod
                with self._lock:
                    pod = self._pods.pop(message["pid"], None)
                if pod is not None:
                    pod._exited(message["exit_code"])
            elif (n := message.get("id")) is not None:
                with self._lock:
                    waiter = self._pending.pop(n, None)
                    if "pid" in message:
                        # Registered here, in the answers' order, so that its exit line (which
                        # comes later on this stream) always finds it.
                        pod = self._pods[message["pid"]] = LaunchedPod(message["pid"])
                        message["pod"] = pod
                if waiter is not None:
                    waiter[1].update(message)
                    waiter[0].set()
                elif "pid" in message:  # forked after its request timed out: nobody's pod
                    self._kill(message["pid"])
        # EOF: the launcher is gone. Pending requests fail; running pods' codes are lost.
        self._gone.set()
        self._ready.set()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
            pods, self._pods = list(self._pods.values()), {}
        for event, _ in pending:
            event.set()
        for pod in pods:
            pod._exited(None)
        if not self._closing:
            log.warning("the pod launcher stopped; pods start as new interpreters")

    @staticmethod
    def _kill(pid: int) -> None:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(pid, signal.SIGKILL)

    def _give_up(self, why: str) -> LauncherUnavailableError:
        """Stop using (and kill) a launcher that hangs; its pods run on."""
        log.warning("the pod launcher does not answer: killing it", why=why)
        self._gone.set()
        with contextlib.suppress(OSError):
            self._proc.kill()
        return LauncherUnavailableError(why)

    def launch(self, argv: list[str], env: dict[str, str], log_path: str) -> LaunchedPod:
        """Fork a pod running ``python -m services.pod ARGV`` with ``env``, output to
        ``log_path``. Raises ``LauncherUnavailableError``."""
        if not self._ready.wait(self.READY_TIMEOUT_S):
            raise self._give_up("not ready after importing for READY_TIMEOUT_S")
        if self._gone.is_set():
            raise LauncherUnavailableError("the pod launcher is not running")
        event, answer = threading.Event(), {}
        with self._lock:
            n = self._next_id
            self._next_id += 1
            self._pending[n] = (event, answer)
        request = json.dumps({"id": n, "argv": argv, "env": env, "log": log_path})
        try:
            assert self._proc.stdin is not None
            # Its own lock: a write may block on a full pipe, and the reader must not wait on it.
            with self._write_lock:
                self._proc.stdin.write(request + "\n")
                self._proc.stdin.flush()
        except (OSError, ValueError) as exc:
            with self._lock:
                self._pending.pop(n, None)
            raise LauncherUnavailableError(f"the pod launcher is gone: {exc}") from None
        if not event.wait(self.ANSWER_TIMEOUT_S):
            with self._lock:
                timed_out = self._pending.pop(n, None) is not None
            if timed_out:
                raise self._give_up("no answer within ANSWER_TIMEOUT_S")
            event.wait()  # the reader took the answer just now: it is being handed over
        if "pod" not in answer:
            raise LauncherUnavailableError(answer.get("error", "the pod launcher is gone"))
        pod: LaunchedPod = answer["pod"]
        return pod

    def close(self) -> None:
        """Let the launcher go (its stdin closes, it exits); the pods it started run on."""
        self._closing = True
        if self._gone.is_set():
            with contextlib.suppress(OSError):
                self._proc.kill()
        with contextlib.suppress(OSError, ValueError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
