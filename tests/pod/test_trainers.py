"""The trainer contract, for every way the pod trains (services/pod/training/trainer.py), in the
style of Stable-Baselines3's tests/test_save_load.py: step, evaluate, save every slot, load the
files into a fresh trainer in a FRESH PROCESS (which scores what this one scored and goes on from
the saved counters), continue, count. And a plugin algorithm registered through a real entry
point trains end to end, spec to trainer; one that does not declare how it trains is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.spec import ExperimentSpec
from services.pod.training.fit import fit, train
from services.pod.training.presets import pod_config, preset, train_config
from services.pod.training.trainer import RunConfig, Trainer, trainer_class
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
    if kind == "ppo-host":  # PPO on a host-stepped env (gymnasium's CartPole)
        return [{**c, "env": "gym:CartPole-v1"} for c in configs("ppo")]
    if kind == "ppo-gsde-population":  # a population with gSDE and the KL early stop
        ppo = {**preset("ppo", "Pendulum-v1"), "eval_episodes": 2, "eval_seed": 1234}
        ppo["env_kwargs"] = {"max_episode_steps": 16}  # episodes end within a rollout
        small = {"num_envs": 8, "num_steps": 16, "num_minibatches": 2, "target_kl": 0.02}
        return [
            {**ppo, "seed": 5 + i, "ppo": {**ppo["ppo"], **small, "learning_rate": lr}}
            for i, lr in enumerate((1e-3, 3e-3))
        ]
    if kind.startswith("portfolio_gradient"):  # portfolio_gradient, portfolio_gradient-population
        pg = preset("portfolio_gradient", "StockTrading-v0")
        pg = {**pg, "eval_episodes": 2, "env_kwargs": {**pg["env_kwargs"], "num_days": 600}}
        if kind == "portfolio_gradient":
            return [pg]
        return [
            {**pg, "seed": 5 + i, "portfolio_gradient": {"learning_rate": lr, "l2": l2}}
            for i, (lr, l2) in enumerate(((0.02, 1e-3), (0.05, 1e-2), (0.1, 1e-4)))
        ]
    if kind == "population":
        ppo = {**preset("ppo", "CartPole-v1"), "eval_episodes": 2, "eval_seed": 1234}
        return [
            {**ppo, "seed": 5 + i, "ppo": {**ppo["ppo"], "num_envs": 4, "learning_rate": lr}}
            for i, lr in enumerate((3e-3, 5e-3, 8e-3))
        ]
    if kind.endswith("-population"):  # sac-population, td3-population, dqn-population
        name = kind.removesuffix("-population")
        env = "CartPole-v1" if name == "dqn" else "Pendulum-v1"
        base = {**preset(name, env), **SMALL_REPLAY, "eval_seed": 1234}
        return [
            {**base, "seed": 5 + i, name: {**base[name], "learning_rate": lr, "tau": tau}}
            for i, (lr, tau) in enumerate(((1e-3, 0.01), (2e-3, 0.02), (3e-3, 0.05)))
        ]
    if kind == "ppo":
        ppo = preset("ppo", "CartPole-v1")
        return [
            {**ppo, "eval_episodes": 2, "eval_seed": 1234, "ppo": {**ppo["ppo"], "num_envs": 4}}
        ]
    env = "CartPole-v1" if kind == "dqn" else "Pendulum-v1"
    return [{**preset(kind, env), **SMALL_REPLAY}]


def build(raw: list[dict[str, Any]], kind: str = "") -> Trainer:
    """The family's trainer for ``raw``."""
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
    "kind",
    [
        "ppo",
        "sac",
        "td3",
        "ddpg",
        "dqn",
        "portfolio_gradient",
        "portfolio_gradient-population",
        "population",
        "sac-population",
        "td3-population",
        "dqn-population",
        "ppo-host",
        "ppo-gsde-population",
    ],
)
def test_step_evaluate_save_load_in_a_fresh_process_continue(tmp_path: Path, kind: str) -> None:
    """The fresh process loads with the family's own trainer: a population slot's files load
    into a single-agent pod (and a population pod's slot)."""
    raw = configs(kind)
    trainer = build(raw, kind)
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


