"""A stock-trading tournament in one process: P PPO agents trained in lock-step on the train
period and scored by their Sharpe ratio on the validation period, on local_tournament.py's
round loop; ``evaluate_market`` runs it (or the portfolio gradient's) on one market and
backtests what it kept. ``run_tournament`` takes the train and validation periods only, so
nothing it does can read the backtest period. Reference: docs/trading.md, "The in-process
tournaments".
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.contracts.algorithms.ppo.config import PPOConfig
from services.contracts.strategies import PBTOptions
from services.pod.algorithms.ppo import HYPERPARAMETERS, PPO
from services.pod.roles.learner import PPOLearner
from services.pod.trading.backtest import (
    buy_and_hold,
    equal_weight,
    metrics,
    run_backtest,
    run_backtest_batch,
)
from services.pod.trading.env import StockTrading, StockTradingEnv, split_periods
from services.pod.trading.local_tournament import LOCAL_PBT, run_local_tournament
from services.pod.trading.market import MarketData
from services.pod.trading.portfolio_gradient import PortfolioPlan, PortfolioResult


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
    population: PPOLearner, validation: MarketData, env_kwargs: Mapping[str, Any]
) -> list[float]:
    """Every agent's Sharpe over one deterministic pass of ``validation`` (one
    sub-environment per agent, all from the period's first day)."""
    p = population.size
    env = StockTradingEnv(num_envs=p, mode="validation", data=validation, **env_kwargs)
    values = run_backtest_batch(env, population.act)
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
    env = StockTrading(mode="train", data=train, **kwargs)
    iterations = plan.iterations
    seeds = [seed * 1000 + i for i in range(p)]
    agents: list[PPO] = []
    for agent_seed, values in zip(seeds, hyperparameters, strict=True):
        torch.manual_seed(agent_seed)
        config = ppo.model_copy(update=dict(values))
        agents.append(PPO(env.single_observation_space, env.single_action_space, config))
    population = PPOLearner(
        env,
        ppo,
        agents,
        hyperparameters,
        seeds,
        total_env_steps=rounds * iterations * ppo.num_envs * ppo.num_steps,
        device=torch.device("cpu"),
        max_episode_steps=env.max_episode_steps,
    )
    driver = _Population(population, validation, kwargs, iterations, agents)
    kept = run_local_tournament(
        driver, rounds, plan.pbt if plan.exploit else None, EXPLORED, seed, on_round
    )
    final = [driver.snapshot(i) for i in range(p)]
    return TournamentResult(kept.snapshot, kept.slot, kept.round, kept.score, kept.history, final)


#: What PBT's explore perturbs; the other per-agent hyperparameters come from the parent as
#: they are.
EXPLORED = ("learning_rate", "ent_coef")


class _Population:
    """The PPO population as the round loop drives it (services/pod/trading/
    local_tournament.py ``LocalPopulation``)."""

    def __init__(
        self,
        population: PPOLearner,
        validation: MarketData,
        env_kwargs: Mapping[str, Any],
        iterations: int,
        agents: Sequence[PPO],
    ) -> None:
        self.population, self.validation, self.env_kwargs = population, validation, env_kwargs
        self.size, self.iterations = population.size, iterations
        self._agents = agents
        # Each agent's hyperparameters as its config holds them (exact, not the tensors').
        self._hyperparameters = [
            {k: float(getattr(a.config, k)) for k in HYPERPARAMETERS} for a in agents
        ]

    def train_round(self) -> None:
        for _ in range(self.iterations):
            self.population.iterate()

    def validation_scores(self) -> list[float]:
        return validation_sharpes(self.population, self.validation, self.env_kwargs)

    def snapshot(self, i: int) -> PPO:
        """Agent ``i`` as it is now, a module of its own (to keep and backtest)."""
        agent = copy.deepcopy(self._agents[i])
        agent.config = agent.config.model_copy(update=self._hyperparameters[i])
        return self.population.agent(i, agent)

    def hyperparameters(self, i: int) -> dict[str, float]:
        return dict(self._hyperparameters[i])

    def copy(self, dst: int, src: int, hyperparameters: Mapping[str, float]) -> None:
        self._hyperparameters[dst] = {**self._hyperparameters[src], **hyperparameters}
        config = self._agents[dst].config.model_copy(update=self._hyperparameters[dst])
        self.population.copy(dst, src, config)


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
    """Split ``data`` in time (``split_market``), run ``plan``'s tournament on train +
    validation, then backtest the kept snapshot, slot 0's final policy and the baselines on the
    backtest period (docs/trading.md). ``simulated``: other markets of the same kind whose train
    periods, cut at the same dates, the agents also train on. ``on_round``: as
    ``run_tournament``'s."""
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
