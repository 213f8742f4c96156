"""The off-policy population trainer: P SAC, TD3, DDPG or DQN agents ("slots") trained together
in one process.

What a pod with ``population.agents_per_pod: P`` (P > 1) trains for an off-policy algorithm
whose card declares a population (SAC, TD3, DDPG, DQN): the stacked agents of
services/pod/algorithms/stacked.py (Fast PBT's layout: flat weights, one batched Adam,
per-agent hyperparameters as tensors, one replay buffer per agent in one tensor), updated
eagerly or by the compiled K-step update of services/pod/algorithms/kstep.py (SAC, TD3, DDPG,
DQN). The roles are a single agent's (services/pod/training/offpolicy.py), for P
agents at once: the worker (services/pod/roles/worker.py ``PopulationReplayWorker``) steps one
batched env of P * num_envs sub-environments, agent p in the slice
[p * num_envs, (p + 1) * num_envs); the learner (services/pod/roles/learner.py
``PopulationReplayLearner``) pays the update-to-data ratio for every agent; the evaluator plays
agent p's evaluation episodes in the p-th slice of the evaluation env (``evaluate_groups``).
DQN's ε schedule and target-update period run on each slot's own counters, as a single DQN
pod's run on its own.

Each slot saves and loads exactly the training files a single-agent pod of its algorithm
writes (services/pod/training/offpolicy.py ``save_offpolicy_files`` / ``load_offpolicy_files``:
weights, optimiser, replay buffer, counters), so PBT's exploit copies a slot from any pod's files
and ``podium export`` loads a slot's. A slot's counters are the population's plus the offset of
the files it was loaded from. Settings that shape the networks, the data or the loop are shared
by the agents (refused when they differ: ``HyperparameterError`` naming the field).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from services.contracts.algorithms.card import AlgorithmCard, card
from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.algorithms.offpolicy import ReplayLoopConfig
from services.logs import get_logger
from services.pod.algorithms.kstep import KStep
from services.pod.algorithms.replay_buffer import ReplayBuffer
from services.pod.algorithms.sac import SAC, target_entropy
from services.pod.algorithms.spaces import check_action_space
from services.pod.algorithms.stacked import (
    POPULATIONS,
    PopulationDQN,
    PopulationSAC,
    PopulationTD3,
    StackedReplay,
)
from services.pod.roles.evaluator import EvalResult, evaluate_groups
from services.pod.roles.learner import PopulationReplayLearner, ReplayLearner
from services.pod.roles.worker import PopulationReplayWorker
from services.pod.training.offpolicy import (
    OffPolicyConfig,
    OffPolicyTrainer,
    compile_updates,
    load_offpolicy_files,
    save_offpolicy_files,
)
from services.pod.training.trainer import (
    Counters,
    Roles,
    Trainer,
    algorithm_class,
    train_in_process,
)

log = get_logger(__name__)


def _varied(algorithm: str) -> tuple[str, ...]:
    found = card(algorithm).population
    return found.hyperparameters if found else ()


#: Fields every agent of a population shares (they shape the networks, the data or the loop).
def _shared(config: OffPolicyConfig) -> dict[str, Any]:
    agent = config.agent_config.model_dump(exclude=set(_varied(config.algorithm)))
    loop = {k: getattr(config, k) for k in ReplayLoopConfig.model_fields}
    run = {
        k: getattr(config, k)
        for k in ("env", "env_kwargs", "eval_env_kwargs", "device", "eval_episodes")
    }
    return {**{f"{config.algorithm}.{k}": v for k, v in agent.items()}, **loop, **run}


class OffPolicyPopulationTrainer(Trainer[OffPolicyConfig]):
    """``len(configs)`` SAC, TD3, DDPG or DQN agents in one process; ``step`` is one vector step of
    worker → replay → learner for every agent at once."""

    config_class = OffPolicyConfig
    one_update_per_step = False
    loop_hyperparameters: ClassVar[tuple[str, ...]] = OffPolicyTrainer.loop_hyperparameters
    pod_defaults: ClassVar = OffPolicyTrainer.pod_defaults

    @classmethod
    def for_algorithm(cls, card: AlgorithmCard) -> type[Trainer]:
        if card.name not in POPULATIONS:
            raise HyperparameterError(
                f"population pods (population.agents_per_pod > 1) of the off-policy family "
                f"train {', '.join(sorted(POPULATIONS))} only, not {card.name}"
            )
        return cls

    def __init__(self, configs: Sequence[OffPolicyConfig], roles: Roles | None = None) -> None:
        first = configs[0]
        train_in_process(
            roles,
            "off-policy populations train fused: every role in this process",
            algorithm=first.algorithm,
        )
        self.size = p = len(configs)
        self.configs = list(configs)
        for config in configs:
            self._check(config)
        self.env, self.eval_env = first.make_envs(first.num_envs, slots=p)
        try:
            check_action_space(first.algorithm, self.env.single_action_space)
        except ValueError:
            self.close()
            raise
        self.device = self.env.device
        singles = [self._single(c) for c in configs]
        self.population = POPULATIONS[first.algorithm]([agent for agent, _ in singles])
        self.replay = StackedReplay(p, singles[0][1])
        # Exploration noise, random actions and minibatches of every agent.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(first.seed)
        kstep = None
        if compile_updates(first, self.device, p):
            kstep = KStep(
                self.population,
                self.replay.fields,
                self.replay.filled,
                first.batch_size,
                first.seed,
                compile=True,
            )
        self.learner = PopulationReplayLearner(
            self.population,
            self.replay,
            self.generator,
            first.learning_starts,
            first.updates_per_step,
            first.batch_size,
            kstep=kstep,
            k=first.updates_per_call,
        )
        self.worker = PopulationReplayWorker(
            self.env,
            self.population,
            self.replay,
            self.generator,
            first.learning_starts,
            first.seed,
            self.learner.slot_env_steps,
        )
        self._stats: dict[str, torch.Tensor] = {}

    def _check(self, config: OffPolicyConfig) -> None:
        """Refuse a config whose shared settings differ from the first slot's, naming them."""
        first = self.configs[0].algorithm
        if config.algorithm != first or first not in POPULATIONS:
            raise HyperparameterError(
                f"algorithm: this population pod trains {first}, not {config.algorithm}"
            )
        mine, theirs = _shared(config), _shared(self.configs[0])
        if differ := sorted(k for k in mine if mine[k] != theirs[k]):
            raise HyperparameterError(
                f"population.agents_per_pod = {self.size}: {', '.join(differ)} differ between "
                f"the agents of a population, which share them; it may vary "
                f"{', '.join(_varied(config.algorithm))}"
            )

    def _single(self, config: OffPolicyConfig) -> tuple[SAC, ReplayBuffer]:
        """A fresh single agent and an empty buffer of the population's shape, seeded as a
        single-agent pod seeds its agent."""
        torch.manual_seed(config.seed)
        env = self.env
        algorithm = algorithm_class(config.algorithm)
        agent = algorithm(
            env.single_observation_space, env.single_action_space, config.agent_config
        )
        buffer = ReplayBuffer(
            config.buffer_size,
            tuple(env.single_observation_space.shape),
            agent.action_shape,
            torch.int64 if agent.discrete else torch.float32,
            device=self.device,
        )
        return agent.to(self.device), buffer

    # -- the clock ---------------------------------------------------------------------------
    @property
    def env_steps(self) -> int:
        return self.learner.env_steps

    @property
    def updates(self) -> int:
        return self.learner.updates

    @property
    def step_env_steps(self) -> int:
        return self.configs[0].num_envs

    def counters(self, slot: int) -> Counters:
        return Counters(*self.learner.slot_counters(slot))

    # -- training ----------------------------------------------------------------------------
    def step(self) -> None:
        taken = self.worker.step(self.learner.env_steps)
        self._stats = self.learner.learn(taken) or self._stats

    def progress(self) -> dict[str, float]:
        """The agents' last losses averaged; the mean return of every agent's episodes."""
        record = {k: float(v.mean()) for k, v in self._stats.items()}
        if (train_return := self.worker.train_return()) is not None:
            record["train_return"] = train_return
        return record

    def evaluate(self) -> list[EvalResult]:
        p = self.size

        def act(obs: torch.Tensor) -> torch.Tensor:
            action = self.population.deterministic(obs.view(p, obs.shape[0] // p, -1))
            return action.reshape(obs.shape[0], *action.shape[2:])

        return evaluate_groups(self.eval_env, act, groups=p, seed=self.configs[0].evaluation_seed)

    def config(self, slot: int) -> OffPolicyConfig:
        return self.configs[slot]

    # -- training files ----------------------------------------------------------------------
    def _view(self, config: OffPolicyConfig) -> _SlotView:
        """A single-agent trainer's parts (what the training files are read from and written
        to), of the population's shape."""
        agent, buffer = self._single(config)
        generator = torch.Generator(device=self.device)
        learner = ReplayLearner(
            agent,
            buffer,
            generator,
            config.learning_starts,
            config.updates_per_step,
            config.batch_size,
        )
        return _SlotView(agent, buffer, generator, learner, _NoWorker())

    def save(self, slot: int, directory: Path) -> None:
        config, counters = self.configs[slot], self.counters(slot)
        view = self._view(config)
        self.population.get(slot, view.agent)
        self.replay.get(slot, view.buffer)
        view.generator.set_state(self.generator.get_state())
        view.learner.env_steps, view.learner.updates = counters.env_steps, counters.updates
        view.learner.update_debt = self.learner.update_debt
        save_offpolicy_files(directory, cast(OffPolicyTrainer, view), config)

    def _place(self, slot: int, view: _SlotView, config: OffPolicyConfig) -> None:
        self.population.put(slot, view.agent)
        self.replay.put(slot, view.buffer)
        self.configs[slot] = config
        self.learner.place(slot, view.learner.env_steps, view.learner.updates)

    def load(self, slot: int, directory: Path, config: OffPolicyConfig) -> None:
        self._check(config)
        view = self._view(config)
        load_offpolicy_files(directory, cast(OffPolicyTrainer, view))
        # The slot trains with ``config``'s hyperparameters (PBT's explore), not its files'.
        view.agent.config = config.agent_config
        if isinstance(view.agent, SAC):
            dim = math.prod(view.agent.action_shape)
            view.agent.target_entropy = target_entropy(config.sac, dim)
        self._place(slot, view, config)

    def reset(self, slot: int, config: OffPolicyConfig) -> None:
        self._check(config)
        self._place(slot, self._view(config), config)

    def close(self) -> None:
        for env in (getattr(self, "env", None), getattr(self, "eval_env", None)):
            if env is not None:
                env.close()
        self.env = self.eval_env = None  # type: ignore[assignment]


class _NoWorker:
    """``load_offpolicy_files`` starts the worker's episodes afresh; a slot has no worker."""

    obs: torch.Tensor | None = None


@dataclass
class _SlotView:
    """What ``save_offpolicy_files`` / ``load_offpolicy_files`` read of a single-agent
    trainer."""

    agent: SAC
    buffer: ReplayBuffer
    generator: torch.Generator
    learner: ReplayLearner
    worker: _NoWorker


__all__ = [
    "OffPolicyPopulationTrainer",
    "PopulationDQN",
    "PopulationSAC",
    "PopulationTD3",
    "StackedReplay",
]
