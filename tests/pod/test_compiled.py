"""The compiled on-device loop (services/pod/algorithms/compiled.py): the same numbers as eager,
eager where it cannot compile (logged), and no recompilation when PBT rebuilds the agent.

Compiling costs tens of seconds on a small shared CPU, so the tests that compile are ``slow``;
they share one process's dynamo cache (a graph compiled by one is reused by the next).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.spec import ExperimentSpec
from services.pod.algorithms.compiled import AUTO_MIN_ENVS, compile_counters, should_compile
from services.pod.algorithms.rollout import Rollout
from services.pod.config import PPORunConfig
from services.pod.envs.cartpole import CartPoleEnv
from services.pod.roles.rollout_roles import build_agent, make_worker
from services.pod.roles.worker import FusedRolloutWorker, RolloutWorker
from services.pod.training.onpolicy import OnPolicyTrainer
from services.pod.training.presets import pod_config

ROOT = Path(__file__).resolve().parents[2]


def _config(env: str = "CartPole-v1", compile: str = "on", **ppo: object) -> PPORunConfig:
    sde = {"sde_sample_freq": 4} if env == "Pendulum-v1" else {}
    return PPORunConfig.model_validate(
        {
            "env": env,
            "seed": 3,
            "total_env_steps": 10_000,
            "ppo": {"num_envs": 8, "num_steps": 8, "compile": compile, **sde, **ppo},
        }
    )


def _rollout_and_update(
    env_cls_or_id: str | type, compile: bool, device: str = "cpu"
) -> tuple[Rollout, dict]:
    env_id = env_cls_or_id if isinstance(env_cls_or_id, str) else "CartPole-v1"
    cfg = _config(env_id, compile="off").model_copy(update={"device": device})
    env, _, agent = build_agent(cfg)
    if not isinstance(env_cls_or_id, str):
        env = env_cls_or_id(8, seed=cfg.seed)
    agent.compiled = compile
    worker = FusedRolloutWorker(env, agent.policy, 8, cfg.ppo.gamma, cfg.seed, compile=compile)
    worker.collect()
    rollout = worker.collect()  # a second one: statistics and episodes carried over
    return rollout, agent.update(rollout)


def _assert_close(a: Rollout, b: Rollout) -> None:
    for name, x in a.tensors().items():
        y = b.tensors()[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if x.dtype == torch.bool or not x.dtype.is_floating_point:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=name)


def test_auto_compiles_only_where_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not should_compile("off", "cpu", 10**6)
    assert should_compile("on", "cpu", 1)
    assert not should_compile("auto", "cuda", 10**6)  # unmeasured: not on by default
    # The CPU measured slower end to end at every size (docs/benchmarks.md).
    assert not should_compile("auto", "cpu", 10**6)
    monkeypatch.setitem(AUTO_MIN_ENVS, "cpu", 4096)  # as a measurement that paid would set it
    assert not should_compile("auto", "cpu", 4095)
    assert should_compile("auto", "cpu", 4096)


def test_a_spec_sets_compile_for_its_pods() -> None:
    # One-value choice in the search space: every pod of the experiment takes it.
    spec = ExperimentSpec.model_validate(
        {
            "name": "compiled",
            "env": {"name": "CartPole-v1"},
            "algorithms": {"ppo": 1.0},
            "search_space": {"compile": {"type": "choice", "values": ["on"]}},
        }
    )
    config = pod_config(spec, {"compile": "on"}, seed=0)
    assert isinstance(config, PPORunConfig) and config.ppo.compile == "on"
    with pytest.raises(HyperparameterError, match="compile"):
        pod_config(spec, {"compile": "sometimes"}, seed=0)


def test_an_env_that_is_not_torch_native_rolls_out_eager_and_says_so() -> None:
    cfg = _config("gym:CartPole-v1")
    env, eval_env, agent = build_agent(cfg)
    try:
        assert agent.compiled  # the update still compiles: it does not touch the env
        with capture_logs() as logs:
            worker = make_worker(cfg, env, agent)
        assert type(worker) is RolloutWorker
        assert [e["event"] for e in logs] == ["compile.env_not_torch_native"]
    finally:
        env.close()
        eval_env.close()


def test_off_keeps_the_eager_worker_and_update() -> None:
    cfg = _config(compile="off")
    env, _, agent = build_agent(cfg)
    assert not agent.compiled
    assert type(make_worker(cfg, env, agent)) is RolloutWorker


def _run_child(code: str, **env: str) -> dict:
    child_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"result": json.loads(proc.stdout.strip().splitlines()[-1]), "log": proc.stderr}


_TRAIN_ONE_STEP = """
    import json
    from services.pod.training.fit import train
    from services.pod.training.onpolicy import OnPolicyTrainer
    from services.pod.config import PPORunConfig
    cfg = PPORunConfig.model_validate({"total_env_steps": 64, "eval_every_steps": 10**9,
        "ppo": {"num_envs": 8, "num_steps": 8, "compile": "on"}})
    trainer = OnPolicyTrainer([cfg])
    result = train(cfg, trainer=trainer)
    print(json.dumps({"compiled": trainer.learner.agent.compiled,
                      "worker": type(trainer.roles.worker).__name__,
                      "env_steps": trainer.learner.env_steps}))
