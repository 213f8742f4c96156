"""A leaderboard that is down or gone does not make the reconcile loop spin.

Passes are counted while the real leaderboard is stopped (its port closed: calls are refused
at once, then an open circuit breaker answers them at once), after it comes back on the same
port, and with a leaderboard URL nothing ever listens on (experiments cannot register). A
loop that spins runs thousands of passes a second: a failed call woke it and the next pass
asked again at once. A healthy loop's own rate depends on the pods' reports and the machine
(23-53 passes in 3 s were seen on a busy 2-core machine), so the outage's passes are compared
with the healthy rate measured in the same test, not with a fixed count.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from services.leaderboard.app import create_app as create_leaderboard_app
from services.leaderboard.settings import LeaderboardSettings
from services.orchestrator.app import create_app
from services.orchestrator.settings import OrchestratorSettings
from tests.orchestrator.conftest import LB_TOKEN, TOKEN, live_pods, spec, wait_for
from tests.orchestrator.servers import ServerThread

API = "/api/v1/experiments"
#: Timed passes every 0.5 s, so an idle loop runs ~6 in 3 s; a spinning one runs thousands.
INTERVAL_S = 0.5
WINDOW_S = 3.0
MAX_PASSES = 30  # with no pod running: timed passes and the leaderboard's answers only
#: Passes during and after an outage, at most this many times the healthy loop's.
MAX_RATIO = 4.0


def _not_spinning(passes: int, healthy: int) -> bool:
    # A floor of the idle loop's own passes: a healthy count can be small on a quiet machine.
    return passes <= MAX_RATIO * max(healthy, MAX_PASSES / MAX_RATIO)


def _passes_in(client: TestClient, seconds: float) -> int:
    rec = client.app.state.reconciler
    before = rec.passes
    time.sleep(seconds)
    return rec.passes - before


def _experiments(client: TestClient, n: int) -> list[str]:
    body = {
        "population": {"min_pods": 1, "max_pods": 1},
        "standin": {"report_interval_s": 0.2, "score_step": 1.0},
    }
    return [client.post(API, json=spec(f"e{i}", **body)).json()["id"] for i in range(n)]


def test_a_stopped_leaderboard_does_not_make_the_loop_spin(
    make_settings: Callable[..., OrchestratorSettings],
    flush_redis: None,
    tmp_path: Path,
    redis_url: str,
) -> None:
    lb_settings = LeaderboardSettings(
        data_dir=tmp_path / "lb", redis_url=redis_url, api_token=LB_TOKEN
    )
    board = ServerThread(create_leaderboard_app(lb_settings)).__enter__()
    port = board.port
    settings = make_settings(
        capacity_cpu=8,
        reconcile_interval_s=INTERVAL_S,
        leaderboard_url=board.url,
        leaderboard_breaker_reset_s=1.0,
    )
    try:
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = f"Bearer {TOKEN}"
            ids = _experiments(client, 8)
            d = Path(settings.data_dir)
            wait_for(lambda: all(len(live_pods(d, i)) == 1 for i in ids), timeout=60)
            wait_for(lambda: all(client.get(f"{API}/{i}").json()["best_score"] for i in ids))
            healthy = _passes_in(client, WINDOW_S)

            board.__exit__(None, None, None)  # the leaderboard is gone
            down = _passes_in(client, WINDOW_S)
            assert _not_spinning(down, healthy), f"{down} passes down, {healthy} healthy"
            assert client.app.state.reconciler.last_error is None

            board = ServerThread(create_leaderboard_app(lb_settings), port=port).__enter__()
            # Back: progress is read again (the pods report again: the scores go up) ...
            scores = {i: client.get(f"{API}/{i}").json()["best_score"] for i in ids}
            wait_for(
                lambda: all(client.get(f"{API}/{i}").json()["best_score"] > scores[i] for i in ids),
                timeout=30,
            )
            # ... and the loop is idle again.
            back = _passes_in(client, WINDOW_S)
            assert _not_spinning(back, healthy), f"{back} passes back, {healthy} healthy"
            print(f"passes in {WINDOW_S}s: healthy {healthy}, down {down}, back {back}")
    finally:
        board.__exit__(None, None, None)


def test_an_unreachable_leaderboard_does_not_make_the_loop_spin(
    make_settings: Callable[..., OrchestratorSettings], flush_redis: None
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    settings = make_settings(
        capacity_cpu=8,
        reconcile_interval_s=INTERVAL_S,
        leaderboard_url=url,
        leaderboard_breaker_reset_s=1.0,
    )
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        ids = _experiments(client, 8)
        wait_for(
            lambda: all(
                "leaderboard unavailable" in (client.get(f"{API}/{i}").json()["reason"] or "")
                for i in ids
            )
        )
        passes = _passes_in(client, WINDOW_S)
        assert passes <= MAX_PASSES, f"{passes} passes in {WINDOW_S}s"
        # Still asking (backing off, not given up): the reason stays the leaderboard's.
        exp = client.get(f"{API}/{ids[0]}").json()
        assert exp["state"] == "pending" and "leaderboard unavailable" in exp["reason"]
