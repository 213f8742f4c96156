"""StockTrading-v0: the env protocol, the trading arithmetic, the market data and its loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.pod.envs import make_env
from services.pod.trading.env import (
    StockTradingEnv,
    market_periods,
    simulated_train_periods,
)
from services.pod.trading.market import (
    CSV_COLUMNS,
    INDICATORS,
    MOMENTUM_WINDOWS,
    MarketData,
    MarketDataError,
    compute_indicators,
    load_csv,
    synthetic_market,
)
from tests.pod.envs import test_env_protocol as protocol

MAKER = protocol.Maker(lambda s: make_env("StockTrading-v0", protocol.N, seed=s, episode_length=30))


# -- protocol ------------------------------------------------------------------------------
def test_protocol_shapes_autoreset_and_bookkeeping() -> None:
    protocol.test_shapes_dtypes_autoreset_and_bookkeeping(MAKER)


def test_protocol_seeding() -> None:
    protocol.test_same_seed_same_trajectory_other_seed_differs(MAKER)
    protocol.test_constructor_seed_is_used_by_the_first_reset(MAKER)


def test_masked_reset_path_and_spaces() -> None:
    env = make_env("StockTrading-v0", 4, seed=0, episode_length=5, num_stocks=3)
    env._host_reads_free = False  # the accelerator path, exercised on CPU
    assert env.single_observation_space.shape == (1 + 2 * 3 + 3 * 4,)
    assert env.single_action_space.shape == (3,)
    env.reset()
    for t in range(1, 11):
        _, _, terminated, truncated, _ = env.step(torch.rand(4, 3) * 2 - 1)
        assert not terminated.any()
        assert bool(truncated.all()) == (t % 5 == 0)
    with pytest.raises(ValueError, match="mode"):
        StockTradingEnv(mode="live")
    with pytest.raises(TypeError, match="hmaxx"):
        make_env("StockTrading-v0", 1, hmaxx=3)


# -- accounting ----------------------------------------------------------------------------
def _direct_step(balance, holdings, price, next_price, action, hmax, cost, scaling):
    """One trading day written out with Python floats, stock by stock."""
    value_before = balance + sum(h * p for h, p in zip(holdings, price, strict=True))
    holdings = list(holdings)
    shares = [float(int(a * hmax)) for a in action]  # truncated toward zero
    for i, s in enumerate(shares):
        if s < 0:
            sold = min(-s, holdings[i])
            balance += sold * price[i] * (1 - cost)
            holdings[i] -= sold
    buys = [max(s, 0.0) for s in shares]
    total = sum(b * p * (1 + cost) for b, p in zip(buys, price, strict=True))
    if total > balance:
        buys = [float(np.floor(b * balance / total)) for b in buys]
    for i, b in enumerate(buys):
        balance -= b * price[i] * (1 + cost)
        holdings[i] += b
    value_after = balance + sum(h * p for h, p in zip(holdings, next_price, strict=True))
    return balance, holdings, (value_after - value_before) * scaling


def test_trading_arithmetic_matches_a_direct_computation() -> None:
    env = StockTradingEnv(
        num_envs=4,
        num_stocks=3,
        seed=0,
        initial_amount=50_000.0,
        hmax=200,
        transaction_cost=0.002,
        reward_scaling=1e-3,
        episode_length=40,
    )
    env.reset()
    close = env.data.close
    g = torch.Generator().manual_seed(0)
    cash_limited = 0
    for _ in range(25):
        actions = torch.rand((4, 3), generator=g, dtype=torch.float64) * 2.4 - 1.2  # some > 1
        before = env.state.clone()
        _, reward, _, truncated, _ = env.step(actions)
        assert not truncated.any()
        for n in range(4):
            day = int(before[n, 1])
            balance, holdings, expected = _direct_step(
                float(before[n, 0]),
                before[n, 2:].tolist(),
                close[day].tolist(),
                close[day + 1].tolist(),
                actions[n].clamp(-1, 1).tolist(),
                200,
                0.002,
                1e-3,
            )
            buys = [max(int(a * 200), 0) for a in actions[n].clamp(-1, 1).tolist()]
            cash_limited += sum(b * p for b, p in zip(buys, close[day], strict=True)) > balance
            assert int(env.state[n, 1]) == day + 1
            assert float(env.state[n, 0]) == pytest.approx(balance, abs=1e-6)
            assert env.state[n, 2:].tolist() == holdings
            assert float(reward[n]) == pytest.approx(expected, abs=1e-9)
            assert float(env.state[n, 0]) >= 0 and min(holdings) >= 0
    assert cash_limited > 0, "the cash limit must have been exercised"


def test_sell_more_than_held_and_hold() -> None:
    env = StockTradingEnv(num_envs=2, num_stocks=2, random_start=False, transaction_cost=0.01)
    env.reset()
    env.state[:, 2:] = torch.tensor([[3.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    p0, p1 = env.data.close[0], env.data.close[1]
    _, reward, *_ = env.step(torch.tensor([[-1.0, -1.0], [0.0, 0.0004]]))
    # Env 0 sold only its 3 shares of stock 0 (nothing of stock 1), paying 1%.
    assert env.state[0, 2:].tolist() == [0.0, 0.0]
    assert float(env.state[0, 0]) == pytest.approx(1e6 + 3 * p0[0] * 0.99)
    assert float(reward[0]) == pytest.approx(-3 * p0[0] * 0.01 * 1e-4)
    # Env 1 held (|a| * hmax < 1 share): nothing traded, account unchanged.
    assert env.state[1, 2:].tolist() == [0.0, 0.0] and float(env.state[1, 0]) == 1e6
    assert float(reward[1]) == 0.0
    assert p1[0] != p0[0]


def test_backtest_mode_is_one_pass_and_rewards_sum_to_the_pnl() -> None:
    train = StockTradingEnv(num_envs=1, mode="train")
    env = StockTradingEnv(num_envs=2, mode="backtest", seed=0)
    assert env.data.dates[0] > train.data.dates[-1]
    assert env.max_episode_steps == env.data.num_days - 1
    env.reset()
    assert env.day.tolist() == [0.0, 0.0]
    total = torch.zeros(2, dtype=torch.float64)
    for t in range(env.max_episode_steps):
        action = torch.full((2, env.num_stocks), 0.5)
        action[1] = -0.2 if t % 7 else 1.0
        _, reward, _, truncated, info = env.step(action)
        total += reward
        assert bool(truncated.all()) == (t == env.max_episode_steps - 1)
    pnl = (env.last_account_value - env.initial_amount) * env.reward_scaling
    torch.testing.assert_close(total, pnl)
    torch.testing.assert_close(info["episode_return"], pnl)


def _policy(obs: torch.Tensor, step: int) -> torch.Tensor:
    """Weights-mode actions that differ per sub-environment and change over time: sub-env 0
    stays in cash (a flat account), the others trade."""
    n, dim = obs.shape[0], 6
    action = torch.linspace(-1.0, 1.0, dim).repeat(n, 1) * torch.cos(
        torch.arange(n, dtype=torch.float32).unsqueeze(1) + 0.1 * step
    )
    action[0] = -1.0  # invested fraction 0: all cash
    return action


@pytest.mark.parametrize("mode", ["validation", "train"])
def test_sharpe_score_is_the_backtest_metric_of_each_episode(mode: str) -> None:
    """``score="sharpe"``: every finished episode reports the Sharpe ratio of its account
    values, as services.pod.trading.backtest computes it (0 for the account that stays in cash),
    also across autoresets (train mode: several episodes per sub-environment)."""
    from services.pod.trading.backtest import sharpe_of

    n = 3
    kwargs = {"validation_fraction": 0.2, "action_mode": "weights", "episode_length": 40}
    env = StockTradingEnv(n, mode=mode, seed=3, score="sharpe", **kwargs)
    plain = StockTradingEnv(n, mode=mode, seed=3, **kwargs)
    obs, _ = env.reset()
    plain.reset()
    values = [[env.initial_amount] for _ in range(n)]
    checked = 0
    for t in range(2 * env.max_episode_steps):
        action = _policy(obs, t)
        obs, _, _, truncated, info = env.step(action)
        _, _, _, _, plain_info = plain.step(action)
        assert "episode_score" not in plain_info  # the default env reports returns only
        for i in range(n):
            values[i].append(float(env.last_account_value[i]))
            if truncated[i]:
                expected = sharpe_of(np.array(values[i]))
                assert float(info["episode_score"][i]) == pytest.approx(expected, abs=1e-9)
                assert (expected == 0.0) == (i == 0)
                values[i] = [env.initial_amount]
                checked += 1
            else:
                assert float(info["episode_score"][i]) == 0.0
    assert checked == 2 * n


def test_reset_starts_the_sharpe_sums_afresh() -> None:
    """An evaluator resets an env whose previous episodes ran on past their end (it checks
    for finished episodes every 32 steps): what they added must not leak into the next."""
    from services.pod.trading.backtest import sharpe_of

    kwargs = {"validation_fraction": 0.2, "action_mode": "weights", "score": "sharpe"}
    env = StockTradingEnv(2, mode="validation", **kwargs)
    obs, _ = env.reset()
    for t in range(7):
        obs, *_ = env.step(_policy(obs, t))
    obs, _ = env.reset()
    values = [env.initial_amount]
    for t in range(env.max_episode_steps):
        obs, _, _, truncated, info = env.step(_policy(obs, t))
        values.append(float(env.last_account_value[1]))
    assert bool(truncated[1])
    expected = sharpe_of(np.array(values))
    assert float(info["episode_score"][1]) == pytest.approx(expected, abs=1e-9)


def test_a_bad_score_is_refused() -> None:
    with pytest.raises(ValueError, match="score must be 'return' or 'sharpe'"):
        StockTradingEnv(1, score="sortino")  # type: ignore[arg-type]


# -- market data -----------------------------------------------------------------------------
def test_synthetic_market_is_deterministic_and_split_by_date() -> None:
    a, b, c = synthetic_market(5), synthetic_market(5), synthetic_market(6)
    for name in ("open", "high", "low", "close", "volume", "indicators"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.close, c.close)
    assert (a.high >= np.maximum(a.open, a.close)).all() and (a.low <= a.close).all()
    assert np.isfinite(a.indicators).all()
    train, test = a.split(a.default_split_date())
    assert train.num_days + test.num_days == a.num_days
    assert train.dates[-1] < test.dates[0] == a.default_split_date()
    np.testing.assert_array_equal(test.close, a.close[train.num_days :])
    # Indicators are causal: computed on the train period alone they are the same values.
    np.testing.assert_allclose(
        compute_indicators(train.high, train.low, train.close), train.indicators, atol=1e-9
    )


def _write_csv(path: Path, rows: list[list[object]], header=CSV_COLUMNS) -> Path:
    lines = [",".join(header)] + [",".join(str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(days: int = 40) -> list[list[object]]:
    market = synthetic_market(1, num_stocks=2, num_days=60)
    rows = []
    for t in range(days):
        for s, tic in enumerate(("BBB", "AAA")):
            rows.append(
                [
                    str(market.dates[t]),
                    tic,
                    market.open[t, s],
                    market.high[t, s],
                    market.low[t, s],
                    market.close[t, s],
                    market.volume[t, s],
                ]
            )
    return rows


def test_load_csv_reads_user_data_and_trains_on_it(tmp_path: Path) -> None:
    rows = _rows()
    path = _write_csv(tmp_path / "ohlcv.csv", rows[::-1])  # order does not matter
    data = load_csv(path)
    assert data.tickers == ("AAA", "BBB") and data.num_days == 40
    assert data.close[0, 1] == pytest.approx(rows[0][5])  # BBB, day 0
    assert data.indicators.shape == (40, 2, 4)
    env = make_env("StockTrading-v0", 2, seed=0, csv_path=str(path), split_date=str(data.dates[30]))
    assert env.data.num_days == 30 and env.max_episode_steps == 29
    env.reset()
    env.step(torch.zeros(2, 2))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.__setitem__(3, [*r[3][:5], "abc", r[3][6]]), r":5: close 'abc' is not a"),
        (lambda r: r.__setitem__(0, [*r[0][:2], -1.0, *r[0][3:]]), r":2: prices must be > 0"),
        (lambda r: r.__setitem__(1, [r[1][0], r[1][1], 5, 1, 9, 5, 1]), r":3: high/low"),
        (lambda r: r.__setitem__(2, ["2020-13-40", *r[2][1:]]), r":4: date '2020-13-40'"),
        (lambda r: r.__setitem__(2, [r[2][0], "", *r[2][2:]]), r":4: empty value in column"),
        (lambda r: r.append(list(r[0])), r"duplicate row for date"),
        (lambda r: r.pop(5), r"has no row for tic AAA"),
        (lambda r: r.__setitem__(4, [*r[4][:6], -3]), r":6: volume must be >= 0"),
    ],
)
def test_load_csv_names_the_bad_row(tmp_path: Path, edit, message: str) -> None:
    rows = _rows()
    edit(rows)
    with pytest.raises(MarketDataError, match=message):
        load_csv(_write_csv(tmp_path / "bad.csv", rows))


def test_load_csv_names_missing_columns_and_files(tmp_path: Path) -> None:
    header = ("date", "tic", "open", "high", "close")
    path = _write_csv(tmp_path / "cols.csv", [["2020-01-02", "A", 1, 2, 1]], header=header)
    with pytest.raises(MarketDataError, match="missing column\\(s\\) low, volume"):
        load_csv(path)
    with pytest.raises(MarketDataError, match="no data rows"):
        load_csv(_write_csv(tmp_path / "empty.csv", []))
    with pytest.raises(MarketDataError, match="cannot read"):
        load_csv(tmp_path / "absent.csv")


# -- regimes, periods, causality -----------------------------------------------------------
@pytest.mark.parametrize("regime", ["trend", "mean_reversion", "crash"])
def test_regimes_are_deterministic_and_differ(regime: str) -> None:
    a = synthetic_market(3, num_days=400, regime=regime)
    np.testing.assert_array_equal(a.close, synthetic_market(3, num_days=400, regime=regime).close)
    assert not np.array_equal(a.close, synthetic_market(3, num_days=400).close)
    assert (a.close > 0).all() and np.isfinite(a.turbulence).all()
    assert (a.turbulence[:60] == 0).all() and (a.turbulence[60:] >= 0).all()
    with pytest.raises(ValueError, match="regime"):
        synthetic_market(3, regime="sideways")


def test_crash_regime_crashes_after_turbulence_rises() -> None:
    """The crash regime's designed property: the stress spell's turbulence comes first."""
    before, calm = [], []
    for seed in range(3):
        m = synthetic_market(seed, num_days=2520, regime="crash")
        market = np.log(m.close[1:] / m.close[:-1]).mean(axis=1)
        week = np.convolve(market, np.ones(5), "valid")  # the market's 5-day log-return
        crash_days = np.flatnonzero(week < -0.08) + 1
        first = crash_days[np.r_[True, np.diff(crash_days) > 20]]  # each crash's first day
        assert len(first) >= 3
        before += [m.turbulence[d - 10 : d].mean() for d in first if d > 70]
        calm.append(np.median(m.turbulence[60:]))
    assert np.median(before) > 1.3 * np.median(calm)


def _prefix_market(full: MarketData, days: int) -> MarketData:
    """The market as known on day ``days - 1``: every feature recomputed from that prefix."""
    s = slice(0, days)
    return MarketData.from_ohlcv(
        full.dates[s], full.tickers, full.open[s], full.high[s], full.low[s], full.close[s],
        full.volume[s],
    )  # fmt: skip


@pytest.mark.parametrize("regime", ["mixed", "crash"])
def test_features_are_causal(regime: str) -> None:
    """Every feature of day t, and every observation the env shows on day t, is the same
    whether the data ends on day t or goes on: nothing is computed from later days."""
    full = synthetic_market(2, num_stocks=3, num_days=300, regime=regime)
    days = 200
    prefix = _prefix_market(full, days)
    np.testing.assert_allclose(prefix.indicators, full.indicators[:days], atol=1e-9)
    np.testing.assert_allclose(prefix.turbulence, full.turbulence[:days], atol=1e-9)
    np.testing.assert_allclose(prefix.momentum, full.momentum[:days], atol=1e-9)
    kwargs = {
        "transaction_cost": 0.001,
        "turbulence": True,
        "momentum": True,
        "action_mode": "weights",
    }
    env_full = StockTradingEnv(mode="backtest", data=full, **kwargs)
    env_prefix = StockTradingEnv(mode="backtest", data=prefix, **kwargs)
    obs_full, _ = env_full.reset()
    obs_prefix, _ = env_prefix.reset()
    rng = torch.Generator().manual_seed(0)
    for _ in range(days - 1):
        torch.testing.assert_close(obs_full, obs_prefix)
        action = torch.rand(1, 4, generator=rng) * 2 - 1
        obs_full = env_full.step(action)[0]
        obs_prefix = env_prefix.step(action)[0]
    # A feature that used the future would also fail here: changing the days after the
    # prefix (a crash of every price) leaves the prefix's features as they were.
    close = full.close.copy()
    close[days:] *= 0.5
    high, low = np.maximum(full.high, close), np.minimum(full.low, close)
    shocked = MarketData.from_ohlcv(
        full.dates, full.tickers, full.open, high, low, close, full.volume
    )
    np.testing.assert_allclose(shocked.indicators[:days], full.indicators[:days], atol=1e-9)
    np.testing.assert_allclose(shocked.turbulence[:days], full.turbulence[:days], atol=1e-9)
    np.testing.assert_allclose(shocked.momentum[:days], full.momentum[:days], atol=1e-9)


def test_momentum_is_the_trailing_log_return_and_reads_the_days_before_a_period() -> None:
    full = synthetic_market(1, num_stocks=3, num_days=700, regime="trend")
    t = 500
    for i, k in enumerate(MOMENTUM_WINDOWS):
        want = np.log(full.close[t] / full.close[t - k])
        np.testing.assert_allclose(full.momentum[t, :, i], want, rtol=1e-9)
    # Fewer days than the window: the return since the first day.
    np.testing.assert_allclose(full.momentum[40, :, 2], np.log(full.close[40] / full.close[0]))
    assert (full.momentum[0] == 0).all()
    # A later period (here the last 200 days) keeps the values computed on the whole history,
    # so its first day's yearly momentum is a year's return, not zero.
    later = StockTradingEnv(mode="backtest", data=full.slice(500, 700), momentum=True)
    plain = StockTradingEnv(mode="backtest", data=full.slice(500, 700))
    obs, _ = later.reset()
    assert obs.shape[1] == plain.single_observation_space.shape[0] + 3 * len(MOMENTUM_WINDOWS)
    assert later.single_observation_space.shape == (obs.shape[1],)
    torch.testing.assert_close(
        obs[0, -3 * len(MOMENTUM_WINDOWS) :],
        torch.as_tensor(full.momentum[500].reshape(-1), dtype=torch.float32),
    )


def test_train_validation_backtest_periods_are_disjoint_and_in_order() -> None:
    periods = market_periods(market_seed=1, regime="trend", validation_fraction=0.2)
    train, validation, backtest = periods["train"], periods["validation"], periods["backtest"]
    assert train.dates[-1] < validation.dates[0] and validation.dates[-1] < backtest.dates[0]
    assert train.num_days + validation.num_days + backtest.num_days == 2520
    assert validation.num_days == 504 and backtest.num_days == 504
    full = synthetic_market(1, regime="trend")
    np.testing.assert_array_equal(validation.close, full.close[train.num_days : -504])
    # The envs of each mode read their period and nothing else.
    for mode, period in periods.items():
        env = StockTradingEnv(mode=mode, market_seed=1, regime="trend", validation_fraction=0.2)
        np.testing.assert_array_equal(env.data.dates, period.dates)
    # Without a validation period the split is the old (train, backtest) one.
    assert set(market_periods()) == {"train", "backtest"}
    with pytest.raises(ValueError, match="validation_fraction"):
        StockTradingEnv(mode="validation")
    with pytest.raises(ValueError, match="before the split"):
        market_periods(validation_date="2019-06-03", split_date="2018-01-02")


def test_weights_mode_rebalances_to_target_weights_paying_costs() -> None:
    """Worked by hand: 1,000 cash, closes 10 and 20, target 50% / 50% at a 1% cost."""
    close = np.array([[10.0, 20.0], [11.0, 19.0], [11.0, 19.0], [12.0, 18.0]])
    data = MarketData.from_ohlcv(
        np.arange("2020-01-01", "2020-01-05", dtype="datetime64[D]"), ("A", "B"),
        close, close, close, close, np.ones_like(close),
    )  # fmt: skip
    env = StockTradingEnv(
        mode="backtest", data=data, initial_amount=1000.0, transaction_cost=0.01,
        action_mode="weights", reward_scaling=1.0,
    )  # fmt: skip
    env.reset()
    # Fully invested (a_0 = 1), split 1 : 1 (a = 0.2, 0.2): weights 0.5 each.
    _, reward, *_ = env.step(torch.tensor([[1.0, 0.2, 0.2]]))
    # floor(500 / (10 * 1.01)) = 49 and floor(500 / (20 * 1.01)) = 24 shares.
    cash = 1000.0 - (49 * 10 + 24 * 20) * 1.01
    assert env.balance.item() == pytest.approx(cash)
    assert env.holdings.tolist() == [[49.0, 24.0]]
    assert reward.item() == pytest.approx(cash + 49 * 11 + 24 * 19 - 1000.0)
    # a_0 = -1: all cash, selling everything and receiving 99% of the value.
    env.step(torch.tensor([[-1.0, 1.0, 1.0]]))
    assert env.holdings.tolist() == [[0.0, 0.0]]
    assert env.balance.item() == pytest.approx(cash + (49 * 11 + 24 * 19) * 0.99)
    # Costs are what the env charges: at zero cost the same trades keep every cent.
    free = StockTradingEnv(
        mode="backtest", data=data, initial_amount=1000.0, transaction_cost=0.0,
        action_mode="weights",
    )  # fmt: skip
    free.reset()
    free.step(torch.ones(1, 3))
    free.step(-torch.ones(1, 3))
    assert free.balance.item() == pytest.approx(1000.0 + 50 * 1 - 25 * 1)


def _in_order(obs: torch.Tensor, order: torch.Tensor, s: int) -> torch.Tensor:
    """The unshuffled env's observation with each per-stock block read in ``order``."""
    k, w = len(INDICATORS), len(MOMENTUM_WINDOWS)

    def block(start: int, width: int) -> torch.Tensor:
        cols = obs[:, start : start + s * width].reshape(len(obs), s, width)
        return cols.gather(1, order.unsqueeze(2).expand(-1, -1, width)).reshape(len(obs), -1)

    turbulence = 1 + 2 * s + s * k
    return torch.cat(
        [
            obs[:, :1],
            block(1, 1),
            block(1 + s, 1),
            block(1 + 2 * s, k),
            obs[:, turbulence : turbulence + 2],
            block(turbulence + 2, w),
        ],
        dim=1,
    )


