"""The trainer interface: every way the pod trains, behind one contract, and which trainer
trains an algorithm.

A *trainer* trains ``size`` agents ("slots") of one algorithm on one env, batched as one
population (a single agent is P = 1): the on-policy algorithms (onpolicy.py), the off-policy
ones (offpolicy.py), the portfolio gradient (services/pod/trading/). ``podium train``'s fit loop
(fit.py) and the pod's round loop (services/pod/runtime/rounds.py) see nothing else of an
algorithm: they step, evaluate, save and load slots, and read counters.

The trunk chooses the trainer, never the algorithm: an algorithm's card
(services/contracts/algorithms/) declares its *family*, and the trainer registered under that
family's name (entry points ``podium.trainers``; ``<family>.population`` for P agents in one
process) trains it, eagerly or compiled as ``compile`` and the machine say
(services/pod/algorithms/compiled.py ``Decision``)."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, Protocol, TypeVar

import torch

from services import registry
from services.contracts.algorithms.card import AlgorithmCard, CardError, card
from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.logs import get_logger
from services.pod.algorithms.compiled import Decision
from services.pod.config import RunConfig
from services.pod.roles.evaluator import EvalResult

__all__ = ["RunConfig", "Trainer", "build_trainer", "trainer_class"]

log = get_logger(__name__)


C = TypeVar("C", bound=RunConfig)


@dataclass(frozen=True)
class Counters:
    """A slot's counters as its training files hold them."""

    env_steps: int
    updates: int


