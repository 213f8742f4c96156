"""What the pod is doing, said in its log: ``pod activity`` records (their format:
services/contracts/pod_activity.py) that the live display of ``podium run`` / ``submit --wait``
reads (services/cli/live.py), so that a pod that compiles for a minute is seen compiling.

Activities: ``starting`` (the process is up: importing, checking its input), ``loading``
(asking the generator where to start, fetching a parent's files, building the trainer),
``compiling``, ``training``, ``evaluating`` (an evaluation and its report). The round loop says
its phase (``now``); compiling is seen, not said: a thread samples the pod's main thread every
``SAMPLE_S`` and reports ``compiling`` while its stack is in one of the ``COMPILERS``,
whichever trainer asked for it. A record is logged when the activity changes and every
``HEARTBEAT_S`` while it stays one other than training, with ``seconds`` in it so far.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from services.contracts.pod_activity import EVENT
from services.logs import get_logger

log = get_logger("services.pod")

SAMPLE_S = 0.5
HEARTBEAT_S = 10.0

#: (end of a source file's path, function): a stack with one of these frames is compiling.
COMPILERS = frozenset(
    {
        ("torch/_dynamo/convert_frame.py", "_compile"),
        ("torch/_dynamo/aot_compile.py", "aot_compile_fullgraph"),
        ("torch/_dynamo/aot_compile.py", "deserialize"),
        ("torch/_inductor/compile_fx.py", "compile_fx"),
    }
)
_FILE_ENDS = tuple({path for path, _ in COMPILERS})


class CompileStopped(BaseException):  # not an Exception: torch's handlers let it by
    """The pod's stop, raised by its signal handler into a compile in progress (not one of its
    final report): the pod ends now, not after a compile of a minute nobody would use. Torch's
    tracing state is left half-way, so not even the final report can run: what trained since
    the last report is lost (a compile comes at the start of training or a first evaluation)."""


def compiling(frame: Any) -> bool:
    """Whether the stack from ``frame`` (a thread's current one) is in one of the ``COMPILERS``."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_FILE_ENDS) and any(
            code.co_filename.endswith(path) and code.co_name == name for path, name in COMPILERS
        ):
            return True
        frame = frame.f_back
    return False


class Activity:
    """The pod's activity, logged by a thread of its own (see the module docstring)."""

    def __init__(self, sample_s: float = SAMPLE_S, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.sample_s, self.heartbeat_s = sample_s, heartbeat_s
        self._thread_id = threading.get_ident()  # the thread that trains: the pod's main one
        self._phase = "starting"
        self._shown: tuple[str, float] = ("", 0.0)  # (activity, since when: monotonic)
        self._logged_at = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._show(time.monotonic())
        self._thread = threading.Thread(target=self._run, name="pod-activity", daemon=True)
        self._thread.start()

    def now(self, phase: str) -> None:
        """The round loop's phase from now on (shown unless the pod is compiling)."""
        self._phase = phase
        self._show(time.monotonic())

    def _show(self, now: float) -> None:
        with self._lock:
            frame = sys._current_frames().get(self._thread_id)
            current = "compiling" if compiling(frame) else self._phase
            activity, since = self._shown
            if current != activity:
                self._shown = (current, now)
                since = now
            elif current == "training" or now - self._logged_at < self.heartbeat_s:
                return
            self._logged_at = now
        log.info(EVENT, activity=current, seconds=round(now - since, 1))

    def _run(self) -> None:
        while not self._stop.wait(self.sample_s):
            self._show(time.monotonic())

    def close(self) -> None:
        self._stop.set()


_current: Activity | None = None


def start() -> Activity:
    """Start saying the pod's activity (once per process; ``now`` is a no-op before)."""
    global _current
    if _current is None:
        _current = Activity()
    return _current


def now(phase: str) -> None:
    """The pod's phase from now on, if its activity is being said (``start``)."""
    if _current is not None:
        _current.now(phase)