def test_shuffled_stocks_are_the_same_market_in_another_order() -> None:
    """A training episode's stock order changes what the agent sees in each slot and which
    stock each action entry trades, nothing else: the same trades in the shuffled slots give
    the same account, cent for cent."""
    s = 5
    kwargs = {
        "num_envs": 6,
        "seed": 3,
        "market_seed": 1,
        "regime": "trend",
        "action_mode": "weights",
        "turbulence": True,
        "momentum": True,
        "transaction_cost": 0.001,
    }
    plain = StockTradingEnv(**kwargs)
    shuffled = StockTradingEnv(shuffle_stocks=True, **kwargs)
    obs_plain, _ = plain.reset()
    obs_shuffled, _ = shuffled.reset()
    order = shuffled.state[:, 2 + s :].long()
    assert (order.sort(1).values == torch.arange(s)).all()  # each row a permutation
    assert (order != torch.arange(s)).any()
    rng = torch.Generator().manual_seed(0)
    for _ in range(30):
        torch.testing.assert_close(obs_shuffled, _in_order(obs_plain, order, s))
        action = torch.rand(6, s + 1, generator=rng) * 2 - 1
        slotted = torch.cat([action[:, :1], action[:, 1:].gather(1, order)], dim=1)
        obs_plain, reward_plain, *_ = plain.step(action)
        obs_shuffled, reward_shuffled, *_ = shuffled.step(slotted)
        torch.testing.assert_close(reward_shuffled, reward_plain, rtol=0, atol=0)
        torch.testing.assert_close(shuffled.holdings, plain.holdings, rtol=0, atol=0)
    # Selection and the report read the data's order: no shuffling outside training.
    backtest = StockTradingEnv(mode="backtest", market_seed=1, shuffle_stocks=True)
    assert backtest.state_dim == 2 + s


