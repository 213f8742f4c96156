"""The tournament end to end: real orchestrator, leaderboard, Redis and pod processes.

CartPole tournaments with small rounds (the preset solves CartPole in ~12k env steps):
reaching the target stops every pod; a SIGKILLed pod is replaced and loses no leaderboard
entry; a restarted orchestrator adopts its pods; a restarted leaderboard loses nothing (pods
retry); a pod whose env raises is reported failed with the error while the experiment goes on.
"""

from __future__ import annotations

import os
import signal
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import (
    Service,
    live_pods,
    pod_log,
    reports,
    wait_for,
)

pytestmark = pytest.mark.slow

TARGET = 475.0
K = 64


def spec(name: str, pods: int = 2, **over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "env": {"name": "CartPole-v1"},
        "algorithms": {"ppo": 1.0},
        "search_space": {
            "learning_rate": {"type": "log_uniform", "low": 4e-3, "high": 1.2e-2},
            "ent_coef": {"type": "uniform", "low": 0.0, "high": 0.01},
        },
        "generator": {"strategy": "pbt"},
        "population": {"min_pods": pods, "max_pods": pods},
        "resources": {"cpu": 1, "gpus": 0, "memory": "1Gi"},
        "round": {"env_steps": 4096},
        "target_return": TARGET,
        "top_k": K,
        "evaluation": {"episodes": 5},
        "budget": {"wall_time_s": 240},
    }
    out.update(over)
    return out


