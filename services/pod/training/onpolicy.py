"""The on-policy trainer: P >= 1 agents ("slots") of an on-policy algorithm trained together.
What ``podium train`` and every PPO pod train; another on-policy algorithm is its card and its
agent class (``PPO``'s subclass with its own loss).

Each step is one iteration of PPO (services/pod/algorithms/ppo.py): the worker's rollout of P
agents x N sub-environments (services/pod/roles/worker.py), the learner's update
(``ppo.learn``), then, when asked, the evaluator's greedy episodes
(services/pod/roles/evaluator.py). On a functional env (services/pod/envs/functional.py) the
whole iteration is programs (services/pod/algorithms/compiled.py) when ``compile`` says so
(decided once per trainer by ``compiled.Decision``), on a GPU replayed as one CUDA graph; a
host-stepped env (gymnasium, EnvPool, a plugin ``VecEnv``) steps on the host between the same
functions, whose updates compile too. ``learners: N`` runs N replicas averaged after every
epoch (services/pod/training/fusion.py).

Each slot saves and loads a single PPO agent's training files (``save_ppo_files``), so any PPO
pod's files (a PBT parent) load into a slot and a slot's into any pod or ``podium export``.
Loading writes into the state tensors the programs take: nothing compiles again. What would
change the programs (the network, the rollout's shape, the env) is shared by the slots; they
may differ only in the card's population hyperparameters (and the gradient clip) and seeds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import torch

from services.contracts.algorithms.card import AlgorithmCard
from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.logs import get_logger
from services.pod.algorithms import ppo
from services.pod.algorithms.compiled import (
    CompileFailedError,
    CompileWork,
    Decision,
    cached,
    compile_work,
    count_compile,
    mark_cached,
)
from services.pod.algorithms.ppo import PPO, PPO_STATS
from services.pod.algorithms.spaces import check_action_space
from services.pod.config import PPORunConfig, on_policy_config
from services.pod.roles.evaluator import EvalResult
from services.pod.roles.learner import PPOEnvs, PPOLearner, per_agent
from services.pod.roles.worker import EpisodeTally
from services.pod.training.checkpoint import (
    CheckpointError,
    TrainingFiles,
    json_bytes,
    load_into,
    optimizer_from_files,
    optimizer_to_files,
    read_agent_files,
    tensor_bytes,
    write_files,
)
from services.pod.training.trainer import Counters, Trainer, algorithm_class, check_population_slot

log = get_logger(__name__)


class OnPolicyTrainer(Trainer[PPORunConfig]):
    """``len(configs)`` PPO agents (see the module docstring); counters are per agent."""

    config_class = PPORunConfig
    one_update_per_step = True
    # Pods train open-ended rounds and the generator tunes the learning rate (PBT), so PPO's
    # LR is not annealed toward a budget unless the hyperparameters ask for it.
    pod_defaults: ClassVar[Mapping[str, object]] = {"ppo": {"anneal_lr": False}}

    @classmethod
    def for_algorithm(cls, card: AlgorithmCard) -> type[Trainer]:
        config_class = on_policy_config(card.name)
        if config_class is PPORunConfig:
            return cls
        return type(
            f"{config_class.__name__}Trainer",
            (cls,),
            {"config_class": config_class, "pod_defaults": {card.name: {"anneal_lr": False}}},
        )

    @classmethod
    def replicas(cls, config: PPORunConfig) -> int:
        return config.learners

    def __init__(
        self, configs: Sequence[PPORunConfig], horizon_env_steps: int | None = None
    ) -> None:
        first = configs[0]
        self.size = p = len(configs)
        self.configs = list(configs)
        self.agent_class: type[PPO] = algorithm_class(first.algorithm)  # type: ignore[assignment]
        self.per_slot = set(ppo.hyperparameter_names(self.agent_class.card))
        for config in configs:
            self._check(config)
        if reason := ppo.unsupported(first.agent_config):
            raise HyperparameterError(f"{first.algorithm}: {reason}")
        if p > 1 and first.learners > 1:
            raise HyperparameterError("learners > 1 trains one agent per pod, not a population")
        self.device = torch.device(first.device)
        self.world = 1
        self.envs = PPOEnvs.build(first, p)
        self.fn = self.envs.fn
        self.obs_space, self.action_space = self.envs.spaces()
        try:
            check_action_space(first.algorithm, self.action_space)
        except ValueError as exc:
            self.close()
            raise HyperparameterError(str(exc)) from None
        train = self.envs.train
        self.population = PPOLearner(
            train,
            first.agent_config,
            [self._fresh(c) for c in configs],
            [per_agent(c.agent_config) for c in configs],
            [c.seed for c in configs],
            first.total_env_steps,
            self.device,
            getattr(train, "max_episode_steps", None),
            reset_seed=first.seed,
        )
        self.shape = self.population.shape
        self.offsets = [Counters(0, 0) for _ in configs]
        #: One agent's clock goes on from the counters of the files it was loaded from (a
        #: resumed run trains what is left of its budget); a population's slots keep theirs
        #: as offsets from the population's clock.
        self.base = Counters(0, 0)
        self.iterations = 0
        self.compile_seconds = 0.0
        self._metrics: dict[str, torch.Tensor] | None = None
        self.tally = EpisodeTally(p, self.device)
        horizon = horizon_env_steps or first.total_env_steps
        if first.target_return is not None and first.expected_env_steps:
            # A run with a target is expected to stop near where the preset's runs solve.
            horizon = min(horizon, 2 * first.expected_env_steps)
        self.decision = Decision(
            first.agent_config.compile, "onpolicy", self.device, units=float(horizon),
            cached=cached(first, self.program_key(), self._programs()),
        )  # fmt: skip
        self._describe()

    # -- building ---------------------------------------------------------------------------
    def _check(self, config: PPORunConfig) -> None:
        check_population_slot(self.configs[0], config, self.per_slot, self.size)

    def _fresh(self, config: PPORunConfig) -> PPO:
        torch.manual_seed(config.seed)
        agent = self.agent_class(self.obs_space, self.action_space, config.agent_config)
        return agent.to(self.device)

    def program_key(self) -> str:
        """What fixes this trainer's programs: their shape, the env and the device type."""
        env = self.configs[0].env
        kwargs = sorted(self.configs[0].env_kwargs.items())
        return f"{self.shape!r} env={env} {kwargs} device={self.device.type}"

    def _programs(self) -> tuple[str, ...]:
        """The programs compiling builds."""
        return ("iteration",) if self.fn is None else ("iteration", "evaluate")

    def _describe(self) -> None:
        d = self.decision
        if d.compiled is None:
            what = f"deciding ({d.mode}: timing the first eager iterations)"
        elif d.compiled:
            parts = ["update"] if self.fn is None else ["rollout", "update", "evaluation"]
            what = f"compiled ({', '.join(parts)}; {d.reason})"
            if self.fn is None:
                why = f"env {self.configs[0].env!r} has no functional step"
                what += f"; rollout and evaluation on the host ({why})"
        else:
            what = f"eager ({d.reason})"
        self.compiled = what

    # -- the clock --------------------------------------------------------------------------
    @property
    def env_steps(self) -> int:
        return self.iterations * self.shape.batch * self.world + self.base.env_steps

    @property
    def updates(self) -> int:
        return self.iterations + self.base.updates

    @property
    def step_env_steps(self) -> int:
        return self.shape.batch * self.world

    def counters(self, slot: int) -> Counters:
        offset = self.offsets[slot]
        return Counters(self.env_steps + offset.env_steps, self.updates + offset.updates)

    # -- training ---------------------------------------------------------------------------
    def join_group(self, world: int) -> None:
        """One of ``world`` learner replicas: start from rank 0's agent, average every epoch."""
        from services.pod.training.fusion import StateAverager

        averager = StateAverager(self.population.state)
        averager.broadcast(0)
        self.world = world
        self.population.after_epoch = averager
        # Each replica counts its own env steps: its learning rate anneals over its budget share.
        self.population.hp["total_env_steps"].div_(world)

    def step(self) -> None:
        d = self.decision
        before = compile_work()
        if d.compiled is None:
            start = time.perf_counter()
            self._took(self.population.iterate(False))
            if d.eager_call(time.perf_counter() - start, self.shape.batch):
                self._describe()
            return
        try:
            metrics = self.population.iterate(bool(d.compiled))
        except CompileFailedError as exc:
            d.failed(exc)
            self._describe()
            metrics = self.population.iterate(False)
        self._took(metrics)
        self._count_compile(before, "iteration")

    def _took(self, metrics: dict[str, torch.Tensor]) -> None:
        """An iteration's statistics: kept for ``progress``, its episodes tallied."""
        self._metrics = metrics
        self.tally.add(metrics["return_sum"], metrics["episodes"])
        self.iterations += 1

    def _count_compile(self, before: CompileWork, program: str) -> None:
        if count_compile(self, before, program) and self.decision.compiled:  # not failed
            mark_cached(self.configs[0], self.program_key(), program)

    def progress(self) -> dict[str, float]:
        """The agents' last-epoch statistics averaged; the mean return of every agent's
        training episodes that finished in the last rollout."""
        if self._metrics is None:
            return {}
        m = self._metrics
        record = dict(zip(PPO_STATS, m["stats"].mean(0).tolist(), strict=True))
        record["lr"] = float(m["lr"].mean())
        if (train_return := self.tally.mean("progress")) is not None:
            record["train_return"] = train_return
        return record

    def recent_returns(self) -> list[float | None]:
        return self.tally.means("pbt")

    def evaluate(self) -> list[EvalResult]:
        before = compile_work()
        envs, compiled = self.envs, bool(self.decision.compiled)
        seed = self.configs[0].evaluation_seed
        try:
            out = self.population.evaluate(envs.evaluation, envs.start, seed, compiled)
        except CompileFailedError as exc:
            self.decision.failed(exc)
            self._describe()
            out = self.population.evaluate(envs.evaluation, envs.start, seed, False)
        self._count_compile(before, "evaluate")
        return out

    # -- slots ------------------------------------------------------------------------------
    def config(self, slot: int) -> PPORunConfig:
        return self.configs[slot]

    def agent(self, slot: int) -> PPO:
        """Slot ``slot`` as a single PPO agent: weights, statistics, Adam state."""
        return self.population.agent(slot, self._fresh(self.configs[slot]))

    def save(self, slot: int, directory: Path) -> None:
        counters = self.counters(slot)
        save_ppo_files(
            directory, self.agent(slot), self.configs[slot],
            {"env_steps": counters.env_steps, "updates": counters.updates,
             "total_env_steps": self.configs[slot].total_env_steps},
        )  # fmt: skip

    def _place(self, slot: int, agent: PPO, config: PPORunConfig, counters: Counters) -> None:
        self._check(config)
        self.population.put(slot, agent, config.agent_config, config.seed, counters.env_steps)
        self.configs[slot] = config
        if self.size == 1:
            run = self.iterations * self.shape.batch * self.world
            self.base = Counters(counters.env_steps - run, counters.updates - self.iterations)
        else:
            self.offsets[slot] = Counters(
                counters.env_steps - self.env_steps, counters.updates - self.updates
            )

    def load(self, slot: int, directory: Path, config: PPORunConfig) -> None:
        agent = self._fresh(config)
        files = load_ppo_files(directory, agent)
        counters = files.documents.get("counters", {})
        self._place(
            slot, agent, config,
            Counters(int(counters.get("env_steps", 0)), int(counters.get("updates", 0))),
        )  # fmt: skip

    def reset(self, slot: int, config: PPORunConfig) -> None:
        self._place(slot, self._fresh(config), config, Counters(0, 0))

    def copy(self, dst: int, src: int, config: PPORunConfig) -> None:
        self._check(config)
        self.population.copy(dst, src, config.agent_config)
        self.configs[dst] = config

    def close(self) -> None:
        self.envs.close()


