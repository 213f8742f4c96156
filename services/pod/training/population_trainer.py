"""The population trainer: P PPO agents ("slots") trained together in one process.

What a pod with ``population.agents_per_pod: P`` (P > 1) trains. The agents share one network shape,
rollout shape and number of epochs and are trained in lock-step by
``services.pod.training.population.PopulationPPO`` (stacked weights, batched matmuls; per-agent
hyperparameters as tensors; each agent its own slice of one batched env). A pod with P agents costs
one interpreter, one torch import and one set of envs instead of P, and a population update is
several times faster than updating P agents one after another (docs/benchmarks.md, "Vectorized
populations").

Each slot saves and loads the training files a single PPO agent has
(services/pod/training/onpolicy.py),
so any pod or ``podium export`` loads them and a parent from any PPO pod goes into a slot.
Its counters are the population's plus the offset of the files it was loaded from: a parent's
counters go on in the slot's files, as they do in a single pod restarted from it.

What a population cannot train is refused (``HyperparameterError``, naming it), never turned
off silently: gSDE exploration and ``target_kl`` (which would stop some agents' epochs early
and break the lock-step). The roles always run in this process.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import torch

from services.contracts.algorithms.hyperparameters import check_population_settings
from services.logs import get_logger
from services.pod.algorithms.ppo import PPO
from services.pod.config import PPORunConfig
from services.pod.roles.evaluator import EvalResult
from services.pod.roles.learner import RolloutLearner
from services.pod.training.onpolicy import OnPolicyTrainer, load_ppo_files, save_ppo_files
from services.pod.training.population import HYPERPARAMETERS, PopulationPPO, build_population
from services.pod.training.trainer import Counters, Roles, Trainer

log = get_logger(__name__)


def check_population_config(config: PPORunConfig) -> None:
    """Refuse PPO settings a population cannot train, naming them and the env's preset."""
    check_population_settings(config.env, "ppo", config.ppo.model_dump())


class PPOSlotsTrainer(Trainer[PPORunConfig]):
    """What the trainers of P PPO agents in one process (``PopulationTrainer``, the Anakin
    trainer) share: each slot's config and counters, and a slot loaded or reset as a single PPO
    agent (whose training files any PPO pod loads) put into it."""

    config_class = PPORunConfig
    one_update_per_step = True
    pod_defaults: ClassVar = OnPolicyTrainer.pod_defaults

    configs: list[PPORunConfig]
    #: Each slot's counters minus the trainer's (a loaded parent's go on).
    offsets: list[Counters]

    @abstractmethod
    def _fresh(self, config: PPORunConfig) -> RolloutLearner:
        """A fresh single PPO agent of this trainer's shape, seeded by ``config``."""

    @abstractmethod
    def _put(self, slot: int, learner: RolloutLearner, config: PPORunConfig) -> None:
        """Write ``learner``'s agent and ``config``'s hyperparameters into slot ``slot``."""

    @abstractmethod
    def _agent_of(self, slot: int) -> RolloutLearner:
        """Slot ``slot``'s agent (weights, observation statistics, Adam state) as a single
        PPO agent's learner; its counters are the caller's to set."""

    def learner(self, slot: int) -> RolloutLearner:
        """Slot ``slot`` as a single PPO agent's learner, with the slot's budget and counters:
        what its training files hold."""
        learner = self._agent_of(slot)
        config, counters = self.configs[slot], self.counters(slot)
        learner.total_env_steps = config.total_env_steps
        learner.env_steps, learner.updates = counters.env_steps, counters.updates
        return learner

    def save(self, slot: int, directory: Path) -> None:
        save_ppo_files(directory, self.learner(slot), self.configs[slot])

    def config(self, slot: int) -> PPORunConfig:
        return self.configs[slot]

    def counters(self, slot: int) -> Counters:
        offset = self.offsets[slot]
        return Counters(self.env_steps + offset.env_steps, self.updates + offset.updates)

    def _place(self, slot: int, learner: RolloutLearner, config: PPORunConfig) -> None:
        self._put(slot, learner, config)
        self.configs[slot] = config
        self.offsets[slot] = Counters(
            learner.env_steps - self.env_steps, learner.updates - self.updates
        )

    def load(self, slot: int, directory: Path, config: PPORunConfig) -> None:
        learner = self._fresh(config)
        load_ppo_files(directory, learner)
        self._place(slot, learner, config)

    def reset(self, slot: int, config: PPORunConfig) -> None:
        self._place(slot, self._fresh(config), config)


class PopulationTrainer(PPOSlotsTrainer):
    """``len(configs)`` PPO agents; ``env_steps`` and ``updates`` count per agent."""

    def __init__(self, configs: Sequence[PPORunConfig], roles: Roles | None = None) -> None:
        for config in configs:
            check_population_config(config)
        first = configs[0]  # the settings the agents share
        self.size = len(configs)
        self.configs = list(configs)
        self.device = first.device
        self.population: PopulationPPO = build_population(
            first.env,
            first.ppo,
            [self._hyperparameters(c) for c in configs],
            seed=first.seed,  # agent i is seeded first.seed + i, as the pod's configs say
            total_env_steps=first.total_env_steps,
            eval_episodes=first.eval_episodes,
            device=first.device,
            env_kwargs=first.env_kwargs,
            eval_env_kwargs=first.eval_env_kwargs,
        )
        self.eval_seed = first.evaluation_seed
        self.offsets = [Counters(0, 0) for _ in configs]
        self._stats: list[dict[str, float]] = []
        self._returns: list[torch.Tensor] = []

    @staticmethod
    def _hyperparameters(config: PPORunConfig) -> dict[str, float]:
        return {k: getattr(config.ppo, k) for k in HYPERPARAMETERS}

    @property
    def env_steps(self) -> int:
        return self.population.env_steps  # per agent, whatever their files' counters

    @property
    def updates(self) -> int:
        return self.population.updates

    @property
    def step_env_steps(self) -> int:
        return self.population.base_config.batch_size

    def step(self) -> None:
        rollout = self.population.collect()
        self._stats = self.population.update(rollout)
        self._returns = rollout.episode_returns

    def progress(self) -> dict[str, float]:
        """The agents' statistics averaged; the mean return of every agent's episodes."""
        names = self._stats[0] if self._stats else {}
        record = {k: sum(s[k] for s in self._stats) / self.size for k in names}
        returns = torch.cat(self._returns) if self._returns else torch.zeros(0)
        if returns.numel():
            record["train_return"] = float(returns.mean())
        return record

    def evaluate(self) -> list[EvalResult]:
        return self.population.evaluate(seed=self.eval_seed)

    def _agent_of(self, slot: int) -> RolloutLearner:
        return self.population.learner(slot)

    def _fresh(self, config: PPORunConfig) -> RolloutLearner:
        check_population_config(config)
        env = self.population.env
        torch.manual_seed(config.seed)
        agent = PPO(env.single_observation_space, env.single_action_space, config.ppo)
        return RolloutLearner(agent.to(self.device), config.total_env_steps)

    def _put(self, slot: int, learner: RolloutLearner, config: PPORunConfig) -> None:
        self.population.set_agent(slot, learner.agent, self._hyperparameters(config))

    def close(self) -> None:
        for env in (self.population.env, self.population.eval_env):
            if env is not None:
                env.close()
