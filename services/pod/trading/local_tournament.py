"""The in-process tournaments' round loop (tournament.py's PPO, portfolio_gradient.py's): each
round every agent trains and is scored on the validation period, the best (agent, round)
snapshot so far is kept, then PBT's exploit (the leaderboard's decision,
services/contracts/strategies.py ``population_exploits``) and explore. Rules: docs/trading.md,
"The in-process tournaments".
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from services.contracts.strategies import PBTOptions, population_exploits

#: The in-process tournaments' PBT: the leaderboard's PBT options at their defaults (parents
#: from the top quarter, explore's factors 0.8 and 1.2), with the worst quarter replaced after
#: each round. The leaderboard's default (no truncation: any agent below the best) relies on
#: its ready rule to judge an agent only every few rounds; here every agent is judged after
#: every round, and replacing all but the best each time would leave one lineage.
LOCAL_PBT = PBTOptions(truncation=0.25)

S = TypeVar("S")
S_co = TypeVar("S_co", covariant=True)


class LocalPopulation(Protocol[S_co]):
    """P agents trained in lock-step in one process, as the round loop drives them."""

    @property
    def size(self) -> int: ...

    def train_round(self) -> None:
        """One round of training of every agent."""
        ...

    def validation_scores(self) -> list[float]:
        """Every agent's score on the validation period (higher is better)."""
        ...

    def snapshot(self, i: int) -> S_co:
        """Agent ``i`` standalone, as it is now (to keep and backtest)."""
        ...

    def hyperparameters(self, i: int) -> dict[str, float]:
        """Agent ``i``'s per-agent hyperparameters."""
        ...

    def copy(self, dst: int, src: int, hyperparameters: Mapping[str, float]) -> None:
        """Agent ``dst`` restarts from agent ``src`` (weights and optimiser state) with
        ``hyperparameters``."""
        ...


@dataclass
class Kept(Generic[S]):
    """The kept (agent, round) snapshot and every round's scores (the leaderboard after it)."""

    snapshot: S
    slot: int
    round: int
    score: float
    history: list[list[float]]


def explore(
    hyperparameters: Mapping[str, float],
    names: Sequence[str],
    options: PBTOptions,
    rng: random.Random,
) -> dict[str, float]:
    """``hyperparameters`` with each of ``names`` multiplied by one of the options'
    ``perturb_factors`` (each drawn apart); as they are with ``explore`` off."""
    out = dict(hyperparameters)
    if options.explore:
        for name in names:
            out[name] = float(out[name]) * rng.choice(options.perturb_factors)
    return out


def run_local_tournament(
    population: LocalPopulation[S],
    rounds: int,
    pbt: PBTOptions | None,
    explored: Sequence[str],
    seed: int,
    on_round: Callable[[int, list[float]], None] | None = None,
) -> Kept[S]:
    """``rounds`` rounds of ``population`` (docs/trading.md); without ``pbt`` the agents
    train apart (best of P). ``explored``: the hyperparameters explore perturbs. ``seed``:
    PBT's draws (parents and factors), the only randomness here. ``on_round(round, scores)``:
    called with every agent's validation score after each round (a benchmark's clock)."""
    rng = random.Random(seed)
    kept: Kept[S] | None = None
    history: list[list[float]] = []
    for round_ in range(rounds):
        population.train_round()
        scores = population.validation_scores()
        history.append(scores)
        if on_round is not None:
            on_round(round_, scores)
        leader = int(np.argmax(scores))
        if kept is None or scores[leader] > kept.score:
            kept = Kept(population.snapshot(leader), leader, round_, scores[leader], history)
        if pbt is not None and round_ < rounds - 1:
            for agent, parent in population_exploits(scores, pbt, rng):
                hyperparameters = explore(population.hyperparameters(parent), explored, pbt, rng)
                population.copy(agent, parent, hyperparameters)
    if kept is None:
        raise ValueError("need rounds >= 1")
    return kept
