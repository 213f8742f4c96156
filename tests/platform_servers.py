"""The embedded platform (`podium up`: both services over real HTTP on 127.0.0.1, an embedded
Redis) with the stand-in pod as the local backend's pod command, so experiments run fast."""

from __future__ import annotations

import sys
from pathlib import Path

from services.cli.platform import Platform
from tests.orchestrator.conftest import STANDIN

STANDIN_OVERRIDES = {
    "pod_command": [sys.executable, STANDIN, "{experiment_id}", "{pod_id}"],
    "reconcile_interval_s": 0.2,
    "termination_grace_s": 2.0,
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.4,
    "capacity_cpu": 2,
    "capacity_gpus": 0,
    "capacity_memory": "16Gi",
}


def standin_platform(data_dir: Path) -> Platform:
    """Unstarted; use as a context manager (stops every pod, both services and Redis)."""
    return Platform(
        data_dir=data_dir,
        orchestrator_port=0,
        leaderboard_port=0,
        orchestrator_overrides=STANDIN_OVERRIDES,
    )
