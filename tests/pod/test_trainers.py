"""The trainer contract, for every way the pod trains (services/pod/trainer.py), in the style of
Stable-Baselines3's tests/test_save_load.py: step, evaluate, save every slot, load the files
into a fresh trainer in a FRESH PROCESS (which scores what this one scored and goes on from the
saved counters), continue, count. And a plugin algorithm registered through a real entry
point trains end to end, spec to trainer; one that does not declare how it trains is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.contracts.spec import ExperimentSpec
from services.pod.algorithms.hyperparameters import HyperparameterError
from services.pod.fit import train
from services.pod.presets import pod_config, preset, train_config
from services.pod.trainer import RunConfig, Trainer, trainer_class
from tests.pod.harness import ROOT
from tests.pod.plugins import register_plugin

SMALL_REPLAY = {
    "num_envs": 4,
    "learning_starts": 32,
    "batch_size": 16,
    "buffer_size": 500,
    "eval_episodes": 2,
}


def configs(kind: str) -> list[dict[str, Any]]:
    """Small configs of every trainer (one per slot), as a pod or ``podium train`` makes
    them: the preset with a few fields on top; evaluated on shared start states, as a pod's."""
    if kind == "population":
        ppo = {**preset("ppo", "CartPole-v1"), "eval_episodes": 2, "eval_seed": 1234}
        return [
            {**ppo, "seed": 5 + i, "ppo": {**ppo["ppo"], "num_envs": 4, "learning_rate": lr}}
            for i, lr in enumerate((3e-3, 5e-3, 8e-3))
        ]
    if kind == "ppo":
        ppo = preset("ppo", "CartPole-v1")
        return [
            {**ppo, "eval_episodes": 2, "eval_seed": 1234, "ppo": {**ppo["ppo"], "num_envs": 4}}
        ]
    if kind == "portfolio_gradient":
        pg = preset(kind, "StockTrading-v0")
        return [{**pg, "eval_episodes": 2, "env_kwargs": {**pg["env_kwargs"], "num_days": 600}}]
    env = "CartPole-v1" if kind == "dqn" else "Pendulum-v1"
    return [{**preset(kind, env), **SMALL_REPLAY}]


def build(raw: list[dict[str, Any]]) -> Trainer:
    cls = trainer_class(raw[0]["algorithm"], len(raw))
    return cls([cls.config_class.model_validate(c) for c in raw])


def steps_to_update(trainer: Trainer) -> int:
    """Steps until the trainer has made at least one update (off-policy: after
    ``learning_starts``)."""
    steps = 0
    while trainer.updates == 0:
        trainer.step()
        steps += 1
    return steps


CHILD = """
import json, sys
from pathlib import Path
from tests.pod.test_trainers import build

raw, directory = json.loads(sys.argv[1]), Path(sys.argv[2])
trainer = build(raw)  # fresh weights, seeded otherwise: loading must replace them
for i in range(trainer.size):
    trainer.load(i, directory / f"slot{i}", trainer.config(i))
loaded = [list(vars(trainer.counters(i)).values()) for i in range(trainer.size)]
scores = [r.mean for r in trainer.evaluate()]
before = trainer.env_steps
trainer.step()
trainer.save(0, directory / "continued")
print(json.dumps({"loaded": loaded, "scores": scores, "stepped": trainer.env_steps - before,
                  "step": trainer.step_env_steps}))
"""


@pytest.mark.parametrize(
    "kind", ["ppo", "sac", "td3", "ddpg", "dqn", "portfolio_gradient", "population"]
)
def test_step_evaluate_save_load_in_a_fresh_process_continue(tmp_path: Path, kind: str) -> None:
    raw = configs(kind)
    trainer = build(raw)
    assert trainer.size == len(raw)
    step = trainer.step_env_steps
    # Step: the clock counts per slot, every step adds what it said it would.
    steps = steps_to_update(trainer)
    assert trainer.env_steps == steps * step and trainer.updates >= 1
    # How it trains: the training episodes' return, or (the portfolio gradient, which plays
    # no episodes) the train period's Sharpe.
    trained = set(trainer.progress()) & {"train_return", "train_sharpe"}
    assert trained or trainer.one_update_per_step is False
    # Evaluate: one finite result per slot, on the evaluation env's episodes.
    results = trainer.evaluate()
    assert len(results) == trainer.size
    assert all(len(r.episodes) == 2 for r in results)
    # Save every slot; each slot's files hold its own config and counters.
    for i in range(trainer.size):
        trainer.save(i, tmp_path / f"slot{i}")
        assert trainer.config(i).seed == raw[i].get("seed", 0)
    counters = [[c.env_steps, c.updates] for c in map(trainer.counters, range(trainer.size))]
    trainer.close()

    # Load into a fresh trainer in a fresh process; continue there.
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(raw), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["loaded"] == counters  # the counters go on from the files
    assert child["scores"] == pytest.approx([r.mean for r in results], rel=1e-5)
    assert child["stepped"] == child["step"] == step  # and training goes on from there
    # What the fresh process saved after continuing loads again, with the counters moved on.
    again = build(raw[:1])
    again.load(0, tmp_path / "continued", again.config(0))
    assert again.counters(0).env_steps == counters[0][0] + step
    again.close()


