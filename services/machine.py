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


def own_cgroup(controller: str) -> tuple[Path, Path, bool] | None:
    """This process's cgroup directory of ``controller``, the mount of its hierarchy, and
    whether that hierarchy is v2: cgroup v1's own hierarchy of the controller where one is
    mounted, else the unified one (v2; under ``unified/`` on a hybrid host). None: neither."""
    lines = _text(PROC_CGROUP).splitlines()
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return CGROUP / controller / path.lstrip("/"), CGROUP / controller, False
    for line in lines:
        if line.startswith("0::"):
            for mount in (CGROUP / "unified", CGROUP):
                if (mount / "cgroup.controllers").exists():
                    return mount / line[3:].lstrip("/"), mount, True
    return None


def _dirs(controller: str) -> list[Path]:
    """This process's cgroup directories of ``controller``, its own first, then each parent up
    to the mount. In a container the mount is often the container's own cgroup while the path
    names it from the host's root: the mount remains."""
    found = own_cgroup(controller)
    if found is None:
        return []
    own, mount, _ = found
    path = own.relative_to(mount)
    return [mount / d for d in (path, *path.parents) if (mount / d).is_dir()]


def cpus() -> float:
    """The CPUs this process may use at once: the cores it may run on, at most its quota."""
    pairs = []
    for d in _dirs("cpu"):  # v2: "max 100000" or "<quota> <period>"; v1: a quota of -1 is none
        pairs.append(_text(d / "cpu.max").partition(" ")[::2])
        pairs.append((_text(d / "cpu.cfs_quota_us"), _text(d / "cpu.cfs_period_us")))
    quotas = [int(q) / int(p) for q, p in pairs if q.isdigit() and p.isdigit() and int(p) > 0]
    return min([float(len(os.sched_getaffinity(0))), *quotas])


def memory_bytes() -> int | None:
    """The least memory limit of this process's cgroups, or None where none is set."""
    # v2 says "max" where none; v1 the largest multiple of the page size below 2**63.
    names = ("memory.max", "memory.limit_in_bytes")
    limits = [_text(d / name) for d in _dirs("memory") for name in names]
    return min((int(t) for t in limits if t.isdigit() and int(t) < 1 << 62), default=None)
