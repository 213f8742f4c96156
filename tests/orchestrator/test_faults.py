"""Faults the orchestrator must take in its stride.

Local backend with real stand-in pod processes, the real leaderboard over HTTP, real Redis;
the hung leaderboard is a real TCP server that accepts connections and never answers.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from services.orchestrator.app import create_app
from services.orchestrator.leaderboard_client import LeaderboardProgress
from tests.orchestrator.conftest import LB_TOKEN, TOKEN, create, live_pods, spec, started, wait_for

API = "/api/v1/experiments"


def _get(client: TestClient, exp_id: str) -> dict:
    r = client.get(f"{API}/{exp_id}")
    assert r.status_code == 200, r.text
    return r.json()


def _events(client: TestClient, exp_id: str) -> list[dict]:
    return client.get(f"{API}/{exp_id}/events", params={"limit": 1000}).json()


def _data_dir(client: TestClient) -> Path:
    return Path(client.app.state.settings.data_dir)


def _board(leaderboard, exp_id: str, path: str = "") -> dict:
    url = f"{leaderboard.url}/api/v1/experiments/{exp_id}{path}"
    return httpx.get(url, headers={"Authorization": f"Bearer {LB_TOKEN}"}).json()


def _allowances(data: Path, exp_id: str) -> dict[str, int]:
    """Pod → the env steps it was allowed, as its first line says (a pod stopped at the end
    before it logged anything has no line)."""
    out = {}
    for log in (data / "experiments" / exp_id / "pods").glob("*.log"):
        lines = [x for x in log.read_text().splitlines() if "max_env_steps=" in x]
        if lines:
            out[log.stem] = int(lines[0].split("max_env_steps=")[1])
    return out


# -- input that can never work ------------------------------------------------------
def test_a_pods_bad_input_exit_fails_the_experiment_at_once(client: TestClient) -> None:
    body = spec(
        population={"min_pods": 1, "max_pods": 1}, standin={"crash_after_s": 0.1, "crash_code": 2}
    )
    exp_id = create(client, body)
    exp = wait_for(lambda: (e := _get(client, exp_id))["state"] == "failed" and e)
    assert exp["reason"].startswith("a pod refused its input (exit code 2)")
    assert "cannot train dqn on Pendulum-v1" in exp["reason"]  # the pod's own message
    assert exp["progress"]["pods_launched"] == 1  # not retried
    failed = [e for e in _events(client, exp_id) if e["type"] == "pod_failed"]
    assert len(failed) == 1 and "refused its input" in failed[0]["message"]
    wait_for(lambda: _get(client, exp_id)["result"])
    assert _get(client, exp_id)["progress"]["pods_launched"] == 1


def test_what_no_pod_can_train_is_refused_at_submission(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for env, algorithm, kinds in [
        ("Pendulum-v1", "dqn", "dqn trains discrete actions, Pendulum-v1 has continuous"),
        ("gym:CartPole-v1", "sac", "sac trains continuous actions, gym:CartPole-v1 has discrete"),
        ("Pendulum-v1", "portfolio_gradient", "portfolio_gradient trains StockTrading-v0 only"),
    ]:
        r = client.post(API, json=spec(env={"name": env}, algorithms={algorithm: 1.0}))
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["msg"].startswith(
            "Value error, algorithms do not fit env.name: "
        )
        assert f"cannot train {algorithm} on {env}" in r.text and kinds in r.text
    # A mix where one algorithm does not fit is refused too: its pods would exit 2.
    r = client.post(API, json=spec(env={"name": "Pendulum-v1"}, algorithms={"ppo": 1, "dqn": 1}))
    assert r.status_code == 422 and "cannot train dqn" in r.text

    # An algorithm a plugin registers (a real .dist-info on sys.path) that no pod runtime
    # trains: registered, so known by name, but refused with what pods do train.
    (tmp_path / "podium_plugin_algo.py").write_text("class A2C:\n    pass\n")
    dist = tmp_path / "podium_plugin_algo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: podium-plugin-algo\n")
    (dist / "entry_points.txt").write_text("[podium.algorithms]\na2c = podium_plugin_algo:A2C\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = client.post(API, json=spec(algorithms={"a2c": 1.0}))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert [tuple(e["loc"]) for e in detail] == [("body", "algorithms")]
    assert "'a2c' is registered but no pod can train it" in detail[0]["msg"]
    pods_train = "pods train: ddpg, dqn, portfolio_gradient, ppo, sac, td3"
    assert f"podium.algorithm_cards); {pods_train}" in detail[0]["msg"]
    assert client.get(API).json() == []


# -- an outside kill is not a crash loop --------------------------------------------
def _kill_every_pod_limit_times(
    client: TestClient, exp_id: str, ready: Callable[[dict[str, int]], bool]
) -> list[dict[str, Any]]:
    """SIGKILL both pods of ``exp_id`` once ``ready(pods)``, crash-loop-limit times over (a node
    lost, a preemption): the experiment goes on, every pod replaced. Its pod_failed events."""
    limit = client.app.state.settings.crash_loop_limit
    d = _data_dir(client)
    killed: list[str] = []
    for _ in range(limit):
        pods = wait_for(
            lambda: len(p := live_pods(d, exp_id)) == 2 and not set(p) & set(killed) and p
        )
        wait_for(lambda: ready(pods))  # noqa: B023
        for pod, pid in pods.items():
            os.killpg(pid, signal.SIGKILL)
            killed.append(pod)
    wait_for(lambda: len(p := live_pods(d, exp_id)) == 2 and not set(p) & set(killed))
    exp = wait_for(lambda: (e := _get(client, exp_id))["progress"]["pods_launched"] >= 10 and e)
    assert exp["state"] == "running", exp["reason"]
    assert exp["progress"]["pods_launched"] == 2 + 2 * limit
    failed = [e for e in _events(client, exp_id) if e["type"] == "pod_failed"]
    assert len(failed) == 2 * limit
    return failed


def test_killing_pods_that_had_reported_is_not_a_crash_loop(client: TestClient) -> None:
    body = spec(
        population={"min_pods": 2, "max_pods": 2},
        standin={"report_interval_s": 0.05, "info_lines": True},
    )
    exp_id = create(client, body)
    calls = client.app.state.reconciler.calls
    # Each has trained and reported, and the orchestrator has seen the report.
    failed = _kill_every_pod_limit_times(
        client, exp_id, lambda pods: all(calls.reported(exp_id, pod) for pod in pods)
    )
    assert all("not counted as a crash" in e["message"] for e in failed)


def test_killing_pods_before_they_report_is_not_a_crash_loop(client: TestClient) -> None:
    # Pods killed from outside (SIGKILL) before their first report, more
    # times than the crash-loop limit: how they ended says they did not crash.
    body = spec(population={"min_pods": 2, "max_pods": 2}, standin={"info_lines": True})
    client.app.state.reconciler.calls.source = _Silent()  # no pod ever reports
    exp_id = create(client, body)
    d = _data_dir(client)
    failed = _kill_every_pod_limit_times(client, exp_id, lambda pods: started(d, exp_id, pods))
    assert all(
        "not counted as a crash: killed by SIGKILL from outside" in e["message"] for e in failed
    ), failed


def test_the_last_log_line_is_left_out_of_a_reason_when_it_is_an_info_line(
    client: TestClient,
) -> None:
    # Pods that crash without a word (a segfault) right after an ordinary info line: a crash loop;
    # that info line is not the reason.
    limit = client.app.state.settings.crash_loop_limit
    body = spec(
        population={"min_pods": 1, "max_pods": 1},
        standin={
            "report_interval_s": 0.02,
            "info_lines": True,
            "crash_after_reports": 1,
            "crash_signal": "SIGSEGV",
        },
    )
    client.app.state.reconciler.calls.source = _Silent()
    exp_id = create(client, body)
    exp = wait_for(lambda: (e := _get(client, exp_id))["state"] == "failed" and e)
    assert (
        exp["reason"]
        == f"pods keep crashing: {limit} consecutive failures; last: killed by SIGSEGV"
    )
    assert "round reported" in exp["last_failure"]["log_tail"]  # still shown, in its place


class _Silent:
    """A leaderboard that registers experiments and knows of no report."""

    def register(self, experiment_id, spec) -> None:
        return None

    def progress(self, experiment_id):
        from services.orchestrator.leaderboard_client import Progress

        return Progress()

    def delete(self, experiment_id) -> None:
        return None

    def reporters(self, experiment_id, after):
        from services.orchestrator.leaderboard_client import Reports

        return Reports({}, {}, after)


# -- budgets and targets -------------------------------------------------------------
def test_the_env_step_budget_is_not_overshot(client: TestClient, leaderboard) -> None:
    budget = 5000
    body = spec(
        population={"min_pods": 2, "max_pods": 2},
        budget={"total_env_steps": budget},
        standin={"report_interval_s": 0.05, "env_steps_per_report": 1000},
    )
    exp_id = create(client, body)
    d = _data_dir(client)
    exp = wait_for(lambda: (e := _get(client, exp_id))["result"] and e)
    assert exp["state"] == "budget_exhausted"
    wait_for(lambda: not live_pods(d, exp_id))
    assert _board(leaderboard, exp_id)["env_steps"] == budget  # spent, and not one step more
    allowances = _allowances(d, exp_id).values()
    assert len(allowances) >= 2 and sum(allowances) <= budget


def test_a_budget_the_batches_do_not_divide_is_handed_out_in_whole_batches(
    client: TestClient, leaderboard
) -> None:
    # 3 pods training 4,096-step batches, a budget of 40,960. The first pods
    # train 12,288 steps each; the 4,096 left were split 1,365 per pod, each of which trained
    # nothing, reported, exited and was replaced (27 pods in 8 s).
    budget, batch = 40_960, 4_096
    body = spec(
        population={"min_pods": 3, "max_pods": 3},
        resources={"cpu": 1},
        budget={"total_env_steps": budget},
        standin={
            "report_interval_s": 0.05,
            "env_steps_per_report": batch,
            "batch_env_steps": batch,
        },
    )
    exp_id = create(client, body)
    d = _data_dir(client)
    exp = wait_for(
        lambda: (e := _get(client, exp_id))["result"] or e["progress"]["pods_launched"] > 8,
        timeout=30,
    )
    exp = _get(client, exp_id)
    assert exp["progress"]["pods_launched"] == 4, exp  # 3, then 1 for the last batch
    assert exp["state"] == "budget_exhausted" and exp["result"]["env_steps"] == budget
    assert _board(leaderboard, exp_id)["env_steps"] == budget
    wait_for(lambda: not live_pods(d, exp_id))
    allowances = sorted(_allowances(d, exp_id).values())
    assert allowances == [batch, 13_653, 13_653, 13_653]  # no pod below one batch


def test_a_killed_pods_replacement_gets_all_it_left_of_its_allowance(
    client: TestClient, leaderboard
) -> None:
    # Two pods allowed 60,000 steps each. One is killed after some reports while the other
    # still trains: its replacement may train all the killed one left. The running pod's
    # reports are in the count, and not held again in its allowance (counting them twice
    # gave the replacement less, and the rest to a third pod once the running one ended).
    budget = 120_000
    body = spec(
        population={"min_pods": 2, "max_pods": 2},
        budget={"total_env_steps": budget},
        standin={"report_interval_s": 0.1, "env_steps_per_report": 1_000},
    )
    exp_id = create(client, body)
    d = _data_dir(client)
    pods = wait_for(lambda: len(p := live_pods(d, exp_id)) == 2 and p)
    victim, other = sorted(pods)
    wait_for(lambda: _board(leaderboard, exp_id)["env_steps"] >= 10_000)
    os.killpg(pods[victim], signal.SIGKILL)
    exp = wait_for(lambda: (e := _get(client, exp_id))["result"] and e, timeout=60)
    assert exp["state"] == "budget_exhausted" and exp["result"]["env_steps"] == budget
    allowed = _allowances(d, exp_id)
    [replacement] = set(allowed) - {victim, other}
    log = _board(leaderboard, exp_id, "/submissions")["submissions"]
    done = sum(r["env_steps"] for r in log if r["pod_id"] == victim)
    assert allowed == {victim: 60_000, other: 60_000, replacement: 60_000 - done}, done
    assert exp["progress"]["pods_launched"] == 3, exp


def test_each_pods_logged_steps_are_summed_once_over_reads_that_return_a_report_again() -> None:
    from services.orchestrator.leaderboard_client import Progress, Reports
    from services.orchestrator.progress_calls import ProgressCalls, make_breaker

    log = [("s1", "p1.m0", 100), ("s2", "p1.m1", 100), ("s3", "p2", 50)]

    class Log:
        """The submission log after the cursor: what was read before comes again (a partial
        page), and the count, read after it, holds a report more (decided in between)."""

        def progress(self, experiment_id: str) -> Progress:
            return Progress(env_steps=sum(n for _, _, n in log) + 25)

        def reporters(self, experiment_id: str, after: str | None) -> Reports:
            reports = {sid: (reporter, n) for sid, reporter, n in log}
            return Reports(dict.fromkeys([r for _, r, _ in log], 1), {}, None, reports)

    woken = threading.Event()
    calls = ProgressCalls(Log(), 1, make_breaker(3, 3.0), woken.set)  # type: ignore[arg-type]

    def read() -> Progress:
        woken.clear()
        calls.progress("e", 0.0, since=time.monotonic(), read_log=True)
        wait_for(woken.is_set)
        return calls.progress("e", 60.0)[0]

    try:
        assert read().reported == {"p1": 200, "p2": 50}
        log.append(("s4", "p2", 50))
        assert read().reported == {"p1": 200, "p2": 100}  # s1-s3 read again, counted once
        assert read().reported == {"p1": 200, "p2": 100}
    finally:
        calls.close()


def test_a_count_read_from_the_leaderboard_holds_the_batch_of_the_reports_it_counts() -> None:
    """The reconciler reads the count (``progress``) and the batch (``batch``) apart, while a
    leaderboard thread stores an answer. A count that holds a pod's report must come with the
    batch that report said: a new pod's allowance is counted in whole batches of it, and with
    the count but not the batch, a 40,960-step budget's first replacement was given 1,366 env
    steps (less than one batch of 2,048: it trained nothing and was replaced, once more)."""
    from services.orchestrator.leaderboard_client import Progress, Reports
    from services.orchestrator.progress_calls import ProgressCalls, make_breaker

    class Log:
        def progress(self, experiment_id: str) -> Progress:
            return Progress(env_steps=12_288)

        def reporters(self, experiment_id: str, after: str | None) -> Reports:
            return Reports({"p1": 2_048}, {"p1": -500.0}, "s1", {"s1": ("p1", 12_288)})

    published, release = threading.Event(), threading.Event()

    def pause_once_published(frame: Any, event: str, arg: Any) -> Any:
        """In the leaderboard thread: stop it at the first line after its answer's count is
        published, for this thread to read what a reconciler's pass would read then."""
        if frame.f_code is not ProgressCalls._fetch.__code__:
            return None

        def line(frame: Any, event: str, arg: Any) -> Any:
            board = frame.f_locals.get("board")
            mine = board is not None and board.asked_at == frame.f_locals["asked_at"]
            if event == "line" and mine and not published.is_set():
                published.set()
                release.wait(10)
            return line

        return line

    calls = ProgressCalls(Log(), 1, make_breaker(3, 3.0), lambda: None)  # type: ignore[arg-type]
    previous = threading.gettrace()
    threading.settrace(pause_once_published)  # the pool's thread starts with the first call
    try:
        calls.progress("e", 0.0, since=time.monotonic(), read_log=True)
        assert published.wait(10)
        progress, settled = calls.progress("e", 60.0)
        assert settled and progress.reported == {"p1": 12_288}
        assert calls.batch("e") == 2_048
    finally:
        threading.settrace(previous)  # type: ignore[arg-type]
        release.set()
        calls.close()


