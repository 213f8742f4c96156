"""StockTrading-v0: FinRL's multi-stock trading task, torch-batched.

Each sub-environment is one trading account over one market (``services.pod.envs.market``).
Every step is one trading day:

* Action: one value in [-1, 1] per stock, times ``hmax`` (FinRL's max shares per trade) and
  truncated toward zero to whole shares: negative sells, positive buys, |a| < 1/hmax holds.
* Sells first, at the day's close: never more than held (no shorting); the account receives
  ``shares * close * (1 - transaction_cost)``.
* Then buys, at the same close, each costing ``shares * close * (1 + transaction_cost)``.
  When the cash does not cover every buy, all buys are scaled down by the same factor and
  floored to whole shares (FinRL fills the largest buys first, one stock at a time; scaling is
  the batched equivalent that never overdraws). No leverage: the balance never goes negative.
* The day advances; the reward is the change of the account value (cash + holdings at close)
  from before the trades to the next close, after costs, times ``reward_scaling`` (FinRL's
  1e-4: a 1% move of a 1M account is a reward of 1).

State (row per sub-environment): ``[balance, day, holdings_1..S]`` in float64 by default so
cash arithmetic is exact to the cent. Observation (float32), FinRL's layout scaled so PPO
sees numbers of order one: ``[balance / initial_amount, close / its 30-day mean (S),
holdings * close / initial_amount (S), indicators (S x 4: macd / close, rsi / 100,
cci / 100, dx / 100)]``.

Episodes: in ``mode="train"`` an episode is ``episode_length`` days (default 252, one trading
year, at most the whole train period) from a start day drawn uniformly from the env's
generator (``random_start=False``: day 0); in ``mode="backtest"`` it is one pass over the
whole held-out period from its first day. The end of an episode is a truncation (the market
goes on); nothing terminates.

Market data: the synthetic market (``market_seed``, ``num_stocks``, ``num_days``) or the
user's file (``csv_path``, columns in ``services.pod.envs.market``), split by ``split_date``
(default: the date 80% of the way through) into the train and backtest periods.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import TorchVecEnv
from services.pod.envs.market import (
    INDICATORS,
    MarketData,
    load_csv,
    rolling_mean,
    synthetic_market,
)

Mode = Literal["train", "backtest"]


def market_periods(
    market_seed: int = 0,
    num_stocks: int = 5,
    num_days: int = 2520,
    csv_path: str | None = None,
    split_date: str | None = None,
) -> tuple[MarketData, MarketData]:
    """(train, backtest) periods of the market the env's keyword arguments describe."""
    data = (
        load_csv(csv_path)
        if csv_path is not None
        else _synthetic(market_seed, num_stocks, num_days)
    )
    return data.split(split_date if split_date is not None else data.default_split_date())


@lru_cache(maxsize=8)
def _synthetic(seed: int, num_stocks: int, num_days: int) -> MarketData:
    """Shared between the envs of a process (train, eval, backtest): read-only."""
    return synthetic_market(seed, num_stocks, num_days)


