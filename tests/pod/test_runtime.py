"""The pod runtime against the real leaderboard (uvicorn on loopback, embedded Redis).

Covers the round loop (train, evaluate, submit training files that load back into an agent),
restart from a better parent with new hyperparameters, a leaderboard restart in the middle of
a run (the pod retries; every submission lands exactly once), the pod process's SIGTERM
contract, its /metrics, and bad input.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from services.contracts.leaderboard import Manifest, SubmissionResponse
from services.contracts.spec import ExperimentSpec
from services.contracts.strategies import PBTOptions, parent_is_better
from services.pod.config import PPORunConfig
from services.pod.roles.evaluator import EvalResult
from services.pod.runtime.lineage import Lineage, ReadyRule
from services.pod.runtime.rounds import HyperparameterError, check_hyperparameter_names
from services.pod.training.checkpoint import read_files, write_files
from services.pod.training.fit import build
from services.pod.training.presets import pod_config, preset
from tests.pod.harness import (
    ROOT,
    InThread,
    Leaderboard,
    client,
    make_spec,
    pod_env,
    register,
    runtime,
    sigterm_pod_when,
    start_pod,
    stop_after,
)


def test_hyperparameters_map_onto_the_preset() -> None:
    spec = ExperimentSpec.model_validate(make_spec(env={"name": "Pendulum-v1"}))
    config = pod_config(spec, {"learning_rate": 5e-4, "num_envs": 32}, seed=7)
    ref = PPORunConfig.model_validate(preset("ppo", "Pendulum-v1"))
    assert config.ppo.learning_rate == 5e-4 and config.ppo.num_envs == 32
    assert config.ppo.sde_sample_freq == ref.ppo.sde_sample_freq == 4  # the preset underneath
    assert config.ppo.anneal_lr is False and config.eval_episodes == 4 and config.seed == 7
    with pytest.raises(HyperparameterError, match="'lr'.*learning_rate"):
        pod_config(spec, {"lr": 1e-3}, seed=0)
    with pytest.raises(HyperparameterError, match=r"ppo\.num_envs"):
        pod_config(spec, {"num_envs": 0}, seed=0)
    with pytest.raises(HyperparameterError, match="'batch_size'"):
        check_hyperparameter_names(["gamma", "batch_size"], ["ppo"])
    check_hyperparameter_names(["gamma", "batch_size"])  # an off-policy loop's name


def test_ready_rule_and_lineage_bookkeeping() -> None:
    """What both pod runtimes share: when PBT judges an agent, and how a report's answer
    moves its lineage on (only an accepted submission becomes the next parent)."""
    spec = ExperimentSpec.model_validate(make_spec())
    defaults = PBTOptions.model_fields  # the one statement of the defaults
    assert ReadyRule.of(spec) == ReadyRule(
        defaults["ready_reports"].default,
        defaults["ready_env_steps"].default,
    )
    tuned = make_spec(generator={"strategy": "pbt", "options": {"ready_reports": 1}})
    assert ReadyRule.of(ExperimentSpec.model_validate(tuned)) == ReadyRule(1, 16_384)

    agent = Lineage("pod-a", hyperparameters={"learning_rate": 1e-3}, env_steps_at_start=100)
    evaluation = EvalResult(mean=10.0, std=1.0, episodes=[9.0, 11.0])
    sent = agent.submission(2048, evaluation, trained_env_steps=100 + 2048)
    assert sent["pod_id"] == "pod-a" and sent["env_steps"] == 2048 and sent["score"] == 10.0
    assert sent["trained_env_steps"] == 2148
    assert sent["eval"] == {"mean": 10.0, "std": 1.0, "episodes": 2}
    assert (sent["parent_id"], sent["generation"]) == (None, 0)

    agent.record(SubmissionResponse(accepted=False), 10.0)
    assert (agent.reports, agent.candidate_id, agent.generation) == (1, None, 0)
    assert not ReadyRule(reports=1, env_steps=10_000).is_ready(agent, 100 + 5_000)
    assert ReadyRule(reports=1, env_steps=10_000).is_ready(agent, 100 + 10_000)
    assert not ReadyRule(reports=2, env_steps=10_000).is_ready(agent, 100 + 10_000)

    agent.record(SubmissionResponse(accepted=True, candidate_id="c1", rank=1), 12.0)
    assert (agent.score, agent.rank, agent.reports) == (12.0, 1, 2)
    assert (agent.candidate_id, agent.parent_id, agent.generation) == ("c1", "c1", 1)
    assert not ReadyRule(reports=0, env_steps=0).is_ready(agent, 10**9)  # the best there is


def test_protect_improving_keeps_a_rising_agent() -> None:
    """Readiness judged on improvement (``protect_improving``): an agent whose score rose by
    more than the margin since its previous report is not judged, however far below the
    leader; one that stalled, fell or rose by less is, as under the plain rule."""
    pbt = {"strategy": "pbt", "options": {"ready_reports": 1, "protect_improving": 5.0}}
    rule = ReadyRule.of(ExperimentSpec.model_validate(make_spec(generator=pbt)))
    assert rule == ReadyRule(1, 16_384, improving_margin=5.0, higher_is_better=True)
    assert ReadyRule.of(ExperimentSpec.model_validate(make_spec())).improving_margin is None

    agent = Lineage("pod-a", env_steps_at_start=0)
    steps = 10**6  # trained long enough: only the scores decide
    agent.record(SubmissionResponse(accepted=False, rank=3), -900.0)
    assert agent.previous_score is None and rule.is_ready(agent, steps)  # one score: no trend
    agent.record(SubmissionResponse(accepted=False, rank=3), -600.0)
    assert agent.previous_score == -900.0
    assert not rule.is_ready(agent, steps)  # rose by 300: still learning, kept
    plain = ReadyRule(1, 16_384)
    assert plain.is_ready(agent, steps)  # the old rule replaces it
    agent.record(SubmissionResponse(accepted=False, rank=3), -597.0)
    assert rule.is_ready(agent, steps)  # rose by 3, within the margin: judged
    agent.record(SubmissionResponse(accepted=False, rank=3), -700.0)
    assert rule.is_ready(agent, steps)  # fell: judged

    # Lower is better: a falling score is the improvement.
    lower = ReadyRule(1, 0, improving_margin=5.0, higher_is_better=False)
    cost = Lineage("pod-b")
    cost.record(SubmissionResponse(accepted=False, rank=2), 100.0)
    cost.record(SubmissionResponse(accepted=False, rank=2), 50.0)
    assert not lower.is_ready(cost, steps)
    cost.record(SubmissionResponse(accepted=False, rank=2), 80.0)
    assert lower.is_ready(cost, steps)
    # The leader is never judged, improving or not.
    cost.record(SubmissionResponse(accepted=True, candidate_id="c", rank=1), 10.0)
    assert not lower.is_ready(cost, steps) and not ReadyRule(1, 0).is_ready(cost, steps)


def test_exploit_margin_keeps_an_explorer_from_a_copy_of_an_idle_agent() -> None:
    """``exploit_margin``: the parent must beat the agent by more than the margin. On
    MountainCarContinuous an exploring agent scores a little below the idle ones (the action
    cost: -1.8 against -0.0); with the plain rule it is replaced by a copy of an idle agent
    (docs/benchmarks.md), with a margin of 10 it keeps exploring, and a parent at the goal
    (+90) still replaces it."""
    pbt = {"strategy": "pbt", "options": {"exploit_margin": 10.0}}
    rule = ReadyRule.of(ExperimentSpec.model_validate(make_spec(generator=pbt)))
    assert rule.exploit_margin == 10.0
    assert ReadyRule.of(ExperimentSpec.model_validate(make_spec())).exploit_margin == 0.0

    def parent(score: float) -> Manifest:
        return Manifest(
            experiment_id="e",
            pod_id="p",
            algorithm="td3",
            hyperparameters={},
            parent_id="c-parent",
            parent_score=score,
            generation=1,
            checkpoint={"candidate_id": "c-parent", "files": {}},
            decision="exploit",
            strategy="pbt",
        )

    explorer = Lineage("pod-a")
    explorer.record(SubmissionResponse(accepted=False, rank=3), -1.8)
    assert parent_is_better(parent(-0.0), explorer, True)  # the plain rule copies the idle one
    assert not parent_is_better(parent(-0.0), explorer, True, rule.exploit_margin)
    assert parent_is_better(parent(90.0), explorer, True, rule.exploit_margin)
    # Lower is better: the margin applies the other way round.
    cost = Lineage("pod-b")
    cost.record(SubmissionResponse(accepted=False, rank=3), 100.0)
    assert parent_is_better(parent(95.0), cost, False)
    assert not parent_is_better(parent(95.0), cost, False, 10.0)
    assert parent_is_better(parent(85.0), cost, False, 10.0)
    # An agent with no score yet loses to any parent, margin or not.
    assert parent_is_better(parent(-1e6), Lineage("pod-c"), True, 10.0)
    with pytest.raises(ValidationError, match="exploit_margin"):
        PBTOptions.model_validate({"exploit_margin": -1.0})


@pytest.mark.parametrize("bad", [-1.0, "5", float("nan"), float("inf")])
def test_protect_improving_is_validated(bad: object) -> None:
    with pytest.raises(ValidationError, match="protect_improving"):
        PBTOptions.model_validate({"protect_improving": bad})
    spec = make_spec(generator={"strategy": "pbt", "options": {"protect_improving": bad}})
    with pytest.raises(ValidationError, match="protect_improving"):
        ExperimentSpec.model_validate(spec)


def test_rounds_report_files_that_load_back(leaderboard: Leaderboard, tmp_path: Path) -> None:
    spec = make_spec()
    register(leaderboard, "e1", spec)
    rt = runtime(leaderboard, "e1", spec, "pod-a", tmp_path)
    stop_after(rt, lambda r: len(r.submissions) >= 3)
    rt.close()
    # Every report reached the updater once; the final one comes after the stop.
    with leaderboard.api() as api:
        summary = api.get("/experiments/e1").json()
        board = api.get("/experiments/e1/leaderboard").json()["candidates"]
    assert summary["submissions"] == len(rt.submissions) >= 4
    assert summary["env_steps"] == sum(s["env_steps"] for s in rt.submissions) >= 3 * 1024
    assert board and all(c["pod_id"] == "pod-a" for c in board)
    # A candidate's own env steps are the pod's up to its report, not that report's share.
    so_far = itertools.accumulate(s["env_steps"] for s in rt.submissions)
    trained = dict(zip((s["candidate_id"] for s in rt.submissions), so_far, strict=True))
    assert {c["candidate_id"]: c["trained_env_steps"] for c in board} == {
        c["candidate_id"]: trained[c["candidate_id"]] for c in board
    }
    assert max(c["trained_env_steps"] for c in board) > board[0]["env_steps"] > 0
    best = board[0]
    assert best["hyperparameters"] == rt.slots[0].hyperparameters
    assert set(best["hyperparameters"]) == {"learning_rate"}
    # The files of the best candidate are a complete, verified checkpoint.
    with leaderboard.api() as api:
        files = {
            name: api.get(f["download_path"].removeprefix("/api/v1")).content
            for name, f in best["files"].items()
        }
    original = json.loads(files.pop("manifest.json"))
    write_files(tmp_path / "dl", files, {"algorithm": original["algorithm"]})
    assert read_files(tmp_path / "dl").manifest["files"] == original["files"]
    # A fresh agent of the pod's config, evaluated as the pod evaluated (compiled or eager:
    # their numbers may differ in the last bits, and a greedy action with them).
    config = rt.trainer.config(0)
    assert isinstance(config, PPORunConfig)
    how = "on" if rt.trainer.decision.compiled else "off"
    config = config.model_copy(update={"ppo": config.ppo.model_copy(update={"compile": how})})
    trainer = build(config)
    trainer.load(0, tmp_path / "dl", config)
    assert trainer.evaluate()[0].mean == pytest.approx(best["score"])


def test_restart_from_a_better_parent(leaderboard: Leaderboard, tmp_path: Path) -> None:
    spec = make_spec()
    register(leaderboard, "e2", spec)
    # A strong parent on the board: trained to the target first.
    first = runtime(leaderboard, "e2", spec, "pod-parent", tmp_path)
    stop_after(first, lambda r: (r.slots[0].score or 0) >= 200, timeout=240)
    first.close()
    with leaderboard.api() as api:
        parent = api.get("/experiments/e2/best").json()
        actor = api.get(parent["files"]["actor.safetensors"]["download_path"][len("/api/v1") :])
    parent_state = safetensors.torch.load(actor.content)

    child = runtime(leaderboard, "e2", spec, "pod-child", tmp_path)
    manifest = child.client.generate("pod-child")
    assert manifest.parent_id == parent["candidate_id"]  # pbt exploits the board
    child.start([manifest])
    agent = child.trainer.agent(0)
    # Weights and observation statistics are the parent's; the LR is the proposed one.
    for name, value in agent.policy.state_dict().items():
        assert torch.equal(value, parent_state[name]), name
    lr = manifest.hyperparameters["learning_rate"]
    assert [g["lr"] for g in agent.optimizer.state_dict()["param_groups"]] == [lr]
    assert float(child.trainer.population.hp["learning_rate"][0]) == pytest.approx(lr)
    assert child.slots[0].parent_id == parent["candidate_id"]
    assert child.slots[0].generation == parent["generation"] + 1
    child.close()
    with leaderboard.api() as api:
        lease = api.delete(f"/experiments/e2/leases/{manifest.lease_id}")
    assert lease.status_code == 404  # the pod released it once the files were loaded


def test_a_pod_trains_the_ensemble_algorithm_it_was_given(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """The orchestrator's PODIUM_ALGORITHM (RuntimeSettings.algorithm) is what the pod asks
    the generator for, whatever the generator would draw."""
    # Seeded so that the generator's own draw for the pod is known: PPO for p0.
    spec = make_spec(
        algorithms={"ppo": 1.0, "dqn": 1.0},
        search_space={},
        generator={"strategy": "pbt", "options": {"seed": 0}},
    )
    register(leaderboard, "given", spec)
    drawn = client(leaderboard, "given").generate("p0")
    assert drawn.algorithm == "ppo"
    rt = runtime(leaderboard, "given", spec, "p0", tmp_path, algorithm="dqn")
    rt.start()
    assert rt.slots[0].algorithm == rt.trainer.config(0).algorithm == "dqn"
    rt.close()


def test_truncation_keeps_a_pod_that_is_not_among_the_worst(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """With PBT's ``truncation`` the pod asks with its score and keeps its agent unless it is
    in the bottom share; without the score the generator would hand it the better parent."""
    options = {"truncation": 0.25, "ready_reports": 1, "ready_env_steps": 0}
    spec = make_spec(generator={"strategy": "pbt", "options": options})
    register(leaderboard, "e-trunc", spec)
    rt = runtime(leaderboard, "e-trunc", spec, "pod-mid", tmp_path)
    try:
        rt.start([rt.client.generate("pod-mid")])
        with leaderboard.api() as api:  # a better and a worse pod (reports without files)
            for pod, score in (("pod-top", 1e6), ("pod-low", -1e6)):
                body = {"submission_id": pod, "pod_id": pod, "algorithm": "ppo",
                        "score": score, "eval": {"mean": score, "episodes": 1}}  # fmt: skip
                assert api.post("/experiments/e-trunc/submissions", json=body).status_code == 200
        rt.train_round()
        rt.report()
        assert rt.slots[0].rank == 2  # not the best: PBT judges it
        restarts: list[dict] = []
        rt.place = lambda i, manifest, *_, **__: restarts.append(manifest)  # a restart's parent
        rt.maybe_exploit()  # the middle of three pods: 1 of 3 is replaced, and not this one
        assert restarts == []
        manifest = rt.client.generate("pod-mid", algorithm="ppo")  # no score: a parent
        assert manifest.decision == "explore" and manifest.parent_score == 1e6
        rt.client.release(manifest.lease_id)
    finally:
        rt.close()


def test_leaderboard_restart_loses_no_submission(tmp_path: Path) -> None:
    lb = Leaderboard(tmp_path / "lb").start()
    spec = make_spec(round={"env_steps": 512})
    register(lb, "e3", spec)
    rt = runtime(lb, "e3", spec, "pod-r", tmp_path)
    running = InThread(rt)
    running.wait_until(lambda rt: len(rt.submissions) >= 2)
    lb.stop()  # the leaderboard (and its embedded Redis) goes away mid-run
    running.wait_until(lambda rt: rt.client.retries > 0)
    before = len(rt.submissions)
    lb = Leaderboard(tmp_path / "lb", port=lb.port).start()
    running.wait_until(lambda rt: len(rt.submissions) >= before + 2)
    running.stop()
    rt.close()
    try:
        with lb.api() as api:
            summary = api.get("/experiments/e3").json()
            lineage = api.get("/experiments/e3/lineage").json()
    finally:
        lb.stop()
    assert summary["submissions"] == len(rt.submissions)
    assert summary["env_steps"] == sum(s["env_steps"] for s in rt.submissions)
    assert len({s["submission_id"] for s in rt.submissions}) == len(rt.submissions)
    accepted = {s["candidate_id"] for s in rt.submissions if s["accepted"]}
    assert accepted == {n["candidate_id"] for n in lineage["nodes"]}  # a flat, linked list


def metric(url: str, name: str) -> float:
    text = httpx.get(url, timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPUs granted where torch sees none")
def test_a_pod_granted_gpus_torch_cannot_see_refuses_to_start(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """Granted a GPU it cannot use, a pod would train on the CPU and hold the GPU for nobody
    (a warning line was the only sign): it exits 2 at start, saying why."""
    spec = make_spec()
    register(leaderboard, "no-gpu", spec)
    env = {**pod_env(leaderboard, "no-gpu", "p0", spec, tmp_path), "PODIUM_GPUS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "services.pod"], cwd=ROOT, env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 2, done.stderr.decode()[-2000:]
    last = json.loads(done.stderr.decode().strip().splitlines()[-1])
    assert last["event"] == "bad input" and "1 GPU granted (PODIUM_GPUS=1)" in last["error"]
    assert "is a CPU build" in last["error"] or "sees no CUDA device" in last["error"]
    assert "Traceback" not in done.stderr.decode()


def test_pod_process_reports_serves_metrics_and_stops_on_sigterm(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    spec = make_spec()
    register(leaderboard, "e4", spec)
    pod_dir = tmp_path / "pods"
    pod_dir.mkdir()
    proc = start_pod(leaderboard, "e4", "p0", spec, pod_dir, tmp_path / "pod.log")
    try:
        port_file = pod_dir / "p0.metrics_port"
        deadline = time.monotonic() + 90
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        url = f"http://127.0.0.1:{int(port_file.read_text())}/metrics"
        while metric(url, "podium_pod_submissions_total") < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert metric(url, "podium_pod_env_steps_total") >= 2048
        assert metric(url, "podium_pod_rounds_total") >= 2
        assert metric(url, "podium_pod_env_steps_per_second") > 0
        # Latest first: the best only grows, so it bounds any earlier latest even if an
        # evaluation lands between the two scrapes.
        latest = metric(url, "podium_pod_eval_return")
        assert metric(url, "podium_pod_best_eval_return") >= latest
        with leaderboard.api() as api:
            before = api.get("/experiments/e4").json()["submissions"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [json.loads(line) for line in (tmp_path / "pod.log").read_text().splitlines()]
    reports = [line for line in lines if line["event"] == "reported"]
    # The final report, unless the stop came right after a report of the same agent.
    assert reports[-1]["final"] is True or lines[-2]["event"].startswith("nothing trained")
    with leaderboard.api() as api:
        after = api.get("/experiments/e4").json()["submissions"]
    assert after == len(reports)
    if reports[-1]["final"]:  # a final report was made, so it is counted after the stop
        assert after > before
    assert lines[-1]["event"] == "pod stopped"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"PODIUM_SPEC": "{not json"}, "PODIUM_SPEC is not valid JSON"),
        ({"PODIUM_SPEC": json.dumps({"name": "x"})}, "env: Field required"),
        (
            {
                "PODIUM_SPEC": json.dumps(
                    make_spec(search_space={"lr": {"type": "choice", "values": [1]}})
                )
            },
            "'lr' not hyperparameters of 'ppo'",  # the spec's own check, before the pod's
        ),
        ({"PODIUM_LEADERBOARD_URL": None}, "PODIUM_LEADERBOARD_URL"),
        ({"PODIUM_CPU": "lots"}, "PODIUM_CPU"),
        ({"PODIUM_ALGORITHM": "sac"}, "PODIUM_ALGORITHM 'sac' is not in the spec's algorithms"),
    ],
)
def test_bad_input_is_a_clear_error(
    tmp_path: Path, change: dict[str, str | None], message: str
) -> None:
    env = pod_env(Leaderboard(tmp_path), "e", "p", make_spec(), tmp_path)
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    done = subprocess.run(
        [sys.executable, "-m", "services.pod"], cwd=ROOT, env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 2
    last = json.loads(done.stderr.decode().strip().splitlines()[-1])
    assert last["event"] == "bad input" and message in last["error"]
    assert "Traceback" not in done.stderr.decode()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # The generator hands out DQN for a continuous-action env.
        ({"env": {"name": "Pendulum-v1"}, "algorithms": {"dqn": 1.0}}, "cannot train dqn on"),
        # gymnasium's envs have no card of their arguments, so a misspelt one reaches the pod
        # (it crashed, exit 1, and was replaced until the launch budget ran out).
        ({"env": {"name": "gym:CartPole-v1", "kwargs": {"bogus": 1}}}, "'bogus'"),
        # An env whose extra this pod lacks (Isaac Lab here): no new pod would have it either.
        ({"env": {"name": "Isaac-Ant-v0"}}, "Isaac Lab is not installed"),
    ],
)
def test_what_the_env_cannot_take_is_bad_input(
    tmp_path: Path, leaderboard: Leaderboard, change: dict, message: str
) -> None:
    """Exit 2 naming it, no traceback (the orchestrator's events show the message)."""
    spec = make_spec(**change, search_space={})
    register(leaderboard, "bad-input", spec)
    env = pod_env(leaderboard, "bad-input", "p0", spec, tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "services.pod"], cwd=ROOT, env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 2, done.stderr.decode()[-2000:]
    last = json.loads(done.stderr.decode().strip().splitlines()[-1])
    assert last["event"] == "bad input" and message in last["error"], last


def test_a_broken_plugin_is_bad_input_not_a_crash_to_relaunch(
    tmp_path: Path, leaderboard: Leaderboard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An env plugin whose module fails to import, or a generator strategy that fails: the pod
    exited 1 (or retried the leaderboard's 500) and was replaced until the budget ran out; now
    exit 2 naming the plugin, so the experiment fails at once with the reason."""
    from tests.pod.plugins import register_plugin

    source = (
        "import podium_no_such_module\n"
        "from services.leaderboard.generator import Strategy\n"
        "class Raises(Strategy):\n"
        "    name = 'raises'\n"
        "    def propose(self, ctx):\n"
        "        raise RuntimeError('boom')\n"
    )
    register_plugin(tmp_path, monkeypatch, "podium_broken", source, {})
    (tmp_path / "podium_strategy.py").write_text(source.split("\n", 1)[1])
    entry_points = tmp_path / "podium_broken-0.1.dist-info" / "entry_points.txt"
    entry_points.write_text(
        "[podium.envs]\nBroken-v0 = podium_broken:Env\n"
        "[podium.generators]\nraises = podium_strategy:Raises\n"
    )
    cases = {
        "env": (make_spec(env={"name": "Broken-v0"}, search_space={}),
                "env 'Broken-v0' (registered as podium_broken:Env in podium.envs) cannot be "
                "loaded: ModuleNotFoundError"),
        "generator": (make_spec(generator={"strategy": "raises"}),
                      "generator.strategy 'raises' failed to propose: RuntimeError('boom')"),
    }  # fmt: skip
    for name, (spec, message) in cases.items():
        register(leaderboard, name, spec)
        (tmp_path / name).mkdir()
        env = {
            **pod_env(leaderboard, name, "p0", spec, tmp_path / name),
            "PYTHONPATH": str(tmp_path),
        }
        done = subprocess.run(
            [sys.executable, "-m", "services.pod"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr.decode()[-2000:]
        last = json.loads(done.stderr.decode().strip().splitlines()[-1])
        assert last["event"] == "bad input" and message in last["error"], last


def test_a_population_pod_process_reports_each_agent_and_stops_on_sigterm(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """``population.agents_per_pod: 3``: ``python -m services.pod`` trains three agents in one
    process and each reaches the board as its own candidate (pod id ``<pod>.m<i>``)."""
    spec = make_spec(population={"min_pods": 1, "max_pods": 1, "agents_per_pod": 3})
    register(leaderboard, "pop", spec)
    log = tmp_path / "pod.log"
    proc = start_pod(leaderboard, "pop", "p0", spec, tmp_path, log)
    with leaderboard.api() as api:

        def six_submitted() -> bool:  # two reports of each of the three agents
            return api.get("/experiments/pop").json()["submissions"] >= 6

        lines = sigterm_pod_when(proc, log, six_submitted, 120)
        nodes = api.get("/experiments/pop/lineage").json()["nodes"]
    assert {n["pod_id"] for n in nodes} == {"p0.m0", "p0.m1", "p0.m2"}
    started = [line for line in lines if line["event"] == "pod started"]
    assert started and started[0]["agents"] == 3


def test_a_pod_stops_within_its_env_step_budget(leaderboard: Leaderboard, tmp_path: Path) -> None:
    """``PODIUM_MAX_ENV_STEPS``: the pod takes every whole step that fits in the budget and no
    more, makes its final report and exits 0 on its own (no SIGTERM)."""
    spec = make_spec()
    register(leaderboard, "budget", spec)
    budget, step = 2_500, 16 * 16  # the CartPole preset's rollout: 16 envs x 16 steps
    proc = start_pod(
        leaderboard, "budget", "p0", spec, tmp_path, tmp_path / "pod.log",
        PODIUM_MAX_ENV_STEPS=str(budget),
    )  # fmt: skip
    try:
        assert proc.wait(timeout=120) == 0, (tmp_path / "pod.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [json.loads(line) for line in (tmp_path / "pod.log").read_text().splitlines()]
    with leaderboard.api() as api:
        summary = api.get("/experiments/budget").json()
    assert summary["env_steps"] == budget // step * step  # 2,304: one more step would exceed
    assert lines[-1]["event"] == "pod stopped" and lines[-1]["env_steps"] == summary["env_steps"]
    reports = [line for line in lines if line["event"] == "reported"]
    assert reports[-1]["final"] is True and summary["submissions"] == len(reports)


def test_a_population_pod_shares_its_env_step_budget(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """The budget counts every agent's env steps: 3 agents of 256 per step take 768 a step."""
    spec = make_spec(population={"min_pods": 1, "max_pods": 1, "agents_per_pod": 3})
    register(leaderboard, "budget-pop", spec)
    rt = runtime(leaderboard, "budget-pop", spec, "p0", tmp_path, max_env_steps=2_500)
    rt.run()  # returns by itself once the budget is spent
    rt.close()
    assert rt.env_steps == 3 * 768 and rt.stopping
    assert sum(s["env_steps"] for s in rt.submissions) == rt.env_steps
    assert [s["final"] for s in rt.submissions][-3:] == [True] * 3