def test_what_is_left_below_one_batch_ends_the_experiment(client: TestClient, leaderboard) -> None:
    # 10,000 steps, 4,096-step batches, one pod at a time: 8,192 trained, 1,808 left: no pod
    # can train a step of them, so none is launched and the experiment ends.
    body = spec(
        population={"min_pods": 1, "max_pods": 1},
        budget={"total_env_steps": 10_000},
        standin={
            "report_interval_s": 0.05,
            "env_steps_per_report": 4_096,
            "batch_env_steps": 4_096,
        },
    )
    exp_id = create(client, body)
    exp = wait_for(
        lambda: (e := _get(client, exp_id))["result"] or e["progress"]["pods_launched"] > 4,
        timeout=30,
    )
    exp = _get(client, exp_id)
    assert exp["state"] == "budget_exhausted", exp
    assert exp["progress"]["pods_launched"] == 1 and exp["result"]["env_steps"] == 8_192
    assert exp["reason"] == "env-step budget spent: 1808 steps left, below one batch of 4096"


def test_a_target_met_by_the_final_reports_wins_over_a_spent_budget(
    client: TestClient, leaderboard
) -> None:
    # The first report spends the budget below the target; the final report (made on SIGTERM,
    # after the end) meets it: the experiment met its target.
    body = spec(
        population={"min_pods": 1, "max_pods": 1},
        budget={"total_env_steps": 1000},
        target_return=20.0,
        standin={
            "report_interval_s": 0.3,
            "score_step": 10.0,
            "env_steps_per_report": 1000,
            "ignore_max_env_steps": True,
        },
    )
    exp_id = create(client, body)
    exp = wait_for(lambda: (e := _get(client, exp_id))["result"] and e, timeout=30)
    assert exp["result"]["best"]["score"] >= 20.0
    assert exp["state"] == "succeeded" and exp["result"]["state"] == "succeeded"
    assert exp["reason"] == "target return 20 reached"
    types = [e["type"] for e in _events(client, exp_id)]
    assert "budget_exhausted" in types and types.index("target_reached") > types.index(
        "budget_exhausted"
    )