# -- training files --------------------------------------------------------------------------
def save_ppo_files(
    directory: Path, agent: PPO, config: PPORunConfig, counters: Mapping[str, int]
) -> dict[str, str]:
    """Write one agent's full training state; returns file name → sha256."""
    critic_state = {f"critic.{k}": v for k, v in agent.critic.state_dict().items()}
    critic_state |= {f"return_rms.{k}": v for k, v in agent.return_rms.state_dict().items()}
    opt_tensors, opt_meta = optimizer_to_files(agent.optimizer.state_dict())
    files = {
        "actor.safetensors": tensor_bytes(agent.policy.state_dict()),
        "critic.safetensors": tensor_bytes(critic_state),
        "optimizer.safetensors": opt_tensors,
        "optimizer.json": opt_meta,
        "hyperparameters.json": json_bytes(config.model_dump(mode="json")),
        "counters.json": json_bytes(dict(counters)),
    }
    return write_files(directory, files, {"algorithm": agent.name})


def load_ppo_files(directory: Path, agent: PPO) -> TrainingFiles:
    """Restore an agent from verified training files (weights, statistics, optimiser);
    returns them (their counters are the caller's)."""
    files = read_agent_files(directory, agent.name, {"actor", "critic", "optimizer"})
    load_into(agent.policy, files.tensors["actor"], "actor.safetensors")
    critic = files.tensors["critic"]
    for prefix, module in (("critic.", agent.critic), ("return_rms.", agent.return_rms)):
        part = {k.removeprefix(prefix): v for k, v in critic.items() if k.startswith(prefix)}
        load_into(module, part, "critic.safetensors")
    try:
        agent.optimizer.load_state_dict(
            optimizer_from_files(files.tensors["optimizer"], files.documents["optimizer"])
        )
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"optimizer state does not fit this agent: {exc}") from exc
    return files


__all__ = ["OnPolicyTrainer", "load_ppo_files", "save_ppo_files"]
