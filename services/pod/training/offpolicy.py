"""The off-policy trainer (SAC, TD3, DDPG, DQN family, and plugins of it): P >= 1 agents
("slots") of one algorithm trained together in one process, one vector step at a time:

* worker (services/pod/roles/worker.py ``ReplayWorker``): step the P x N sub-environments with
  each agent's exploring policy and append its N transitions to its replay buffer;
* learner (services/pod/roles/learner.py ``ReplayLearner``): ``updates_per_step`` updates per
  env step (the update-to-data ratio) of every agent, each on a fresh minibatch of its buffer,
  by the algorithm's one update (services/pod/algorithms/stacked.py ``KStep``), eager or
  compiled (``compile``: services/pod/algorithms/compiled.py), ``updates_per_call`` per call
  compiled, and on a GPU one CUDA graph per call;
* evaluator: deterministic episodes of every agent on its slice of its own env.

Many cheap torch-native sub-environments and few large-batch updates is what makes this fast:
on a CPU a gradient step of small networks costs far more (per-op overhead, small matmuls) than
a vector step of tens of sub-environments, so wall time tracks the gradient steps and fresh
data is nearly free (docs/benchmarks.md).

Each slot saves and loads exactly a single agent's training files (weights, optimiser, replay
buffer, counters), so PBT's exploit copies a slot from any pod's files and ``podium export``
loads a slot's. Settings that shape the networks, the data or the loop are shared by the slots
(``HyperparameterError`` naming the field where they differ); they may differ in the card's
population hyperparameters and their seeds."""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, Field, create_model, model_validator

