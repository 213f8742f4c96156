"""Both services as real HTTP servers (uvicorn on 127.0.0.1) on one Redis, the orchestrator's
local backend starting the stand-in pod: what the HTTP hardening and schemathesis tests hit."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from services.leaderboard.app import create_app as create_leaderboard_app
from services.leaderboard.settings import LeaderboardSettings
from services.orchestrator.app import create_app as create_orchestrator_app
from services.orchestrator.settings import OrchestratorSettings
from tests.orchestrator.conftest import LB_TOKEN, STANDIN, TOKEN, kill_all
from tests.orchestrator.servers import ServerThread


@dataclass
class Platform:
    orchestrator: ServerThread
    leaderboard: ServerThread

    @property
    def orchestrator_auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}

    @property
    def leaderboard_auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {LB_TOKEN}"}


@contextlib.contextmanager
def platform(data_dir: Path, redis_url: str, **orchestrator: Any) -> Iterator[Platform]:
    """Both services on a flushed Redis; every stand-in pod is killed on the way out."""
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    r.close()
    lb = LeaderboardSettings(
        data_dir=data_dir / "leaderboard", redis_url=redis_url, api_token=LB_TOKEN
    )
    with ServerThread(create_leaderboard_app(lb)) as lb_server:
        values: dict[str, Any] = {
            "data_dir": data_dir / "orchestrator",
            "redis_url": redis_url,
            "api_token": TOKEN,
            "backend": "local",
            "capacity_cpu": 2,
            "capacity_gpus": 0,
            "capacity_memory": "16Gi",
            "reconcile_interval_s": 0.2,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.4,
            "termination_grace_s": 2,
            "leaderboard_url": lb_server.url,
            "leaderboard_token": LB_TOKEN,
            "pod_command": [sys.executable, STANDIN, "{experiment_id}", "{pod_id}"],
            **orchestrator,
        }
        try:
            with ServerThread(create_orchestrator_app(OrchestratorSettings(**values))) as orch:
                yield Platform(orchestrator=orch, leaderboard=lb_server)
        finally:
            kill_all(data_dir / "orchestrator")
