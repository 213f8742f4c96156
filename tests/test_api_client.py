"""The one leaderboard client's retry policy and typing, against real HTTP: a server that fails
on purpose (a leaderboard restarting answers 503) in front of answers the leaderboard's own
models describe."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.api_client import LeaderboardClient, LeaderboardError, ServiceClient, ServiceError
from services.contracts.leaderboard import Manifest
from tests.orchestrator.servers import ServerThread

MANIFEST = Manifest(
    experiment_id="e",
    pod_id="p",
    algorithm="ppo",
    hyperparameters={"learning_rate": 1e-3},
    parent_id=None,
    generation=0,
    checkpoint="fresh",
    decision="fresh",
    strategy="pbt",
).model_dump(mode="json")


class Flaky:
    """Answers ``failures`` times with ``status`` before ``body``; records every request."""

    def __init__(self) -> None:
        self.failures, self.status, self.body = 0, 503, MANIFEST
        self.seen: list[dict[str, Any]] = []
        self.app = FastAPI()

        @self.app.post("/api/v1/experiments/{exp}/generate")
        async def generate(exp: str, request: Request) -> JSONResponse:
            self.seen.append(
                {"auth": request.headers.get("authorization"), "body": await request.json()}
            )
            if len(self.seen) <= self.failures:
                return JSONResponse({"detail": "restarting"}, status_code=self.status)
            return JSONResponse(self.body)


@pytest.fixture
def flaky() -> Iterator[tuple[Flaky, str]]:
    server = Flaky()
    with ServerThread(server.app) as srv:
        yield server, srv.url


def client(url: str, **kw: Any) -> LeaderboardClient:
    return LeaderboardClient(url, "e", "tok", initial_backoff_s=0.01, max_backoff_s=0.05, **kw)


def test_5xx_and_429_are_retried_until_the_answer_comes(flaky: tuple[Flaky, str]) -> None:
    server, url = flaky
    server.failures = 3
    for status in (503, 429):
        server.seen.clear()
        server.status = status
        with client(url) as c:
            manifest = c.generate("p", algorithm="ppo", score=float("nan"))
            assert isinstance(manifest, Manifest) and manifest.decision == "fresh"
            assert c.retries == 3 and len(server.seen) == 4
    # One bearer header, and the request body is the leaderboard's GenerateRequest (a score
    # that is not finite is not sent).
    assert {s["auth"] for s in server.seen} == {"Bearer tok"}
    assert server.seen[-1]["body"] == {"pod_id": "p", "algorithm": "ppo"}


def test_a_4xx_is_never_retried(flaky: tuple[Flaky, str]) -> None:
    server, url = flaky
    server.failures, server.status = 5, 409
    with client(url) as c, pytest.raises(LeaderboardError, match="HTTP 409") as info:
        c.generate("p")
    assert info.value.status == 409 and info.value.detail == "restarting"
    assert len(server.seen) == 1 and c.retries == 0


def test_retries_stop_at_the_deadline_or_after_retry_for_s(flaky: tuple[Flaky, str]) -> None:
    server, url = flaky
    server.failures = 10**6
    with client(url, retry_for_s=0) as c, pytest.raises(LeaderboardError) as info:
        c.generate("p")  # the orchestrator's policy: one attempt, the next pass asks again
    assert info.value.status == 503 and len(server.seen) == 1
    server.seen.clear()
    with client(url) as c:
        c.deadline = time.monotonic() + 0.3  # a pod told to stop
        with pytest.raises(LeaderboardError) as info:
            c.generate("p")
    assert info.value.status == 503 and 1 < len(server.seen) == c.retries + 1


def test_an_unreachable_service_is_an_error_without_status() -> None:
    c = ServiceClient("http://127.0.0.1:9", retry_for_s=0.05, initial_backoff_s=0.01)
    with c, pytest.raises(ServiceError, match="cannot reach the service") as info:
        c.json("GET", "/experiments")
    assert info.value.status is None and info.value.detail == "connection refused"


def test_an_answer_the_model_does_not_describe_is_an_error(flaky: tuple[Flaky, str]) -> None:
    server, url = flaky
    server.body = {**MANIFEST, "checkpoint": "fresh", "parent_id": "c1"}  # inconsistent
    with client(url) as c, pytest.raises(LeaderboardError, match="unexpected Manifest"):
        c.generate("p")
