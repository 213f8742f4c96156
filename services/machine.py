"""What of the machine this process may use: its CPUs (the cores it may run on, at most its
cgroup's CPU quota) and its memory (at most its cgroup's limit).

In a container (Docker's ``--cpus``/``--memory``, a Kubernetes limit, a CI runner's job) these
are less than the host's, which ``os.cpu_count()`` and the physical pages report. The local
backend sizes its capacity by them, so that ``podium run`` in a 4-CPU container on a 64-core host
starts pods for 4 CPUs; a pod sizes EnvPool's threads by them (threads past a CPU quota are
throttled, not run). A limit on any cgroup from the process's own up to the mount applies.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Where the cgroup file systems are mounted, and where this process's cgroups are named.
CGROUP = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _dirs(controller: str) -> list[Path]:
    """This process's cgroup directories of ``controller`` (cgroup v1's name; "" for v2), its
    own first, then each parent up to the mount. In a container the mount is often the
    container's own cgroup while the path names it from the host's root: the mount remains."""
    for line in _text(PROC_CGROUP).splitlines():
        _, names, path = line.split(":", 2)
        if (controller in names.split(",")) if controller else not names:
            mount = CGROUP / controller if controller else CGROUP
            own = Path(path.lstrip("/"))
            return [mount / d for d in (own, *own.parents) if (mount / d).is_dir()]
    return []


def cpus() -> float:
    """The CPUs this process may use at once: the cores it may run on, at most its quota."""
    limit = float(len(os.sched_getaffinity(0)))
    for d in _dirs(""):  # cgroup v2: "max 100000" or "<quota> <period>"
        quota, _, period = _text(d / "cpu.max").partition(" ")
        if quota.isdigit() and period.isdigit() and int(period) > 0:
            limit = min(limit, int(quota) / int(period))
    for d in _dirs("cpu"):  # cgroup v1: a quota of -1 is none
        quota, period = _text(d / "cpu.cfs_quota_us"), _text(d / "cpu.cfs_period_us")
        if quota.isdigit() and period.isdigit() and int(period) > 0:
            limit = min(limit, int(quota) / int(period))
    return limit


def memory_bytes() -> int | None:
    """The least memory limit of this process's cgroups, or None where none is set."""
    limits = [_text(d / "memory.max") for d in _dirs("")]  # v2: "max" where none
    limits += [_text(d / "memory.limit_in_bytes") for d in _dirs("memory")]  # v1
    # v1 says "none" with the largest multiple of the page size below 2**63.
    return min((int(t) for t in limits if t.isdigit() and int(t) < 1 << 62), default=None)
