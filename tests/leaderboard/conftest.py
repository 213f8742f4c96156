"""Fixtures: the real leaderboard app on a real embedded Redis under a temp data dir."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient

from services.leaderboard.app import create_app
from services.leaderboard.settings import LeaderboardSettings

TOKEN = "test-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

SPACE = {
    "lr": {"type": "log_uniform", "low": 1e-5, "high": 1e-2},
    "gamma": {"type": "uniform", "low": 0.9, "high": 0.999},
    "batch_size": {"type": "choice", "values": [32, 64, 128, 256]},
    "epochs": {"type": "int_uniform", "low": 1, "high": 10},
}


def settings_for(data_dir: Path, **kw: Any) -> LeaderboardSettings:
    return LeaderboardSettings(
        data_dir=data_dir, api_token=TOKEN, gc_interval_s=3600, gc_grace_s=0, **kw
    )


def experiment(top_k: int = 4, strategy: str = "pbt", **kw: Any) -> dict[str, Any]:
    return {
        "top_k": top_k,
        "generator": {"strategy": strategy, "options": kw.pop("options", {})},
        "algorithms": kw.pop("algorithms", {"ppo": 1.0}),
        "search_space": kw.pop("search_space", SPACE),
        **kw,
    }


def result(sid: str, score: float, files: dict[str, bytes] | None = None, **kw: Any) -> dict:
    return {
        "submission_id": sid,
        "pod_id": kw.pop("pod_id", "pod-0"),
        "algorithm": kw.pop("algorithm", "ppo"),
        "hyperparameters": kw.pop(
            "hyperparameters", {"lr": 1e-3, "gamma": 0.99, "batch_size": 64, "epochs": 4}
        ),
        "parent_id": kw.pop("parent_id", None),
        "generation": kw.pop("generation", 0),
        "env_steps": kw.pop("env_steps", 1000),
        "score": score,
        "eval": {"mean": score, "std": 1.0, "episodes": 8},
        "files": {n: hashlib.sha256(b).hexdigest() for n, b in (files or {}).items()},
        **kw,
    }


def multipart(res: dict, files: dict[str, bytes]) -> dict[str, Any]:
    parts: dict[str, Any] = {"result": (None, json.dumps(res), "application/json")}
    for name, data in files.items():
        parts[name] = (name, data, "application/octet-stream")
    return parts


@pytest.fixture
def lb_settings(tmp_path: Path) -> LeaderboardSettings:
    return settings_for(tmp_path / "data")


@pytest.fixture
def client(lb_settings: LeaderboardSettings) -> Iterator[TestClient]:
    with TestClient(create_app(lb_settings), headers=AUTH) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    """uvicorn serving the app on loopback in a background thread."""

    def __init__(self, settings: LeaderboardSettings):
        self.app = create_app(settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
