"""End to end through the API with the local backend: real Redis, real pod processes, a real
HTTP leaderboard slice the pods report to."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
from fastapi.testclient import TestClient

from tests.orchestrator.conftest import create, live_pods, spec, started, wait_for


def _data_dir(client: TestClient) -> Path:
    return Path(client.app.state.settings.data_dir)


def _get(client: TestClient, exp_id: str) -> dict:
    r = client.get(f"/api/v1/experiments/{exp_id}")
    assert r.status_code == 200, r.text
    return r.json()


def _events(client: TestClient, exp_id: str) -> list[dict]:
    return client.get(f"/api/v1/experiments/{exp_id}/events?limit=1000").json()


def _wait_for_events(client: TestClient, exp_id: str, kind: str) -> list[dict]:
    """The experiment's events of ``kind``, once there is one."""
    return wait_for(lambda: [e for e in _events(client, exp_id) if e["type"] == kind])


def test_replaces_a_pod_killed_with_sigkill(client: TestClient) -> None:
    exp_id = create(client, spec(population={"min_pods": 2, "max_pods": 2}))
    d = _data_dir(client)
    pods = wait_for(lambda: len(live_pods(d, exp_id)) == 2 and live_pods(d, exp_id))
    victim, pid = sorted(pods.items())[0]
    os.killpg(pid, signal.SIGKILL)

    after = wait_for(lambda: (p := live_pods(d, exp_id)) and len(p) == 2 and victim not in p and p)
    assert set(after) - set(pods), "a new pod replaced the killed one"
    # The new pod's process runs before the pass that started it records its event.
    replaced = _wait_for_events(client, exp_id, "pod_replaced")
    assert victim in replaced[0]["message"]
    failed = [e for e in _events(client, exp_id) if e["type"] == "pod_failed"]
    assert failed and failed[0]["pod_id"] == victim and "SIGKILL" in failed[0]["message"]

    def settled() -> dict | None:
        e = _get(client, exp_id)
        return e if {p["pod_id"] for p in e["pods"]} == set(after) else None

    exp = wait_for(settled)
    assert exp["state"] == "running" and exp["progress"]["pods_launched"] == 3
    assert exp["last_failure"]["pod_id"] == victim
    assert exp["last_failure"]["reason"] == "killed by SIGKILL"


def _algorithms(pods: dict[str, int]) -> dict[str, str | None]:
    """pod id -> the PODIUM_ALGORITHM its process was started with."""
    return {pod: psutil.Process(pid).environ().get("PODIUM_ALGORITHM") for pod, pid in pods.items()}


def test_an_ensemble_keeps_each_algorithms_share_of_the_pods(client: TestClient) -> None:
    # Three pods, PPO weighted twice DQN's: two PPO pods and one DQN pod, every time (each pod
    # drawing its algorithm would give no DQN pod in 8 of 27 launches), and a failed pod
    # comes back as its own algorithm.
    body = spec(algorithms={"ppo": 2.0, "dqn": 1.0}, population={"min_pods": 3, "max_pods": 3})
    exp_id = create(client, body)
    d = _data_dir(client)
    pods = wait_for(lambda: len(p := live_pods(d, exp_id)) == 3 and p)
    algorithms = _algorithms(pods)
    assert sorted(algorithms.values()) == ["dqn", "ppo", "ppo"]
    # The API shows each pod's algorithm.
    shown = wait_for(lambda: len((e := _get(client, exp_id))["pods"]) == 3 and e)
    assert {p["pod_id"]: p["algorithm"] for p in shown["pods"]} == algorithms
    [victim] = [pod for pod, algorithm in algorithms.items() if algorithm == "dqn"]
    os.killpg(pods[victim], signal.SIGKILL)
    after = wait_for(lambda: (p := live_pods(d, exp_id)) and len(p) == 3 and victim not in p and p)
    [new] = set(after) - set(pods)
    assert _algorithms({new: after[new]}) == {new: "dqn"}
    replaced = _wait_for_events(client, exp_id, "pod_replaced")
    assert replaced[0]["message"] == f"replaces failed pod {victim} (dqn)"


