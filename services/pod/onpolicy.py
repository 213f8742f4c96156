"""PPO's trainer: worker → learner → evaluator over rollouts, one agent.

A step collects a rollout (services/pod/worker.py ``RolloutWorker``) and makes one update
(services/pod/learner.py ``RolloutLearner``); the evaluator scores the learner's policy. The
worker and evaluator run where the ``RolloutRoles`` put them: in this process, sharing the
learner's policy object (``LocalRoles``, Anakin-style), or in processes or containers of their
own (services/pod/multiprocess.py), fed the learner's weights before every rollout or
evaluation. ``learners: N`` fuses N replicas by averaging (services/pod/fusion.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Protocol, cast

import torch
from pydantic import Field

from services.logs import get_logger
from services.pod.algorithms.ppo import PPO
from services.pod.algorithms.ppo_config import PPOConfig
from services.pod.checkpoint import (
    CheckpointError,
    TrainingFiles,
    json_bytes,
    load_into,
    optimizer_from_files,
    optimizer_to_files,
    read_files,
    tensor_bytes,
    write_files,
)
from services.pod.compiled import should_compile
from services.pod.envs.base import TorchVecEnv, VecEnv
from services.pod.evaluator import EvalResult, Evaluator
from services.pod.fusion import ParameterAverager
from services.pod.learner import RolloutLearner
from services.pod.trainer import Counters, Roles, RunConfig, Trainer, check_action_space
from services.pod.worker import FusedRolloutWorker, Rollout, RolloutWorker

log = get_logger(__name__)


class PPORunConfig(RunConfig):
    """One PPO training run. ``ppo`` holds the algorithm's hyperparameters."""

    ppo: PPOConfig = Field(default_factory=PPOConfig)
    learners: int = Field(
        1,
        ge=1,
        le=64,
        description="Learner replicas, each with its own envs, averaged after every epoch.",
    )


def build_agent(config: PPORunConfig) -> tuple[VecEnv, VecEnv, PPO]:
    """The training env, the evaluation env and a fresh agent, seeded by ``config``: every
    process that builds them from the same config gets the same initial weights."""
    torch.manual_seed(config.seed)
    env, eval_env = config.make_envs(config.ppo.num_envs)
    try:
        check_action_space(PPO, env.single_action_space)
    except ValueError:
        env.close()
        eval_env.close()
        raise
    agent = PPO(env.single_observation_space, env.single_action_space, config.ppo)
    agent.compiled = should_compile(config.ppo.compile, config.device, config.ppo.num_envs)
    return env, eval_env, agent.to(config.device)


def make_worker(config: PPORunConfig, env: VecEnv, agent: PPO) -> RolloutWorker:
    """The fused (Anakin) worker where the agent compiles and the env is torch-native, else
    the eager one; an env that cannot be compiled says so once in the log."""
    cfg = config.ppo
    args = (agent.policy, cfg.num_steps, cfg.gamma, config.seed)
    if agent.compiled and isinstance(env, TorchVecEnv):
        return FusedRolloutWorker(env, *args, compile=True)
    if agent.compiled:
        log.warning("compile.env_not_torch_native", env=config.env, fallback="eager rollout")
    return RolloutWorker(env, *args)


class RolloutRoles(Roles, Protocol):
    """Where PPO's worker and evaluator run (``LocalRoles`` here, services/pod/multiprocess.py
    apart): built for a config, they collect rollouts and evaluate the learner's policy."""

    def build(
        self, config: PPORunConfig, env: VecEnv, eval_env: VecEnv, learner: RolloutLearner
    ) -> None: ...
    def collect(self) -> Rollout: ...
    def evaluate(self) -> EvalResult: ...


class LocalRoles:
    """Worker and evaluator in this process, holding the learner's own policy: nothing to
    copy between them."""

    in_process = True

    def __init__(self) -> None:
        self.worker: RolloutWorker | None = None
        self.evaluator: Evaluator | None = None
        self.learner: RolloutLearner | None = None

    def build(
        self, config: PPORunConfig, env: VecEnv, eval_env: VecEnv, learner: RolloutLearner
    ) -> None:
        self.close()  # a restart from a parent replaces the envs too
        self.worker = make_worker(config, env, learner.agent)
        self.evaluator = Evaluator(eval_env, seed=config.evaluation_seed)
        self.learner = learner

    def collect(self) -> Rollout:
        assert self.worker is not None
        return self.worker.collect()

    def evaluate(self) -> EvalResult:
        assert self.evaluator is not None and self.learner is not None
        return self.evaluator.evaluate(self.learner.policy)

    def close(self) -> None:
        for role in (self.worker, self.evaluator):
            if role is not None:
                role.env.close()
        self.worker = self.evaluator = None


