"""Three-process mode (worker and evaluator processes, learner here, linked by a Unix socket and
shared-memory files) trains the same agent as the fused mode for the same seed, reloads weights
on a rebuild, and reports a role's failure or death."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.pod.config import PPORunConfig
from services.pod.roles.multiprocess import ProcessRoles, RoleError
from services.pod.training.onpolicy import OnPolicyTrainer
from services.pod.training.presets import preset
from tests.pod.harness import ppo_trainer
from tests.pod.plugins import register_plugin


def config(**over) -> PPORunConfig:
    base = preset("ppo", "CartPole-v1")
    base.update(seed=3, eval_episodes=4, **over)
    # Eager on both sides: the processes' rollouts run eager, the update is the learner's.
    base["ppo"] = {**base["ppo"], "compile": "off"}
    return PPORunConfig.model_validate(base)


def run(roles, cfg: PPORunConfig, updates: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    trainer = OnPolicyTrainer([cfg], roles)  # roles None: in this process
    scores = []
    for i in range(updates):
        trainer.step()
        if i % 4 == 3:
            scores.append(trainer.evaluate()[0].mean)
    return {k: v.clone() for k, v in trainer.agent(0).state_dict().items()}, scores


@pytest.fixture(scope="module")
def processes():
    roles = ProcessRoles(threads=1)
    yield roles
    roles.close()


def test_processes_train_the_same_agent_as_fused(processes: ProcessRoles) -> None:
    torch.set_num_threads(1)
    cfg = config()
    fused_state, fused_scores = run(None, cfg, 12)
    proc_state, proc_scores = run(processes, cfg, 12)
    assert processes.peers["worker"].version >= 12  # the worker took the weights each time
    for name, value in fused_state.items():
        torch.testing.assert_close(proc_state[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert proc_scores == pytest.approx(fused_scores, rel=1e-3)
    # Training moved the weights, so equality above is not two untouched initialisations.
    fresh = ppo_trainer(cfg).agent(0)
    assert not torch.equal(fresh.state_dict()["critic.0.weight"], proc_state["critic.0.weight"])


def test_rebuild_reuses_the_processes_and_takes_new_weights(processes: ProcessRoles) -> None:
    pids = {name: p.pid for name, p in processes.processes.items()}
    cfg = config(ppo={**preset("ppo", "CartPole-v1")["ppo"], "num_envs": 8})
    trainer = OnPolicyTrainer([cfg], processes)
    with torch.no_grad():  # a policy that always pushes left: episodes end after ~9 steps
        trainer.population.state["params"].zero_()
    [first] = trainer.evaluate()
    assert first.mean < 15
    trainer.step()
    assert trainer.env_steps == 8 * 16  # the worker rebuilt its env with the new num_envs
    assert {name: p.pid for name, p in processes.processes.items()} == pids


PLUGIN = """
from services.pod.envs.cartpole import CartPoleEnv


class ExplodingCartPole(CartPoleEnv):
    def step(self, action):
        raise RuntimeError("simulator exploded")
"""


def test_a_failing_role_is_reported_with_its_error(tmp_path: Path, monkeypatch) -> None:
    # A plugin env registered through the real entry-point mechanism; spawned processes get
    # this sys.path too.
    envs = {"Exploding-v0": "podium_exploding_env:ExplodingCartPole"}
    register_plugin(tmp_path, monkeypatch, "podium_exploding_env", PLUGIN, {"podium.envs": envs})
    roles = ProcessRoles(threads=1)
    try:
        trainer = OnPolicyTrainer([config(env="Exploding-v0")], roles)
        with pytest.raises(RoleError, match="the worker failed: RuntimeError: simulator"):
            trainer.step()
    finally:
        roles.close()
    assert all(not p.is_alive() for p in roles.processes.values())
    assert not roles.directory.exists()  # socket and shared files are gone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_processes_on_cuda_train_the_same_agent_as_fused() -> None:
    cfg = config(device="cuda")
    fused_state, fused_scores = run(None, cfg, 8)
    roles = ProcessRoles(threads=1)
    try:
        proc_state, proc_scores = run(roles, cfg, 8)
    finally:
        roles.close()
    for name, value in fused_state.items():
        torch.testing.assert_close(proc_state[name], value, rtol=1e-3, atol=1e-4, msg=name)
    assert proc_scores == pytest.approx(fused_scores, rel=1e-2)