@pytest.mark.parametrize("kind", ["ppo", "sac"])
def test_the_training_clock_waits_for_the_steps_to_be_done(monkeypatch, kind: str) -> None:
    """fit's clock (train_seconds, the steps/s ``podium train`` shows) counts steps until
    their work is done, ``Trainer.wait``: on a CUDA device a step returns once it is launched
    (a CUDA graph's replay), and the clock counted launches alone (2.5M env steps/s
    reported for an H200 training at 115k). A record per step (PPO), or per evaluation."""
    trainer = build(configs(kind), kind)
    waited: list[float] = []

    def finishing() -> None:  # a device still running the steps it was given
        time.sleep(0.05)
        waited.append(0.05)

    monkeypatch.setattr(trainer, "wait", finishing)
    config = trainer.config(0).model_copy(
        update={"total_env_steps": 3 * trainer.step_env_steps, "eval_every_steps": 10**6}
    )
    result = fit(config, trainer)
    records = len(result.history)
    assert records == (3 if trainer.one_update_per_step else 1) and len(waited) == records
    assert result.train_seconds >= sum(waited)
    trainer.close()


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


def test_a_sac_population_slot_and_a_single_sac_agent_take_each_others_files(
    tmp_path: Path,
) -> None:
    """PBT across kinds of off-policy pods: a single SAC agent's files (weights, optimiser,
    replay buffer, counters) go into a population's slot, and a slot's files into a single SAC
    agent; either way the agent scores what it scored where it was saved, and trains on."""
    single = build([{**configs("sac-population")[0], "seed": 9}])
    steps_to_update(single)
    single.step()
    single.save(0, tmp_path / "single")
    [expected] = single.evaluate()
    population = build(configs("sac-population"))
    config = population.config(1).model_copy(update={"sac": single.config(0).sac})
    population.load(1, tmp_path / "single", config)
    assert population.counters(1) == single.counters(0)
    assert population.evaluate()[1].mean == pytest.approx(expected.mean, rel=1e-5)
    steps_to_update(population)
    population.step()
    population.save(1, tmp_path / "slot")
    [slot_score] = [population.evaluate()[1]]
    fresh = build([population.config(1).model_dump()])
    fresh.load(0, tmp_path / "slot", population.config(1))
    assert fresh.counters(0) == population.counters(1)
    assert fresh.evaluate()[0].mean == pytest.approx(slot_score.mean, rel=1e-5)
    _, buffer = fresh.single(0)  # type: ignore[attr-defined]
    assert len(buffer) == min(population.counters(1).env_steps, buffer.capacity)
    updates = fresh.updates
    for _ in range(4):
        fresh.step()
    assert fresh.updates > updates
    for trainer in (single, population, fresh):
        trainer.close()


def test_a_population_trains_gsde_and_target_kl() -> None:
    """gSDE's noise matrices and the KL early stop are per agent in the batched state: a
    population trains them (each agent as it would alone: tests/pod/test_population.py)."""
    trainer = build(configs("ppo-gsde-population"))
    try:
        for _ in range(3):
            trainer.step()
        assert trainer.updates == 3 and len(trainer.evaluate()) == 2
    finally:
        trainer.close()


