"""A stock-trading tournament in one process: P PPO agents, scored on the validation period
(``evaluate_market`` also runs services/pod/trading/portfolio_gradient.py's tournament).

The leaderboard's rule, in process: P agents (each its own hyperparameters and seed) train in
lock-step (``services.pod.training.population.PopulationPPO``) on the train period; after every
round each agent is scored by its Sharpe ratio over one deterministic pass of the validation
period, the best (agent, round) snapshot so far is kept (selection and early stopping on
validation), and, as PBT's exploit/explore, the worst quarter of the agents restart from a
parent with its learning rate and entropy coefficient perturbed: the round loop of
services/pod/trading/local_tournament.py, which the portfolio gradient's tournament runs too,
with the leaderboard's PBT decision. What comes back is the kept snapshot's policy, to
backtest afterwards.

``run_tournament`` takes the train and validation periods only, so nothing it does (training,
scoring, exploiting, keeping) can read the backtest period.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.contracts.algorithms.ppo.config import PPOConfig
from services.contracts.strategies import PBTOptions
from services.pod.algorithms.ppo import PPO
from services.pod.trading.backtest import (
    buy_and_hold,
    equal_weight,
    metrics,
    run_backtest,
    run_backtest_batch,
)
from services.pod.trading.env import StockTradingEnv, split_periods
from services.pod.trading.local_tournament import LOCAL_PBT, run_local_tournament
from services.pod.trading.market import MarketData
from services.pod.trading.portfolio_gradient import PortfolioPlan, PortfolioResult
from services.pod.training.population import PopulationPPO


@dataclass(frozen=True)
class TournamentPlan:
    """What a tournament trains: shared PPO settings, one hyperparameter mapping per agent
    (the population's per-agent fields), ``rounds`` rounds of ``round_env_steps`` env steps per
    agent, and whether PBT replaces agents after a round (``exploit``, by ``pbt``'s rules:
    services/pod/trading/local_tournament.py)."""

    ppo: PPOConfig
    hyperparameters: Sequence[Mapping[str, float]]
    rounds: int
    round_env_steps: int
    seed: int = 0
    exploit: bool = True
    pbt: PBTOptions = field(default_factory=LOCAL_PBT.model_copy)

    @property
    def iterations(self) -> int:
        """Rollouts and updates per round: the round's env steps per agent in whole rollouts
        of ``num_envs * num_steps`` (at least one)."""
        return max(1, self.round_env_steps // (self.ppo.num_envs * self.ppo.num_steps))

    def run(
        self,
        train: Sequence[MarketData],
        validation: MarketData,
        env_kwargs: Mapping[str, Any],
        on_round: Callable[[int, list[float]], None] | None = None,
    ) -> TournamentResult:
        """``run_tournament`` of this plan (``evaluate_market`` runs any plan this way)."""
        return run_tournament(train, validation, env_kwargs, self, on_round)


@dataclass
class TournamentResult:
    """The kept snapshot and how the tournament got there."""

    agent: PPO  # the kept snapshot, standalone (weights and observation statistics)
    slot: int
    round: int
    validation_sharpe: float
    #: Per round, every agent's validation Sharpe (the leaderboard after that round).
    history: list[list[float]] = field(default_factory=list)
    #: Every agent's final policy (after the last round), for reports only.
    final_agents: list[PPO] = field(default_factory=list)

    @property
    def kept_act(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.agent.policy.act_deterministic

    @property
    def single_act(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Slot 0 as it ended: one agent of the same budget, no selection."""
        return self.final_agents[0].policy.act_deterministic


def sharpe_of(values: np.ndarray) -> float:
    """Sharpe of one account-value series; a flat series (all cash) scores 0, not NaN."""
    sharpe = metrics(values).sharpe
    return 0.0 if math.isnan(sharpe) else sharpe


def validation_sharpes(
    population: PopulationPPO, validation: MarketData, env_kwargs: Mapping[str, Any]
) -> list[float]:
    """Every agent's Sharpe over one deterministic pass of ``validation`` (one
    sub-environment per agent, all from the period's first day)."""
    p = population.size
    env = StockTradingEnv(num_envs=p, mode="validation", data=validation, **env_kwargs)

    def act(obs: torch.Tensor) -> torch.Tensor:
        return population._deterministic(obs.view(p, 1, -1)).reshape(p, -1)

    values = run_backtest_batch(env, act)
    return [sharpe_of(values[:, i]) for i in range(p)]


def run_tournament(
    train: MarketData | Sequence[MarketData],
    validation: MarketData,
    env_kwargs: Mapping[str, Any],
    plan: TournamentPlan,
    on_round: Callable[[int, list[float]], None] | None = None,
) -> TournamentResult:
    """Train the plan's agents on ``train`` (one market's train period, or several markets'
    whose episodes are drawn from all), keep the snapshot with the best Sharpe on
    ``validation``.

    ``env_kwargs``: StockTradingEnv's account and observation settings (costs, action mode,
    features, episode length); the periods come from ``train`` and ``validation``. ``on_round(round,
    scores)``: called with every agent's validation Sharpe after each round (a benchmark's clock).
    """
    ppo, hyperparameters, rounds, seed = plan.ppo, plan.hyperparameters, plan.rounds, plan.seed
    if rounds < 1 or plan.round_env_steps < 1:
        raise ValueError("need rounds >= 1 and round_env_steps >= 1")
    p = len(hyperparameters)
    kwargs = {k: v for k, v in env_kwargs.items() if k != "mode"}
    env = StockTradingEnv(num_envs=p * ppo.num_envs, mode="train", data=train, seed=seed, **kwargs)
    iterations = plan.iterations
    population = PopulationPPO(
        env,
        ppo,
        hyperparameters,
        [seed * 1000 + i for i in range(p)],
        total_env_steps=rounds * iterations * ppo.num_envs * ppo.num_steps,
    )
    agents = _Population(population, validation, kwargs, iterations)
    kept = run_local_tournament(
        agents, rounds, plan.pbt if plan.exploit else None, EXPLORED, seed, on_round
    )
    final = [population.agent(i, adam_state=False) for i in range(p)]
    env.close()
    return TournamentResult(kept.snapshot, kept.slot, kept.round, kept.score, kept.history, final)


#: What PBT's explore perturbs; the other per-agent hyperparameters come from the parent as
#: they are.
EXPLORED = ("learning_rate", "ent_coef")


class _Population:
    """The PPO population as the round loop drives it (services/pod/trading/
    local_tournament.py ``LocalPopulation``)."""

    def __init__(
        self,
        population: PopulationPPO,
        validation: MarketData,
        env_kwargs: Mapping[str, Any],
        iterations: int,
    ) -> None:
        self.population, self.validation, self.env_kwargs = population, validation, env_kwargs
        self.size, self.iterations = population.size, iterations

    def train_round(self) -> None:
        for _ in range(self.iterations):
            self.population.update(self.population.collect())

    def validation_scores(self) -> list[float]:
        return validation_sharpes(self.population, self.validation, self.env_kwargs)

    def snapshot(self, i: int) -> PPO:
        return self.population.agent(i, adam_state=False)  # to backtest, not to train

    def hyperparameters(self, i: int) -> dict[str, float]:
        return self.population.hyperparameters[i]

    def copy(self, dst: int, src: int, hyperparameters: Mapping[str, float]) -> None:
        self.population.copy_agent(dst, src, hyperparameters)


#: The StockTradingEnv arguments that choose the periods, not the account or observation.
PERIOD_KWARGS = ("split_date", "validation_fraction", "validation_date")


@dataclass
class MarketReport:
    """A tournament on one market and the backtest of what it kept."""

    tournament: TournamentResult | PortfolioResult
    #: Strategy → account values over the backtest period (one per day, the first day's
    #: value included): ``agent`` (the kept snapshot), ``single agent`` (slot 0's final
    #: policy: one pod of the same budget, no selection), ``buy-and-hold``, ``equal weight``.
    backtest_values: dict[str, np.ndarray]
    backtest_dates: np.ndarray


def split_market(
    data: MarketData, env_kwargs: Mapping[str, Any]
) -> tuple[dict[str, MarketData], dict[str, Any]]:
    """``data`` cut in time by ``env_kwargs``' split settings into train, validation and
    backtest periods (a validation period is required), and the rest of ``env_kwargs``: the
    account and observation settings every period's StockTradingEnv takes."""
    kwargs = {k: v for k, v in env_kwargs.items() if k not in PERIOD_KWARGS}
    split = {k: env_kwargs[k] for k in PERIOD_KWARGS if k in env_kwargs}
    periods = split_periods(data, **split)
    if "validation" not in periods:
        raise ValueError("selection needs a validation period: set validation_fraction > 0")
    return periods, kwargs


def evaluate_market(
    data: MarketData,
    env_kwargs: Mapping[str, Any],
    plan: TournamentPlan | PortfolioPlan,
    simulated: Sequence[MarketData] = (),
    on_round: Callable[[int, list[float]], None] | None = None,
) -> MarketReport:
    """Split ``data`` in time (``env_kwargs``' split settings; a validation period is
    required), run the tournament on train + validation (PPO agents for a ``TournamentPlan``,
    services/pod/trading/portfolio_gradient.py's for a ``PortfolioPlan``), then backtest the kept
    snapshot and the baselines, all paying the same transaction cost, on the backtest period.

    ``simulated``: other markets of the same kind (``synthetic_market(replica=k)``) whose train
    periods, cut at the same dates, the agents also train on; nothing else reads them. ``on_round``:
    as ``run_tournament``'s."""
    periods, kwargs = split_market(data, env_kwargs)
    split = {k: env_kwargs[k] for k in PERIOD_KWARGS if k in env_kwargs}
    train = [periods["train"], *(split_periods(m, **split)["train"] for m in simulated)]
    result = plan.run(train, periods["validation"], kwargs, on_round)
    # From here on the backtest period is read, and only to report.
    backtest = periods["backtest"]
    env = StockTradingEnv(num_envs=1, mode="backtest", data=backtest, **kwargs)
    cost = env.transaction_cost
    values = {
        "agent": run_backtest(env, result.kept_act),
        "single agent": run_backtest(env, result.single_act),
        "buy-and-hold": buy_and_hold(backtest.close, env.initial_amount, cost),
        "equal weight": equal_weight(backtest.close, env.initial_amount, cost),
    }
    return MarketReport(result, values, backtest.dates)


def sample_hyperparameters(
    space: Mapping[str, Sequence[float]], count: int, seed: int
) -> list[dict[str, float]]:
    """``count`` draws, each value uniformly from its list of ``space`` (a grid's choices)."""
    rng = np.random.default_rng(seed)
    return [{k: float(rng.choice(list(v))) for k, v in space.items()} for _ in range(count)]
