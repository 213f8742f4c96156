"""What of the machine a process may use: cgroup CPU quotas and memory limits, as the kernel
lays them out (v2 nested under a Kubernetes pod, v1 inside a Docker container), and a real
quota where this machine lets a test set one."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from services import machine

CORES = len(os.sched_getaffinity(0))


LAYOUTS = {
    # A Kubernetes container on cgroup v2: the pod's cgroup holds the quota, the container's
    # says "max"; the least limit on the path up applies.
    "v2-kubernetes": (
        "0::/kubepods/pod1/ctr\n",
        {
            "cgroup.controllers": "cpu memory",
            "cpu.max": "max 100000",
            "kubepods/pod1/cpu.max": "50000 100000",
            "kubepods/pod1/ctr/cpu.max": "max 100000",
            "kubepods/pod1/memory.max": "max",
            "kubepods/pod1/ctr/memory.max": "1073741824",
        },
        min(CORES, 0.5),
        1 << 30,
    ),
    # Docker on cgroup v1: the path names the container from the host's root, but the mount is
    # the container's own cgroup.
    "v1-docker": (
        "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n",
        {
            "cpu/cpu.cfs_quota_us": "150000",
            "cpu/cpu.cfs_period_us": "100000",
            "memory/memory.limit_in_bytes": "536870912",
        },
        min(CORES, 1.5),
        512 << 20,
    ),
    # No limit: v1's quota -1 and its largest memory "limit", v2's "max".
    "none": (
        "4:memory:/\n3:cpu:/\n0::/user.slice\n",
        {
            "cpu/cpu.cfs_quota_us": "-1",
            "cpu/cpu.cfs_period_us": "100000",
            "cpu.max": "max",
            "memory/memory.limit_in_bytes": "9223372036854771712",
        },
        CORES,
        None,
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_cgroup_limits_as_the_kernel_lays_them_out(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc, files, cpus, memory = LAYOUTS[layout]
    monkeypatch.setattr(machine, "CGROUP", tmp_path / "cgroup")
    monkeypatch.setattr(machine, "PROC_CGROUP", tmp_path / "proc-self-cgroup")
    (tmp_path / "proc-self-cgroup").write_text(proc)
    for name, text in files.items():
        path = tmp_path / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    assert machine.cpus() == cpus
    assert machine.memory_bytes() == memory


def test_the_local_backends_capacity_and_envpools_threads_follow_the_quota(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.orchestrator.settings import OrchestratorSettings

    monkeypatch.setattr(machine, "cpus", lambda: 0.5)
    monkeypatch.setattr(machine, "memory_bytes", lambda: 256 << 20)
    cpu, _, memory = OrchestratorSettings().local_capacity()
    assert (cpu, memory) == (0.5, 256 << 20)
    pytest.importorskip("envpool")
    from services.pod.envs.envpool_adapter import EnvPoolVecEnv

    assert EnvPoolVecEnv("HalfCheetah-v5", num_envs=8)._num_threads == 1


def _v1_cpu_controller() -> Path | None:
    root = Path("/sys/fs/cgroup/cpu")
    ok = os.geteuid() == 0 and (root / "cpu.cfs_quota_us").exists() and os.access(root, os.W_OK)
    return root if ok else None


@pytest.mark.skipif(_v1_cpu_controller() is None, reason="needs root and cgroup v1's cpu mount")
def test_a_real_quota_is_read_by_a_process_inside_it() -> None:
    group = _v1_cpu_controller() / f"podium-test-{uuid.uuid4().hex[:8]}"  # type: ignore[operator]
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")
        code = (
            f"open('{group}/cgroup.procs', 'w').write('0'); "
            "from services import machine; print(machine.cpus())"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        )
        assert float(out.stdout) == min(CORES, 0.5)
    finally:
        group.rmdir()