def test_risk_aversion_counts_a_day_as_its_mean_variance_utility() -> None:
    kwargs = {"num_envs": 4, "seed": 1, "market_seed": 0, "action_mode": "weights"}
    neutral = StockTradingEnv(**kwargs)
    averse = StockTradingEnv(risk_aversion=8.0, **kwargs)
    neutral.reset()
    averse.reset()
    action = torch.ones(4, 6)  # fully invested, equal weights
    for _ in range(10):
        before = neutral.account_value()
        _, reward_neutral, *_ = neutral.step(action)
        _, reward_averse, *_ = averse.step(action)
        gain = reward_neutral / neutral.reward_scaling
        x = gain / before
        want = (x - 4.0 * x * x) * before * averse.reward_scaling
        torch.testing.assert_close(reward_averse, want)
        assert (reward_averse < reward_neutral).all()


def test_replicas_are_other_markets_of_the_regime() -> None:
    market = synthetic_market(2, num_days=300, regime="trend")
    first = synthetic_market(2, num_days=300, regime="trend", replica=0)
    np.testing.assert_array_equal(
        first.close, synthetic_market(2, num_days=300, regime="trend", replica=0).close
    )
    others = [synthetic_market(2, num_days=300, regime="trend", replica=1)]
    others += [synthetic_market(s, num_days=300, regime="trend") for s in range(5)]
    assert not any(np.array_equal(first.close, m.close) for m in [market, *others])
    np.testing.assert_array_equal(first.dates, market.dates)
    with pytest.raises(ValueError, match="replica"):
        synthetic_market(2, replica=-1)