def test_an_ensemble_scaled_in_keeps_each_algorithms_share(client: TestClient) -> None:
    # DQN, PPO, DQN; the PPO pod fails and its replacement (PPO) is the newest pod. A
    # higher-priority experiment then takes a CPU: the newest DQN pod stops, not the PPO one.
    d = _data_dir(client)  # capacity: 4 CPUs, 1 CPU per pod
    pods3 = {"min_pods": 1, "max_pods": 3}
    body = spec("ens", algorithms={"ppo": 1.0, "dqn": 1.0}, population=pods3)
    low = create(client, body)
    pods = wait_for(lambda: len(p := live_pods(d, low)) == 3 and p)
    [victim] = [pod for pod, algorithm in _algorithms(pods).items() if algorithm == "ppo"]
    os.killpg(pods[victim], signal.SIGKILL)
    after = wait_for(lambda: (p := live_pods(d, low)) and len(p) == 3 and victim not in p and p)
    wait_for(lambda: started(d, low, after))
    high = create(client, spec("high", priority=10, population={"min_pods": 2, "max_pods": 2}))
    wait_for(lambda: len(live_pods(d, high)) == 2)
    remaining = wait_for(lambda: len(p := live_pods(d, low)) == 2 and p)
    assert sorted(_algorithms(remaining).values()) == ["dqn", "ppo"]
    [stopped] = set(after) - set(remaining)
    dqn_started = {
        e["pod_id"]
        for e in _events(client, low)
        if e["type"] == "pod_started" and e["message"] == "pod started (dqn)"
    }
    assert len(dqn_started) == 2 and stopped in dqn_started  # (both started in one pass)


def test_a_single_algorithm_leaves_the_choice_to_the_generator(client: TestClient) -> None:
    exp_id = create(client, spec(population={"min_pods": 1, "max_pods": 1}))
    pods = wait_for(lambda: len(p := live_pods(_data_dir(client), exp_id)) == 1 and p)
    assert list(_algorithms(pods).values()) == [None]


def test_cancel_stops_every_pod_gracefully(client: TestClient) -> None:
    exp_id = create(client, spec(population={"min_pods": 1, "max_pods": 3}))
    d = _data_dir(client)
    pods = wait_for(lambda: len(p := live_pods(d, exp_id)) == 3 and p)
    wait_for(lambda: started(d, exp_id, pods))
    r = client.post(f"/api/v1/experiments/{exp_id}/cancel")
    assert r.status_code == 202
    wait_for(lambda: not live_pods(d, exp_id))
    exp = wait_for(lambda: (e := _get(client, exp_id))["result"] and e)
    assert exp["state"] == "cancelled"
    assert exp["reason"] == "cancelled by request"
    for pod_id in pods:  # each pod got SIGTERM, made its final report, then exited
        assert (d / "experiments" / exp_id / "pods" / f"{pod_id}.final").exists()
    assert not [e for e in _events(client, exp_id) if e["type"] == "pod_failed"]


def _final_marker(d: Path, exp_id: str, pod_id: str) -> Path:
    return d / "experiments" / exp_id / "pods" / f"{pod_id}.final"


def test_stops_at_target_reward_and_records_the_best(client: TestClient) -> None:
    body = spec(
        population={"min_pods": 2, "max_pods": 2},
        target_return=50.0,
        standin={"report_interval_s": 0.1, "score_step": 10.0},
    )
    exp_id = create(client, body)
    d = _data_dir(client)
    exp = wait_for(lambda: (e := _get(client, exp_id))["state"] == "succeeded" and e)
    assert exp["reason"] == "target return 50 reached"
    wait_for(lambda: not live_pods(d, exp_id))
    exp = wait_for(lambda: (e := _get(client, exp_id))["result"] and e)
    assert exp["result"]["best"]["score"] >= 50.0
    assert exp["best_score"] >= 50.0 and exp["best"]["candidate_id"]
    assert [e for e in _events(client, exp_id) if e["type"] == "target_reached"]


def test_stops_when_the_env_step_budget_is_spent(client: TestClient) -> None:
    body = spec(
        budget={"total_env_steps": 5000},
        standin={"report_interval_s": 0.05, "env_steps_per_report": 1000},
    )
    exp_id = create(client, body)
    d = _data_dir(client)
    exp = wait_for(lambda: (e := _get(client, exp_id))["state"] == "budget_exhausted" and e)
    assert exp["reason"].startswith("env-step budget spent")
    assert exp["progress"]["env_steps"] >= 5000
    wait_for(lambda: not live_pods(d, exp_id))


def test_stops_when_the_wall_time_budget_is_spent(client: TestClient) -> None:
    exp_id = create(client, spec(budget={"wall_time_s": 1.0}))
    d = _data_dir(client)
    wait_for(lambda: live_pods(d, exp_id))
    exp = wait_for(lambda: (e := _get(client, exp_id))["state"] == "budget_exhausted" and e)
    assert exp["reason"] == "wall-time budget spent: 1s"
    assert exp["progress"]["elapsed_s"] >= 1.0
    wait_for(lambda: not live_pods(d, exp_id))


