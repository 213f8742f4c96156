"""StockTrading-v0: FinRL's multi-stock trading task, torch-batched.

Each sub-environment is one trading account over one market (``market.py``); every step is one
trading day. The actions, the account's arithmetic and reward, the observation, episodes, the
market's periods, the Sharpe score and the simulated markets: docs/trading.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import TorchVecEnv
from services.pod.envs.functional import FunctionalEnv
from services.pod.trading.market import (
    INDICATORS,
    MOMENTUM_WINDOWS,
    TRADING_DAYS_PER_YEAR,
    MarketData,
    load_csv,
    rolling_mean,
    synthetic_market,
)

Mode = Literal["train", "validation", "backtest"]
MODES = ("train", "validation", "backtest")


def market_periods(
    market_seed: int = 0,
    num_stocks: int = 5,
    num_days: int = 2520,
    csv_path: str | None = None,
    split_date: str | None = None,
    regime: str = "mixed",
    validation_fraction: float = 0.0,
    validation_date: str | None = None,
) -> dict[str, MarketData]:
    """The periods (``train``, ``backtest`` and, when asked for, ``validation``) of the market
    the env's keyword arguments describe, in time order and disjoint."""
    data = (
        load_csv(csv_path)
        if csv_path is not None
        else _synthetic(market_seed, num_stocks, num_days, regime)
    )
    return split_periods(data, split_date, validation_fraction, validation_date)


def split_periods(
    data: MarketData,
    split_date: str | None = None,
    validation_fraction: float = 0.0,
    validation_date: str | None = None,
) -> dict[str, MarketData]:
    """``data`` cut in time: ``train``, then (when asked for) ``validation``, then ``backtest``
    from ``split_date`` (default: ``MarketData.default_split_date``). The validation period is
    ``validation_date`` .. the split, or the ``validation_fraction`` of all days before it."""
    split = np.datetime64(split_date if split_date is not None else data.default_split_date())
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    if validation_date is None and validation_fraction > 0:
        cut = int(np.searchsorted(data.dates, split)) - round(validation_fraction * data.num_days)
        validation_date = str(data.dates[max(cut, 0)])
    if validation_date is None:
        train, backtest = data.split(split)
        return {"train": train, "backtest": backtest}
    if np.datetime64(validation_date) >= split:
        raise ValueError(f"validation_date {validation_date} must be before the split {split}")
    train, validation, backtest = data.split3(validation_date, split)
    return {"train": train, "validation": validation, "backtest": backtest}


def simulated_train_periods(
    count: int,
    market_seed: int = 0,
    num_stocks: int = 5,
    num_days: int = 2520,
    regime: str = "mixed",
    split_date: str | None = None,
    validation_fraction: float = 0.0,
    validation_date: str | None = None,
) -> list[MarketData]:
    """The train periods of ``count`` replicas of the synthetic market (docs/trading.md,
    "Simulated history"), cut as the market itself is."""
    # Not cached as the market is: only a train env reads them, once, into its own tensors.
    return [
        split_periods(
            synthetic_market(market_seed, num_stocks, num_days, regime=regime, replica=k),
            split_date,
            validation_fraction,
            validation_date,
        )["train"]
        for k in range(count)
    ]


@lru_cache(maxsize=16)
def _synthetic(seed: int, num_stocks: int, num_days: int, regime: str) -> MarketData:
    """Shared between the envs of a process (train, eval, backtest): read-only."""
    return synthetic_market(seed, num_stocks, num_days, regime=regime)


#: The observation's blocks that the account fills; the others are ``market_features``'.
ACCOUNT_BLOCKS = ("cash", "weights")


def observation_blocks(turbulence: bool, momentum: bool) -> list[tuple[str, int, bool]]:
    """The observation's blocks in order (docs/trading.md): name, columns per entry, and
    whether there is an entry per stock (then stock 0's columns come first, then stock 1's)."""
    blocks = [("cash", 1, False), ("close", 1, True), ("weights", 1, True)]
    blocks += [("indicators", len(INDICATORS), True)]
    blocks += [("turbulence", 2, False)] * turbulence
    blocks += [("momentum", len(MOMENTUM_WINDOWS), True)] * momentum
    return blocks