# -- a hung leaderboard ---------------------------------------------------------------
class HungServer:
    """Accepts TCP connections and never answers (a SIGSTOPped leaderboard)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(conn)  # read nothing, answer nothing

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def hung() -> Iterator[HungServer]:
    srv = HungServer()
    yield srv
    srv.close()


def test_a_hung_leaderboard_does_not_stall_replacing_pods(
    make_settings, flush_redis: None, hung: HungServer
) -> None:
    settings = make_settings(capacity_cpu=8)
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        d = Path(settings.data_dir)
        ids = [
            create(client, spec(f"e{i}", population={"min_pods": 1, "max_pods": 1}))
            for i in range(8)
        ]
        wait_for(lambda: all(len(live_pods(d, i)) == 1 for i in ids), timeout=60)
        wait_for(lambda: all(_get(client, i)["state"] == "running" for i in ids))
        # Every experiment registered; now the leaderboard stops answering.
        rec = client.app.state.reconciler
        rec.calls.source = LeaderboardProgress(hung.url, LB_TOKEN)
        wait_for(lambda: len(hung.conns) >= 8)  # the calls are hanging now
        victim_exp = ids[3]
        ((victim, pid),) = live_pods(d, victim_exp).items()
        wait_for(lambda: started(d, victim_exp, {victim: pid}))
        passes = rec.passes
        os.killpg(pid, signal.SIGKILL)
        new = wait_for(lambda: (p := live_pods(d, victim_exp)) and victim not in p and p)
        assert len(new) == 1
        # Replaced within a few passes, each of which did not wait on the leaderboard (the old
        # reconciler spent 5 s per experiment per pass here: over 40 s for one pass).
        assert rec.passes - passes <= 5, rec.passes - passes
        assert rec.last_error is None
        # Still hung, and still replacing: a second kill, in another experiment.
        ((victim2, pid2),) = live_pods(d, ids[6]).items()
        os.killpg(pid2, signal.SIGKILL)
        wait_for(lambda: (p := live_pods(d, ids[6])) and victim2 not in p)


def test_a_backoff_end_does_not_wait_for_the_next_timed_pass(
    make_settings, flush_redis: None
) -> None:
    # Timed passes every 60 s: only the end of the backoff can wake the loop in time.
    settings = make_settings(
        reconcile_interval_s=60, backoff_initial_s=0.5, backoff_max_s=5, crash_loop_limit=10
    )
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        body = spec(population={"min_pods": 1, "max_pods": 1}, standin={"crash_after_s": 0.3})
        exp_id = create(client, body)
        # 1st failure: replaced at once; 2nd: after 0.5 s; 3rd: after 1 s.
        wait_for(lambda: _get(client, exp_id)["progress"]["pods_launched"] >= 4, timeout=20)
        waits = [e for e in _events(client, exp_id) if "replacing in" in e["message"]]
        assert [e["message"].split("replacing in ")[1].split("s")[0] for e in waits][:3] == [
            "0.00",
            "0.50",
            "1.00",
        ]


def test_the_circuit_breaker_stops_calling_a_failing_leaderboard_and_tries_again_later() -> None:
    from fastapi import FastAPI, Response

    from services.orchestrator.progress_calls import ProgressCalls, make_breaker
    from tests.orchestrator.servers import ServerThread

    hits: list[str] = []
    app = FastAPI()

    @app.get("/api/v1/experiments/{exp_id}/best")
    def down(exp_id: str) -> Response:
        hits.append(exp_id)
        return Response(status_code=503)

    woken = threading.Event()
    with ServerThread(app) as srv:
        calls = ProgressCalls(
            LeaderboardProgress(srv.url, LB_TOKEN), 4, make_breaker(3, 3.0), woken.set
        )
        try:
            for exp in ("e1", "e2", "e3"):  # three failures in a row open the breaker
                n = len(hits)
                calls.progress(exp, 0.0)
                wait_for(lambda: len(hits) == n + 1 and not calls._board(exp).inflight)  # noqa: B023
            assert calls.breaker.opened
            # A failure is not asked again at once (that spun the reconcile loop): not before the
            # breaker lets calls through again.
            assert calls._board("e3").retry_at - time.monotonic() > 2.0
            for i in range(10):  # while open: answered at once, the leaderboard is not called
                calls.progress(f"x{i}", 0.0)
                wait_for(lambda: not calls._board(f"x{i}").inflight)  # noqa: B023
                calls.progress("e3", 0.0)  # backing off: not even sent
                assert not calls._board("e3").inflight
            assert len(hits) == 3
            assert not woken.is_set()  # a failure nobody waits for wakes nobody
            # After the recovery time, one call goes through again.
            wait_for(lambda: not calls.breaker.opened, timeout=10)
            calls.progress("e4", 0.0)
            wait_for(lambda: len(hits) == 4)
            prog, settled = calls.progress("e5", 0.0, since=0.0)
            assert prog.best is None and settled  # failures settle a wait; nothing is known
            # A pass waiting for an answer newer than now is woken by a failure too.
            calls.progress("e6", 0.0, since=time.monotonic())
            wait_for(woken.is_set)
        finally:
            calls.close()


def test_while_a_registration_is_retried_the_leaderboards_failure_stands() -> None:
    """A new experiment's reason says the leaderboard is unavailable for as long as it is,
    also while a retry is in flight (on a busy machine that window is long): not that the
    experiment is being registered."""
    from fastapi import FastAPI, Response

    from services.api_client import ServiceError
    from services.contracts.spec import ExperimentSpec
    from services.orchestrator.progress_calls import ProgressCalls, make_breaker
    from tests.orchestrator.servers import ServerThread

    seen: list[str] = []
    release = threading.Event()
    app = FastAPI()

    @app.put("/api/v1/experiments/{exp_id}")
    def register(exp_id: str) -> Any:
        seen.append(exp_id)
        if len(seen) == 1:
            return Response(status_code=503)
        release.wait(30)  # the retry hangs until the test lets it answer
        return {}

    exp = ExperimentSpec.model_validate(spec())
    with ServerThread(app) as srv:
        calls = ProgressCalls(
            LeaderboardProgress(srv.url, LB_TOKEN), 2, make_breaker(10, 1.0), lambda: None,
            min_retry_s=0.01, max_retry_s=0.02,
        )  # fmt: skip
        try:
            assert calls.register("e", exp) is False  # the first call, in flight
            wait_for(lambda: calls._board("e").registered.done())
            with pytest.raises(ServiceError):
                calls.register("e", exp)  # its 503
            time.sleep(0.05)  # past the back-off: the retry is sent, and hangs
            with pytest.raises(ServiceError):
                calls.register("e", exp)
            wait_for(lambda: len(seen) == 2)
            with pytest.raises(ServiceError):
                calls.register("e", exp)  # still in flight: the 503 stands
            release.set()
            wait_for(lambda: calls._board("e").registered.done())
            assert calls.register("e", exp) is True
        finally:
            release.set()
            calls.close()