#: A built-in-style algorithm of a known family, as one folder: its card (torch-free), its
#: config and a preset beside it, and its agent class.
NOISY = {
    "__init__.py": """
from pydantic import Field

from services.contracts.algorithms.card import OFF_POLICY, AlgorithmCard, PopulationCard
from services.contracts.algorithms.ddpg.config import DDPGConfig
from services.contracts.algorithms.offpolicy import ReplayLoopConfig


class NoisyConfig(DDPGConfig):
    exploration_noise: float = 0.3
    noise_decay: float = Field(1.0, gt=0)  # a hyperparameter no built-in algorithm has


CARD = AlgorithmCard(
    name="noisy_ddpg",
    family=OFF_POLICY,
    config=NoisyConfig,
    loop_config=ReplayLoopConfig,
    action_kinds=("continuous",),
    population=PopulationCard(hyperparameters=("learning_rate", "tau", "exploration_noise")),
    presets_package=__name__,
)
""",
    "agent.py": """
from services.pod.algorithms.ddpg import DDPG


class NoisyDDPG(DDPG):
    name = "noisy_ddpg"
""",
}

#: An algorithm of a new family, with its own trainer, as one folder: (1+1) random search on a
#: linear CartPole policy, a family no built-in trainer trains.
HILL_CLIMB = {
    "__init__.py": """
from pydantic import BaseModel, ConfigDict, Field

from services.contracts.algorithms.card import AlgorithmCard


class HillClimbConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sigma: float = Field(0.5, gt=0)
    num_envs: int = Field(8, ge=1)
    horizon: int = Field(50, ge=1)


CARD = AlgorithmCard(
    name="hill_climb",
    family="random_search",
    config=HillClimbConfig,
    action_kinds=("discrete",),
)
""",
    "trainer.py": """
from pathlib import Path

import torch
from pydantic import Field

from services.pod.config import RunConfig
from services.pod.roles.evaluator import evaluate_groups
from services.pod.training.checkpoint import json_bytes, read_files, tensor_bytes, write_files
from services.pod.training.trainer import Counters, Trainer

from podium_hill import HillClimbConfig


class HillClimb:
    name = "hill_climb"


class LinearPolicy(torch.nn.Module):
    def __init__(self, obs: int, actions: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(actions, obs), requires_grad=False)

    def act_deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        return (obs @ self.weight.T).argmax(-1)


class HillClimbRunConfig(RunConfig):
    algorithm: str = "hill_climb"
    hill_climb: HillClimbConfig = Field(default_factory=HillClimbConfig)


class HillClimbTrainer(Trainer[HillClimbRunConfig]):
    config_class = HillClimbRunConfig
    one_update_per_step = True

    def __init__(self, configs) -> None:
        [config] = configs
        self.size = 1
        self.env = None
        self.reset(0, config)

    def reset(self, slot, config) -> None:
        self.close()
        self._config, hc = config, config.hill_climb
        self.env, self.eval_env = config.make_envs(hc.num_envs)
        space = self.env.single_observation_space
        self.policy = LinearPolicy(space.shape[0], int(self.env.single_action_space.n))
        self.generator = torch.Generator().manual_seed(config.seed)
        self.best = float("-inf")
        self._env_steps = self._updates = 0

    @property
    def step_env_steps(self) -> int:
        return self._config.hill_climb.num_envs * self._config.hill_climb.horizon

    def _score(self, weight: torch.Tensor) -> float:
        obs, _ = self.env.reset(seed=self._config.seed)
        total = torch.zeros(())
        for _ in range(self._config.hill_climb.horizon):
            obs, reward, *_ = self.env.step((obs @ weight.T).argmax(-1))
            total += reward.sum()
        return float(total)

    def step(self) -> None:
        noise = torch.randn(self.policy.weight.shape, generator=self.generator)
        candidate = self.policy.weight + self._config.hill_climb.sigma * noise
        score = self._score(candidate)
        if score >= self.best:
            self.best = score
            self.policy.weight.copy_(candidate)
        self._env_steps += self.step_env_steps
        self._updates += 1

    def progress(self):
        return {"best_train_score": self.best}

    def evaluate(self):
        act = self.policy.act_deterministic
        return evaluate_groups(self.eval_env, act, seed=self._config.evaluation_seed)

    def config(self, slot):
        return self._config

    def counters(self, slot):
        return Counters(self._env_steps, self._updates)

    def save(self, slot, directory: Path) -> None:
        files = {
            "actor.safetensors": tensor_bytes({"weight": self.policy.weight}),
            "hyperparameters.json": json_bytes(self._config.model_dump(mode="json")),
            "counters.json": json_bytes({"env_steps": self._env_steps, "updates": self._updates}),
        }
        write_files(directory, files, {"algorithm": "hill_climb"})

    def load(self, slot, directory: Path, config) -> None:
        files = read_files(directory)
        self.reset(slot, config)
        self.policy.weight.copy_(files.tensors["actor"]["weight"])
        counters = files.documents["counters"]
        self._env_steps, self._updates = counters["env_steps"], counters["updates"]

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.eval_env.close()
            self.env = None
""",
}


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Algorithms registered through the real entry-point mechanism, each one folder and its
    entry points: a built-in-style one of a known family (with a preset), one of a new family
    with its own trainer, and a name registered as an agent with no card."""
    (tmp_path / "noisy").mkdir()
    noisy = {**NOISY, "presets/Pendulum-v1.yaml": "total_env_steps: 96\n"}
    register_plugin(
        tmp_path / "noisy",
        monkeypatch,
        "podium_noisy",
        noisy,
        {
            "podium.algorithm_cards": {"noisy_ddpg": "podium_noisy:CARD"},
            "podium.algorithms": {
                "noisy_ddpg": "podium_noisy.agent:NoisyDDPG",
                "bare": "podium_noisy.agent:NoisyDDPG",
            },
        },
    )
    (tmp_path / "hill").mkdir()
    register_plugin(
        tmp_path / "hill",
        monkeypatch,
        "podium_hill",
        HILL_CLIMB,
        {
            "podium.algorithm_cards": {"hill_climb": "podium_hill:CARD"},
            "podium.algorithms": {"hill_climb": "podium_hill.trainer:HillClimb"},
            "podium.trainers": {"random_search": "podium_hill.trainer:HillClimbTrainer"},
        },
    )


@pytest.mark.usefixtures("plugins")
def test_a_plugin_algorithm_trains_end_to_end(tmp_path: Path) -> None:
    # podium train: its preset (beside its card), its own config field, the one fit loop.
    layers = [{"algorithm": "noisy_ddpg", **SMALL_REPLAY}]
    config = train_config("Pendulum-v1", [*layers, {"noisy_ddpg": {"noise_decay": 0.5}}])
    assert config.total_env_steps == 96  # from the card's preset
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
    # Its card's action kinds are checked at submission, as a built-in's are.
    with pytest.raises(ValidationError, match="cannot train noisy_ddpg on CartPole-v1"):
        ExperimentSpec.model_validate(
            {"name": "plugin", "env": {"name": "CartPole-v1"}, "algorithms": {"noisy_ddpg": 1}}
        )


@pytest.mark.usefixtures("plugins")
def test_a_plugin_algorithm_trains_as_a_population_with_a_compiled_update() -> None:
    """The plugin is its card and one module: its agent class names the stack its update runs
    on (here DDPG's), so it trains as a population pod and its update compiles, with nothing
    registered anywhere else."""
    base = {**preset("noisy_ddpg", "Pendulum-v1"), **SMALL_REPLAY, "eval_seed": 1234}
    raw = [
        {**base, "seed": i, "noisy_ddpg": {"learning_rate": lr}}
        for i, lr in enumerate((1e-3, 3e-3))
    ]
    population = build(raw)
    try:
        steps_to_update(population)
        assert population.size == 2 and len(population.evaluate()) == 2
        rates = population.population.hp["learning_rate"].tolist()  # type: ignore[attr-defined]
        assert rates == pytest.approx([1e-3, 3e-3])
    finally:
        population.close()
    compiled = build([{**raw[0], "compile": "on"}])
    try:
        assert compiled.compiled.startswith("compiled (update")
    finally:
        compiled.close()
    spec = {
        "name": "plugin",
        "env": {"name": "Pendulum-v1"},
        "algorithms": {"noisy_ddpg": 1},
        "population": {"agents_per_pod": 4},
        "search_space": {"learning_rate": {"type": "log_uniform", "low": 1e-4, "high": 1e-2}},
    }
    assert ExperimentSpec.model_validate(spec).population.agents_per_pod == 4


@pytest.mark.usefixtures("plugins")
def test_an_algorithm_of_a_new_family_trains_with_its_own_trainer(tmp_path: Path) -> None:
    """A new family: its card names the family, its trainer is registered under that name,
    and the trunk (``trainer_class``, the fit loop, the spec check) needs nothing else."""
    config = train_config(
        "CartPole-v1",
        [{"algorithm": "hill_climb", "total_env_steps": 4_000, "eval_every_steps": 2_000}],
    )
    assert type(config).__name__ == "HillClimbRunConfig"
    result = train(config, out_dir=tmp_path)
    assert result.history[-1]["env_steps"] == 4_000
    # Random search on a linear policy balances CartPole well past a random policy's ~22.
    assert max(h["eval_return"] for h in result.history if "eval_return" in h) > 60
    manifest = json.loads((tmp_path / "checkpoints" / "best" / "manifest.json").read_text())
    assert manifest["algorithm"] == "hill_climb"
    spec = {"name": "hc", "env": {"name": "CartPole-v1"}, "algorithms": {"hill_climb": 1}}
    assert ExperimentSpec.model_validate(spec).algorithms == {"hill_climb": 1}
    with pytest.raises(ValidationError, match="'sigma2' not hyperparameters of 'hill_climb'"):
        ExperimentSpec.model_validate(
            {**spec, "search_space": {"sigma2": {"type": "choice", "values": [1.0]}}}
        )
    with pytest.raises(
        ValidationError,
        match="population pods train .*PPO.* only, not hill_climb",
    ):
        ExperimentSpec.model_validate({**spec, "population": {"agents_per_pod": 2}})
    with pytest.raises(HyperparameterError, match="hill_climb trains one agent per pod"):
        trainer_class("hill_climb", 2)


@pytest.mark.usefixtures("plugins")
def test_an_algorithm_without_a_card_is_refused() -> None:
    with pytest.raises(HyperparameterError, match="'bare' is not trainable by a pod"):
        train_config("Pendulum-v1", [{"algorithm": "bare"}])
    with pytest.raises(HyperparameterError, match="'nope' is not trainable by a pod"):
        train_config("Pendulum-v1", [{"algorithm": "nope"}])
    spec = {"name": "bare", "env": {"name": "Pendulum-v1"}, "algorithms": {"bare": 1}}
    with pytest.raises(ValidationError, match="'bare' is registered but no pod can train it"):
        ExperimentSpec.model_validate(spec)


def test_every_preset_file_is_a_valid_run_config() -> None:
    """The presets are data (services/contracts/algorithms/<algorithm>/presets/<env>.yaml): each
    one validates against its algorithm's run config, a typo in one is caught here, not by a user.
    """
    from services.contracts.algorithms.hyperparameters import preset_files

    shipped = sorted(preset_files())
    assert ("ppo", "CartPole-v1") in shipped and ("sac", "Pendulum-v1") in shipped
    for algorithm, env in shipped:
        config = trainer_class(algorithm).config_class.model_validate(preset(algorithm, env))
        assert (config.algorithm, config.env) == (algorithm, env)


#: A second on-policy algorithm as a plugin: its card (a config extending PPO's) and one module,
#: its agent class with its own loss (a vanilla policy gradient with a value baseline).
VPG = {
    "__init__.py": """
from services.contracts.algorithms.card import ON_POLICY, AlgorithmCard, PopulationCard
from services.contracts.algorithms.ppo.config import PPOConfig


class VPGConfig(PPOConfig):
    update_epochs: int = 1
    num_minibatches: int = 1


CARD = AlgorithmCard(
    name="vpg",
    family=ON_POLICY,
    config=VPGConfig,
    action_kinds=("discrete", "continuous"),
    population=PopulationCard(hyperparameters=("learning_rate", "ent_coef", "vf_coef")),
    presets_package=__name__,
)
""",
    "agent.py": """
import torch

from podium_vpg import CARD
from services.pod.algorithms import policies as pi
from services.pod.algorithms.ppo import PPO


class VPG(PPO):
    name = "vpg"
    card = CARD

    @staticmethod
    def loss(shape, params, minibatch, hp):
        obs, actions, old_logp, adv, returns, _ = minibatch
        logp, entropy = pi.log_prob_entropy(shape.policy, params, obs, actions)
        value = pi.value(shape.policy, params, obs)
        pg = -(logp * adv).mean(1)
        v = 0.5 * (value - returns).square().mean(1)
        ent = entropy.mean(1)
        with torch.no_grad():
            kl = (old_logp - logp).mean(1)
            stats = torch.stack((pg, v, ent, kl, torch.full_like(pg, -1.0)), 1)
        return (pg - hp["ent_coef"] * ent + hp["vf_coef"] * v).sum(), stats
""",
    "presets/CartPole-v1.yaml": "total_env_steps: 4096\neval_episodes: 2\n",
}


def test_a_second_on_policy_algorithm_is_its_card_and_one_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The on-policy family builds what the card names: the plugin's agent class, its run
    config (its own field), its loss inside PPO's rollout, GAE and update; one agent and a
    population (the card's hyperparameters per agent); compiled like PPO."""
    from services.pod.training.trainer import build_trainer

    (tmp_path / "vpg").mkdir()
    register_plugin(
        tmp_path / "vpg",
        monkeypatch,
        "podium_vpg",
        VPG,
        {
            "podium.algorithm_cards": {"vpg": "podium_vpg:CARD"},
            "podium.algorithms": {"vpg": "podium_vpg.agent:VPG"},
        },
    )
    small = {"algorithm": "vpg", "vpg": {"num_envs": 8, "num_steps": 32}}
    config = train_config("CartPole-v1", [small])
    assert config.total_env_steps == 4096 and config.vpg.update_epochs == 1  # type: ignore[attr-defined]
    trainer = build_trainer([config])
    try:
        assert type(trainer.agent(0)).__name__ == "VPG"
        before = trainer.population.state["params"].clone()  # type: ignore[attr-defined]
        trainer.step()
        assert trainer.progress()["clipfrac"] == -1.0  # the statistics of its own loss
        assert not torch.equal(before, trainer.population.state["params"])  # type: ignore[attr-defined]
        trainer.save(0, tmp_path / "files")
        manifest = json.loads((tmp_path / "files" / "manifest.json").read_text())
        assert manifest["algorithm"] == "vpg"
    finally:
        trainer.close()
    rates = [{**small, "seed": i, "vpg": {**small["vpg"], "learning_rate": lr}} for i, lr in
             enumerate((1e-3, 3e-3))]  # fmt: skip
    population = build_trainer([train_config("CartPole-v1", [r]) for r in rates])
    try:
        population.step()
        hp = population.population.hp  # type: ignore[attr-defined]
        assert hp["learning_rate"].tolist() == pytest.approx([1e-3, 3e-3])
        assert "clip_coef" not in hp  # not one of its per-agent hyperparameters
    finally:
        population.close()
    compiled = build_trainer([train_config("CartPole-v1", [{**small, "vpg": {"compile": "on"}}])])
    assert compiled.compiled.startswith("compiled (rollout, update, evaluation")
    compiled.close()