def market_features(data: MarketData, turbulence: bool, momentum: bool) -> np.ndarray:
    """(T, D): per day, the observation's market columns (docs/trading.md), in its order."""
    # Prices relative to their 30-day mean: stationary, so a policy learnt on the train
    # period reads the backtest period's prices on the same scale (raw or
    # first-day-relative prices would let it memorise the train period's price levels).
    relative = data.close / rolling_mean(data.close, 30)
    ind = data.indicators
    features = np.stack(
        [
            ind[..., INDICATORS.index("macd")] / data.close,
            ind[..., INDICATORS.index("rsi_30")] / 100.0,
            ind[..., INDICATORS.index("cci_30")] / 100.0,
            ind[..., INDICATORS.index("dx_30")] / 100.0,
        ],
        axis=-1,
    )
    columns = [relative, features.reshape(data.num_days, -1)]
    if turbulence:
        index = np.diff(np.log(data.close), axis=0, prepend=np.log(data.close[:1])).mean(1)
        realised_vol = np.sqrt(rolling_mean(index**2, 20) * TRADING_DAYS_PER_YEAR)
        columns.append(np.log1p(np.maximum(data.turbulence, 0.0) / data.num_stocks)[:, None])
        columns.append(realised_vol[:, None])
    if momentum:
        columns.append(data.momentum.reshape(data.num_days, -1))
    return np.concatenate(columns, axis=1)


