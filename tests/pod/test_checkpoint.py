"""Training files: bit-exact round trip, and every kind of damage is a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from services.pod.config import PPORunConfig
from services.pod.training.checkpoint import (
    CheckpointError,
    read_agent_files,
    read_files,
    tensor_bytes,
    write_files,
)
from services.pod.training.onpolicy import load_ppo_files, save_ppo_files
from services.pod.training.presets import preset
from tests.pod.harness import ppo_trainer


def trained(env: str = "Pendulum-v1", seed: int = 0):
    cfg = PPORunConfig.model_validate(
        {**preset("ppo", env), "seed": seed, "ppo": {"num_envs": 8, "num_steps": 16}}
    )
    trainer = ppo_trainer(cfg)
    for _ in range(3):
        trainer.step()
    return cfg, trainer


def save(trainer, path) -> None:
    counters = trainer.counters(0)
    save_ppo_files(
        path, trainer.agent(0), trainer.config(0),
        {"env_steps": counters.env_steps, "updates": counters.updates},
    )  # fmt: skip


def all_tensors(trainer) -> dict[str, torch.Tensor]:
    agent = trainer.agent(0)
    out = {f"agent.{k}": v for k, v in agent.state_dict().items()}
    for index, state in agent.optimizer.state_dict()["state"].items():
        for name, value in state.items():
            out[f"opt.{index}.{name}"] = value
    return out


@pytest.mark.parametrize("env", ["Pendulum-v1", "CartPole-v1"])
def test_round_trip_is_bit_exact(tmp_path, env):
    cfg, trainer = trained(env)
    save(trainer, tmp_path / "ckpt")

    _, fresh = trained(env, seed=123)  # different weights before loading
    fresh.load(0, tmp_path / "ckpt", cfg)

    before, after = all_tensors(trainer), all_tensors(fresh)
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype, key
        assert torch.equal(before[key], after[key]), key
    assert fresh.counters(0) == trainer.counters(0)
    lr = [g["lr"] for g in fresh.agent(0).optimizer.state_dict()["param_groups"]]
    assert lr == [cfg.ppo.learning_rate]
    files = read_files(tmp_path / "ckpt")
    assert files.documents["hyperparameters"] == trainer.config(0).model_dump(mode="json")


def test_continued_training_is_identical_after_reload(tmp_path):
    cfg, trainer = trained()
    save(trainer, tmp_path / "ckpt")
    _, copy = trained(seed=99)
    copy.load(0, tmp_path / "ckpt", cfg)
    roll = trainer.population.collect()
    iteration = trainer.population.state["iteration"].clone()
    for t in (trainer, copy):  # the same rollout, the same update: the same agent
        t.population.state["iteration"].copy_(iteration)
        t.population.learn(roll)
    for key, value in trainer.agent(0).state_dict().items():
        assert torch.equal(value, copy.agent(0).state_dict()[key]), key


def test_save_replaces_atomically_and_leaves_no_temp_dirs(tmp_path):
    _, trainer = trained()
    save(trainer, tmp_path / "ckpt")
    trainer.step()
    save(trainer, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert read_files(tmp_path / "ckpt").documents["counters"]["updates"] == 4


@pytest.fixture
def saved(tmp_path):
    _, trainer = trained()
    save(trainer, tmp_path / "ckpt")
    return tmp_path / "ckpt", trainer.agent(0)


def test_truncated_file_is_rejected(saved):
    path, learner = saved
    data = (path / "actor.safetensors").read_bytes()
    (path / "actor.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="actor.safetensors.*truncated or modified"):
        load_ppo_files(path, learner)


def test_tampered_weights_are_rejected(saved):
    path, learner = saved
    data = bytearray((path / "critic.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "critic.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="critic.safetensors"):
        load_ppo_files(path, learner)


def test_missing_file_and_missing_manifest(saved):
    path, learner = saved
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(CheckpointError, match="optimizer.safetensors is missing"):
        load_ppo_files(path, learner)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a Podium checkpoint"):
        read_files(path)


def test_manifest_cannot_point_outside_the_directory(saved):
    path, _ = saved
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["../escape.json"] = {"sha256": "0" * 64, "bytes": 1}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="bad file name"):
        read_files(path)


def test_checkpoint_of_another_architecture_is_rejected(saved, tmp_path):
    path, _ = saved
    cfg = PPORunConfig.model_validate(
        {**preset("ppo", "Pendulum-v1"), "ppo": {"num_envs": 8, "hidden_sizes": [32]}}
    )
    other = ppo_trainer(cfg).agent(0)
    with pytest.raises(CheckpointError, match="does not fit"):
        load_ppo_files(path, other)


def test_files_of_another_algorithm_or_without_a_needed_file_are_refused(tmp_path):
    """``read_agent_files``, every trainer's load check: the algorithm the files name, then
    the tensor files the agent needs."""
    actor = tensor_bytes({"w": torch.zeros(2)})
    write_files(tmp_path / "a", {"actor.safetensors": actor}, {"algorithm": "ppo"})
    assert read_agent_files(tmp_path / "a", "ppo", {"actor"}).tensors["actor"]["w"].shape == (2,)
    with pytest.raises(CheckpointError, match="checkpoint of 'ppo', agent is 'sac'"):
        read_agent_files(tmp_path / "a", "sac", {"actor", "critic"})  # the algorithm first
    with pytest.raises(CheckpointError, match=r"missing \['critic', 'optimizer'\]"):
        read_agent_files(tmp_path / "a", "ppo", {"actor", "critic", "optimizer"})


def test_pickle_is_never_loaded(saved):
    """A .pt/pickle file smuggled into the manifest is not parsed at all."""
    path, learner = saved
    payload = b"cos\nsystem\n(S'touch /tmp/podium-pwned'\ntR."
    (path / "evil.pt").write_bytes(payload)
    manifest = json.loads((path / "manifest.json").read_text())
    import hashlib

    manifest["files"]["evil.pt"] = {
        "sha256": hashlib.sha256(payload).hexdigest(),
        "bytes": len(payload),
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    files = load_ppo_files(path, learner)
    assert "evil" not in files.tensors and "evil" not in files.documents
