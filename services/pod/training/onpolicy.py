"""PPO's trainer: worker → learner → evaluator over rollouts, one agent.

A step collects a rollout (services/pod/roles/worker.py ``RolloutWorker``) and makes one update
(services/pod/roles/learner.py ``RolloutLearner``); the evaluator scores the learner's policy. The
worker and evaluator run where the ``RolloutRoles`` put them: in this process, sharing the learner's
policy object (``LocalRoles``, Anakin-style), or in processes or containers of their own
(services/pod/roles/multiprocess.py), fed the learner's weights before every rollout or evaluation.
``learners: N`` fuses N replicas by averaging (services/pod/training/fusion.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar, cast

import torch

from services.logs import get_logger
from services.pod.config import PPORunConfig
from services.pod.roles.evaluator import EvalResult
from services.pod.roles.learner import RolloutLearner
from services.pod.roles.rollout_roles import LocalRoles, RolloutRoles, build_agent
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
from services.pod.training.fusion import ParameterAverager
from services.pod.training.trainer import Counters, Roles, Trainer

log = get_logger(__name__)


class OnPolicyTrainer(Trainer[PPORunConfig]):
    """One PPO agent (one slot)."""

    config_class = PPORunConfig
    one_update_per_step = True
    # Pods train open-ended rounds and the generator tunes the learning rate (PBT), so PPO's
    # LR is not annealed toward a budget unless the hyperparameters ask for it.
    pod_defaults: ClassVar[Mapping[str, object]] = {"ppo": {"anneal_lr": False}}

    def __init__(self, configs: Sequence[PPORunConfig], roles: Roles | None = None) -> None:
        [config] = configs
        # Roles apart are services/pod/roles/multiprocess.py's, which implement RolloutRoles.
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
    opt_tensors, opt_meta = optimizer_to_files(agent.optimizer_state_dict())
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
    agent = learner.agent
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
    if "counters" in files.documents:
        learner.load_counters(files.documents["counters"])
    return files