def test_simulated_markets_train_on_each_replica_within_its_own_days() -> None:
    """Training episodes start in the market's train period and in each replica's, and stay
    inside the market they started in; what a replica's day shows is what an env on that
    replica alone shows (features computed per market, none across the seam)."""
    market = {"market_seed": 1, "regime": "crash", "num_days": 600, "validation_fraction": 0.2}
    kwargs = {
        "episode_length": 60,
        "action_mode": "weights",
        "turbulence": True,
        "momentum": True,
    }
    env = StockTradingEnv(num_envs=64, seed=0, simulated_markets=3, **market, **kwargs)
    own = market_periods(1, 5, 600, regime="crash", validation_fraction=0.2)["train"]
    replicas = simulated_train_periods(3, 1, 5, 600, "crash", validation_fraction=0.2)
    segments = [own, *replicas]
    bounds = np.cumsum([0] + [m.num_days for m in segments])
    alone = [StockTradingEnv(num_envs=64, data=m, random_start=False, **kwargs) for m in segments]
    np.testing.assert_array_equal(env.prices.numpy(), np.concatenate([m.close for m in segments]))

    def market_of(day: torch.Tensor) -> np.ndarray:
        return np.searchsorted(bounds, day.long().numpy(), side="right") - 1

    obs, _ = env.reset()
    started_in = market_of(env.day)
    seen = set(started_in.tolist())
    action = torch.ones(64, 6)
    for _ in range(150):  # 2.5 episodes: starts after autoresets too
        for i in range(0, 64, 7):  # the same day of the same market, alone: the same columns
            k = int(started_in[i])
            alone[k].state[i] = env.state[i]
            alone[k].state[i, 1] -= float(bounds[k])
            torch.testing.assert_close(obs[i], alone[k].observe(alone[k].state)[i])
        obs, _, _, truncated, _ = env.step(action)
        now = market_of(env.day)
        inside = ~truncated.numpy()
        assert (now[inside] == started_in[inside]).all()
        started_in = now  # a truncated episode's autoreset starts the next one
        seen.update(now.tolist())
    assert seen == {0, 1, 2, 3}


