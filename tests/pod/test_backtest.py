"""Backtest metrics against hand-computed values; the buy-and-hold baseline; a backtest run."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from services.pod.trading.backtest import buy_and_hold, equal_weight, metrics, run_backtest
from services.pod.trading.env import StockTradingEnv


def test_metrics_of_a_short_series() -> None:
    # Returns: +10%, -10%, +22/99; the peak 110 is followed by 99 (a 10% drawdown).
    m = metrics([100.0, 110.0, 99.0, 121.0], periods_per_year=252)
    returns = [0.1, -0.1, 22 / 99]
    mean, std = statistics.mean(returns), statistics.stdev(returns)  # sample std (ddof=1)
    assert m.days == 3
    assert m.cumulative_return == pytest.approx(0.21)
    assert m.annual_return == pytest.approx(1.21**84 - 1)  # 252 / 3 = 84 periods a year
    assert m.annual_volatility == pytest.approx(std * math.sqrt(252))
    assert m.sharpe == pytest.approx(mean / std * math.sqrt(252))
    assert m.max_drawdown == pytest.approx(-0.1)
    assert m.calmar == pytest.approx((1.21**84 - 1) / 0.1)


def test_metrics_of_a_year_with_a_deep_drawdown() -> None:
    # 252 days: up 1% a day for 100 days, then down to half the peak, then flat to the end.
    up = 100.0 * 1.01 ** np.arange(101)
    down = np.linspace(up[-1], up[-1] / 2, 51)[1:]
    flat = np.full(252 - 150, up[-1] / 2)
    values = np.concatenate([up, down, flat])
    m = metrics(values)
    growth = (1.01**100) / 2
    assert m.days == 252
    assert m.cumulative_return == pytest.approx(growth - 1)
    assert m.annual_return == pytest.approx(growth - 1)  # exactly one year
    assert m.max_drawdown == pytest.approx(-0.5)
    assert m.calmar == pytest.approx((growth - 1) / 0.5)


def test_metrics_edge_cases_and_bad_input() -> None:
    flat = metrics([5.0, 5.0, 5.0])
    assert flat.cumulative_return == 0 and flat.max_drawdown == 0
    assert math.isnan(flat.sharpe) and math.isnan(flat.calmar)
    with pytest.raises(ValueError, match="at least 2"):
        metrics([1.0])
    with pytest.raises(ValueError, match="> 0"):
        metrics([1.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        metrics([1.0, math.nan])


def test_buy_and_hold() -> None:
    close = np.array([[10.0, 20.0], [12.0, 18.0], [8.0, 30.0]])
    np.testing.assert_allclose(buy_and_hold(close, 1000.0, 0.0), [1000.0, 1050.0, 1150.0])
    # With a 1% cost: 49 and 24 shares (not 50 and 25), 20.3 of cash left over.
    np.testing.assert_allclose(
        buy_and_hold(close, 1000.0, 0.01), [20.3 + 490 + 480, 20.3 + 588 + 432, 20.3 + 392 + 720]
    )


def test_equal_weight_rebalanced_pays_costs_on_what_it_trades() -> None:
    """Worked by hand at a 1% cost: day 0 buys 500 + 500 (cost 10); day 1 the first stock
    doubled, 1,485 is rebalanced by trading 247.5 + 247.5 (cost 4.95); day 2 it halved back,
    1,110.0375 is rebalanced by trading 185.00625 x 2 (cost 3.700125)."""
    close = np.array([[10.0, 20.0], [20.0, 20.0], [10.0, 20.0]])
    np.testing.assert_allclose(
        equal_weight(close, 1000.0, 0.01, rebalance_every=1), [990.0, 1480.05, 1106.337375]
    )
    # Monthly (here: every 2 days) it drifts in between: day 1 is not rebalanced.
    np.testing.assert_allclose(equal_weight(close, 1000.0, 0.01, 2), [990.0, 1485.0, 990.0])
    np.testing.assert_allclose(equal_weight(close, 1000.0, 0.0, 1), [1000.0, 1500.0, 1125.0])
    with pytest.raises(ValueError, match="rebalance_every"):
        equal_weight(close, rebalance_every=0)


def test_run_backtest_records_the_account_value_every_day() -> None:
    env = StockTradingEnv(num_envs=1, mode="backtest", num_stocks=3, transaction_cost=0.0, hmax=100)
    hold = run_backtest(env, lambda obs: torch.zeros(1, 3))
    assert len(hold) == env.data.num_days
    np.testing.assert_allclose(hold, env.initial_amount)
    # Buying on day 0 only, then holding: the account tracks the shares bought at the close.
    day0 = {"done": False}

    def buy_once(obs: torch.Tensor) -> torch.Tensor:
        action = torch.zeros(1, 3) if day0["done"] else torch.ones(1, 3)
        day0["done"] = True
        return action

    values = run_backtest(env, buy_once)
    shares = np.full(3, 100.0)
    assert env.data.close[0] @ shares < env.initial_amount  # all three buys are affordable
    expected = env.initial_amount + env.data.close @ shares - env.data.close[0] @ shares
    np.testing.assert_allclose(values, expected, rtol=1e-12)