def test_a_population_slot_takes_a_single_agents_files(tmp_path: Path) -> None:
    """PBT across kinds of pods: a single PPO agent's files go into a population's slot (and
    a slot's files are a single agent's: the test above loads them back)."""
    single = build(configs("ppo"))
    steps_to_update(single)
    single.save(0, tmp_path / "single")
    [expected] = single.evaluate()
    population = build(configs("population"))
    config = population.config(1).model_copy(update={"ppo": single.config(0).ppo})
    population.load(1, tmp_path / "single", config)
    assert population.counters(1) == single.counters(0)
    assert population.evaluate()[1].mean == pytest.approx(expected.mean, rel=1e-5)


def test_a_population_refuses_gsde_and_target_kl() -> None:
    raw = configs("population")
    for change in ({"sde_sample_freq": 4}, {"target_kl": 0.02}):
        changed = [{**c, "ppo": {**c["ppo"], **change}} for c in raw]
        name = next(iter(change))
        with pytest.raises(HyperparameterError, match=f"without gSDE and target_kl.*{name}"):
            build(changed)


PLUGIN = """
from services.pod.algorithms.ddpg import DDPG
from services.pod.algorithms.offpolicy_config import DDPGConfig


class NoisyConfig(DDPGConfig):
    exploration_noise: float = 0.3
    noise_decay: float = 1.0  # a hyperparameter no built-in algorithm has


class NoisyDDPG(DDPG):
    name = "noisy_ddpg"
    config_class = NoisyConfig


class Undeclared:
    name = "bare"
"""


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two algorithms registered through the real entry-point mechanism."""
    algorithms = {"noisy_ddpg": "podium_noisy:NoisyDDPG", "bare": "podium_noisy:Undeclared"}
    # Its config model torch-free, where the control plane finds it by name (no import).
    configs = {"noisy_ddpg": "podium_noisy:NoisyConfig"}
    register_plugin(
        tmp_path,
        monkeypatch,
        "podium_noisy",
        PLUGIN,
        {"podium.algorithms": algorithms, "podium.algorithm_configs": configs},
    )


@pytest.mark.usefixtures("plugins")
def test_a_plugin_algorithm_trains_end_to_end(tmp_path: Path) -> None:
    # podium train: its preset layers, its own config field, the one fit loop.
    layers = [{"algorithm": "noisy_ddpg", **SMALL_REPLAY, "total_env_steps": 96}]
    config = train_config("Pendulum-v1", [*layers, {"noisy_ddpg": {"noise_decay": 0.5}}])
    assert config.noisy_ddpg.noise_decay == 0.5  # type: ignore[attr-defined]
    result = train(config, out_dir=tmp_path)
    assert result.history and result.history[-1]["env_steps"] == 96
    manifest = json.loads((tmp_path / "checkpoints" / "latest" / "manifest.json").read_text())
    assert manifest["algorithm"] == "noisy_ddpg"
    # A pod: the spec names it, the generator's hyperparameters go to its config or the loop.
    spec = ExperimentSpec.model_validate(
        {
            "name": "plugin",
            "env": {"name": "Pendulum-v1"},
            "algorithms": {"noisy_ddpg": 1.0},
            "search_space": {"noise_decay": {"type": "choice", "values": [0.9]}},
        }
    )
    pod = pod_config(spec, {"noise_decay": 0.9, "batch_size": 32}, seed=3)
    assert isinstance(pod, RunConfig) and pod.algorithm == "noisy_ddpg"
    assert pod.noisy_ddpg.noise_decay == 0.9 and pod.batch_size == 32  # type: ignore[attr-defined]


@pytest.mark.usefixtures("plugins")
def test_an_algorithm_that_does_not_declare_how_it_trains_is_refused() -> None:
    with pytest.raises(HyperparameterError, match="'bare'.*does not declare config_class"):
        train_config("Pendulum-v1", [{"algorithm": "bare"}])
    with pytest.raises(HyperparameterError, match="'nope' is not trainable by a pod"):
        train_config("Pendulum-v1", [{"algorithm": "nope"}])


def test_every_preset_file_is_a_valid_run_config() -> None:
    """The presets are data (services/pod/presets/<algorithm>/<env>.yaml): each one validates
    against its algorithm's run config, a typo in one is caught here, not by a user."""
    from services.pod.algorithms.hyperparameters import preset_files

    shipped = sorted(preset_files())
    assert ("ppo", "CartPole-v1") in shipped and ("sac", "Pendulum-v1") in shipped
    for algorithm, env in shipped:
        config = trainer_class(algorithm).config_class.model_validate(preset(algorithm, env))
        assert (config.algorithm, config.env) == (algorithm, env)