class OnPolicyTrainer(Trainer[PPORunConfig]):
    """One PPO agent (one slot)."""

    config_class = PPORunConfig
    one_update_per_step = True
    # Pods train open-ended rounds and the generator tunes the learning rate (PBT), so PPO's
    # LR is not annealed toward a budget unless the hyperparameters ask for it.
    pod_defaults: ClassVar[Mapping[str, object]] = {"ppo": {"anneal_lr": False}}

    def __init__(self, configs: Sequence[PPORunConfig], roles: Roles | None = None) -> None:
        [config] = configs
        # Roles apart are services/pod/multiprocess.py's, which implement RolloutRoles.
        apart = roles is not None and not roles.in_process
        self.roles = cast(RolloutRoles, roles) if apart else LocalRoles()
        self.size = 1
        self._stats: dict[str, float] = {}
        self._returns = torch.zeros(0)
        self.reset(0, config)

    def reset(self, slot: int, config: PPORunConfig) -> None:
        self._config = config
        env, eval_env, agent = build_agent(config)
        self.learner = RolloutLearner(agent, config.total_env_steps)
        self.roles.build(config, env, eval_env, self.learner)

    @classmethod
    def replicas(cls, config: PPORunConfig) -> int:
        return config.learners

    def join_group(self, world: int) -> None:
        self.learner.world = world
        averager = ParameterAverager(self.learner.agent, self.learner.agent.optimizer)
        averager.broadcast(0)  # one starting point for all replicas
        self.learner.after_epoch = averager

    @property
    def step_env_steps(self) -> int:
        return self._config.ppo.batch_size * self.learner.world

    def step(self) -> None:
        rollout = self.roles.collect()
        self._stats = self.learner.update(rollout)
        self._returns = rollout.episode_returns.clone()  # shared memory when apart

    def progress(self) -> dict[str, float]:
        record = dict(self._stats)
        if self._returns.numel():
            record["train_return"] = float(self._returns.mean())
        return record

    def evaluate(self) -> list[EvalResult]:
        return [self.roles.evaluate()]

    def config(self, slot: int) -> PPORunConfig:
        return self._config

    def counters(self, slot: int) -> Counters:
        return Counters(self.learner.env_steps, self.learner.updates)

    def save(self, slot: int, directory: Path) -> None:
        save_ppo_files(directory, self.learner, self._config)

    def load(self, slot: int, directory: Path, config: PPORunConfig) -> None:
        if config != self._config:
            self.reset(slot, config)
        load_ppo_files(directory, self.learner)
        # The optimiser state came with the parent's learning rate; use the proposed one.
        for group in self.learner.agent.optimizer.param_groups:
            group["lr"] = config.ppo.learning_rate

    def close(self) -> None:
        if self.roles.in_process:
            self.roles.close()


# -- training files --------------------------------------------------------------------------
def save_ppo_files(
    directory: Path, learner: RolloutLearner, config: PPORunConfig
) -> dict[str, str]:
    """Write the learner's full training state; returns file name → sha256."""
    agent = learner.agent
    critic_state = {f"critic.{k}": v for k, v in agent.critic.state_dict().items()}
    critic_state |= {f"return_rms.{k}": v for k, v in agent.return_rms.state_dict().items()}
    opt_tensors, opt_meta = optimizer_to_files(agent.optimizer)
    files = {
        "actor.safetensors": tensor_bytes(agent.policy.state_dict()),
        "critic.safetensors": tensor_bytes(critic_state),
        "optimizer.safetensors": opt_tensors,
        "optimizer.json": opt_meta,
        "hyperparameters.json": json_bytes(config.model_dump(mode="json")),
        "counters.json": json_bytes(learner.counters()),
    }
    return write_files(directory, files, {"algorithm": agent.name})


def load_ppo_files(directory: Path, learner: RolloutLearner) -> TrainingFiles:
    """Restore a learner from a verified checkpoint (weights, optimiser, counters)."""
    files = read_files(directory)
    needed = {"actor", "critic", "optimizer"}
    if missing := needed - files.tensors.keys():
        raise CheckpointError(f"{directory}: missing {sorted(missing)}")
    agent = learner.agent
    if (found := files.manifest.get("algorithm")) != agent.name:
        raise CheckpointError(f"{directory}: checkpoint of {found!r}, agent is {agent.name!r}")
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
    if "counters" in files.documents:
        learner.load_counters(files.documents["counters"])
    return files
