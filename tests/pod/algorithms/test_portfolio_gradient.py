"""The portfolio gradient (services/pod/trading/portfolio_gradient.py): its closed-form
account, its policy acting in StockTradingEnv, its population of agents, and what it learns."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from services.contracts.algorithms.portfolio_gradient.config import PortfolioGradientConfig
from services.pod.trading.env import StockTradingEnv, split_periods
from services.pod.trading.market import synthetic_market
from services.pod.trading.portfolio_gradient import (
    FeatureLayout,
    PeriodData,
    PortfolioPolicy,
    net_returns,
    sharpe,
)
from services.pod.trading.portfolio_trainer import PortfolioTrainer
from services.pod.training.presets import train_config

ENV = {
    "validation_fraction": 0.2,
    "action_mode": "weights",
    "turbulence": True,
    "momentum": True,
    "transaction_cost": 0.001,
    "rebalance_band": 0.01,
}
HPS = [{"learning_rate": 0.05, "l2": 1e-3}, {"learning_rate": 0.02, "l2": 1e-2}]


def test_net_returns_are_the_accounts_daily_returns() -> None:
    """Two stocks, three closes: hold (0.5, 0.25) then (0, 0.75); costs on each change."""
    close = torch.tensor([[10.0, 20.0], [11.0, 19.0], [11.0, 20.9]], dtype=torch.float64)
    weights = torch.tensor([[[0.5, 0.25], [0.0, 0.75], [0.0, 0.0]]], dtype=torch.float64)
    got = net_returns(weights, close, cost=0.01)
    day1 = 0.5 * 0.1 + 0.25 * -0.05 - 0.01 * 0.75
    day2 = 0.75 * 0.1 - 0.01 * (0.5 + 0.5)
    torch.testing.assert_close(got, torch.tensor([[day1, day2]], dtype=torch.float64))
    returns = torch.tensor([[0.01, -0.02, 0.03], [0.0, 0.0, 0.0]], dtype=torch.float64)
    expected = np.mean([0.01, -0.02, 0.03]) / np.std([0.01, -0.02, 0.03], ddof=1) * np.sqrt(252)
    assert sharpe(returns)[0].item() == pytest.approx(expected)
    assert sharpe(returns)[1].item() == 0.0  # all cash: 0, not NaN


def test_the_env_holds_what_the_policy_asks_for() -> None:
    """``act`` maps the policy's weights to StockTradingEnv's weights action: one step from
    cash (no band) leaves the account holding those weights, up to whole shares."""
    data = synthetic_market(1, num_stocks=5, regime="trend")
    periods = split_periods(data, validation_fraction=0.2)
    kwargs = {k: v for k, v in ENV.items() if k != "validation_fraction"}
    kwargs["rebalance_band"] = 0.0
    layout = FeatureLayout.of(5, kwargs)
    policy = PortfolioPolicy(layout)
    policy.fit_statistics(PeriodData.of(periods["train"], layout))
    scorer, invested = [0.5, -0.3, 0.2, 0.1, -0.2, 0.4, 0.8, 1.2], [0.3, -0.4, 0.5]
    policy.params = torch.tensor([scorer + invested], dtype=torch.float64)
    env = StockTradingEnv(1, mode="backtest", data=periods["backtest"], **kwargs)
    obs, _ = env.reset()
    stock, market = layout.observed(obs.double())
    wanted = policy.weights(*policy.normalize(stock, market))[0, 0]
    assert wanted.max() - wanted.min() > 0.05  # a real tilt, not equal weights
    obs, *_ = env.step(policy.act(obs))
    held = obs[0, 1 + 5 : 1 + 10].double()  # the account's weights after the trade
    torch.testing.assert_close(held, wanted, atol=2e-3, rtol=0)


def _trainer(hps: list[dict[str, float]]) -> PortfolioTrainer:
    market = {"market_seed": 3, "num_stocks": 5, "num_days": 1000, "regime": "crash", **ENV}
    layers = [{"algorithm": "portfolio_gradient", "env_kwargs": market, "eval_episodes": 1}]
    config = train_config("StockTrading-v0", [*layers, {"eval_env_kwargs": {"score": "sharpe"}}])
    configs = [config.model_copy(update={"portfolio_gradient": hp}) for hp in map(_agent, hps)]
    return PortfolioTrainer(configs)


def _agent(hp: dict[str, float]) -> PortfolioGradientConfig:
    return PortfolioGradientConfig.model_validate(hp)


def _train(trainer: PortfolioTrainer, steps: int) -> list[float]:
    for _ in range(steps):
        trainer.step()
    return [r.mean for r in trainer.evaluate()]


def test_a_population_trains_each_agent_as_alone_and_a_copy_trains_as_its_source() -> None:
    """Batched, each agent is the agent trained alone with its hyperparameters, and scores as
    it would alone; a copy (PBT's exploit with explore's factor 1) then trains exactly as its
    source while the others train on as they were."""
    hps = [*HPS, {"learning_rate": 0.1, "l2": 1e-4}, {"learning_rate": 0.01, "l2": 0.0}]
    population = _trainer(hps)
    together = _train(population, 5)
    for i, hp in enumerate(hps):
        alone = _trainer([hp])
        assert _train(alone, 5) == pytest.approx([together[i]], rel=1e-9)
        torch.testing.assert_close(alone.policy.params[0], population.policy.params[i])
        alone.close()
    apart = _trainer(hps)
    _train(apart, 5)
    loser, leader = int(np.argmin(together)), int(np.argmax(together))
    population.copy(loser, leader, population.config(leader))
    scores, without = _train(population, 5), _train(apart, 5)
    assert scores[loser] == scores[leader]
    others = [i for i in range(4) if i != loser]
    assert [scores[i] for i in others] == [without[i] for i in others]
    for trainer in (population, apart):
        trainer.close()


#: Market seeds nothing was designed on: the method and its preset were chosen on seeds 0-14.
HELD_OUT_SEEDS = range(50, 65)


@pytest.mark.slow
@pytest.mark.nightly  # 45 markets' tournaments: minutes
def test_the_kept_agent_beats_buy_and_hold_held_out() -> None:
    """The learning result of docs/benchmarks.md ("Stock trading"), on the held-out market
    seeds 50-64 of each regime, as bench/stock_trading_tournament.py runs it (a population
    pod's trainer of 4 agents, PBT inside the pod by validation Sharpe, the best snapshot
    kept): the kept agent's Sharpe on the backtest period (read by nothing but this report)
    beats buy-and-hold's on at least 30 of the 45 markets (33 measured), and by a paired median
    margin on the trend (+0.31 measured) and mean-reverting (+1.9) markets. Not on the crash
    markets (+0.01), which this does not claim. Budget: 4 agents x 300 full-batch gradient
    steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    from stock_trading_tournament import config_of, run_market

    torch.set_num_threads(1)
    config = config_of("portfolio_gradient")
    margins: dict[str, list[float]] = {}
    for regime in ("trend", "mean_reversion", "crash"):
        for seed in HELD_OUT_SEEDS:
            record = run_market(regime, seed, 4, 30, 10, config, True, "portfolio_gradient")
            sharpe = {k: v["sharpe"] for k, v in record["metrics"].items()}
            margins.setdefault(regime, []).append(sharpe["agent"] - sharpe["buy-and-hold"])
    won = sum(m > 0 for regime in margins.values() for m in regime)
    assert won >= 30, margins
    assert np.median(margins["trend"]) > 0.1, margins
    assert np.median(margins["mean_reversion"]) > 0.5, margins


def test_period_data_reads_the_envs_features() -> None:
    """The gradient's features are the env's observation columns for the same days."""
    data = synthetic_market(2, num_stocks=5, num_days=700, regime="trend")
    periods = split_periods(data, validation_fraction=0.2)
    kwargs = {k: v for k, v in ENV.items() if k != "validation_fraction"}
    layout = FeatureLayout.of(5, kwargs)
    period = PeriodData.of(periods["validation"], layout)
    env = StockTradingEnv(1, mode="validation", data=periods["validation"], **kwargs)
    obs, _ = env.reset()
    stock, market = layout.observed(obs.double())
    torch.testing.assert_close(stock[0], period.stock[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(market[0], period.market[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(period.close, torch.as_tensor(periods["validation"].close))
