"""The portfolio gradient (services/pod/trading/portfolio_gradient.py): its closed-form
account, its policy acting in StockTradingEnv, its batched tournament, and what it learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.contracts.strategies import PBTOptions
from services.pod.trading.backtest import metrics
from services.pod.trading.env import StockTradingEnv, split_periods
from services.pod.trading.market import synthetic_market
from services.pod.trading.portfolio_gradient import (
    FeatureLayout,
    PeriodData,
    PortfolioPlan,
    net_returns,
    run_portfolio_tournament,
    sharpe,
)
from services.pod.trading.tournament import evaluate_market, split_market

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
    periods, kwargs = split_market(data, ENV)
    kwargs = {**kwargs, "rebalance_band": 0.0}
    plan = PortfolioPlan(HPS[:1], rounds=1, round_steps=5)
    policy = run_portfolio_tournament(periods["train"], periods["validation"], kwargs, plan).policy
    scorer, invested = [0.5, -0.3, 0.2, 0.1, -0.2, 0.4, 0.8, 1.2], [0.3, -0.4, 0.5]
    policy.params = torch.tensor([scorer + invested], dtype=torch.float64)
    env = StockTradingEnv(1, mode="backtest", data=periods["backtest"], **kwargs)
    obs, _ = env.reset()
    layout = FeatureLayout.of(5, kwargs)
    stock, market = layout.observed(obs.double())
    wanted = policy.weights(*policy.normalize(stock, market))[0, 0]
    assert wanted.max() - wanted.min() > 0.05  # a real tilt, not equal weights
    obs, *_ = env.step(policy.act(obs))
    held = obs[0, 1 + 5 : 1 + 10].double()  # the account's weights after the trade
    torch.testing.assert_close(held, wanted, atol=2e-3, rtol=0)


def test_agents_train_apart_without_exploit_and_are_copied_with_it() -> None:
    """Batched, each agent is exactly the agent trained alone with its hyperparameters; with
    PBT's exploit the agents' first round is the same and the later ones differ."""
    data = synthetic_market(3, num_stocks=5, num_days=1000, regime="crash")
    periods, kwargs = split_market(data, ENV)
    args = (periods["train"], periods["validation"], kwargs)
    hps = [*HPS, {"learning_rate": 0.1, "l2": 1e-4}, {"learning_rate": 0.01, "l2": 0.0}]
    apart = run_portfolio_tournament(*args, PortfolioPlan(hps, 4, 5, exploit=False))
    for i, hp in enumerate(hps):
        alone = run_portfolio_tournament(*args, PortfolioPlan([hp], 4, 5))
        np.testing.assert_allclose([h[i] for h in apart.history], [h[0] for h in alone.history])
    pbt = run_portfolio_tournament(*args, PortfolioPlan(hps, 4, 5, exploit=True, seed=1))
    assert pbt.history[0] == apart.history[0] and pbt.history[1:] != apart.history[1:]
    # The kept snapshot is the best (agent, round) on the validation period.
    assert pbt.validation_sharpe == max(max(s) for s in pbt.history)
    assert pbt.history[pbt.round][pbt.slot] == pbt.validation_sharpe


def test_exploit_restarts_the_loser_from_a_parent() -> None:
    """PBT's copy takes the parent's parameters, Adam state, learning rate and L2 penalty: with
    explore's factor 1, the worst agent of the first round then trains exactly as the leader
    (the same validation Sharpe every later round); the others train on as they were."""
    data = synthetic_market(3, num_stocks=5, num_days=1000, regime="crash")
    periods, kwargs = split_market(data, ENV)
    args = (periods["train"], periods["validation"], kwargs)
    hps = [*HPS, {"learning_rate": 0.1, "l2": 1e-4}, {"learning_rate": 0.01, "l2": 0.0}]
    same = PBTOptions(truncation=0.25, perturb_factors=(1.0,))
    pbt = run_portfolio_tournament(*args, PortfolioPlan(hps, 2, 5, pbt=same))
    apart = run_portfolio_tournament(*args, PortfolioPlan(hps, 2, 5, exploit=False))
    loser, leader = int(np.argmin(pbt.history[0])), int(np.argmax(pbt.history[0]))
    assert loser != leader and pbt.history[1][loser] == pbt.history[1][leader]
    others = [i for i in range(4) if i != loser]
    assert [pbt.history[1][i] for i in others] == [apart.history[1][i] for i in others]
    torch.testing.assert_close(pbt.final.params[loser], pbt.final.params[leader], rtol=0, atol=0)


def test_training_and_selection_never_read_the_backtest_period() -> None:
    data = synthetic_market(4, num_stocks=5, num_days=1000, regime="trend")
    close = data.close.copy()
    close[-200:] *= np.linspace(1.0, 0.3, 200)[:, None]
    other = type(data).from_ohlcv(
        data.dates, data.tickers, data.open, np.maximum(data.high, close),
        np.minimum(data.low, close), close, data.volume,
    )  # fmt: skip
    plan = PortfolioPlan(HPS, rounds=3, round_steps=5)
    a, b = (evaluate_market(d, ENV, plan) for d in (data, other))
    assert a.tournament.history == b.tournament.history
    torch.testing.assert_close(a.tournament.policy.stock_weights, b.tournament.policy.stock_weights)
    assert not np.allclose(a.backtest_values["agent"], b.backtest_values["agent"])


def test_bad_settings_are_refused() -> None:
    data = synthetic_market(0, num_stocks=5, num_days=600, regime="trend")
    periods = split_periods(data, validation_fraction=0.2)
    args = (periods["train"], periods["validation"])
    with pytest.raises(ValueError, match="action_mode=weights"):
        run_portfolio_tournament(*args, {**ENV, "action_mode": "shares"}, PortfolioPlan(HPS))
    with pytest.raises(ValueError, match="shared by the stocks"):
        run_portfolio_tournament(*args, {**ENV, "shuffle_stocks": True}, PortfolioPlan(HPS))
    with pytest.raises(ValueError, match="rounds"):
        run_portfolio_tournament(*args, ENV, PortfolioPlan(HPS, rounds=0))
    with pytest.raises(ValueError, match="ent_coef"):
        run_portfolio_tournament(*args, ENV, PortfolioPlan([{"learning_rate": 0.1, "ent_coef": 0}]))
    replica = synthetic_market(0, num_stocks=5, num_days=600, regime="trend", replica=0)
    with pytest.raises(ValueError, match="own train period"):
        evaluate_market(data, ENV, PortfolioPlan(HPS), [replica])


#: Market seeds nothing was designed on: the method and its preset were chosen on seeds 0-14.
HELD_OUT_SEEDS = range(50, 65)


@pytest.mark.slow
@pytest.mark.nightly  # 45 markets' tournaments: minutes
def test_the_kept_agent_beats_buy_and_hold_held_out() -> None:
    """The learning result of docs/benchmarks.md ("Stock trading"), on the held-out market
    seeds 50-64 of each regime: the kept agent's Sharpe on the backtest period (read by nothing
    but this report) beats buy-and-hold's on at least 30 of the 45 markets (33 measured), and
    by a paired median margin on the trend (+0.31 measured) and mean-reverting (+1.9) markets.
    Not on the crash markets (paired median +0.01, medians 0.99 against 1.20), which this does
    not claim. With the optimiser's step removed all three assertions fail (23 markets; +0.16
    on mean reversion, -0.16 on trend). Budget: 4 agents x 300 full-batch gradient steps."""
    torch.set_num_threads(1)
    hps = [*HPS, {"learning_rate": 0.1, "l2": 1e-4}, {"learning_rate": 0.05}]
    margins: dict[str, list[float]] = {}
    for regime in ("trend", "mean_reversion", "crash"):
        for seed in HELD_OUT_SEEDS:
            data = synthetic_market(seed, num_stocks=5, regime=regime)
            report = evaluate_market(data, ENV, PortfolioPlan(hps, rounds=30, round_steps=10))
            ours = metrics(report.backtest_values["agent"]).sharpe
            theirs = metrics(report.backtest_values["buy-and-hold"]).sharpe
            margins.setdefault(regime, []).append(ours - theirs)
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