def test_pod_budget_caps_launches_and_replacements(client: TestClient) -> None:
    body = spec(
        population={"min_pods": 1, "max_pods": 1},
        budget={"pods_launched": 2},
        standin={"crash_after_s": 0.3},
    )
    exp_id = create(client, body)
    exp = wait_for(lambda: (e := _get(client, exp_id))["state"] == "budget_exhausted" and e)
    assert exp["progress"]["pods_launched"] == 2
    assert "pod budget spent" in exp["reason"]
    assert len([e for e in _events(client, exp_id) if e["type"] == "pod_failed"]) == 2


def test_crash_looping_pods_fail_the_experiment_with_the_reason(client: TestClient) -> None:
    exp_id = create(client, spec(standin={"crash_after_s": 0.05}))
    exp = wait_for(lambda: (e := _get(client, exp_id))["state"] == "failed" and e)
    assert "pods keep crashing: 4 consecutive failures" in exp["reason"]
    assert "exit code 3" in exp["reason"] and "CUDA error: out of memory" in exp["reason"]
    events = _events(client, exp_id)
    counted = [e for e in events if e["type"] == "pod_failed" and "replacing in" in e["message"]]
    assert len(counted) == 4  # a pod failing after the end is logged, not counted
    delays = [float(e["message"].split("replacing in ")[1].split("s")[0]) for e in counted]
    assert delays == sorted(delays) and delays[-1] > delays[0]  # exponential backoff
    assert [e["type"] for e in events].count("failed") == 1
    wait_for(lambda: not live_pods(_data_dir(client), exp_id))


def test_higher_priority_scales_lower_in_then_capacity_frees_and_it_scales_out(
    client: TestClient,
) -> None:
    d = _data_dir(client)  # capacity: 4 CPUs, 1 CPU per pod
    low = create(client, spec("low", population={"min_pods": 1, "max_pods": 4}))
    low_pods = wait_for(lambda: len(p := live_pods(d, low)) == 4 and p)
    wait_for(lambda: started(d, low, low_pods))

    high = create(client, spec("high", priority=10, population={"min_pods": 3, "max_pods": 3}))
    wait_for(lambda: len(live_pods(d, high)) == 3)
    remaining = live_pods(d, low)
    assert len(remaining) == 1
    stopped = set(low_pods) - set(remaining)
    assert all(_final_marker(d, low, p).exists() for p in stopped)  # SIGTERM → report → exit
    scaled_in = {e["pod_id"] for e in _events(client, low) if e["type"] == "pod_scaled_in"}
    assert scaled_in == stopped
    assert _get(client, low)["desired_pods"] == 1

    # The high-priority experiment ends: its capacity frees up and the low one scales out.
    client.post(f"/api/v1/experiments/{high}/cancel")
    wait_for(lambda: len(live_pods(d, low)) == 4)
    assert not live_pods(d, high)
    assert _get(client, low)["desired_pods"] == 4


def test_fair_share_between_equal_priorities(client: TestClient) -> None:
    d = _data_dir(client)
    a = create(client, spec("a", population={"min_pods": 1, "max_pods": 4}))
    wait_for(lambda: started(d, a, p := live_pods(d, a)) and len(p) == 4)
    b = create(client, spec("b", population={"min_pods": 1, "max_pods": 4}))
    wait_for(lambda: len(live_pods(d, a)) == 2 and len(live_pods(d, b)) == 2)


def test_cannot_fit_now_is_accepted_and_pending_with_the_reason(client: TestClient) -> None:
    big = create(client, spec("big", resources={"cpu": 8, "memory": "1Gi"}))
    many = create(client, spec("many", population={"min_pods": 5, "max_pods": 5}))
    e = wait_for(lambda: (x := _get(client, big))["reason"] and "needs" in x["reason"] and x)
    assert e["state"] == "pending"
    assert "one pod needs 8 CPU" in e["reason"] and "the cluster has 4 CPU" in e["reason"]
    e = wait_for(lambda: (x := _get(client, many))["reason"] and "capacity" in x["reason"] and x)
    assert e["state"] == "pending" and "min_pods=5" in e["reason"]
    assert not live_pods(_data_dir(client))
    pending = client.get("/api/v1/experiments", params={"state": "pending"}).json()
    assert {x["id"] for x in pending} == {big, many}