class StockTradingEnv(TorchVecEnv):
    spec_id = "StockTrading-v0"

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float64,
        seed: int | None = None,
        check_actions: bool = True,
        mode: Mode = "train",
        market_seed: int = 0,
        num_stocks: int = 5,
        num_days: int = 2520,
        csv_path: str | None = None,
        split_date: str | None = None,
        data: MarketData | None = None,
        initial_amount: float = 1_000_000.0,
        hmax: int = 1000,
        transaction_cost: float = 0.001,
        reward_scaling: float = 1e-4,
        episode_length: int | None = 252,
        random_start: bool = True,
    ):
        if mode not in ("train", "backtest"):
            raise ValueError(f"mode must be 'train' or 'backtest', got {mode!r}")
        if data is None:
            train, backtest = market_periods(
                market_seed, num_stocks, num_days, csv_path, split_date
            )
            data = train if mode == "train" else backtest
        if initial_amount <= 0 or hmax < 1 or not 0 <= transaction_cost < 1:
            raise ValueError(
                "need initial_amount > 0, hmax >= 1 and 0 <= transaction_cost < 1, got "
                f"{initial_amount}, {hmax}, {transaction_cost}"
            )
        self.data = data
        self.num_stocks = s = data.num_stocks
        self.state_dim = 2 + s
        last_day = data.num_days - 1  # the last day an episode can reach
        if mode == "backtest" or episode_length is None:
            length = last_day
        else:
            if episode_length < 1:
                raise ValueError(f"episode_length must be >= 1, got {episode_length}")
            length = min(int(episode_length), last_day)
        super().__init__(num_envs, device, dtype, length, seed, check_actions)
        self.mode = mode
        self.initial_amount = float(initial_amount)
        self.hmax = int(hmax)
        self.transaction_cost = float(transaction_cost)
        self.reward_scaling = float(reward_scaling)
        self.random_start = mode == "train" and random_start
        self._last_start = last_day - length  # starts in [0, _last_start]

        as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=self.device)  # noqa: E731
        self.prices = as_t(data.close).to(dtype)  # (T, S) closes
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
        # Per day, everything of the observation that does not depend on the account.
        self._market_obs = as_t(
            np.concatenate([relative, features.reshape(data.num_days, -1)], axis=1)
        ).to(torch.float32)
        obs_dim = 1 + 2 * s + s * len(INDICATORS)
        self.single_observation_space = gym.spaces.Box(
            -np.inf, np.inf, shape=(obs_dim,), dtype=np.float32
        )
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, shape=(s,), dtype=np.float32)
        self._sell_factor = self._const(1.0 - self.transaction_cost)
        self._buy_factor = self._const(1.0 + self.transaction_cost)
        self._hmax = self._const(float(self.hmax))
        self._one_day = self._const(1.0)
        #: Account value (cash + holdings at close) after the last step, before any autoreset:
        #: the series a backtest records. A new tensor every step.
        self.last_account_value = torch.full(
            (num_envs,), self.initial_amount, device=self.device, dtype=dtype
        )

    @property
    def balance(self) -> torch.Tensor:
        return self.columns[0]

    @property
    def day(self) -> torch.Tensor:
        return self.columns[1]

    @property
    def holdings(self) -> torch.Tensor:
        return self.state[:, 2:]

    def account_value(self, state: torch.Tensor | None = None) -> torch.Tensor:
        """Cash plus holdings at the current day's close, per sub-environment."""
        state = self.state if state is None else state
        price = self.prices.index_select(0, state[:, 1].long())
        return state[:, 0] + (state[:, 2:] * price).sum(1)

    def _initial_state(self, n: int) -> torch.Tensor:
        state = torch.zeros(n, self.state_dim, device=self.device, dtype=self.dtype)
        state[:, 0] = self.initial_amount
        if self.random_start and self._last_start > 0:
            state[:, 1] = torch.randint(
                0, self._last_start + 1, (n,), generator=self.generator, device=self.device
            ).to(self.dtype)
        return state

    def _physics_step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        balance, day = self.balance, self.day
        holdings = self.holdings
        price = self.prices.index_select(0, day.long())
        value_before = balance + (holdings * price).sum(1)

        shares = (actions.to(self.dtype).clamp(-1.0, 1.0) * self._hmax).trunc()
        sold = torch.minimum(-shares.clamp(max=0.0), holdings)
        balance.add_((sold * price).sum(1) * self._sell_factor)
        holdings.sub_(sold)

        bought = shares.clamp(min=0.0)
        cost = (bought * price).sum(1) * self._buy_factor
        # Not enough cash for every buy: scale them all down, whole shares only.
        short = cost > balance
        if bool(short.any()) if self._host_reads_free else True:
            scale = torch.where(short, balance / cost.clamp(min=1e-12), 1.0)
            bought = torch.where(short.unsqueeze(1), (bought * scale.unsqueeze(1)).floor(), bought)
            cost = (bought * price).sum(1) * self._buy_factor
        balance.sub_(cost)
        holdings.add_(bought)

        day.add_(self._one_day)
        value_after = balance + (holdings * self.prices.index_select(0, day.long())).sum(1)
        self.last_account_value = value_after
        reward = (value_after - value_before) * self.reward_scaling
        return reward, torch.zeros(self.num_envs, device=self.device, dtype=torch.bool)

    def _observe(self, state: torch.Tensor) -> torch.Tensor:
        market = self._market_obs.index_select(0, state[:, 1].long())
        price = self.prices.index_select(0, state[:, 1].long())
        scale = 1.0 / self.initial_amount
        return torch.cat(
            [
                (state[:, :1] * scale).float(),
                market[:, : self.num_stocks],
                (state[:, 2:] * price * scale).float(),
                market[:, self.num_stocks :],
            ],
            dim=1,
        )
