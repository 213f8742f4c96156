"""Real HTTP servers the orchestrator tests talk to, each run by uvicorn in a thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException


class ServerThread:
    """Serve an ASGI app on 127.0.0.1:<free port> until ``stop``."""

    def __init__(self, app: Any):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.sock.close()


def leaderboard_app(token: str) -> FastAPI:
    """The slice of the leaderboard API the orchestrator and the stand-in pod use.

    Keeps the best score and the total env steps per experiment, as the real leaderboard
    reports them (``/best``, the experiment summary's ``env_steps``).
    """

    def auth(authorization: str = Header(default="")) -> None:
        if authorization != f"Bearer {token}":
            raise HTTPException(401)

    app = FastAPI(dependencies=[Depends(auth)])
    app.state.configs = {}
    app.state.best = {}
    app.state.steps = {}
    app.state.submissions = {}

    @app.put("/api/v1/experiments/{exp_id}")
    def put(exp_id: str, config: dict[str, Any]) -> dict[str, Any]:
        app.state.configs[exp_id] = config
        app.state.steps.setdefault(exp_id, 0)
        return {"experiment_id": exp_id, **config}

    @app.post("/api/v1/experiments/{exp_id}/submissions")
    def submit(exp_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if exp_id not in app.state.configs:
            raise HTTPException(404)
        app.state.submissions.setdefault(exp_id, []).append(body)
        app.state.steps[exp_id] += int(body.get("env_steps", 0))
        best = app.state.best.get(exp_id)
        if best is None or body["score"] > best["score"]:
            n = len(app.state.submissions[exp_id])
            app.state.best[exp_id] = {
                "candidate_id": f"c{n}",
                "score": body["score"],
                "pod_id": body["pod_id"],
            }
        return {"accepted": True}

    @app.get("/api/v1/experiments/{exp_id}/best")
    def best(exp_id: str) -> dict[str, Any]:
        if exp_id not in app.state.best:
            raise HTTPException(404)
        return app.state.best[exp_id]

    @app.get("/api/v1/experiments/{exp_id}")
    def summary(exp_id: str) -> dict[str, Any]:
        if exp_id not in app.state.configs:
            raise HTTPException(404)
        return {"experiment_id": exp_id, "env_steps": app.state.steps[exp_id]}

    @app.delete("/api/v1/experiments/{exp_id}")
    def delete(exp_id: str) -> dict[str, Any]:
        if app.state.configs.pop(exp_id, None) is None:
            raise HTTPException(404)
        return {"deleted": True}

    return app