class Trainer(ABC, Generic[C]):
    """``size`` agents of one algorithm, trained in lock-step (module docstring). ``env_steps``
    and ``updates`` are the trainer's clock, per slot (a single agent's go on from loaded
    training files); ``step_env_steps`` is what the next ``step`` adds to ``env_steps``."""

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
    #: Seconds this trainer spent compiling so far (torch.compile); 0 for an eager one.
    compile_seconds: float = 0.0
    #: What runs compiled and why (not), one line a user reads (``podium train`` prints it).
    compiled: str = "eager"
    decision: Decision | None = None  #: whether its programs compile; None: never

    @abstractmethod
    def __init__(self, configs: Sequence[C], horizon_env_steps: int | None = None) -> None:
        """Build ``len(configs)`` slots, slot i from ``configs[i]``; ``horizon_env_steps``:
        env steps per slot the run is expected to train (a pod's share of the budget; None: the
        configs' ``total_env_steps``), against which a compile must pay."""

    @classmethod
    def for_algorithm(cls, card: AlgorithmCard) -> type[Trainer]:
        """The trainer class for ``card``'s algorithm: this one, or a subclass that knows its
        config (the off-policy trainer makes one per algorithm)."""
        return cls

    @classmethod
    def replicas(cls, config: C) -> int:
        """Learner replicas averaged in a process group (1: none; training/fusion.py)."""
        return 1

    def join_group(self, world: int) -> None:
        """Make this trainer one of ``world`` replicas (in a process group already)."""
        raise NotImplementedError(f"{type(self).__name__} trains no replicas")

    @property
    def compiles_later(self) -> bool:
        """Programs may still compile or load: ``auto`` still timing eager calls, or compiling
        and no program run yet (an off-policy update waits for its replay to fill)."""
        d = self.decision
        return d is not None and d.compiled is not False and self.compile_seconds <= 0

    @property
    def env_steps(self) -> int:
        return self.counters(0).env_steps

    @property
    def updates(self) -> int:
        return self.counters(0).updates

    @abstractmethod
    def step(self) -> None:
        """Train a little: collect and update (every slot at once)."""

    def wait(self) -> None:
        """Return once the work of every ``step`` so far is done. On a CUDA device ``step``
        may return once its work is launched (a CUDA graph's replay, a population's step that
        reads nothing back), so a clock read after ``step`` alone counts launches; whoever
        times training calls this before reading the clock (once per record, not per step:
        waiting stops the host from running ahead)."""
        device = torch.device(self.config(0).device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

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
        """Write slot ``slot``'s training files (services/pod/training/checkpoint.py)."""

    @abstractmethod
    def load(self, slot: int, directory: Path, config: C) -> None:
        """Make slot ``slot`` the agent in ``directory`` with ``config``'s hyperparameters
        (PBT's exploit and explore). Raises ``CheckpointError`` when the files do not fit."""

    @abstractmethod
    def reset(self, slot: int, config: C) -> None:
        """Put a fresh agent built from ``config`` into slot ``slot``."""

    # -- PBT among the slots (a population's trainers) ----------------------------------------
    def copy(self, dst: int, src: int, config: C) -> None:
        """PBT's exploit inside the population: slot ``dst``'s agent becomes slot ``src``'s
        (weights, optimiser state, statistics; an off-policy agent's replay too) with
        ``config``'s hyperparameters (explore), in place: nothing compiles again. ``dst``
        keeps its counters and its random stream."""
        raise NotImplementedError(f"{type(self).__name__} trains one agent: no slot to copy")

    def recent_returns(self) -> list[float | None]:
        """Each slot's mean return of the training episodes that ended since the last call
        (None where none did): what PBT inside a population ranks on by default."""
        raise NotImplementedError(f"{type(self).__name__} counts no training episodes")

    @abstractmethod
    def close(self) -> None: ...


def check_population_slot(
    first: RunConfig, config: RunConfig, per_slot: Sequence[str], size: int
) -> None:
    """Raise ``HyperparameterError`` unless ``config`` may train beside ``first`` in one
    population of ``size``: the same algorithm, and every setting the same but the per-agent
    hyperparameters ``per_slot``, ``compile`` and the seeds (the agents share the rest)."""
    if config.algorithm != first.algorithm:
        raise HyperparameterError(
            f"the slots of one trainer train one algorithm: {first.algorithm}, not "
            f"{config.algorithm}"
        )

    def shared(c: RunConfig) -> dict[str, object]:
        run = c.model_dump(exclude={c.algorithm, "seed", "eval_seed"})
        agent = c.agent_config.model_dump(exclude={*per_slot, "compile"})
        return {**run, **{f"{c.algorithm}.{k}": v for k, v in agent.items()}}

    mine, theirs = shared(config), shared(first)
    if differ := sorted(k for k in mine if mine[k] != theirs[k]):
        raise HyperparameterError(
            f"population.agents_per_pod = {size}: {', '.join(differ)} differ between the agents "
            f"of a population, which share them; they may vary {', '.join(sorted(per_slot))}"
        )


class Algorithm(Protocol):
    """What the class registered under an algorithm's name (``podium.algorithms``) is: the
    agent a trainer of its family builds. Everything else about it is on its card
    (services/contracts/algorithms/)."""

    name: ClassVar[str]


class UnknownAlgorithmError(HyperparameterError, registry.UnknownNameError):
    """An unregistered algorithm name: bad input to a pod, an unknown name to ``podium train``."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        registry.UnknownNameError.__init__(self, kind, name, known)
        self.args = (f"algorithm {name!r} is not trainable by a pod: {self.args[0]}",)


def algorithm_card(name: str) -> AlgorithmCard:
    """The card registered as ``name``: what a pod trains it with. Looked up by registered
    name: a config names, never imports."""
    try:
        return card(name)
    except registry.UnknownNameError as exc:
        raise UnknownAlgorithmError(exc.kind, exc.name, exc.known) from None
    except CardError as exc:
        raise HyperparameterError(str(exc)) from None


def algorithm_class(name: str) -> type[Algorithm]:
    """The agent class registered as ``name`` (``podium.algorithms``)."""
    algorithm_card(name)
    try:
        return registry.load(registry.ALGORITHMS, name, kind="algorithm")
    except registry.UnknownNameError as exc:
        raise HyperparameterError(
            f"algorithm {name!r} has a card but no agent registered under "
            f"{registry.ALGORITHMS}: {exc}"
        ) from None


def trainer_class(algorithm: str, slots: int = 1) -> type[Trainer]:
    """The trainer of ``slots`` agents of ``algorithm``: its card's family decides
    (``podium.trainers``: the family's name for one agent a pod, ``<family>.population`` for
    P agents in one process). Raises ``HyperparameterError`` for what no trainer trains."""
    found = algorithm_card(algorithm)
    population = slots > 1
    if population and found.population is None:
        raise HyperparameterError(
            f"{algorithm} trains one agent per pod: population pods "
            f"(population.agents_per_pod > 1) train only algorithms whose card declares a "
            f"population"
        )
    name = f"{found.family}.population" if population else found.family
    try:
        trainer = registry.load(registry.TRAINERS, name, kind="trainer")
    except registry.UnknownNameError as exc:
        raise HyperparameterError(
            f"algorithm {algorithm!r} is of family {found.family!r}, which no trainer trains "
            f"{'as a population' if population else ''}: {exc}"
        ) from None
    if not (isinstance(trainer, type) and issubclass(trainer, Trainer)):
        raise HyperparameterError(
            f"the trainer registered as {name!r} ({trainer!r}) is not a Trainer subclass"
        )
    return trainer.for_algorithm(found)


def build_trainer(configs: Sequence[RunConfig], horizon_env_steps: int | None = None) -> Trainer:
    """The trainer of ``configs`` (one per slot, all of one algorithm): its family's."""
    cls = trainer_class(configs[0].algorithm, len(configs))
    # A trainer weighs its compiles against the horizon if it takes one (a plugin's may not).
    takes = "horizon_env_steps" in inspect.signature(cls.__init__).parameters
    extra = {"horizon_env_steps": horizon_env_steps} if takes else {}
    trainer = cls(configs, **extra)
    log.info(
        "trainer.chosen",
        trainer=cls.__name__,
        agents=len(configs),
        compiled=trainer.compiled.startswith("compiled"),
        how=trainer.compiled,
    )
    return trainer