def create(orch: Service, body: dict[str, Any]) -> str:
    r = orch.http.post("/experiments", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def experiment(orch: Service, exp_id: str) -> dict[str, Any]:
    return orch.http.get(f"/experiments/{exp_id}").json()


def events(orch: Service, exp_id: str) -> list[dict[str, Any]]:
    return orch.http.get(f"/experiments/{exp_id}/events", params={"limit": 1000}).json()


def board_ids(lb: Service, exp_id: str) -> set[str]:
    r = lb.http.get(f"/experiments/{exp_id}/leaderboard")
    return {c["candidate_id"] for c in r.json()["candidates"]} if r.status_code == 200 else set()


def finished(
    orch: Service, exp_id: str, data: Path, state: str = "succeeded", timeout: float = 150
) -> dict[str, Any]:
    """Wait for the experiment to end in ``state`` and every pod process to be gone."""
    exp = wait_for(
        lambda: (e := experiment(orch, exp_id))["state"] not in ("pending", "running") and e,
        timeout=timeout,
        context=lambda: stalled(orch, exp_id, data),
    )
    assert exp["state"] == state, exp
    if state == "succeeded":
        assert exp["best_score"] >= TARGET
    wait_for(lambda: not live_pods(data, exp_id), timeout=40)
    wait_for(lambda: experiment(orch, exp_id)["result"], timeout=20)
    return experiment(orch, exp_id)


def stalled(orch: Service, exp_id: str, data: Path) -> dict[str, Any]:
    """What a failure to end shows: the experiment's record, its last events, and each pod's
    last log line (a pod that stopped logging is the one that hangs)."""
    pods = {}
    for path in sorted((data / "experiments" / exp_id / "pods").glob("*.log")):
        lines = path.read_text().splitlines()
        pods[path.stem] = (len(lines), lines[-1][:300] if lines else "")
    return {
        "experiment": experiment(orch, exp_id),
        "events": events(orch, exp_id)[-12:],
        "live": sorted(live_pods(data, exp_id)),
        "pods": pods,
    }


def assert_nothing_lost(lb: Service, exp_id: str, data: Path, killed: int = 0) -> None:
    """Every report a pod saw answered is counted once by the leaderboard, and every accepted
    one is on the board, or was evicted by a better one with its record kept (short rounds
    can make more than K entries). A SIGKILLed pod may have had one report counted without
    living to log the answer."""
    done = reports(data, exp_id)
    assert len({r["submission"] for r in done}) == len(done)
    summary = lb.http.get(f"/experiments/{exp_id}").json()
    assert len(done) <= summary["submissions"] <= len(done) + killed
    logged_steps = sum(r["env_steps"] for r in done)
    assert logged_steps <= summary["env_steps"] <= logged_steps + killed * 4096
    accepted = {r["candidate"] for r in done if r["accepted"]}
    status = {}
    for cid in accepted:
        r = lb.http.get(f"/experiments/{exp_id}/candidates/{cid}")
        assert r.status_code == 200, (cid, r.text)
        status[cid] = r.json()["status"]
    assert {c for c, s in status.items() if s == "active"} == accepted & board_ids(lb, exp_id)
    assert accepted - board_ids(lb, exp_id) == {c for c, s in status.items() if s == "evicted"}
    assert min(len(accepted), K) <= summary["size"] <= len(accepted) + killed


def test_tournament_reaches_the_target_and_stops_every_pod(
    make_orchestrator: Callable[..., Service], leaderboard: Service, tmp_path: Path
) -> None:
    orch = make_orchestrator()
    data = tmp_path / "orchestrator"
    exp_id = create(orch, spec("cartpole-four", pods=4))
    wait_for(lambda: len(live_pods(data, exp_id)) == 4)
    exp = finished(orch, exp_id, data)

    assert exp["result"]["best"]["score"] >= TARGET
    every = events(orch, exp_id)
    kinds = [e["type"] for e in every]
    assert kinds.count("pod_started") == 4 and "pod_failed" not in kinds
    assert "target_reached" in kinds
    # Every pod exited by itself with code 0 after the stop, its final report made.
    stopped = [e["message"] for e in every if e["type"] == "pod_stopped"]
    assert stopped == ["pod stopped (exit code 0)"] * 4
    assert_nothing_lost(leaderboard, exp_id, data)
    lineage = leaderboard.http.get(f"/experiments/{exp_id}/lineage").json()
    assert lineage["nodes"]


def test_a_killed_pod_is_replaced_and_no_entry_is_lost(
    make_orchestrator: Callable[..., Service], leaderboard: Service, tmp_path: Path
) -> None:
    orch = make_orchestrator()
    data = tmp_path / "orchestrator"
    # No target: the preset solves CartPole within a second or two of the first entries, and
    # an experiment that reaches its target before the kill is seen rightly replaces nobody
    # (CI saw that race). An env-step budget ends it instead, with the kill mid-run.
    body = spec(
        "cartpole-kill",
        round={"env_steps": 1024},
        target_return=None,
        budget={"total_env_steps": 24 * 1024, "wall_time_s": 240},
    )
    exp_id = create(orch, body)
    pods = wait_for(lambda: len(p := live_pods(data, exp_id)) == 2 and p)
    wait_for(lambda: board_ids(leaderboard, exp_id))
    before = board_ids(leaderboard, exp_id)
    victim = next(iter(pods))
    os.killpg(pods[victim], signal.SIGKILL)

    replaced = wait_for(
        lambda: [e for e in events(orch, exp_id) if e["type"] == "pod_replaced"],
        context=lambda: (experiment(orch, exp_id), events(orch, exp_id)),
    )
    assert f"replaces failed pod {victim}" in replaced[0]["message"]
    finished(orch, exp_id, data, state="budget_exhausted")
    for cid in before:  # still on the board, or evicted by better ones with its record kept
        assert leaderboard.http.get(f"/experiments/{exp_id}/candidates/{cid}").status_code == 200
    assert_nothing_lost(leaderboard, exp_id, data, killed=1)


def test_a_restarted_orchestrator_resumes_without_duplicate_pods(
    make_orchestrator: Callable[..., Service], leaderboard: Service, tmp_path: Path
) -> None:
    orch = make_orchestrator()
    data = tmp_path / "orchestrator"
    exp_id = create(orch, spec("cartpole-orch"))
    pods = wait_for(lambda: len(p := live_pods(data, exp_id)) == 2 and p)
    # Paused while the orchestrator is down: pods that start at once (the pod launcher) could
    # otherwise reach the target before the new orchestrator is up, and there would be no
    # running pods left to adopt.
    for pid in pods.values():
        os.killpg(pid, signal.SIGSTOP)
    orch.stop(signal.SIGKILL)  # a crash: no shutdown at all
    orch.start()
    wait_for(lambda: experiment(orch, exp_id)["state"] == "running")
    assert live_pods(data, exp_id) == pods  # the same processes, adopted
    for pid in pods.values():
        os.killpg(pid, signal.SIGCONT)
    finished(orch, exp_id, data)
    every = events(orch, exp_id)
    assert sorted(e["pod_id"] for e in every if e["type"] == "pod_started") == sorted(pods)
    assert sorted(e["pod_id"] for e in every if e["type"] == "pod_stopped") == sorted(pods)
    assert_nothing_lost(leaderboard, exp_id, data)


def test_a_restarted_leaderboard_loses_nothing(
    make_orchestrator: Callable[..., Service], leaderboard: Service, tmp_path: Path
) -> None:
    orch = make_orchestrator()
    data = tmp_path / "orchestrator"
    exp_id = create(orch, spec("cartpole-lb", round={"env_steps": 1024}))
    wait_for(lambda: len(live_pods(data, exp_id)) == 2)
    wait_for(lambda: board_ids(leaderboard, exp_id))
    leaderboard.stop()
    # Down long enough for the pods to finish a round and find it gone.
    wait_for(
        lambda: any(
            line.get("event") == "leaderboard unavailable, retrying"
            for path in (data / "experiments" / exp_id / "pods").glob("*.log")
            for line in pod_log(data, exp_id, path.stem)
        ),
        timeout=60,
    )
    leaderboard.start()
    finished(orch, exp_id, data)
    assert_nothing_lost(leaderboard, exp_id, data)


FLAKY_ENV = textwrap.dedent(
    """
    import os

    from services.pod.envs.cartpole import CartPoleEnv


    class FlakyCartPole(CartPoleEnv):
        '''CartPole whose first instance anywhere (claimed by creating ``marker``) breaks.'''

        def __init__(self, num_envs=1, device="cpu", seed=None, marker=""):
            super().__init__(num_envs, device=device, seed=seed)
            self.broken = False
            if num_envs > 1 and marker:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                    self.broken = True
                except FileExistsError:
                    pass

        def step(self, action):
            if self.broken:
                raise RuntimeError("simulator exploded: NaN in the physics state")
            return super().step(action)
    """
)


def test_a_pod_whose_env_raises_is_reported_and_the_experiment_goes_on(
    make_orchestrator: Callable[..., Service], leaderboard: Service, tmp_path: Path
) -> None:
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "podium_flaky_env.py").write_text(FLAKY_ENV)
    dist = plugin / "podium_flaky_env-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: podium-flaky-env\n")
    (dist / "entry_points.txt").write_text(
        "[podium.envs]\nFlakyCartPole-v0 = podium_flaky_env:FlakyCartPole\n"
    )
    # The orchestrator validates the name; its pods inherit the path and make the env.
    pythonpath = os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")]))
    orch = make_orchestrator(PYTHONPATH=pythonpath)
    data = tmp_path / "orchestrator"
    marker = tmp_path / "broken-once"
    # One pod at a time: the experiment cannot end before the broken pod's failure is seen.
    body = spec(
        "flaky", pods=1, env={"name": "FlakyCartPole-v0", "kwargs": {"marker": str(marker)}}
    )
    exp_id = create(orch, body)

    failed = wait_for(lambda: [e for e in events(orch, exp_id) if e["type"] == "pod_failed"])
    failure = wait_for(lambda: experiment(orch, exp_id)["last_failure"])
    assert failure["pod_id"] == failed[0]["pod_id"] and "exit code 1" in failure["reason"]
    assert "RuntimeError: simulator exploded" in failure["log_tail"]
    exp = finished(orch, exp_id, data)
    assert exp["state"] == "succeeded"
    kinds = [e["type"] for e in events(orch, exp_id)]
    assert kinds.count("pod_failed") == 1 and "pod_replaced" in kinds
