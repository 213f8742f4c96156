"""The off-policy population trainer: P SAC, TD3, DDPG or DQN agents ("slots") trained together
in one process.

What a pod with ``population.agents_per_pod: P`` (P > 1) trains for an off-policy algorithm
whose card declares a population (SAC, TD3, DDPG, DQN): the stacked agents of
services/pod/algorithms/stacked.py (Fast PBT's layout: flat weights, one batched Adam,
per-agent hyperparameters as tensors, one replay buffer per agent in one tensor), updated
eagerly or by the compiled K-step update of services/pod/algorithms/kstep.py (SAC, TD3, DDPG;
DQN's is eager). Acting is one batched env of P * num_envs sub-environments: agent p owns the
slice [p * num_envs, (p + 1) * num_envs), and its evaluation episodes the p-th slice of the
evaluation env (``evaluate_groups``). DQN's ε schedule and target-update period run on each
slot's own counters, as a single DQN pod's run on its own.

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
from services.pod.roles.learner import ReplayLearner
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
    every agent's slice of the env and the updates it owes (the update-to-data ratio)."""

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
        self.kstep: KStep | None = None
        if compile_updates(first, self.device, p):
            self.kstep = KStep(
                self.population,
                self.replay.fields,
                self.replay.filled,
                first.batch_size,
                first.seed,
                compile=True,
            )
        self.obs: torch.Tensor | None = None
        self._env_steps = self._updates = 0
        self.update_debt = 0.0
        self.offsets = [Counters(0, 0) for _ in configs]
        self.return_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.episodes = torch.zeros((), device=self.device, dtype=torch.int64)
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
        return self._env_steps

    @property
    def updates(self) -> int:
        return self._updates

    @property
    def step_env_steps(self) -> int:
        return self.configs[0].num_envs

    def counters(self, slot: int) -> Counters:
        offset = self.offsets[slot]
        return Counters(self._env_steps + offset.env_steps, self._updates + offset.updates)

    def _slot_counts(self, field: str) -> torch.Tensor:
        """Every slot's own count of ``field`` (``env_steps`` or ``updates``), (P,)."""
        counts = [getattr(self.counters(i), field) for i in range(self.size)]
        return torch.tensor(counts, device=self.device)

    # -- training ----------------------------------------------------------------------------
    def step(self) -> None:
        cfg, p, n = self.configs[0], self.size, self.configs[0].num_envs
        pop = self.population
        if self.obs is None:
            self.obs, _ = self.env.reset(seed=cfg.seed + self._env_steps)
            pop.end_episodes(torch.ones(p * n, dtype=torch.bool, device=self.device))
        obs = self.obs.view(p, n, -1)
        if self._env_steps < cfg.learning_starts:
            action = pop.template.random_action(p * n, self.generator)
            action = action.view(p, n, *pop.action_shape)
        else:
            action = pop.explore(obs, self.generator, self._slot_counts("env_steps"))
        flat_action = action.reshape(p * n, *pop.action_shape)
        next_obs, reward, terminated, truncated, info = self.env.step(
            pop.template.to_env(flat_action)
        )
        self.replay.add(
            obs,
            action,
            reward.view(p, n),
            info["final_obs"].view(p, n, -1),
            terminated.view(p, n),
        )
        self.obs = next_obs
        self.return_sum += info["episode_return"].sum()
        done = terminated | truncated
        self.episodes += done.sum()
        pop.end_episodes(done)
        self._env_steps += n
        self._learn(n)

    def _learn(self, env_steps: int) -> None:
        """``ReplayLearner.learn``'s schedule, for every agent at once."""
        cfg = self.configs[0]
        if self._env_steps < cfg.learning_starts:
            return
        self.update_debt += env_steps * cfg.updates_per_step
        if self.kstep is not None:  # compiled: K updates of every agent per call
            k = cfg.updates_per_call
            while self.update_debt >= k:
                self.update_debt -= k
                self._stats = self.kstep(k, self._updates + 1)
                self._updates += k
            return
        owed = int(self.update_debt)
        self.update_debt -= owed
        for _ in range(owed):
            self._updates += 1
            batch = self.replay.sample(cfg.batch_size, self.generator)
            # DQN's targets move on each slot's own update count, as a single DQN pod's do.
            step = (
                self._slot_counts("updates")
                if isinstance(self.population, PopulationDQN)
                else self._updates
            )
            self._stats = self.population.update(batch, self.generator, step)

    def progress(self) -> dict[str, float]:
        """The agents' last losses averaged; the mean return of every agent's episodes."""
        record = {k: float(v.mean()) for k, v in self._stats.items()}
        if episodes := int(self.episodes):
            record["train_return"] = float(self.return_sum) / episodes
            self.return_sum.zero_()
            self.episodes.zero_()
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
        view.learner.update_debt = self.update_debt
        save_offpolicy_files(directory, cast(OffPolicyTrainer, view), config)

    def _place(self, slot: int, view: _SlotView, config: OffPolicyConfig) -> None:
        self.population.put(slot, view.agent)
        self.replay.put(slot, view.buffer)
        self.configs[slot] = config
        self.offsets[slot] = Counters(
            view.learner.env_steps - self._env_steps, view.learner.updates - self._updates
        )

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