def test_pause_then_resume(client: TestClient) -> None:
    d = _data_dir(client)
    exp_id = create(client, spec(population={"min_pods": 2, "max_pods": 2}))
    pods = wait_for(lambda: len(p := live_pods(d, exp_id)) == 2 and p)
    wait_for(lambda: started(d, exp_id, pods))
    assert client.post(f"/api/v1/experiments/{exp_id}/pause").status_code == 202
    wait_for(lambda: _get(client, exp_id)["state"] == "paused" and not live_pods(d, exp_id))
    assert all(_final_marker(d, exp_id, p).exists() for p in pods)
    assert client.post(f"/api/v1/experiments/{exp_id}/resume").status_code == 202
    new = wait_for(lambda: len(p := live_pods(d, exp_id)) == 2 and p)
    assert not set(new) & set(pods)
    wait_for(lambda: _get(client, exp_id)["state"] == "running")
    types = [e["type"] for e in _events(client, exp_id)]
    assert "paused" in types and "resumed" in types and "pod_failed" not in types


def test_delete_stops_pods_and_forgets_the_experiment(client: TestClient, leaderboard) -> None:
    d = _data_dir(client)
    exp_id = create(client, spec())
    wait_for(lambda: live_pods(d, exp_id))
    import httpx

    from tests.orchestrator.conftest import LB_TOKEN

    def on_board() -> int:
        url = f"{leaderboard.url}/api/v1/experiments/{exp_id}"
        return httpx.get(url, headers={"Authorization": f"Bearer {LB_TOKEN}"}).status_code

    assert on_board() == 200
    assert client.delete(f"/api/v1/experiments/{exp_id}").status_code == 204
    assert client.get(f"/api/v1/experiments/{exp_id}").status_code == 404
    wait_for(lambda: not live_pods(d, exp_id))
    wait_for(lambda: on_board() == 404)
    assert client.get("/api/v1/experiments").json() == []


def test_target_reward_with_the_real_leaderboard(
    make_settings, flush_redis: None, redis_url: str, tmp_path: Path
) -> None:
    """The same flow through the real leaderboard service: the orchestrator registers the
    experiment, the pods submit results to the updater, the orchestrator reads /best."""
    import httpx

    from services.leaderboard.app import create_app as leaderboard_app
    from services.leaderboard.settings import LeaderboardSettings
    from services.orchestrator.app import create_app
    from tests.orchestrator.conftest import LB_TOKEN, TOKEN
    from tests.orchestrator.servers import ServerThread

    lb_settings = LeaderboardSettings(
        data_dir=tmp_path / "leaderboard", redis_url=redis_url, api_token=LB_TOKEN
    )
    with ServerThread(leaderboard_app(lb_settings)) as lb:
        settings = make_settings(leaderboard_url=lb.url)
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = f"Bearer {TOKEN}"
            body = spec(
                population={"min_pods": 2, "max_pods": 2},
                target_return=30.0,
                standin={"report_interval_s": 0.1, "score_step": 10.0},
            )
            exp_id = create(client, body)
            exp = wait_for(lambda: (e := _get(client, exp_id))["result"] and e)
            assert exp["state"] == "succeeded"
            best = exp["result"]["best"]
            assert best["score"] >= 30.0 and best["experiment_id"] == exp_id
            # The result was recorded after the last pod's final report: it is the
            # leaderboard's own final answer.
            r = httpx.get(
                f"{lb.url}/api/v1/experiments/{exp_id}/best",
                headers={"Authorization": f"Bearer {LB_TOKEN}"},
            )
            assert r.json()["candidate_id"] == best["candidate_id"]
            assert not live_pods(Path(settings.data_dir), exp_id)


def test_local_gpus_are_assigned_exclusively(make_settings, flush_redis: None) -> None:
    from services.orchestrator.app import create_app
    from tests.orchestrator.conftest import TOKEN

    settings = make_settings(capacity_gpus=3)
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        d = Path(settings.data_dir)
        exp_id = create(
            client,
            spec(population={"min_pods": 1, "max_pods": 4}, resources={"cpu": 1, "gpus": 1}),
        )

        def gpus_seen() -> dict[str, str]:
            pods = live_pods(d, exp_id)
            if len(pods) != 3 or not started(d, exp_id, pods):
                return {}
            logs = d / "experiments" / exp_id / "pods"
            return {p: (logs / f"{p}.log").read_text().split("gpus=")[1].split()[0] for p in pods}

        seen = wait_for(gpus_seen)  # 3 GPUs, 1 per pod: 3 pods although max_pods is 4
        assert sorted(seen.values()) == ["'0'", "'1'", "'2'"]
        victim = next(p for p, g in seen.items() if g == "'1'")
        os.killpg(live_pods(d, exp_id)[victim], signal.SIGKILL)
        after = wait_for(lambda: victim not in (g := gpus_seen()) and g)
        assert sorted(after.values()) == ["'0'", "'1'", "'2'"]  # the freed GPU is reused
