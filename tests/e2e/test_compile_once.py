"""One compile per experiment, end to end on the embedded platform: a 4-pod CartPole tournament
with ``compile: on`` (real orchestrator with the local backend, leaderboard, Redis and pod
processes) compiles its programs in one pod; the other three wait for it and load what it
published, as does the pod that replaces a killed one. Every pod logs its start-up seconds, and
keeps its last log lines and TensorBoard files in the leaderboard's blob store, which `podium
logs` and `podium tensorboard` read once the pods are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import LB_TOKEN, Service, live_pods, pod_log, wait_for
from tests.e2e.test_tournament import create, events, finished, spec
from tests.pod.harness import compile_trail, compile_work, eval_returns

pytestmark = pytest.mark.slow


def podium(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_compiled_tournament_compiles_once_and_keeps_every_pods_files(
    make_orchestrator: Callable[..., Service], leaderboard: Service, tmp_path: Path
) -> None:
    # One token for both services, as `podium` takes one (--token).
    # Each pod its own compile cache in its pod directory, as deployed (not the session's,
    # where another test may have compiled these programs already): only the share saves.
    orch = make_orchestrator(PODIUM_API_TOKEN=LB_TOKEN, TORCHINDUCTOR_CACHE_DIR="")
    orch.http.headers["Authorization"] = f"Bearer {LB_TOKEN}"
    data = tmp_path / "orchestrator"
    body = spec(
        "cartpole-compiled",
        pods=4,
        search_space={
            "learning_rate": {"type": "log_uniform", "low": 4e-3, "high": 1.2e-2},
            "compile": {"type": "choice", "values": ["on"]},
        },
        round={"env_steps": 2048},
        # No target: it could be reached before the kill below is seen, and then nobody is
        # replaced (tests/e2e/test_tournament.py); an env-step budget ends it instead.
        target_return=None,
        budget={"total_env_steps": 600 * 1024, "wall_time_s": 900},
    )
    exp_id = create(orch, body)
    pods = wait_for(lambda: len(p := live_pods(data, exp_id)) == 4 and p, timeout=60)
    # Once a pod that loaded the published programs has reported, kill it: its replacement
    # loads them too.
    logs = lambda: {p: pod_log(data, exp_id, p) for p in pods}  # noqa: E731

    def loaded_and_reported() -> list[str]:
        return [
            p
            for p, lines in logs().items()
            if any(x["event"] == "pod.first_report" for x in lines)
            and any(x.get("state") == "loaded" for x in lines)
        ]

    victim = wait_for(loaded_and_reported, timeout=900, interval=2)[0]
    os.killpg(pods[victim], signal.SIGKILL)
    wait_for(lambda: [e for e in events(orch, exp_id) if e["type"] == "pod_replaced"])
    # Most of the budget is trained after the kill; on a busy machine that takes minutes. The
    # env steps end it, not the wall time (which would hide a pod that hangs).
    done = finished(orch, exp_id, data, state="budget_exhausted", timeout=600)
    assert done["reason"].startswith("env-step budget spent"), done

    every = {
        p.stem: pod_log(data, exp_id, p.stem)
        for p in (data / "experiments" / exp_id / "pods").glob("*.log")
    }
    # The four, the killed one's replacement, and any pod started for the budget left by pods
    # whose share of it was spent.
    assert len(every) >= 5, sorted(every)
    states: dict[str, list[str]] = {}
    for pod, lines in every.items():
        chosen = [x for x in lines if x["event"] == "trainer.chosen"]
        assert chosen and chosen[0]["compiled"] is True, (pod, chosen)
        for x in lines:
            if x["event"].startswith("compile_cache.") and "state" in x:
                states.setdefault(pod, []).append(x["state"])
    compilers = [p for p, s in states.items() if "claimed" in s]
    assert len(compilers) == 1, compile_trail(every)
    [first] = compilers
    published = next(x for x in every[first] if x["event"] == "compile_cache.published")
    assert published["files"] > 0 and published["first"], published
    for pod in set(every) - {first}:
        assert states[pod][-1] == "loaded", (pod, compile_trail(every))
    # Compiled once: the other pods built no graph and loaded what they ran (their compile
    # seconds are those loads).
    work = {pod: compile_work(lines) for pod, lines in every.items()}
    print(f"compile work by pod: {work}; {first} compiled")
    assert work[first]["built"] > 0, work
    assert all(w["built"] == 0 for p, w in work.items() if p != first), work
    assert any(w["loaded"] > 0 for p, w in work.items() if p != first), work
    for pod, lines in every.items():
        if pod == victim:
            continue
        [stopped] = [x for x in lines if x["event"] == "pod stopped"]
        startup = stopped["startup_s"]
        assert 0 < startup["first_env_step"] <= startup["first_report"], (pod, startup)

    # Every pod's last lines and TensorBoard files outlived it (the killed one's TensorBoard
    # files as of its first report; its log it could not upload).
    auth = ["--url", orch.url, "--token", LB_TOKEN, "--leaderboard-url", leaderboard.url]
    kept = leaderboard.http.get(f"/experiments/{exp_id}/pod-files").json()
    assert {f["pod_id"] for f in kept if f["name"] == "log"} == set(every) - {victim}
    assert {f["pod_id"] for f in kept if f["name"] == "tensorboard"} == set(every)
    for pod in set(every) - {victim}:  # its own last line: after its final report
        own = podium("logs", exp_id, pod, "--tail", "1", *auth)
        assert own.returncode == 0 and '"pod stopped"' in own.stdout, own
    out = tmp_path / "boards"
    boards = podium("tensorboard", exp_id, "--out", str(out), *auth)
    assert boards.returncode == 0, boards.stderr
    assert f"tensorboard --logdir {out}" in boards.stderr
    for pod in every:
        assert eval_returns(out / pod), pod
