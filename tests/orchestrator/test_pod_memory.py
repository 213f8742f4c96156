"""The embedded platform holds each pod to its spec's memory and tells an OOM kill from a kill
from outside (services/orchestrator/backends/memory.py).

Real pods (the default pod command: forks of the pod launcher) on the embedded platform (both
services over HTTP, an embedded Redis). A CartPole DQN pod allowed 80 MiB goes over as it builds
its trainer (its replay of 4M transitions alone fills about 180 MB, whatever the pods share with
the launcher they were forked from): before, the local backend recorded the limit and applied
none (under a memory cgroup of the spec's size, the kernel's OOM kills were taken for kills
from outside: 54 pods in 120 s, the experiment ended only by wall time). Now it fails after the
crash-loop limit, saying why; a pod SIGKILLed from outside is still replaced without counting
as a crash.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.cli.platform import Platform
from services.orchestrator.backends.memory import CgroupLimit, _cgroup_limit
from tests.e2e.conftest import live_pods, wait_for

pytestmark = pytest.mark.slow

CRASH_LOOP_LIMIT = 3
FAST = {
    "reconcile_interval_s": 0.2,
    "termination_grace_s": 5.0,
    "backoff_initial_s": 0.1,
    "backoff_max_s": 0.5,
    "crash_loop_limit": CRASH_LOOP_LIMIT,
    "capacity_cpu": 4,
    "capacity_gpus": 0,
    "capacity_memory": "64Gi",
}
HAS_CGROUP = isinstance(_cgroup_limit(), CgroupLimit)


def spec(name: str, memory: str, buffer_size: int = 10_000) -> dict[str, Any]:
    return {
        "name": name,
        "env": {"name": "CartPole-v1"},
        "algorithms": {"dqn": 1.0},
        "search_space": {
            "learning_rate": {"type": "log_uniform", "low": 1e-4, "high": 1e-3},
            "buffer_size": {"type": "choice", "values": [buffer_size]},
        },
        "population": {"min_pods": 1, "max_pods": 1},
        "resources": {"cpu": 1, "gpus": 0, "memory": memory},
        "round": {"env_steps": 2048},
        "budget": {"wall_time_s": 300},
    }


@pytest.fixture(
    params=[
        pytest.param(
            "auto",
            marks=pytest.mark.skipif(not HAS_CGROUP, reason="no memory cgroup can be made here"),
        ),
        "watch",
    ]
)
def platform(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Platform]:
    mode = {} if request.param == "auto" else {"pod_memory_limit": request.param}
    with Platform(
        data_dir=tmp_path / "data",
        orchestrator_port=0,
        leaderboard_port=0,
        orchestrator_overrides={**FAST, **mode},
    ) as p:
        yield p


def _api(platform: Platform) -> httpx.Client:
    return httpx.Client(
        base_url=f"{platform.orchestrator_url}/api/v1",
        headers={"Authorization": f"Bearer {platform.token}"},
        timeout=30,
    )


def test_pods_over_their_memory_limit_fail_the_experiment_and_outside_kills_do_not(
    platform: Platform,
) -> None:
    with _api(platform) as api:
        hungry_spec = spec("too-little-memory", "80Mi", buffer_size=4_000_000)
        hungry = api.post("/experiments", json=hungry_spec).json()["id"]
        ample = api.post("/experiments", json=spec("killed-from-outside", "4Gi")).json()["id"]

        def experiment(exp_id: str) -> dict[str, Any]:
            return api.get(f"/experiments/{exp_id}").json()

        # The one with room: a pod killed from outside (as by a person, or the machine's own
        # OOM killer) is replaced, and not counted as a crash.
        data = Path(platform.data_dir)
        pods = wait_for(lambda: live_pods(data, ample), timeout=120)
        os.killpg(next(iter(pods.values())), signal.SIGKILL)

        exp = wait_for(
            lambda: (e := experiment(hungry))["state"] not in ("pending", "running") and e,
            timeout=480,  # each of its pods imports torch first: minutes on a busy machine
        )
        assert exp["state"] == "failed", exp
        assert "pods keep crashing" in exp["reason"] and "OOMKilled" in exp["reason"], exp
        assert exp["progress"]["pods_launched"] == CRASH_LOOP_LIMIT, exp

        failed = wait_for(
            lambda: [
                e["message"]
                for e in api.get(f"/experiments/{ample}/events").json()
                if e["type"] == "pod_failed"
            ],
            timeout=30,
        )
        assert "killed by SIGKILL" in failed[0] and "OOMKilled" not in failed[0], failed
        assert "not counted as a crash: killed by SIGKILL from outside" in failed[0], failed
        assert experiment(ample)["state"] == "running"
        # The records say so too (the backend's own view, as `podium logs` shows it).
        for path in (data / "experiments" / hungry / "pods").glob("*.json"):
            record = json.loads(path.read_text())
            assert record["oom_killed"] is True and "OOMKilled" in record["reason"], record
        api.post(f"/experiments/{ample}/cancel")
