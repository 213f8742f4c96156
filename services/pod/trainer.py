"""The trainer interface: every way the pod trains, behind one contract.

A *trainer* trains ``size`` agents ("slots") of one algorithm on one env: PPO on-policy
(services/pod/onpolicy.py), the off-policy algorithms (services/pod/offpolicy.py), the
portfolio gradient (services/pod/portfolio_trainer.py) and a population of P PPO agents in one
process (services/pod/population_trainer.py); a single agent is one slot. ``podium train``'s
fit loop (services/pod/fit.py) and the pod's round loop (services/pod/runtime.py) see nothing
else of an algorithm: they step, evaluate, save and load slots, and read counters.

Which trainer trains an algorithm is a registry lookup: the class registered under its name
(entry points ``podium.algorithms``, services/registry.py) declares its hyperparameters
(``config_class``), the action spaces it takes (``action_spaces``) and ``trainer(slots)``.
Adding an algorithm is one module (the class), one config model, one preset file
(services/pod/presets/) and one entry point.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import gymnasium as gym
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from services import registry
from services.contracts.action_spaces import ActionKind
from services.logs import get_logger
from services.pod.algorithms.hyperparameters import HyperparameterError
from services.pod.envs.base import VecEnv
from services.pod.envs.registry import make_env
from services.pod.evaluator import EvalResult

log = get_logger(__name__)


class RunConfig(BaseModel):
    """What every training run has, whatever its algorithm: env, budget, evaluation, seeds,
    device. Each trainer's config (``PPORunConfig``, ``OffPolicyConfig``) adds the algorithm's
    hyperparameters under the algorithm's name."""

    model_config = ConfigDict(extra="forbid")

    env: str = "CartPole-v1"
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    algorithm: str = "ppo"
    total_env_steps: int = Field(500_000, ge=1, description="Training budget in env steps.")
    eval_every_steps: int = Field(20_000, ge=1)
    eval_episodes: int = Field(10, ge=1)
    eval_env_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="The evaluation env's arguments on top of env_kwargs (e.g. a held-out "
        "period to score on).",
    )
    target_return: float | None = Field(None, description="Stop once the evaluation reaches it.")
    device: str = "cpu"
    seed: int = 0
    eval_seed: int | None = Field(
        None, description="Seed of the evaluation start states (default: seed + 10,000)."
    )
    torch_threads: int | None = Field(
        1, ge=1, description="Intra-op threads; small networks run fastest on one thread."
    )

    @field_validator("device")
    @classmethod
    def _device_here(cls, value: str) -> str:
        # Refused at validation, so `podium train --set device=cuda` on a machine without a GPU
        # is a named-field error, not a traceback from the first tensor put there.
        try:
            device = torch.device(value)
        except RuntimeError:
            raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:N)") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"{value!r}: torch sees no CUDA device on this machine")
            if (device.index or 0) >= torch.cuda.device_count():
                raise ValueError(f"{value!r}: this machine has {torch.cuda.device_count()} GPU(s)")
        return value

    @property
    def agent_config(self) -> BaseModel:
        """The algorithm's hyperparameters (the field named after the algorithm)."""
        return getattr(self, self.algorithm)

    @property
    def evaluation_seed(self) -> int:
        return self.seed + 10_000 if self.eval_seed is None else self.eval_seed

    def make_envs(self, num_envs: int, slots: int = 1) -> tuple[VecEnv, VecEnv]:
        """The training env (``slots * num_envs`` copies, seeded by ``seed``) and the
        evaluation env (one copy per evaluation episode and slot, seeded by
        ``evaluation_seed``)."""
        train_env = make_env(
            self.env, slots * num_envs, device=self.device, seed=self.seed, **self.env_kwargs
        )
        eval_env = make_env(
            self.env,
            slots * self.eval_episodes,
            device=self.device,
            seed=self.evaluation_seed,
            **{**self.env_kwargs, **self.eval_env_kwargs},
        )
        return train_env, eval_env


C = TypeVar("C", bound=RunConfig)


@dataclass(frozen=True)
class Counters:
    """A slot's counters as its training files hold them."""

    env_steps: int
    updates: int


class Roles(Protocol):
    """Where a trainer's worker and evaluator run: in the trainer's process (``in_process``)
    or apart (services/pod/multiprocess.py). A trainer that cannot use roles apart trains in
    its own process and closes them, so that their processes or containers exit."""

    in_process: bool

    def close(self) -> None: ...


def train_in_process(roles: Roles | None, why: str, **fields: object) -> None:
    """For a trainer that cannot use roles apart: when ``roles`` were started apart, say
    ``why`` (a warning) and close them, so that their processes or containers exit."""
    if roles is not None and not roles.in_process:
        log.warning(why, asked=type(roles).__name__, **fields)
        roles.close()