"""


@pytest.mark.parametrize("missing", ["path", "cxx"])
def test_no_cxx_compiler_means_eager_with_a_log_line(tmp_path: Path, missing: str) -> None:
    # The pod's own process, with no C++ compiler to find: on PATH (an empty directory) or
    # where $CXX points.
    env = {"PATH": str(tmp_path)} if missing == "path" else {"CXX": str(tmp_path / "g++")}
    out = _run_child(_TRAIN_ONE_STEP, **env)
    assert out["result"] == {"compiled": False, "worker": "RolloutWorker", "env_steps": 64}
    assert "compile.unavailable" in out["log"] and "no C++ compiler" in out["log"]


@pytest.mark.slow
def test_a_compiler_that_fails_falls_back_to_eager(tmp_path: Path) -> None:
    # A compiler that is there but fails every build (/bin/false): found, tried, failed at
    # the first call, and the run goes on eager.
    out = _run_child(_TRAIN_ONE_STEP, CXX="false", TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    assert out["result"] == {"compiled": True, "worker": "FusedRolloutWorker", "env_steps": 64}
    assert out["log"].count("compile.failed") == 2  # rollout step and loss, each once


class HostReadingCartPole(CartPoleEnv):
    """A plugin-style torch env whose step reads a value on the host: dynamo cannot capture it
    whole (a graph break, an error under fullgraph)."""

    def _physics_step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        reward, terminated = super()._physics_step(actions)
        if float(self.state[:, 0].abs().max()) > 1e9:  # never, but read on the host
            reward = reward * 0
        return reward, terminated


@pytest.mark.slow
def test_an_env_dynamo_cannot_capture_runs_eager_with_the_same_rollout() -> None:
    with capture_logs() as logs:
        compiled, _ = _rollout_and_update(HostReadingCartPole, compile=True)
    failed = [e for e in logs if e["event"] == "compile.failed"]
    assert [e["function"] for e in failed] == ["rollout_step"]
    assert "HostReadingCartPole" in failed[0]["key"]
    eager, _ = _rollout_and_update(HostReadingCartPole, compile=False)
    _assert_close(compiled, eager)


@pytest.mark.slow
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_compiled_rollout_and_update_match_eager(env_id: str) -> None:
    eager_rollout, eager_stats = _rollout_and_update(env_id, compile=False)
    compiled_rollout, compiled_stats = _rollout_and_update(env_id, compile=True)
    _assert_close(compiled_rollout, eager_rollout)
    assert compiled_rollout.episode_returns.numel() or env_id == "Pendulum-v1"
    for name, value in eager_stats.items():
        assert compiled_stats[name] == pytest.approx(value, rel=1e-3, abs=1e-5), name


@pytest.mark.slow
def test_a_pbt_restart_does_not_recompile(tmp_path: Path) -> None:
    trainer = OnPolicyTrainer([_config()])
    assert isinstance(trainer.roles.worker, FusedRolloutWorker)
    trainer.step()  # compiles the rollout step and the loss (or finds them compiled)
    trainer.save(0, tmp_path)
    before = compile_counters()
    # PBT's exploit and explore: the parent's files, new weights and hyperparameters, a new
    # seed; the trainer rebuilds its agent, envs and worker.
    child = _config(
        learning_rate=1e-3, ent_coef=0.02, clip_coef=0.3, vf_coef=0.7, gamma=0.97, anneal_lr=False
    )
    child = child.model_copy(update={"seed": 11})
    trainer.load(0, tmp_path, child)
    trainer.step()
    trainer.step()
    assert compile_counters() == before
    agent = trainer.learner.agent
    assert agent.optimizer.param_groups[0]["lr"] == 1e-3 and agent.config.ent_coef == 0.02


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_compiled_loop_on_cuda_matches_eager(env_id: str) -> None:
    # CUDA graphs (mode="reduce-overhead") replay the step: the same numbers as eager.
    eager_rollout, eager_stats = _rollout_and_update(env_id, compile=False, device="cuda")
    compiled_rollout, compiled_stats = _rollout_and_update(env_id, compile=True, device="cuda")
    assert compiled_rollout.obs.is_cuda
    _assert_close(compiled_rollout, eager_rollout)
    for name, value in eager_stats.items():
        assert compiled_stats[name] == pytest.approx(value, rel=1e-3, abs=1e-5), name
