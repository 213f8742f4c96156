"""The local backend's memory limits: each pod held to its spec's ``resources.memory``, as the
kubelet holds a container to its limit, and an OOM kill told from a kill from outside.

Without a limit a pod that outgrows its share takes the machine's memory from everything else,
and the kernel's OOM killer, when it fires, sends the same SIGKILL a person does: such a pod was
replaced as "stopped from outside", again and again, and the experiment never ended. So each
pod is held to its limit by one of (``pod_memory_limit``):

- ``cgroup``: a memory cgroup of its own, made below the orchestrator's (cgroup v2, or v1's
  ``memory`` hierarchy), with the limit and no swap: the kernel kills the pod when it goes over
  (as on Kubernetes) and the cgroup's ``oom_kill`` count says it did. Needs a cgroup this
  process may create children in (root, or a delegated subtree).
- ``watch``: a thread per pod samples the memory of the pod's processes (their proportional
  set size: a pod forked from the pod launcher shares its pages) every ``WATCH_INTERVAL_S``
  and kills the pod's process group when it is over. Anywhere psutil runs; an allocation
  faster than the sampling can outgrow the limit for that long.
- ``auto`` (default): ``cgroup`` where one can be made, else ``watch``; ``off``: no limit.

A pod forked from the pod launcher is charged (``cgroup``) only what it makes after the fork:
the pages it shares with the launcher (torch, the compiler) stay the launcher's.

A pod killed for its memory ends with the reason ``OOMKilled`` and counts as a crash (the
pod's own doing), so an experiment whose pods keep outgrowing their limit fails after the
crash-loop limit, naming it, as on Kubernetes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

import psutil

from services import machine
from services.logs import get_logger

log = get_logger(__name__)

WATCH_INTERVAL_S = 0.25


class MemoryLimitError(RuntimeError):
    """The limit asked for cannot be applied on this machine."""


class PodMemory(ABC):
    """Holds pods to their memory limits; keys are (experiment id, pod id)."""

    name: str

    @abstractmethod
    def attach(self, key: tuple[str, str], pid: int, limit: int) -> None:
        """Hold the pod (process ``pid``, the leader of its process group) to ``limit`` bytes."""

    @abstractmethod
    def ended(self, key: tuple[str, str]) -> bool:
        """The pod has exited: forget it; True when its memory limit killed it."""


class NoLimit(PodMemory):
    name = "off"

    def attach(self, key: tuple[str, str], pid: int, limit: int) -> None:
        return None

    def ended(self, key: tuple[str, str]) -> bool:
        return False


class CgroupLimit(PodMemory):
    """A memory cgroup per pod below ``parent`` (a directory of a cgroup v2 hierarchy with the
    memory controller on for its children, or of cgroup v1's memory hierarchy)."""

    name = "cgroup"

    def __init__(self, parent: Path, v2: bool) -> None:
        self.parent, self.v2 = parent, v2

    def _files(self) -> tuple[tuple[str, ...], str]:
        """(the files to write the limit to, the file whose ``oom_kill`` line counts kills)."""
        if self.v2:
            return ("memory.max",), "memory.events"
        # memsw: memory and swap together, so that the pod is killed rather than swapped out.
        return ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"), "memory.oom_control"

    def make(self, name: str, limit: int) -> Path:
        group = self.parent / name
        group.mkdir(exist_ok=True)
        limits, _ = self._files()
        (group / limits[0]).write_text(str(limit))
        for extra in (*limits[1:], *(("memory.swap.max",) if self.v2 else ())):
            value = "0" if extra == "memory.swap.max" else str(limit)
            with contextlib.suppress(OSError):  # no swap accounting on this machine
                (group / extra).write_text(value)
        return group

    def _group(self, key: tuple[str, str]) -> Path:
        # Named by the pod: an orchestrator that adopts a running pod finds its group.
        return self.parent / f"podium-{key[0]}-{key[1]}"

    def attach(self, key: tuple[str, str], pid: int, limit: int) -> None:
        group = self.make(self._group(key).name, limit)
        with contextlib.suppress(ProcessLookupError):  # it has exited already
            (group / "cgroup.procs").write_text(str(pid))

    def ended(self, key: tuple[str, str]) -> bool:
        group = self._group(key)
        if not group.exists():
            return False
        killed = _oom_kills(group / self._files()[1]) > 0
        _remove(group)
        return killed


def _oom_kills(path: Path) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _remove(group: Path) -> None:
    """Remove a pod's cgroup once its last process is gone (a group with processes cannot go)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                log.warning("could not remove a pod's cgroup", cgroup=str(group), error=str(exc))
                return
            time.sleep(0.05)


class WatchLimit(PodMemory):
    """A sampling thread per pod (see the module docstring)."""

    name = "watch"

    def __init__(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._killed: set[tuple[str, str]] = set()
        self._stops: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()

    def attach(self, key: tuple[str, str], pid: int, limit: int) -> None:
        stop = threading.Event()
        with self._lock:
            self._stops[key] = stop
        threading.Thread(
            target=self._watch, args=(key, pid, limit, stop), name=f"memory-{key[1]}", daemon=True
        ).start()

    def _watch(self, key: tuple[str, str], pid: int, limit: int, stop: threading.Event) -> None:
        try:
            leader = psutil.Process(pid)
        except psutil.Error:
            return
        while not stop.wait(self.interval_s):
            used = _memory(leader)
            if used is None:
                return
            if used > limit:
                with self._lock:
                    self._killed.add(key)
                log.warning("pod over its memory limit: killing it", pod=key[1], bytes=used)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                return

    def ended(self, key: tuple[str, str]) -> bool:
        with self._lock:
            stop = self._stops.pop(key, None)
            killed = key in self._killed
            self._killed.discard(key)
        if stop is not None:
            stop.set()
        return killed


def _memory(leader: psutil.Process) -> int | None:
    """Bytes the pod's processes use (proportional set size where the system says it, else
    resident); None once the pod is gone."""
    try:
        procs = [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            try:
                total += getattr(p.memory_full_info(), "pss", 0) or p.memory_info().rss
            except (psutil.AccessDenied, AttributeError):
                total += p.memory_info().rss
    return total


def _cgroup_limit() -> CgroupLimit | str:
    """A ``CgroupLimit`` that works here, or why there is none (tried by making a group)."""
    own = machine.own_cgroup("memory")
    if own is None:
        return "no memory cgroup found (/proc/self/cgroup)"
    parent, _, v2 = own
    if v2:
        try:
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+memory")
        except OSError as exc:
            return f"cannot enable the memory controller below {parent}: {exc}"
    limit = CgroupLimit(parent, v2)
    try:
        probe = limit.make(f"podium-probe-{os.getpid()}", 1 << 30)
    except OSError as exc:
        return f"cannot make a memory cgroup below {parent}: {exc}"
    _remove(probe)
    return limit


def pod_memory(mode: str) -> PodMemory:
    """The limits of ``pod_memory_limit`` = ``mode``; raises ``MemoryLimitError`` for
    ``cgroup`` where none can be made."""
    if mode == "off":
        return NoLimit()
    if mode == "watch":
        return WatchLimit()
    found = _cgroup_limit()
    if isinstance(found, CgroupLimit):
        return found
    if mode == "cgroup":
        raise MemoryLimitError(f"pod_memory_limit is cgroup, but {found}")
    log.info("pod memory limits: sampling (no cgroup)", why=found)
    return WatchLimit()
