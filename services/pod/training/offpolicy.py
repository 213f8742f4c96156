"""The off-policy trainer (SAC, TD3, DDPG, DQN family): one agent, fused in one process.

The same worker → learner → evaluator split as PPO's (services/pod/training/onpolicy.py), in the
shape off-policy methods need, one vector step at a time:

* worker (services/pod/roles/worker.py ``ReplayWorker``): step every sub-environment with the
  exploring policy and append the N transitions to the replay buffer;
* learner (services/pod/roles/learner.py ``ReplayLearner``): ``updates_per_step`` gradient updates
  per env step (the update-to-data ratio), each on a fresh minibatch sampled from the buffer;
* evaluator: deterministic episodes on its own env.

Many cheap torch-native sub-environments and few large-batch updates is what makes this fast
in wall time: on a CPU a gradient step of small networks costs far more (per-op overhead and
small matmuls) than a vector step of tens of sub-environments, so wall time tracks the number
of gradient steps, and fresh data is nearly free (docs/benchmarks.md).

The roles always run in this process: the worker steps one vector step at a time into a replay
buffer the learner samples, which the process split (services/pod/roles/multiprocess.py, built
around PPO's rollouts) lacks."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, Field, create_model, model_validator

from services.contracts.algorithms.card import AlgorithmCard, card
from services.contracts.algorithms.ddpg.config import DDPGConfig
from services.contracts.algorithms.dqn.config import DQNConfig
from services.contracts.algorithms.offpolicy import ReplayLoopConfig
from services.contracts.algorithms.sac.config import SACConfig
from services.contracts.algorithms.td3.config import TD3Config
from services.logs import get_logger
from services.pod.algorithms.kstep import COMPILED, should_compile_updates
from services.pod.algorithms.replay_buffer import ReplayBuffer
from services.pod.algorithms.spaces import check_action_space
from services.pod.roles.evaluator import EvalResult, Evaluator
from services.pod.roles.learner import KStepLearner, ReplayLearner
from services.pod.roles.worker import ReplayWorker
from services.pod.training.checkpoint import (
    CheckpointError,
    json_bytes,
    optimizer_from_files,
    optimizer_to_files,
    read_agent_files,
    tensor_bytes,
    write_files,
)
from services.pod.training.trainer import (
    Counters,
    Roles,
    RunConfig,
    Trainer,
    algorithm_class,
    train_in_process,
)

log = get_logger(__name__)


class OffPolicyConfig(RunConfig, ReplayLoopConfig):
    """One off-policy training run: the run's fields, the loop's hyperparameters
    (``ReplayLoopConfig``: envs, replay, batch, update-to-data ratio), and the field named by
    ``algorithm`` holds the agent's. A plugin algorithm's run config is this with a field of
    its own (``OffPolicyTrainer.config_for``)."""

    env: str = "Pendulum-v1"
    algorithm: str = "sac"
    total_env_steps: int = Field(100_000, ge=1, description="Training budget in env steps.")
    eval_every_steps: int = Field(2_048, ge=1)
    sac: SACConfig = Field(default_factory=SACConfig)
    td3: TD3Config = Field(default_factory=TD3Config)
    ddpg: DDPGConfig = Field(default_factory=DDPGConfig)
    dqn: DQNConfig = Field(default_factory=DQNConfig)

    @model_validator(mode="after")
    def _known_algorithm(self) -> OffPolicyConfig:
        agents = [k for k, f in type(self).model_fields.items() if _is_agent_field(f.annotation)]
        if self.algorithm not in agents:
            raise ValueError(
                f"algorithm: {self.algorithm!r} is not an off-policy algorithm "
                f"(one of {', '.join(agents)})"
            )
        return self


def _is_agent_field(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


@cache
def config_for(algorithm: str) -> type[OffPolicyConfig]:
    """The run config of ``algorithm``: ``OffPolicyConfig``, with a field for a plugin's own
    hyperparameters (its card's ``config``) when it is not a built-in one."""
    if algorithm in OffPolicyConfig.model_fields:
        return OffPolicyConfig
    agent = card(algorithm).config
    return create_model(  # type: ignore[call-overload, no-any-return]
        f"{agent.__name__}RunConfig",
        __base__=OffPolicyConfig,
        algorithm=(str, algorithm),
        **{algorithm: (agent, Field(default_factory=agent))},
    )


@cache
def offpolicy_trainer(algorithm: str) -> type[OffPolicyTrainer]:
    """``OffPolicyTrainer``, with ``algorithm``'s run config (``config_for``)."""
    config_class = config_for(algorithm)
    if config_class is OffPolicyConfig:
        return OffPolicyTrainer
    name = f"{config_class.__name__}Trainer"
    return type(name, (OffPolicyTrainer,), {"config_class": config_class})


class OffPolicyTrainer(Trainer[OffPolicyConfig]):
    """One off-policy agent (one slot); ``step`` is one vector step of worker → replay →
    learner."""

    config_class = OffPolicyConfig
    one_update_per_step = False
    loop_hyperparameters: ClassVar[tuple[str, ...]] = tuple(ReplayLoopConfig.model_fields)

    @classmethod
    def for_algorithm(cls, card: AlgorithmCard) -> type[Trainer]:
        return offpolicy_trainer(card.name)

    def __init__(self, configs: Sequence[OffPolicyConfig], roles: Roles | None = None) -> None:
        [config] = configs
        train_in_process(
            roles,
            "off-policy agents train fused: worker, learner and evaluator in this process",
            algorithm=config.algorithm,
        )
        self.size = 1
        self._stats: dict[str, torch.Tensor] = {}
        self._built = False
        self.reset(0, config)

    def reset(self, slot: int, config: OffPolicyConfig) -> None:
        """Construct env, agent, replay buffer and evaluator for ``config``."""
        self.close()
        self._config = config
        # Looked up by registered name: a config can name an algorithm, never a module.
        algorithm = algorithm_class(config.algorithm)
        torch.manual_seed(config.seed)
        env, eval_env = config.make_envs(config.num_envs)
        obs_space, action_space = env.single_observation_space, env.single_action_space
        try:
            check_action_space(config.algorithm, action_space)
        except ValueError:
            env.close()
            eval_env.close()
            raise
        self.agent = algorithm(obs_space, action_space, config.agent_config).to(config.device)
        self.buffer = ReplayBuffer(
            config.buffer_size,
            tuple(obs_space.shape),
            self.agent.action_shape,
            torch.int64 if self.agent.discrete else torch.float32,
            device=env.device,
        )
        # Exploration noise and minibatch sampling.
        self.generator = torch.Generator(device=env.device)
        self.generator.manual_seed(config.seed)
        self.worker = ReplayWorker(
            env, self.agent, self.buffer, self.generator, config.learning_starts, config.seed
        )
        schedule = (config.learning_starts, config.updates_per_step, config.batch_size)
        if compile_updates(config, env.device, 1):
            self.learner: ReplayLearner = KStepLearner(
                self.agent,
                self.buffer,
                self.generator,
                *schedule,
                k=config.updates_per_call,
                seed=config.seed,
                compile=True,
            )
        else:
            self.learner = ReplayLearner(self.agent, self.buffer, self.generator, *schedule)
        self.evaluator = Evaluator(eval_env, seed=config.evaluation_seed)
        self._built = True

    @property
    def policy(self) -> torch.nn.Module:
        return self.agent.policy

    @property
    def step_env_steps(self) -> int:
        return self.worker.env.num_envs

    def step(self) -> None:
        taken = self.worker.step(self.learner.env_steps)
        self._stats = self.learner.learn(taken) or self._stats

    def progress(self) -> dict[str, float]:
        record = {k: float(v) for k, v in self._stats.items()}
        if (train_return := self.worker.train_return()) is not None:
            record["train_return"] = train_return
        return record

    def evaluate(self) -> list[EvalResult]:
        return [self.evaluator.evaluate(self.agent.policy)]

    def config(self, slot: int) -> OffPolicyConfig:
        return self._config

    def counters(self, slot: int) -> Counters:
        return Counters(self.learner.env_steps, self.learner.updates)

    def save(self, slot: int, directory: Path) -> None:
        self.learner.sync()
        save_offpolicy_files(directory, self, self._config)

    def load(self, slot: int, directory: Path, config: OffPolicyConfig) -> None:
        if config != self._config:
            self.reset(slot, config)
        load_offpolicy_files(directory, self)  # weights, optimiser, replay buffer
        # A child explores with its own random stream, not its parent's next draws.
        self.generator.manual_seed(config.seed)
        for optimizer in self.agent.optimizers().values():
            for group in optimizer.param_groups:
                group["lr"] = config.agent_config.learning_rate
        self.learner.reloaded(config.seed)

    def close(self) -> None:
        if self._built:
            self.worker.env.close()
            self.evaluator.env.close()
            self._built = False


def compile_updates(config: OffPolicyConfig, device: torch.device | str, agents: int) -> bool:
    """Whether ``agents`` agents of ``config`` train with the compiled K-step update
    (``config.compile``, resolved by services/pod/algorithms/kstep.py over the run's updates);
    an algorithm without one (a plugin's) trains eager, logged where ``on`` asked for it."""
    if config.compile == "off":
        return False
    if config.algorithm not in COMPILED:
        if config.compile == "on":
            log.warning(
                "compile.unavailable",
                mode=config.compile,
                reason=f"no compiled K-step update for {config.algorithm}",
                fallback="eager",
            )
        return False
    updates = config.total_env_steps * config.updates_per_step * agents
    return should_compile_updates(config.compile, device, updates)


# -- training files --------------------------------------------------------------------------
def save_offpolicy_files(
    directory: Path, trainer: OffPolicyTrainer, config: OffPolicyConfig
) -> dict[str, str]:
    """Write the full training state, replay buffer included; returns file name → sha256.

    ``actor.safetensors`` is the policy alone (enough to act), ``critic.safetensors`` every
    other network (critics, targets, temperature).
    """
    agent = trainer.agent
    state = agent.state_dict()
    files = {
        "actor.safetensors": tensor_bytes(agent.policy.state_dict()),
        "critic.safetensors": tensor_bytes(
            {k: v for k, v in state.items() if not k.startswith("policy.")}
        ),
        "replay_buffer.safetensors": tensor_bytes(trainer.buffer.state_dict()),
        "rng.safetensors": tensor_bytes({"generator": trainer.generator.get_state()}),
        "hyperparameters.json": json_bytes(config.model_dump(mode="json")),
        "counters.json": json_bytes(trainer.learner.counters()),
    }
    for name, optimizer in agent.optimizers().items():
        tensors, meta = optimizer_to_files(optimizer.state_dict())
        files[f"{name}.safetensors"] = tensors
        files[f"{name}.json"] = meta
    return write_files(directory, files, {"algorithm": agent.name})


def load_offpolicy_files(directory: Path, trainer: OffPolicyTrainer) -> None:
    """Restore ``trainer`` from verified training files. Raises ``CheckpointError``."""
    agent = trainer.agent
    optimizers = agent.optimizers()
    needed = {"actor", "critic", "replay_buffer", "rng", *optimizers}
    files = read_agent_files(directory, agent.name, needed)
    state = {f"policy.{k}": v for k, v in files.tensors["actor"].items()}
    state |= files.tensors["critic"]
    try:
        agent.load_state_dict(state, strict=True)
        trainer.buffer.load_state_dict(files.tensors["replay_buffer"])
        trainer.generator.set_state(files.tensors["rng"]["generator"])
        for name, optimizer in optimizers.items():
            optimizer.load_state_dict(
                optimizer_from_files(files.tensors[name], files.documents[name])
            )
        trainer.learner.load_counters(files.documents["counters"])
        trainer.worker.obs = None  # fresh episodes, seeded by the loaded env steps
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{directory}: does not fit this agent: {exc}") from exc
