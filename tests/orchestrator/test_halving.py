"""Successive halving across pods (spec ``population.halving``): the real orchestrator and
leaderboard, stand-in pods whose scores differ by pod (tests/orchestrator/standin_pod.py)."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from services.contracts.spec import ExperimentSpec, halving_pods
from tests.orchestrator.conftest import LB_TOKEN, create, live_pods, spec, wait_for

API = "/api/v1/experiments"


def _scores(leaderboard, exp_id: str) -> dict[str, float]:
    """Each pod's last reported score, from the leaderboard's submission log."""
    url = f"{leaderboard.url}/api/v1/experiments/{exp_id}/submissions"
    r = httpx.get(url, headers={"Authorization": f"Bearer {LB_TOKEN}"})
    assert r.status_code == 200, r.text
    return {s["pod_id"]: s["score"] for s in r.json()["submissions"]}


def test_each_rung_stops_the_pods_with_the_worse_scores_and_runs_fewer(
    client: TestClient, leaderboard
) -> None:
    budget = 40_000
    body = spec(
        population={"min_pods": 4, "max_pods": 4, "halving": {"rung_env_steps": 2_000}},
        resources={"cpu": 1},
        budget={"total_env_steps": budget},
        standin={"report_interval_s": 0.1, "env_steps_per_report": 250, "score_by_pod": 100.0},
    )
    exp_id = create(client, body)
    exp = wait_for(lambda: (e := client.get(f"{API}/{exp_id}").json())["result"] and e, 60)
    assert exp["state"] == "budget_exhausted", exp
    wait_for(lambda: not live_pods(client.app.state.settings.data_dir, exp_id))
    events = client.get(f"{API}/{exp_id}/events", params={"limit": 1000}).json()
    scaled = [e["message"] for e in events if e["type"] == "scaled"]
    # 4 pods, then the best 2 at 8,000 env steps counted, then the best one at 16,000 (a
    # reconciler slower than the reports may see both rungs in one pass: 4 -> 1).
    wanted = [int(m.split(" (")[0].split(" -> ")[1]) for m in scaled]
    assert wanted in ([4, 2, 1], [4, 1]), scaled
    assert all("successive halving" in m for m in scaled[1:]), scaled
    scores = _scores(leaderboard, exp_id)
    started = [e["pod_id"] for e in events if e["type"] == "pod_started"]
    stopped = [e["pod_id"] for e in events if e["type"] == "pod_scaled_in"]
    # The three worst of the first four, worst first (each rung stops its worst first); the
    # best trains on.
    ranked = sorted(started[:4], key=scores.__getitem__)
    assert stopped == ranked[:3], (ranked, stopped, scores)
    stops = [e["message"] for e in events if e["type"] == "pod_scaled_in"]
    assert all(m.startswith("pod stopped by successive halving: last score") for m in stops)
    # Past the last rung one pod trains at a time: a pod starts only once the one before has
    # ended (its allowance spent) or been stopped.
    last_rung = max(i for i, e in enumerate(events) if e["type"] == "scaled")
    active: set[str] = set()
    for i, e in enumerate(events):
        if e["type"] == "pod_started":
            assert i < last_rung or not active, (e, active)
            active.add(e["pod_id"])
        elif e["type"] in ("pod_scaled_in", "pod_completed", "pod_stopped", "pod_failed"):
            active.discard(e["pod_id"])
    assert len(started) > 4  # the best's allowance (a quarter of the budget) ran out
    board = httpx.get(
        f"{leaderboard.url}/api/v1/experiments/{exp_id}",
        headers={"Authorization": f"Bearer {LB_TOKEN}"},
    ).json()
    assert board["env_steps"] <= budget


@pytest.mark.parametrize(
    ("population", "budget", "error"),
    [
        ({"max_pods": 1, "halving": {"rung_env_steps": 10}}, None, "halving needs max_pods >= eta"),
        (
            {"max_pods": 4, "agents_per_pod": 2, "halving": {"rung_env_steps": 1_000}},
            8_000,
            "its first rung comes at 8,000 env steps counted",
        ),
        ({"max_pods": 4, "halving": {"rung_env_steps": 10, "eta": 1}}, None, "eta"),
    ],
)
def test_halving_that_could_never_stop_a_pod_is_refused_at_submission(
    client: TestClient, population: dict, budget: int | None, error: str
) -> None:
    body = spec(population=population)
    if budget is not None:
        body["budget"] = {"total_env_steps": budget}
    r = client.post(API, json=body)
    assert r.status_code == 422, r.text
    assert error in r.text


def test_the_pods_kept_fall_by_eta_at_each_rung_down_to_one() -> None:
    s = ExperimentSpec.model_validate(
        spec(population={"max_pods": 10, "halving": {"rung_env_steps": 100, "eta": 3}})
    )
    rung = 10 * 100
    kept = [halving_pods(s.population, n) for n in (None, rung - 1, rung, 2 * rung, 3 * rung)]
    assert kept == [10, 10, 4, 2, 1]
    assert halving_pods(s.population, 10**12) == 1
    plain = ExperimentSpec.model_validate(spec())
    assert halving_pods(plain.population, 10**6) is None


def test_a_population_pod_is_ranked_by_its_best_agents_last_score() -> None:
    import threading

    from services.orchestrator.leaderboard_client import Progress, Reports
    from services.orchestrator.progress_calls import ProgressCalls, make_breaker

    class Log:
        """The submission log's answer: agents of pod p1 and pod p2 (two reports of m0)."""

        def progress(self, experiment_id: str) -> Progress:
            return Progress(env_steps=10)

        def reporters(self, experiment_id: str, after: str | None) -> Reports:
            scores = {"p1.m0": 5.0, "p1.m1": 9.0, "p2.m0": 7.0, "p3": 1.0}
            return Reports(dict.fromkeys(scores, 1), scores, "c")

    woken = threading.Event()
    calls = ProgressCalls(Log(), 1, make_breaker(3, 3.0), woken.set)  # type: ignore[arg-type]
    try:
        calls.progress("e", 0.0, read_log=True)
        wait_for(lambda: woken.is_set())
        assert calls.pod_scores("e", ["p1", "p2", "p4"]) == {"p1": 9.0, "p2": 7.0}
        assert calls.pod_scores("e", ["p1", "p3"], higher_is_better=False) == {"p1": 5.0, "p3": 1.0}
    finally:
        calls.close()
