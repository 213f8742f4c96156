"""The pod runtime with off-policy agents (SAC, DQN) and algorithm mixes, against the real
leaderboard (uvicorn on loopback, embedded Redis).

Covers rounds that report complete training files (replay buffer included) which load back, a
PBT restart from a SAC parent (weights, replay buffer, proposed learning rate), a spec mixing
PPO and SAC (each pod applies its own algorithm's names), the pod process in ``--mode
processes`` (off-policy trains fused, SIGTERM still makes the final report), and bad input:
names no listed algorithm has, algorithms the env's action space does not fit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from pydantic import ValidationError

from services.contracts.leaderboard import Manifest
from services.contracts.spec import ExperimentSpec
from services.pod.config import PPORunConfig
from services.pod.runtime.rounds import HyperparameterError, check_hyperparameter_names
from services.pod.training.fit import build
from services.pod.training.offpolicy import OffPolicyConfig, OffPolicyTrainer
from services.pod.training.presets import eval_seed, pod_config
from tests.pod.harness import (
    Leaderboard,
    download,
    make_spec,
    register,
    runtime,
    sigterm_pod_when,
    start_pod,
    stop_after,
)


@pytest.fixture
def lb(tmp_path: Path) -> Iterator[Leaderboard]:
    server = Leaderboard(tmp_path / "lb").start()
    yield server
    server.stop()


# Small pins keep a round to a fraction of a second: few envs, early learning, small batches.
SAC_SPACE: dict[str, Any] = {
    "learning_rate": {"type": "log_uniform", "low": 1e-3, "high": 3e-3},
    "num_envs": {"type": "choice", "values": [8]},
    "learning_starts": {"type": "choice", "values": [128]},
    "batch_size": {"type": "choice", "values": [64]},
}


def sac_spec(**over: Any) -> dict[str, Any]:
    return make_spec(
        env={"name": "Pendulum-v1"},
        algorithms={"sac": 1.0},
        search_space=SAC_SPACE,
        round={"env_steps": 256},
        evaluation={"episodes": 2},
        **over,
    )


def dqn_spec() -> dict[str, Any]:
    return make_spec(
        algorithms={"dqn": 1.0},
        search_space={**SAC_SPACE, "exploration_steps": {"type": "choice", "values": [512]}},
        round={"env_steps": 256},
        evaluation={"episodes": 2},
    )


@pytest.mark.parametrize(("algorithm", "spec"), [("sac", sac_spec()), ("dqn", dqn_spec())])
def test_offpolicy_rounds_report_files_that_load_back(
    lb: Leaderboard, tmp_path: Path, algorithm: str, spec: dict[str, Any]
) -> None:
    register(lb, "e1", spec)
    rt = runtime(lb, "e1", spec, "pod-a", tmp_path)
    stop_after(rt, lambda r: len(r.submissions) >= 3)
    rt.close()
    config = rt.trainer.config(0)
    assert isinstance(rt.trainer, OffPolicyTrainer) and isinstance(config, OffPolicyConfig)
    assert config.algorithm == algorithm and config.num_envs == 8
    assert config.batch_size == 64  # a loop hyperparameter, applied at the top level
    own = getattr(config, algorithm)
    assert own.learning_rate == rt.slots[0].hyperparameters["learning_rate"]
    with lb.api() as api:
        summary = api.get("/experiments/e1").json()
        board = api.get("/experiments/e1/leaderboard").json()["candidates"]
    assert summary["submissions"] == len(rt.submissions) >= 4  # the final report included
    assert summary["env_steps"] == sum(s["env_steps"] for s in rt.submissions) >= 3 * 256
    # One agent all along (PBT's readiness counts these env steps): every step was reported.
    assert rt.trainer.env_steps == summary["env_steps"] and rt.slots[0].parent_id
    # Scored on the experiment's shared evaluation start states, like every other pod.
    shared = eval_seed(ExperimentSpec.model_validate(spec))
    assert config.evaluation_seed == shared
    assert board and {c["algorithm"] for c in board} == {algorithm}
    best = board[0]
    assert "replay_buffer.safetensors" in best["files"]
    download(lb, best, tmp_path / "dl")
    restored = build(config)
    restored.load(0, tmp_path / "dl", config)
    assert restored.replay.size[0] > 0 and restored.env_steps >= 256
    # The same agent, scored on the experiment's shared evaluation start states.
    assert restored.evaluate()[0].mean == pytest.approx(best["score"])


def test_restart_from_a_sac_parent_loads_weights_and_replay_buffer(
    lb: Leaderboard, tmp_path: Path
) -> None:
    spec = sac_spec()
    register(lb, "e2", spec)
    first = runtime(lb, "e2", spec, "pod-parent", tmp_path)
    stop_after(first, lambda r: len(r.submissions) >= 2)
    first.close()

    child = runtime(lb, "e2", spec, "pod-child", tmp_path)
    manifest = child.client.generate("pod-child")
    assert manifest.algorithm == "sac" and manifest.parent_id is not None
    parent = child.client.candidate(manifest.parent_id)
    parent_dir = download(lb, parent, tmp_path / "parent")
    files = {p.name: p.read_bytes() for p in parent_dir.iterdir()}
    child.start([manifest])
    trainer = child.trainer
    agent, buffer = trainer.single(0)
    for name, value in safetensors.torch.load(files["actor.safetensors"]).items():
        assert torch.equal(agent.policy.state_dict()[name], value), name
    replay = safetensors.torch.load(files["replay_buffer.safetensors"])
    assert len(buffer) == replay["obs"].shape[0] > 0
    assert torch.equal(buffer.obs[: len(buffer)], replay["obs"])
    assert torch.equal(buffer.action[: len(buffer)], replay["action"])
    counters = json.loads(files["counters.json"])
    assert trainer.env_steps == counters["env_steps"] == child.slots[0].env_steps_at_start
    lr = manifest.hyperparameters["learning_rate"]
    assert agent.optimizer.lr == lr
    assert child.trainer.config(0).sac.learning_rate == lr
    # A child explores with its own stream, not the parent's next draws.
    parent_rng = safetensors.torch.load(files["rng.safetensors"])["generator"]
    assert not torch.equal(trainer.generator.get_state(), parent_rng)
    assert child.slots[0].parent_id == parent.candidate_id
    assert child.slots[0].generation == parent.generation + 1
    child.train_round()  # and it trains on from there
    assert trainer.env_steps >= counters["env_steps"] + 256
    child.close()
    with lb.api() as api:
        lease = api.delete(f"/experiments/e2/leases/{manifest.lease_id}")
    assert lease.status_code == 404  # released once the files were loaded


def test_mixed_spec_trains_each_algorithm_with_its_own_hyperparameters(
    lb: Leaderboard, tmp_path: Path
) -> None:
    spec = make_spec(
        env={"name": "Pendulum-v1"},
        algorithms={"ppo": 0.5, "sac": 0.5},
        search_space={
            **SAC_SPACE,  # learning_rate and num_envs: both; the rest: SAC's loop
            "tau": {"type": "uniform", "low": 0.01, "high": 0.03},  # SAC only
            "gae_lambda": {"type": "uniform", "low": 0.9, "high": 0.95},  # PPO only
            "num_steps": {"type": "choice", "values": [16]},  # PPO only
        },
        round={"env_steps": 256},
        evaluation={"episodes": 2},
    )
    register(lb, "e3", spec)
    pods = {}
    for algorithm in ("ppo", "sac"):
        rt = runtime(lb, "e3", spec, f"pod-{algorithm}", tmp_path)
        manifest = rt.client.generate(rt.pod_id, algorithm=algorithm)
        rt.start([manifest])
        rt.train_round()
        rt.report()
        pods[algorithm] = rt
    ppo, sac = pods["ppo"].trainer.config(0), pods["sac"].trainer.config(0)
    assert isinstance(ppo, PPORunConfig) and isinstance(sac, OffPolicyConfig)
    ppo_h, sac_h = pods["ppo"].slots[0].hyperparameters, pods["sac"].slots[0].hyperparameters
    assert ppo.ppo.gae_lambda == ppo_h["gae_lambda"] and ppo.ppo.num_envs == 8
    assert ppo.ppo.learning_rate == ppo_h["learning_rate"] and ppo.ppo.num_steps == 16
    assert sac.sac.tau == sac_h["tau"] and sac.num_envs == 8 and sac.batch_size == 64
    assert sac.sac.learning_rate == sac_h["learning_rate"]
    assert "tau" not in ppo.ppo.model_dump() and "gae_lambda" not in sac.model_dump()
    with lb.api() as api:
        board = api.get("/experiments/e3/leaderboard").json()["candidates"]
    assert {c["algorithm"] for c in board} == {"ppo", "sac"}
    # Candidates carry every name of the search space: the strategies work on all of them.
    assert all(set(c["hyperparameters"]) == set(spec["search_space"]) for c in board)
    for rt in pods.values():
        rt.close()


def test_hyperparameter_names_are_checked_against_the_listed_algorithms() -> None:
    mixed = ExperimentSpec.model_validate(
        make_spec(env={"name": "Pendulum-v1"}, algorithms={"ppo": 1.0, "sac": 1.0})
    )
    config = pod_config(mixed, {"tau": 0.02, "gae_lambda": 0.9}, seed=1, algorithm="sac")
    assert isinstance(config, OffPolicyConfig) and config.sac.tau == 0.02
    config = pod_config(mixed, {"tau": 0.02, "gae_lambda": 0.9}, seed=1, algorithm="ppo")
    assert isinstance(config, PPORunConfig) and config.ppo.gae_lambda == 0.9
    with pytest.raises(HyperparameterError, match="several algorithms"):
        pod_config(mixed, {}, seed=1)
    sac = ExperimentSpec.model_validate(sac_spec())
    with pytest.raises(HyperparameterError, match="'gae_lambda'.*sac: .*tau"):
        pod_config(sac, {"gae_lambda": 0.9}, seed=1)
    with pytest.raises(HyperparameterError, match=r"sac\.tau"):
        pod_config(sac, {"tau": 2.0}, seed=1)
    with pytest.raises(HyperparameterError, match="batch_size"):
        pod_config(sac, {"batch_size": 0}, seed=1)
    with pytest.raises(HyperparameterError, match="not trainable by a pod"):
        pod_config(sac, {}, seed=1, algorithm="a3c")
    check_hyperparameter_names(["tau", "gae_lambda"], ["ppo", "sac"])
    with pytest.raises(HyperparameterError, match="'tau'"):
        check_hyperparameter_names(["tau", "gae_lambda"], ["ppo"])
    # The spec refuses at submission what no listed algorithm takes, naming the field.
    with pytest.raises(ValidationError, match="'gae_lambda' not hyperparameters of 'sac'"):
        ExperimentSpec.model_validate(
            {**sac_spec(), "search_space": {"gae_lambda": {"type": "choice", "values": [0.9]}}}
        )


@pytest.mark.parametrize(
    ("env", "algorithm", "message"),
    [
        ("Pendulum-v1", "dqn", "cannot train dqn on Pendulum-v1: dqn needs a Discrete"),
        ("CartPole-v1", "sac", "cannot train sac on CartPole-v1: sac needs a continuous"),
        ("Pendulum-v1", "portfolio_gradient", "portfolio_gradient trains StockTrading-v0 only"),
    ],
)
def test_an_algorithm_the_env_cannot_take_is_a_clear_error(
    tmp_path: Path, env: str, algorithm: str, message: str
) -> None:
    # The spec refuses this pairing at submission (services/contracts/envs.py): the
    # pod's own check is the defence for a spec that reaches it anyway, built unvalidated here.
    spec = make_spec(env={"name": env}, algorithms={"ppo": 1.0}, search_space={})
    rt = runtime(Leaderboard(tmp_path), "e", spec, "pod", tmp_path)  # never contacted
    rt.spec = rt.spec.model_copy(update={"algorithms": {algorithm: 1.0}})
    manifest = Manifest(
        experiment_id="e",
        pod_id="pod",
        algorithm=algorithm,
        hyperparameters={},
        parent_id=None,
        generation=0,
        checkpoint="fresh",
        decision="fresh",
        strategy="pbt",
    )
    with pytest.raises(HyperparameterError, match=message):
        rt.start([manifest])
    rt.close()


def test_a_sac_pod_process_reports_on_sigterm(lb: Leaderboard, tmp_path: Path) -> None:
    spec = sac_spec()
    register(lb, "e4", spec)
    pod_dir = tmp_path / "pods"
    pod_dir.mkdir()
    log_path = tmp_path / "pod.log"
    proc = start_pod(lb, "e4", "p0", spec, pod_dir, log_path)
    with lb.api() as api:

        def submitted_twice() -> bool:
            return api.get("/experiments/e4").json()["submissions"] >= 2

        lines = sigterm_pod_when(proc, log_path, submitted_twice)
    events = [line["event"] for line in lines]
    reports = [line for line in lines if line["event"] == "reported"]
    assert reports[-1]["final"] is True or "nothing trained" in events[-2]
    with lb.api() as api:
        assert api.get("/experiments/e4").json()["submissions"] == len(reports)
        board = api.get("/experiments/e4/leaderboard").json()["candidates"]
    assert {c["algorithm"] for c in board} == {"sac"}
    assert events[-1] == "pod stopped"


def test_a_pod_asked_to_stop_while_compiling_stops_at_once(lb: Leaderboard, tmp_path: Path):
    """SIGTERM during a compile (a cold one: a minute on a loaded CPU) abandons it: the pod
    exits 0 at once, saying so, instead of finishing a compile nobody will use."""
    spec = sac_spec()
    spec["search_space"] = {**spec["search_space"], "compile": {"type": "choice", "values": ["on"]}}
    register(lb, "e5", spec)
    pod_dir, log_path, cold = tmp_path / "pods", tmp_path / "pod.log", tmp_path / "cold-cache"
    pod_dir.mkdir()
    cache = {"PODIUM_COMPILE_CACHE_DIR": str(cold), "TORCHINDUCTOR_CACHE_DIR": str(cold)}
    proc = start_pod(lb, "e5", "p0", spec, pod_dir, log_path, **cache)
    lines = sigterm_pod_when(proc, log_path, lambda: '"compiling"' in log_path.read_text())
    events = [line["event"] for line in lines if line["event"] != "pod activity"]
    assert events[-1].startswith("stopped while compiling"), events[-3:]
    assert "compile.done" not in events