class Trainer(ABC, Generic[C]):
    """``size`` agents of one algorithm, trained in lock-step (see the module docstring).

    ``env_steps`` and ``updates`` are the trainer's clock, per slot (a single agent's go on
    from loaded training files); ``step_env_steps`` is what the next ``step`` adds to
    ``env_steps``.
    """

    #: The run config this trainer takes (a ``RunConfig`` with the algorithm's fields).
    config_class: ClassVar[type[RunConfig]]
    #: True when one ``step`` is a whole rollout and its update (a record per step is
    #: cheap); False when it is one vector step (records only at evaluations).
    one_update_per_step: ClassVar[bool]
    #: Hyperparameter names that are the trainer's own, not the algorithm's (e.g. the
    #: off-policy loop's batch and replay settings): top-level fields of ``config_class``.
    loop_hyperparameters: ClassVar[tuple[str, ...]] = ()
    #: What a pod changes in every preset (a layer under the generator's hyperparameters).
    pod_defaults: ClassVar[Mapping[str, object]] = {}

    size: int

    @abstractmethod
    def __init__(self, configs: Sequence[C], roles: Roles | None = None) -> None:
        """Build ``len(configs)`` slots, slot i from ``configs[i]``; ``roles``: where the
        worker and evaluator run (default: in this process)."""

    @classmethod
    def replicas(cls, config: C) -> int:
        """Learner replicas averaged in a process group (services/pod/fusion.py); 1: none."""
        return 1

    def join_group(self, world: int) -> None:
        """Make this trainer one of ``world`` replicas (in a process group already)."""
        raise NotImplementedError(f"{type(self).__name__} trains no replicas")

    @property
    def env_steps(self) -> int:
        return self.counters(0).env_steps

    @property
    def updates(self) -> int:
        return self.counters(0).updates

    @abstractmethod
    def step(self) -> None:
        """Train a little: collect and update (every slot at once)."""

    @abstractmethod
    def progress(self) -> dict[str, float]:
        """Statistics since the last call: the last update's losses, and ``train_return``
        (mean return of the training episodes that ended) where any did."""

    @property
    @abstractmethod
    def step_env_steps(self) -> int:
        """The env steps per slot that the next ``step`` takes."""

    @abstractmethod
    def evaluate(self) -> list[EvalResult]:
        """Score every slot on deterministic episodes of the evaluation env."""

    @abstractmethod
    def config(self, slot: int) -> C:
        """Slot ``slot``'s run config: its hyperparameters and seed, what its files say."""

    @abstractmethod
    def counters(self, slot: int) -> Counters: ...

    @abstractmethod
    def save(self, slot: int, directory: Path) -> None:
        """Write slot ``slot``'s training files (services/pod/checkpoint.py)."""

    @abstractmethod
    def load(self, slot: int, directory: Path, config: C) -> None:
        """Make slot ``slot`` the agent in ``directory`` with ``config``'s hyperparameters
        (PBT's exploit and explore). Raises ``CheckpointError`` when the files do not fit."""

    @abstractmethod
    def reset(self, slot: int, config: C) -> None:
        """Put a fresh agent built from ``config`` into slot ``slot``."""

    @abstractmethod
    def close(self) -> None: ...


class Algorithm(Protocol):
    """What the class registered under an algorithm's name declares."""

    name: ClassVar[str]
    config_class: ClassVar[type[BaseModel]]  # its hyperparameters
    action_spaces: ClassVar[tuple[ActionKind, ...]]

    @classmethod
    def trainer(cls, slots: int) -> type[Trainer]:
        """The trainer for ``slots`` agents of this algorithm; raises ``HyperparameterError``
        for a number of slots it cannot train."""
        ...


class UnknownAlgorithmError(HyperparameterError, registry.UnknownNameError):
    """An algorithm name nothing is registered under: bad input to a pod, an unknown name to
    ``podium train``."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        registry.UnknownNameError.__init__(self, kind, name, known)
        self.args = (f"algorithm {name!r} is not trainable by a pod: {self.args[0]}",)


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered as ``name``; refused (``HyperparameterError``) when it does not
    declare how it trains. Looked up by registered name: a config names, never imports."""
    try:
        cls = registry.load(registry.ALGORITHMS, name, kind="algorithm")
    except registry.UnknownNameError as exc:
        raise UnknownAlgorithmError(exc.kind, exc.name, exc.known) from None
    missing = [a for a in ("config_class", "action_spaces", "trainer") if not hasattr(cls, a)]
    if missing:
        raise HyperparameterError(
            f"algorithm {name!r} ({cls.__module__}.{cls.__qualname__}) does not declare "
            f"{', '.join(missing)}: see services/pod/trainer.py's Algorithm"
        )
    return cls


def trainer_class(algorithm: str, slots: int = 1) -> type[Trainer]:
    return algorithm_class(algorithm).trainer(slots)


def action_kind(space: gym.Space) -> ActionKind | None:
    if isinstance(space, gym.spaces.Discrete):
        return "discrete"
    if isinstance(space, gym.spaces.Box):
        return "continuous"
    return None


def check_action_space(algorithm: type[Algorithm], space: gym.Space) -> None:
    """Refuse an action space the algorithm does not declare (a ValueError naming both)."""
    if action_kind(space) not in algorithm.action_spaces:
        wanted = " or ".join(
            "a Discrete" if k == "discrete" else "a continuous (Box)"
            for k in algorithm.action_spaces
        )
        raise ValueError(f"{algorithm.name} needs {wanted} action space, got {space}")


def build_trainer(configs: Sequence[RunConfig], roles: Roles | None = None) -> Trainer:
    """The trainer of ``configs`` (one per slot, all of one algorithm)."""
    return trainer_class(configs[0].algorithm, len(configs))(configs, roles)
