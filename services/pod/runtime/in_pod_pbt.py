"""PBT among one population pod's agents (``spec.population.exploit``; Fast PBT, Flajolet et al.
2022): every ``every_env_steps`` env steps (each interval ``growth`` times the last: 2 makes
them the rungs of successive halving) rank the agents, copy each winner into a loser's slot
in place (the trainer's ``copy``) with hyperparameters explored over the search space. Nothing
compiles again (a copy changes values, never a program) and nothing goes to the leaderboard:
who descends from whom is the caller's (services/pod/runtime/rounds.py).

The decision is the leaderboard's PBT, one implementation (services/contracts/strategies.py):
``population_exploits`` picks (loser, winner) pairs by truncation and quantile, ``explore``
perturbs or resamples the winner's hyperparameters.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.search_space import SearchSpace
from services.contracts.strategies import PopulationExploit, explore, population_exploits
from services.logs import get_logger
from services.pod.config import RunConfig
from services.pod.training.trainer import Trainer

log = get_logger(__name__)


@dataclass(frozen=True)
class Copied:
    """One copy of a decision: slot ``dst`` now trains slot ``src``'s agent with
    ``hyperparameters`` (``how``: how explore got each); ``scores`` ranked them."""

    dst: int
    src: int
    hyperparameters: dict[str, Any]
    how: dict[str, str]
    scores: list[float]


class InPodPBT:
    """When the pod decides, and what it copies (module docstring)."""

    def __init__(
        self,
        rule: PopulationExploit,
        space: SearchSpace,
        size: int,
        seed: str,
        higher_is_better: bool = True,
    ) -> None:
        self.rule, self.space, self.higher_is_better = rule, space, higher_is_better
        # Seeded by the spec's option and the pod: pods of one experiment draw apart.
        self.rng = random.Random(f"{rule.pbt.seed}:{seed}")
        self.next_decision: int | None = None  # per-slot env steps
        self.interval = float(rule.every_env_steps)  # grows by ``rule.growth`` per decision
        # Each slot's last known recent return: long episodes may end none between two decisions.
        self.recent: list[float | None] = [None] * size

    def due(self, env_steps: int) -> bool:
        """Whether to decide now (``env_steps``: the trainer's per-slot clock, started here)."""
        if self.next_decision is None:
            self.next_decision = env_steps + round(self.interval)
        return env_steps >= self.next_decision

    def scores(self, trainer: Trainer) -> list[float] | None:
        """Every slot's score by the rule's ``by``; None while a slot has none yet."""
        if self.rule.by == "evaluation":
            return [r.mean for r in trainer.evaluate()]
        for i, value in enumerate(trainer.recent_returns()):
            if value is not None:
                self.recent[i] = value
        if any(v is None for v in self.recent):
            log.info("pbt in the pod: an agent has finished no episode yet; deciding later")
            return None
        return [float(v) for v in self.recent if v is not None]

    def select(
        self,
        trainer: Trainer,
        hyperparameters: Sequence[dict[str, Any]],
        built_at: Sequence[int],
        config_for: Callable[[dict[str, Any], int, int], RunConfig],
        scores: list[float] | None = None,
    ) -> list[Copied]:
        """Decide and copy; the copies made, in order. Slot i's are ``hyperparameters[i]`` and
        ``built_at[i]`` (its env steps when its agent was built); ``config_for(hyperparameters,
        src, dst)``: the run config slot ``dst`` trains ``src``'s agent with; ``scores``: every
        slot's score by the rule's ``by`` where the caller has just taken it (default: here)."""
        scores = self.scores(trainer) if scores is None else scores
        if scores is not None:  # a decision made: the next rung is further off
            self.interval *= self.rule.growth
        self.next_decision = trainer.env_steps + round(self.interval)
        if scores is None:
            return []
        options = self.rule.pbt
        copies = []
        for dst, src in population_exploits(scores, options, self.rng, self.higher_is_better):
            if trainer.counters(dst).env_steps - built_at[dst] < options.ready_env_steps:
                continue
            new, how = dict(hyperparameters[src]), {}
            if options.explore:
                new, how = explore(new, self.space, options, self.rng)
            try:
                trainer.copy(dst, src, config_for(new, src, dst))
            except HyperparameterError as exc:  # the spec's population check lets none through
                log.warning("pbt in the pod: cannot copy", slot=dst, source=src, error=str(exc))
                continue
            self.recent[dst] = scores[src]
            copies.append(Copied(dst, src, new, how, scores))
        return copies