from services.contracts.algorithms.card import AlgorithmCard, card
from services.contracts.algorithms.ddpg.config import DDPGConfig
from services.contracts.algorithms.dqn.config import DQNConfig
from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.algorithms.offpolicy import ReplayLoopConfig
from services.contracts.algorithms.sac.config import SACConfig
from services.contracts.algorithms.td3.config import TD3Config
from services.logs import get_logger
from services.pod.algorithms.compiled import (
    CompileFailedError,
    Decision,
    cached,
    compile_work,
    count_compile,
    mark_cached,
)
from services.pod.algorithms.replay_buffer import ReplayBuffer
from services.pod.algorithms.spaces import check_action_space
from services.pod.algorithms.stacked import KStep, Stack, StackedReplay
from services.pod.roles.evaluator import EvalResult, evaluate_groups
from services.pod.roles.learner import ReplayLearner
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
    RunConfig,
    Trainer,
    algorithm_class,
    check_population_slot,
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
    """``len(configs)`` agents of one off-policy algorithm; ``step`` is one vector step of
    worker → replay → learner for every agent at once."""

    config_class = OffPolicyConfig
    one_update_per_step = False
    loop_hyperparameters: ClassVar[tuple[str, ...]] = tuple(ReplayLoopConfig.model_fields)

    @classmethod
    def for_algorithm(cls, card: AlgorithmCard) -> type[Trainer]:
        return offpolicy_trainer(card.name)

    def __init__(
        self,
        configs: Sequence[OffPolicyConfig],
        horizon_env_steps: int | None = None,
    ) -> None:
        first = configs[0]
        self.size = p = len(configs)
        self.configs = list(configs)
        self.algorithm = algorithm_class(first.algorithm)
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
        self.population: Stack = self.algorithm.Stack([agent for agent, _ in singles])
        self.replay = StackedReplay(p, singles[0][1])
        # Exploration noise and random actions of every agent.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(first.seed)
        kstep = KStep(
            self.population,
            self.replay.fields,
            self.replay.filled,
            first.batch_size,
            [c.seed for c in configs],
        )
        horizon = horizon_env_steps or first.total_env_steps
        if first.target_return is not None and first.expected_env_steps:
            horizon = min(horizon, 2 * first.expected_env_steps)
        updates = max(0, horizon - first.learning_starts) * first.updates_per_step
        self.decision = Decision(
            first.compile, "offpolicy", self.device, units=updates * p,
            cached=cached(first, self.program_key(), self._programs()),
        )  # fmt: skip
        self.learner = ReplayLearner(
            self.population, self.replay, first.learning_starts, first.updates_per_step, kstep,
            compiled=bool(self.decision.compiled), k=first.updates_per_call,
        )  # fmt: skip
        self.worker = ReplayWorker(
            self.env, self.population, self.replay, self.generator, first.learning_starts,
            first.seed, self.learner.slot_env_steps,
        )  # fmt: skip
        self._stats: dict[str, torch.Tensor] = {}
        self.compile_seconds = 0.0
        self._noted: set[bool] = set()
        self._describe()

    def program_key(self) -> str:
        """What fixes this trainer's update programs: the algorithm, the agents' shared
        settings (networks, replay and batch shapes, env), P and the device type."""
        first = self.configs[0]
        shared = {k: v for k, v in _shared(first).items() if k.rpartition(".")[2] != "compile"}
        shared["device"] = self.device.type
        return f"{first.algorithm} P={self.size} {sorted(shared.items())}"

    def _programs(self) -> tuple[str, ...]:
        """The update programs compiling builds: TD3's delayed update (actor and targets
        too) and, where the actor waits, the critics' own."""
        return tuple(
            _program(d) for d in ((True, False) if self.population.policy_delay > 1 else (True,))
        )

    def _describe(self) -> None:
        d = self.decision
        if d.compiled is None:
            self.compiled = f"deciding ({d.mode}: timing the first eager updates)"
        elif d.compiled:
            self.compiled = f"compiled (update; {d.reason})"
        else:
            self.compiled = f"eager ({d.reason})"

    def _check(self, config: OffPolicyConfig) -> None:
        """Refuse a config whose shared settings differ from the first slot's, naming them."""
        check_population_slot(self.configs[0], config, _varied(config.algorithm), self.size)
        if not hasattr(self.algorithm, "Stack"):
            raise HyperparameterError(
                f"{config.algorithm} has no stacked update (its agent class names no Stack): "
                f"the off-policy trainer cannot train it"
            )

    def _single(self, config: OffPolicyConfig) -> tuple[Any, ReplayBuffer]:
        """A fresh single agent and an empty buffer of the population's shape, seeded as a
        single-agent pod seeds its agent."""
        torch.manual_seed(config.seed)
        env = self.env
        agent = self.algorithm(
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
        before, updates, start = compile_work(), self.learner.updates, time.perf_counter()
        try:
            self._stats = self.learner.learn(taken) or self._stats
        except CompileFailedError as exc:
            # Failed before its update ran: what is still owed is paid eager from here.
            self.decision.failed(exc)
            self.learner.compile(False, 1)
            self._describe()
            self._stats = self.learner.learn(0) or self._stats
        done = self.learner.updates - updates
        if done and self.decision.compiled is None:
            seconds = time.perf_counter() - start
            if self.decision.eager_call(seconds, done * self.size):
                self.learner.compile(bool(self.decision.compiled), self.configs[0].updates_per_call)
                self._describe()
        count_compile(self, before, "update")
        # Each program that ran compiled is in the compile cache (built or loaded there, here
        # or by an earlier trainer of this process): noted once, for the next process's auto.
        ran = self.learner.kstep.compiled_kinds
        if len(ran) > len(self._noted):  # a length check: this runs every env step
            for delayed in ran - self._noted:
                mark_cached(self.configs[0], self.program_key(), _program(delayed))
            self._noted |= ran

    def progress(self) -> dict[str, float]:
        """The agents' last losses averaged; the mean return of every agent's episodes."""
        record = {k: float(v.mean()) for k, v in self._stats.items()}
        if (train_return := self.worker.tally.mean("progress")) is not None:
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
    def single(self, slot: int) -> tuple[Any, ReplayBuffer]:
        """Slot ``slot`` as a single agent (weights, targets, Adam state) and its buffer."""
        agent, buffer = self._single(self.configs[slot])
        self.population.get(slot, agent)
        self.replay.get(slot, buffer)
        return agent, buffer

    def save(self, slot: int, directory: Path) -> None:
        config, counters = self.configs[slot], self.counters(slot)
        agent, buffer = self.single(slot)
        save_offpolicy_files(
            directory, agent, buffer, self.generator, config,
            {"env_steps": counters.env_steps, "updates": counters.updates,
             "update_debt": self.learner.update_debt},
        )  # fmt: skip

    def _place(self, slot: int, agent: Any, buffer: ReplayBuffer, config: OffPolicyConfig,
               counters: Counters) -> None:  # fmt: skip
        self.population.put(slot, agent)
        self.replay.put(slot, buffer)
        self.configs[slot] = config
        self.learner.place(slot, counters.env_steps, counters.updates)
        # The slot updates with its own random stream, not its predecessor's next draws.
        self.learner.kstep.reseed(slot, config.seed)

    def load(self, slot: int, directory: Path, config: OffPolicyConfig) -> None:
        self._check(config)
        agent, buffer = self._single(config)
        counters = load_offpolicy_files(directory, agent, buffer)
        # The slot trains with ``config``'s hyperparameters (PBT's explore), not its files'.
        agent.config = config.agent_config
        agent.optimizer.lr = config.agent_config.learning_rate
        self._place(
            slot, agent, buffer, config,
            Counters(int(counters["env_steps"]), int(counters["updates"])),
        )  # fmt: skip
        if self.size == 1:  # a child explores with its own random stream, not its parent's
            self.generator.manual_seed(config.seed)
            self.worker.obs = None  # fresh episodes, seeded by the loaded env steps
            self.learner.env_steps = int(counters["env_steps"])
            self.learner.updates = int(counters["updates"])
            self.learner.update_debt = float(counters.get("update_debt", 0.0))
            self.learner.place(slot, self.learner.env_steps, self.learner.updates)
            # The update's draws go on where the files' agent left them (one per update).
            self.learner.kstep.counter.fill_(self.learner.updates)

    def reset(self, slot: int, config: OffPolicyConfig) -> None:
        self._check(config)
        agent, buffer = self._single(config)
        self._place(slot, agent, buffer, config, Counters(0, 0))

    def copy(self, dst: int, src: int, config: OffPolicyConfig) -> None:
        self._check(config)
        self.population.copy(dst, src)
        self.population.set_hyperparameters(dst, config.agent_config)
        self.replay.copy(dst, src)
        self.configs[dst] = config

    def recent_returns(self) -> list[float | None]:
        return self.worker.tally.means("pbt")

    def close(self) -> None:
        for env in (getattr(self, "env", None), getattr(self, "eval_env", None)):
            if env is not None:
                env.close()
        self.env = self.eval_env = None  # type: ignore[assignment]


def _program(delayed: bool) -> str:
    return "update" if delayed else "critics' update"


def _varied(algorithm: str) -> tuple[str, ...]:
    found = card(algorithm).population
    return found.hyperparameters if found else ()


def _shared(config: OffPolicyConfig) -> dict[str, Any]:
    """The fields that fix a population's update programs: the networks', data's and loop's."""
    agent = config.agent_config.model_dump(exclude=set(_varied(config.algorithm)))
    loop = {k: getattr(config, k) for k in ReplayLoopConfig.model_fields}
    run = {
        k: getattr(config, k)
        for k in ("env", "env_kwargs", "eval_env_kwargs", "device", "eval_episodes")
    }
    return {**{f"{config.algorithm}.{k}": v for k, v in agent.items()}, **loop, **run}


# -- training files --------------------------------------------------------------------------
def save_offpolicy_files(
    directory: Path,
    agent: Any,
    buffer: ReplayBuffer,
    generator: torch.Generator,
    config: OffPolicyConfig,
    counters: dict[str, int | float],
) -> dict[str, str]:
    """Write one agent's full training state, replay buffer included; returns file name →
    sha256. ``actor.safetensors`` is the policy alone (enough to act), ``critic.safetensors``
    every other network (critics, targets, temperature)."""
    state = agent.state_dict()
    files = {
        "actor.safetensors": tensor_bytes(agent.policy.state_dict()),
        "critic.safetensors": tensor_bytes(
            {k: v for k, v in state.items() if not k.startswith("policy.")}
        ),
        "replay_buffer.safetensors": tensor_bytes(buffer.state_dict()),
        "rng.safetensors": tensor_bytes({"generator": generator.get_state()}),
        "hyperparameters.json": json_bytes(config.model_dump(mode="json")),
        "counters.json": json_bytes(counters),
    }
    for name, optimizer in agent.optimizers().items():
        tensors, meta = optimizer_to_files(optimizer.state_dict())
        files[f"{name}.safetensors"] = tensors
        files[f"{name}.json"] = meta
    return write_files(directory, files, {"algorithm": agent.name})


def load_offpolicy_files(directory: Path, agent: Any, buffer: ReplayBuffer) -> dict[str, Any]:
    """Restore an agent and its replay buffer from verified training files; returns their
    counters. Raises ``CheckpointError``."""
    optimizers = agent.optimizers()
    needed = {"actor", "critic", "replay_buffer", "rng", *optimizers}
    files = read_agent_files(directory, agent.name, needed)
    state = {f"policy.{k}": v for k, v in files.tensors["actor"].items()}
    state |= files.tensors["critic"]
    try:
        agent.load_state_dict(state, strict=True)
        buffer.load_state_dict(files.tensors["replay_buffer"])
        for name, optimizer in optimizers.items():
            optimizer.load_state_dict(
                optimizer_from_files(files.tensors[name], files.documents[name])
            )
        counters: dict[str, Any] = files.documents["counters"]
        int(counters["env_steps"]), int(counters["updates"])
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{directory}: does not fit this agent: {exc}") from exc
    return counters
