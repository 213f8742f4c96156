"""``python -m services.pod.runtime.launcher``: start CPU pods as forks of one process that
has imported torch once.

A pod would spend its first CPU seconds importing torch, TensorBoard's writer and the compiler
(``PRELOAD``, ``compiled.COMPILER``), each pod again while the experiment waits for its first
score. The local backend (services/orchestrator/backends/pod_launcher.py) starts one launcher per
orchestrator: it imports them once and forks a pod per request, which runs
``services.pod.__main__.main`` as ``python -m services.pod`` would (own session, environment, log).

Only CPU pods come from here: a GPU pod must initialise CUDA in a process that was never
forked from one that might have, so the backend starts those as new interpreters.

Protocol, one JSON object per line. Requests on stdin: ``{"id": n, "argv": [...], "env":
{...}, "log": path}``. Answers on stdout: ``{"id": n, "pid": pid}`` (forked) or
``{"id": n, "error": text}``, and ``{"pid": pid, "exit_code": code}`` when a pod ends (a
negative code: killed by that signal, as ``subprocess`` reports it). The launcher exits when
stdin closes (its orchestrator went away); the pods it started run on, in their own sessions,
and a new orchestrator adopts them from their records.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

from services.logs import configure, get_logger
from services.pod.mkl_dispatch import compile_root, operator_cache_dir
from services.startup import import_all

log = get_logger("services.pod.runtime.launcher")

#: What ``ps`` and ``top`` show for a forked pod (its command line is the launcher's).
POD_PROCESS_NAME = "podium-pod"

PRELOAD = (
    "torch",
    "torch.utils.tensorboard",  # each pod's board opens its writer before the first step
    "torch.utils.tensorboard.summary",
    "services.pod.__main__",
    "services.pod.runtime.rounds",
    "services.pod.training.onpolicy",
    "services.pod.training.offpolicy",
    "services.pod.roles.learner",
)


def preload(names: tuple[str, ...] = PRELOAD) -> None:
    """Import what every pod imports, before any pod is forked. No torch op runs here: torch
    starts its thread pools on first use, and a fork must not inherit them."""
    operator_cache_dir()  # an empty one unset: the ISA probes' programs go to inductor's default
    import_all(names, freeze=True)  # frozen: the pods' collections skip it, its pages shared


def needs_compiler(env: dict[str, str]) -> bool:
    """Whether a pod started with ``env`` may load compiled programs (its compile cache notes its
    spec's env with one of its algorithms, as ``auto`` reads it) or build them (``compile: on``)."""
    from services.pod.algorithms.compiled import PROGRAMS, note_prefix

    spec = json.loads(env.get("PODIUM_SPEC") or "{}")
    task = (spec.get("env") or {}).get("name", "")
    if cache := compile_root(env):
        for algorithm in spec.get("algorithms") or {}:
            if any(Path(cache, PROGRAMS).glob(note_prefix(task, algorithm) + "*")):
                return True
    return "on" in ((spec.get("search_space") or {}).get("compile") or {}).get("values", ())


def _child(request: dict[str, Any], channels: list[int], started: int) -> int:
    """In the forked pod: become what ``python -m services.pod ARGV`` with ENV would be."""
    os.setsid()  # its own session and process group: the backend signals the group
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(POD_PROCESS_NAME)
    # Now the launcher may hand out the pid: its group exists, and ps shows it by its name.
    os.close(started)
    # The handlers a new interpreter starts with.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    for fd in channels:
        os.close(fd)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    # A new interpreter seeds numpy's global generator from the OS; forks would share one
    # stream (``random`` reseeds itself after a fork, torch's default seed is fixed anyway).
    import numpy as np

    np.random.seed()
    sys.argv = [sys.argv[0], *request["argv"]]
    from services.pod.__main__ import main

    return main(request["argv"])


def _fork(request: dict[str, Any], channels: list[int]) -> int:
    """Fork the pod; return its pid once it leads its own process group, as a Popen with
    ``start_new_session`` returns after the child's setsid."""
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(started_w)
        os.read(started_r, 1)  # b"" once the child closed its end (or died)
        os.close(started_r)
        return pid
    os.close(started_r)
    code = 1
    try:
        code = _child(request, channels, started_w)
    except SystemExit as exc:  # what the interpreter makes of it
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:  # an interpreter dies of the SIGINT it did not handle
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # exiting: nothing left to tell
                stream.flush()
        os._exit(code)


def serve(requests: int, answers: TextIO) -> None:
    """Fork a pod per request line of fd ``requests`` until it closes; report each one's exit."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through wake_w
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    channels = [requests, answers.fileno(), wake_r, wake_w, selector.fileno()]

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    compiler_to_import = True  # before the first fork of a pod that uses it (``needs_compiler``)

    def handle(line: bytes) -> None:
        nonlocal compiler_to_import
        request: Any = None
        try:
            request = json.loads(line)
            if compiler_to_import and needs_compiler(request["env"]):
                compiler_to_import = False
                try:
                    from services.pod.algorithms.compiled import COMPILER, prepare_cpu

                    preload(COMPILER)
                    prepare_cpu()
                except Exception as exc:  # the pod meets it too, and says so in its log
                    log.warning("the pod launcher cannot import the compiler", error=repr(exc))
            answer({"id": request["id"], "pid": _fork(request, channels)})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            n = request.get("id") if isinstance(request, dict) else None
            answer({"id": n, "error": f"{type(exc).__name__}: {exc}"})

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            answer({"pid": pid, "exit_code": os.waitstatus_to_exitcode(status)})

    # Unbuffered reads split into lines here: a buffered reader would take several requests
    # from the pipe at once and leave all but the first unseen by the selector.
    unread = b""
    while True:
        for key, _ in selector.select():
            if key.fileobj == requests:
                chunk = os.read(requests, 1 << 16)
                if not chunk:
                    return  # the orchestrator went away; the pods run on
                unread += chunk
                while b"\n" in unread:
                    line, unread = unread.split(b"\n", 1)
                    handle(line)
            else:
                os.read(wake_r, 512)
        reap()


def main() -> int:
    # The protocol gets private copies of stdin and stdout; fds 0 and 1 then point elsewhere,
    # so that nothing a library prints can break a line of it.
    requests = os.dup(0)
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the orchestrator, which closes us
    configure()
    try:
        preload()
    except Exception as exc:  # e.g. an image without torch: the backend starts pods itself
        log.error("the pod launcher cannot import the pod's code", error=f"{exc!r}")
        return 1
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    serve(requests, answers)
    return 0


if __name__ == "__main__":
    code = main()
    # Nothing is left to clean up (answers flushed, the pods run on their own): skip the
    # interpreter's teardown of torch's modules, which the orchestrator's shutdown would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