class StockTrading(FunctionalEnv):
    """The trading account's arithmetic and the market's tables (docs/trading.md) as a
    functional env. State per sub-environment: ``[balance, day, holdings (S)]``, then, when
    shuffling, the episode's stock order (S), and, when scoring by Sharpe ratio, the episode's
    sums of daily returns and of their squares."""

    name = "StockTrading-v0"

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float64,
        max_episode_steps: int | None = None,
        mode: Mode = "train",
        market_seed: int = 0,
        num_stocks: int = 5,
        num_days: int = 2520,
        csv_path: str | None = None,
        split_date: str | None = None,
        regime: str = "mixed",
        validation_fraction: float = 0.0,
        validation_date: str | None = None,
        data: MarketData | Sequence[MarketData] | None = None,
        initial_amount: float = 1_000_000.0,
        hmax: int = 1000,
        transaction_cost: float = 0.001,
        reward_scaling: float = 1e-4,
        episode_length: int | None = 252,
        random_start: bool = True,
        action_mode: Literal["shares", "weights"] = "shares",
        rebalance_band: float = 0.0,
        turbulence: bool = False,
        momentum: bool = False,
        risk_aversion: float = 0.0,
        shuffle_stocks: bool = False,
        simulated_markets: int = 0,
        score: Literal["return", "sharpe"] = "return",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if score not in ("return", "sharpe"):
            raise ValueError(f"score must be 'return' or 'sharpe', got {score!r}")
        if action_mode not in ("shares", "weights"):
            raise ValueError(f"action_mode must be 'shares' or 'weights', got {action_mode!r}")
        if not 0 <= simulated_markets <= 256:  # each one built and held by the env
            raise ValueError(f"simulated_markets must be in [0, 256], got {simulated_markets}")
        if simulated_markets and (csv_path is not None or data is not None):
            raise ValueError(
                "simulated_markets needs the env's own synthetic market (no csv_path, no data)"
            )
        if data is None:
            # One set of market settings for both cuts, by keyword (the functions' orders differ).
            market = {
                "market_seed": market_seed,
                "num_stocks": num_stocks,
                "num_days": num_days,
                "split_date": split_date,
                "regime": regime,
                "validation_fraction": validation_fraction,
                "validation_date": validation_date,
            }
            periods = market_periods(csv_path=csv_path, **market)
            if mode not in periods:
                raise ValueError(
                    "mode='validation' needs a validation period: set validation_fraction > 0 "
                    "or validation_date"
                )
            data = periods[mode]
            if simulated_markets and mode == "train":
                data = [data, *simulated_train_periods(simulated_markets, **market)]
        # The markets episodes run in, one after the other in the env's tensors.
        segments = [data] if isinstance(data, MarketData) else list(data)
        if not segments or (len(segments) > 1 and mode != "train"):
            raise ValueError("need one market to run in (several only in train mode)")
        if len({m.num_stocks for m in segments}) > 1:
            raise ValueError("every market trained on needs the same number of stocks")
        data = segments[0]
        if initial_amount <= 0 or hmax < 1 or not 0 <= transaction_cost < 1:
            raise ValueError(
                "need initial_amount > 0, hmax >= 1 and 0 <= transaction_cost < 1, got "
                f"{initial_amount}, {hmax}, {transaction_cost}"
            )
        if not 0.0 <= rebalance_band < 1.0:
            raise ValueError(f"rebalance_band must be in [0, 1), got {rebalance_band}")
        if not 0.0 <= risk_aversion < 1e4:
            raise ValueError(f"risk_aversion must be in [0, 1e4), got {risk_aversion}")
        self.data = data
        self.num_stocks = s = data.num_stocks
        self.shuffle = mode == "train" and shuffle_stocks
        self.score = score
        self._order = 2 + s
        self._sums = self._order + s * int(self.shuffle)
        self.state_dim = self._sums + 2 * int(score == "sharpe")
        self.reset_uniforms = 1 + s * int(self.shuffle)
        last_day = min(m.num_days for m in segments) - 1  # the last day an episode can reach
        if mode != "train" or episode_length is None:
            length = last_day
        else:
            if episode_length < 1:
                raise ValueError(f"episode_length must be >= 1, got {episode_length}")
            length = min(int(episode_length), last_day)
        super().__init__(device, dtype, length)
        self.mode = mode
        self.initial_amount = float(initial_amount)
        self.hmax = int(hmax)
        self.transaction_cost = float(transaction_cost)
        self.reward_scaling = float(reward_scaling)
        self.action_mode = action_mode
        self.rebalance_band = float(rebalance_band)
        self.risk_aversion = float(risk_aversion)
        self.random_start = mode == "train" and random_start
        # The days an episode may start on: in each market, those a whole episode fits after.
        offsets = np.cumsum([0] + [m.num_days for m in segments])
        as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=self.device)  # noqa: E731
        self._starts = as_t(
            np.concatenate(
                [
                    np.arange(o, o + m.num_days - length)
                    for o, m in zip(offsets[:-1], segments, strict=True)
                ]
            )
        ).to(dtype)
        self.prices = as_t(np.concatenate([m.close for m in segments])).to(dtype)  # (T, S)
        # Per day, everything of the observation that does not depend on the account.
        self._market_obs = as_t(
            np.concatenate([market_features(m, turbulence, momentum) for m in segments])
        ).to(torch.float32)
        # The observation's blocks (docs/trading.md): (columns, whether per stock). Per
        # column: the stock it describes (-1: none) and the distance to the next stock's
        # column of its block, so a stock order maps every column at once.
        stock_of, stride = [], []
        for _, width, per_stock in observation_blocks(turbulence, momentum):
            n = width * s if per_stock else width
            stock_of += [c // width if per_stock else -1 for c in range(n)]
            stride += [width if per_stock else 0] * n
        obs_dim = len(stock_of)
        self._obs_stock = torch.tensor(stock_of, device=self.device)
        self._obs_stride = torch.tensor(stride, device=self.device)
        self._obs_columns = torch.arange(obs_dim, device=self.device)
        self.single_observation_space = gym.spaces.Box(
            -np.inf, np.inf, shape=(obs_dim,), dtype=np.float32
        )
        action_dim = s + 1 if action_mode == "weights" else s
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, shape=(action_dim,), dtype=np.float32)

    # -- the account ---------------------------------------------------------------------------
    def holdings(self, state: torch.Tensor) -> torch.Tensor:
        return state[..., 2 : 2 + self.num_stocks]

    def price(self, state: torch.Tensor) -> torch.Tensor:
        """The close of each stock on the state's day, (..., S)."""
        return self.prices[state[..., 1].long()]

    def account_value(self, state: torch.Tensor) -> torch.Tensor:
        """Cash plus holdings at the state's day's close, (...)."""
        return state[..., 0] + (self.holdings(state) * self.price(state)).sum(-1)

    def stock_order(self, state: torch.Tensor) -> torch.Tensor:
        """(..., S): the data's stock shown in each slot of the observation and action."""
        return state[..., self._order : self._order + self.num_stocks].long()

    # -- the functional env --------------------------------------------------------------------
    def init(self, u: torch.Tensor) -> torch.Tensor:
        lead = u.shape[:-1]
        state = torch.zeros(*lead, self.state_dim, device=self.device, dtype=self.dtype)
        state[..., 0] = self.initial_amount
        if self.random_start and len(self._starts) > 1:
            k = len(self._starts)
            pick = (u[..., 0] * k).long().clamp(max=k - 1)
            state[..., 1] = self._starts[pick]
        if self.shuffle:
            order = u[..., 1 : 1 + self.num_stocks].argsort(-1)
            state[..., self._order : self._order + self.num_stocks] = order.to(self.dtype)
        return state

    def step(
        self, state: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.num_stocks
        balance, day = state[..., 0], state[..., 1]
        holdings = self.holdings(state)
        price = self.price(state)
        value_before = balance + (holdings * price).sum(-1)
        action = action.to(self.dtype).clamp(-1.0, 1.0)
        if self.shuffle:  # the per-stock entries back in the data's order
            first = 1 if self.action_mode == "weights" else 0
            per_stock = action[..., first:]
            ordered = torch.zeros_like(per_stock).scatter(-1, self.stock_order(state), per_stock)
            action = torch.cat([action[..., :first], ordered], dim=-1)
        if self.action_mode == "weights":
            shares = self._rebalance_shares(action, holdings, price, value_before)
        else:
            shares = (action * self.hmax).trunc()
        sold = torch.minimum(-shares.clamp(max=0.0), holdings)
        balance = balance + (sold * price).sum(-1) * (1.0 - self.transaction_cost)
        holdings = holdings - sold

        bought = shares.clamp(min=0.0)
        buy_factor = 1.0 + self.transaction_cost
        cost = (bought * price).sum(-1) * buy_factor
        # Not enough cash for every buy: scale them all down, whole shares only (FinRL fills the
        # largest first, one stock at a time; scaling is the batched form that never overdraws).
        short = cost > balance
        scale = torch.where(short, balance / cost.clamp(min=1e-12), 1.0)
        bought = torch.where(short.unsqueeze(-1), (bought * scale.unsqueeze(-1)).floor(), bought)
        cost = (bought * price).sum(-1) * buy_factor
        balance = balance - cost
        holdings = holdings + bought

        day = day + 1.0
        value_after = balance + (holdings * self.prices[day.long()]).sum(-1)
        gain = value_after - value_before
        parts = [balance.unsqueeze(-1), day.unsqueeze(-1), holdings, state[..., 2 + s :]]
        new = torch.cat(parts, dim=-1)
        if self.score == "sharpe":  # the episode's Sharpe ratio is kept only when asked for
            r = gain / value_before
            sums = state[..., self._sums :] + torch.stack([r, r * r], dim=-1)
            new = torch.cat([new[..., : self._sums], sums], dim=-1)
        if self.risk_aversion:  # (x - λ/2 x²) times the value before, x = gain / value before
            gain = gain - 0.5 * self.risk_aversion * gain * gain / value_before
        reward = gain * self.reward_scaling
        return new, reward, torch.zeros_like(reward, dtype=torch.bool)

    def episode_score(self, state: torch.Tensor, length: torch.Tensor) -> torch.Tensor | None:
        """The episode's Sharpe ratio (``score="sharpe"``) from its sums of daily returns."""
        if self.score != "sharpe":
            return None
        n = length.to(self.dtype)  # days so far, this step's included
        total, squares = state[..., self._sums], state[..., self._sums + 1]
        mean = total / n
        var = (squares - n * mean * mean).clamp(min=0.0) / (n - 1).clamp(min=1.0)
        std = var.sqrt()
        return torch.where(std > 0, mean / std.clamp(min=1e-300) * TRADING_DAYS_PER_YEAR**0.5, 0.0)

    def _rebalance_shares(
        self, action: torch.Tensor, holdings: torch.Tensor, price: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Whole shares to trade (negative sells) toward the target weights of
        ``action_mode="weights"`` (docs/trading.md)."""
        u = (action + 1.0) * 0.5
        invested, split = u[..., :1], u[..., 1:]
        total = split.sum(-1, keepdim=True)
        split = torch.where(total > 0, split / total.clamp(min=1e-12), 1.0 / self.num_stocks)
        weights = invested * split
        # Buys pay the cost on top of the price: aim so the bought shares and their cost fit.
        buy_factor = 1.0 + self.transaction_cost
        target = (weights * value.unsqueeze(-1) / (price * buy_factor)).floor()
        delta = target - holdings
        small = (delta.abs() * price) < self.rebalance_band * value.unsqueeze(-1)
        return torch.where(small, 0.0, delta)

    def observe(self, state: torch.Tensor) -> torch.Tensor:
        s = self.num_stocks
        day = state[..., 1].long()
        market = self._market_obs[day]
        price = self.prices[day]
        holdings = self.holdings(state)
        if self.action_mode == "weights":
            # Cash and holdings as fractions of the account: the current weights, on the same
            # scale however much the account has grown.
            scale = 1.0 / (state[..., :1] + (holdings * price).sum(-1, keepdim=True))
        else:
            scale = torch.full_like(state[..., :1], 1.0 / self.initial_amount)
        obs = torch.cat(
            [
                (state[..., :1] * scale).float(),
                market[..., :s],
                (holdings * price * scale).float(),
                market[..., s:],
            ],
            dim=-1,
        )
        if not self.shuffle:
            return obs
        # Slot j of every per-stock block shows the data's stock order[j].
        lead = state.shape[:-1]
        stock = self._obs_stock.clamp(min=0).expand(*lead, -1)
        shown = self.stock_order(state).gather(-1, stock)
        shift = (shown - self._obs_stock) * self._obs_stride * (self._obs_stock >= 0)
        return obs.gather(-1, self._obs_columns + shift)


class StockTradingEnv(TorchVecEnv):
    """StockTrading-v0's vector env (``StockTrading``'s arguments pass through)."""

    functional = StockTrading
    fn: StockTrading

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float64,
        seed: int | None = None,
        check_actions: bool = True,
        **market: Any,
    ):
        """``market``: ``StockTrading``'s arguments (docs/trading.md)."""
        super().__init__(num_envs, device, dtype, None, seed, check_actions, **market)

    @property
    def balance(self) -> torch.Tensor:
        return self.state[:, 0]

    @property
    def day(self) -> torch.Tensor:
        return self.state[:, 1]

    @property
    def holdings(self) -> torch.Tensor:
        return self.fn.holdings(self.state)

    def account_value(self, state: torch.Tensor | None = None) -> torch.Tensor:
        """Cash plus holdings at the current day's close, per sub-environment."""
        return self.fn.account_value(self.state if state is None else state)

    @property
    def last_account_value(self) -> torch.Tensor:
        """Account value (cash + holdings at close) after the last step, before any
        autoreset: the series a backtest records."""
        return self.fn.account_value(self.final_state)
