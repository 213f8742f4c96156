"""Env-step budgets with real pods, whose batch the orchestrator learns only from their reports.

Real orchestrator, leaderboard, Redis and pod processes, the orchestrator's default progress
poll (2 s): three Pendulum PPO pods (128 envs x 16 steps: batches of 2,048 env steps) with
budgets their batches do not divide. Each pod reports once, when its allowance is spent, so
pods end often and close together; the batch must still reach the allowances. It did not: the
count asked for after a pod ended never read the submission log, and it refreshed the progress
that the periodic read would have, so every allowance was computed without the batch (budget
40,960: 30 pods in 30 s, 27 of them given 1,365 env steps, less than a batch, each trained
nothing and was replaced).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import Service, live_pods, pod_log, reports, wait_for

pytestmark = pytest.mark.slow

PODS, BATCH = 3, 128 * 16
SPENT = "the experiment's env-step budget is spent"  # a pod's log line, with its allowance


def spec(budget: int) -> dict:
    return {
        "name": f"pendulum-budget-{budget}",
        "env": {"name": "Pendulum-v1"},
        "algorithms": {"ppo": 1.0},
        "search_space": {
            "learning_rate": {"type": "log_uniform", "low": 3e-4, "high": 3e-3},
            "compile": {"type": "choice", "values": ["off"]},
        },
        "population": {"min_pods": PODS, "max_pods": PODS},
        "resources": {"cpu": 1, "gpus": 0, "memory": "2Gi"},
        "round": {"env_steps": 16384},  # longer than any allowance: one report per pod
        "evaluation": {"episodes": 5},
        "budget": {"total_env_steps": budget, "wall_time_s": 300},
    }


@pytest.mark.parametrize("budget", [8_192, 20_000, 40_960])
def test_a_budget_the_batches_do_not_divide_ends_without_churning_pods(
    make_orchestrator: Callable[..., Service], tmp_path: Path, budget: int
) -> None:
    orch = make_orchestrator(PODIUM_PROGRESS_POLL_S="2", PODIUM_CAPACITY_CPU=str(PODS))
    data = tmp_path / "orchestrator"
    r = orch.http.post("/experiments", json=spec(budget))
    assert r.status_code == 201, r.text
    exp_id = r.json()["id"]

    def experiment() -> dict:
        return orch.http.get(f"/experiments/{exp_id}").json()

    # Ended, or churning pods (then the count below says how many).
    wait_for(
        lambda: (e := experiment())["result"] or e["progress"]["pods_launched"] > 2 * PODS,
        timeout=240,
    )
    exp = experiment()
    # What a failure shows (its captured output): each pod's start, allowance, reports and end.
    print(orch.http.get(f"/experiments/{exp_id}/events", params={"limit": 1000}).json())
    for path in sorted((data / "experiments" / exp_id / "pods").glob("*.log")):
        print(path.stem, [line for line in pod_log(data, exp_id, path.stem) if line.get("event")
                          in {"pod starting", "reported", "pod stopped", SPENT}])  # fmt: skip
    # The batches left after the first pods go to at most two more: one pod when they are fewer
    # than the pods to start, else one each (two of 40,960's three pods ending in the same pass
    # leave two batches for two slots; all three, two batches for one pod).
    assert exp["progress"]["pods_launched"] <= PODS + 2, exp
    wait_for(lambda: not live_pods(data, exp_id), timeout=60)
    exp = experiment()
    assert exp["progress"]["pods_launched"] <= PODS + 2, exp
    assert exp["state"] == "budget_exhausted", exp
    trained: dict[str, int] = defaultdict(int)
    for report in reports(data, exp_id):
        trained[report["pod"]] += report["env_steps"]
    started = {
        e["pod_id"]
        for e in orch.http.get(f"/experiments/{exp_id}/events", params={"limit": 1000}).json()
        if e["type"] in ("pod_started", "pod_replaced")
    }
    assert started and all(trained[p] >= BATCH for p in started), dict(trained)
    # What is left below a batch is all that is left untrained.
    assert 0 <= budget - sum(trained.values()) < BATCH, dict(trained)