def test_simulated_markets_are_refused_where_they_cannot_apply(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="simulated_markets"):
        StockTradingEnv(csv_path=str(_write_csv(tmp_path / "m.csv", _rows())), simulated_markets=2)
    with pytest.raises(ValueError, match="simulated_markets"):
        StockTradingEnv(simulated_markets=-1)
    periods = market_periods(0, 5, 400, regime="trend")
    with pytest.raises(ValueError, match="train mode"):
        StockTradingEnv(mode="backtest", data=[periods["backtest"], periods["train"]])
    # Validation and backtest read the market's own period, replicas or not.
    plain = StockTradingEnv(mode="backtest", market_seed=4, num_days=400)
    simulated = StockTradingEnv(mode="backtest", market_seed=4, num_days=400, simulated_markets=2)
    np.testing.assert_array_equal(simulated.prices.numpy(), plain.prices.numpy())


def test_a_pod_of_the_spec_scores_its_agents_by_their_validation_sharpe() -> None:
    """``evaluation.env_kwargs`` {mode: validation, score: sharpe}: a pod trains on the train
    period and ranks its agents by the Sharpe ratio of a deterministic pass of the validation
    period (what PBT inside the pod and the leaderboard select by)."""
    from services.contracts.spec import ExperimentSpec
    from services.pod.trading.backtest import run_backtest, sharpe_of
    from services.pod.training.onpolicy import OnPolicyTrainer
    from services.pod.training.presets import pod_config
    from tests.pod.harness import make_spec

    on_validation = {"mode": "validation", "score": "sharpe"}
    spec = ExperimentSpec.model_validate(
        make_spec(
            env={"name": "StockTrading-v0", "kwargs": {"regime": "crash", "num_stocks": 3}},
            evaluation={"episodes": 1, "env_kwargs": on_validation},
        )
    )
    small = {"num_envs": 4, "num_steps": 16, "num_minibatches": 2}
    draws = [{"learning_rate": 3e-4}, {"learning_rate": 1e-3}]
    configs = [pod_config(spec, {**small, **hp}, seed=1 + i) for i, hp in enumerate(draws)]
    assert configs[0].eval_env_kwargs == on_validation
    train_env, eval_env = configs[0].make_envs(2)
    assert (train_env.mode, eval_env.mode, eval_env.score) == ("train", "validation", "sharpe")
    assert eval_env.data.dates[0] > train_env.data.dates[-1]
    # A population pod of two agents: its trainer builds the population's evaluation env.
    trainer = OnPolicyTrainer(configs)
    trainer.step()
    scores = [r.mean for r in trainer.evaluate()]
    kwargs = {k: v for k, v in configs[0].env_kwargs.items() if k != "validation_fraction"}
    expected = []
    for i in range(2):
        env = StockTradingEnv(1, mode="validation", data=eval_env.data, **kwargs)
        values = run_backtest(env, trainer.agent(i).policy.act_deterministic)
        expected.append(sharpe_of(values))
    assert scores == pytest.approx(expected, rel=1e-5)  # the evaluator sums in float32
    assert len(set(scores)) == 2  # two agents, two scores
    trainer.close()
