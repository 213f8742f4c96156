"""StockTrading-v0: FinRL's multi-stock trading task, torch-batched.

Each sub-environment is one trading account over one market (``services.pod.trading.market``). Every
step is one trading day:

* Action (``action_mode="shares"``, FinRL's): one value in [-1, 1] per stock, times ``hmax``
  (FinRL's max shares per trade) and truncated toward zero to whole shares: negative sells, positive
  buys, |a| < 1/hmax holds. ``action_mode="weights"`` (FinRL's portfolio-allocation form,
  independent of price levels): S + 1 values in [-1, 1]; the first sets the invested fraction ``f =
  (a_0 + 1) / 2`` (the rest is cash), the others the split between stocks, ``u_s = (a_s + 1) / 2``
  normalised to sum to 1 (equal when all are -1). Target weights ``f * u_s / sum(u)``: all +1 is
  equal weight fully invested, ``a_0 = -1`` all cash. The env trades whole shares toward the target,
  paying the same costs as below, and skips a stock's trade when it is smaller than
  ``rebalance_band`` of the account (churn that would only pay costs).
* Sells first, at the day's close: never more than held (no shorting); the account receives
  ``shares * close * (1 - transaction_cost)``.
* Then buys, at the same close, each costing ``shares * close * (1 + transaction_cost)``.
  When the cash does not cover every buy, all buys are scaled down by the same factor and
  floored to whole shares (FinRL fills the largest buys first, one stock at a time; scaling is
  the batched equivalent that never overdraws). No leverage: the balance never goes negative.
* The day advances; the reward is the change of the account value (cash + holdings at close)
  from before the trades to the next close, after costs, times ``reward_scaling`` (FinRL's
  1e-4: a 1% move of a 1M account is a reward of 1). With ``risk_aversion`` = λ > 0 the
  day's return ``x`` (that change over the value before) counts as the mean-variance utility
  ``x - λ/2 x²`` instead of ``x``: a return-maximiser stays fully invested whatever the
  volatility, while the Sharpe ratio the strategy is judged by rewards holding less when the
  volatility is high (the best invested fraction under this utility is μ/(λσ²)).

State (row per sub-environment): ``[balance, day, holdings_1..S]`` in float64 by default so cash
arithmetic is exact to the cent. Observation (float32), FinRL's layout scaled so PPO sees numbers of
order one: ``[balance / initial_amount, close / its 30-day mean (S), holdings * close /
initial_amount (S) (with ``action_mode="weights"``: both divided by the account value instead, the
current weights), indicators (S x 4: macd / close, rsi / 100, cci / 100, dx / 100)]``, plus with
``turbulence=True`` two market-wide risk entries: ``log1p(turbulence / S)`` (FinRL's turbulence
index, ``services.pod.trading.market``) and the equal-weight index's realised volatility over the
last 20 days, annualised (the role of FinRL's VIX option), and with ``momentum=True`` each stock's
trailing log-returns over a quarter, half a year and a year (S x 3,
``services.pod.trading.market.MOMENTUM_WINDOWS``): the 30-day indicators are mostly noise against a
trend that lasts years. Every market feature of day t is computed from days <= t only (the momentum
of a period's first days reads the days before it, as the indicators do).

Stock order (``shuffle_stocks=True``, train mode only): each training episode shows the stocks
in an order of its own, drawn at its reset (kept in the state after the holdings), and reads
the action's per-stock entries in that order. Five stocks over a few years are a handful of
trends: a policy that sees them always in the same slots can learn "slot 3 rises" from the
train period, which says nothing about the backtest; shuffled, only what the features say of
a stock is worth learning. Validation and backtest episodes keep the data's order.

Episodes: in ``mode="train"`` an episode is ``episode_length`` days (default 252, one trading
year, at most the whole train period) from a start day drawn uniformly from the env's
generator (``random_start=False``: day 0); in ``mode="validation"`` and ``mode="backtest"``
it is one pass over the whole period from its first day. The end of an episode is a
truncation (the market goes on); nothing terminates.

Market data: the synthetic market (``market_seed``, ``num_stocks``, ``num_days``, ``regime``) or the
user's file (``csv_path``, columns in ``services.pod.trading.market``), split by ``split_date``
(default: the date 80% of the way through) into the train and backtest periods. With
``validation_fraction`` > 0 (or a ``validation_date``) the last days before the split are the
validation period instead of training data: what selects agents and snapshots (the tournament's
score, early stopping) reads it, and the backtest period is read by nothing but the final report.

Score (``score="sharpe"``): each finished episode also reports its Sharpe ratio as
``info["episode_score"]``, ``mean(r) / std(r, ddof=1) * sqrt(252)`` over the episode's daily returns
``r`` of the account value (0 where they do not vary, e.g. all cash), the metric of
``services.pod.trading.backtest``; evaluators rank by it instead of the return. With the evaluation
env's ``mode="validation"`` (the spec's ``evaluation.env_kwargs``) a tournament ranks pods by their
Sharpe ratio on the validation period, as bench/stock_trading_tournament.py does in one process.

Simulated history (``simulated_markets`` = N > 0, synthetic markets only, train mode): one
market's train period is a few years, a handful of trends and crashes to learn from. With N
the training episodes also start in the train periods of N other markets of the same regime
(``synthetic_market(..., replica=k)``, cut at the same dates), each episode inside one market:
the regime's simulator as training data, as FinRL-Meta's market environments are. Validation
and backtest are the market's own periods, which no replica is.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import Info, TorchVecEnv
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
    """``data`` cut in time: ``train``, then (when asked for) ``validation``, then
    ``backtest`` from ``split_date`` (default: 80% of the way through). The validation period is
    ``validation_date`` .. the split, or the ``validation_fraction`` of all days just before the
    split."""
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
    """The train periods of ``count`` replicas of the synthetic market (module docstring,
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
    """The observation's blocks in order (module docstring): name, columns per entry, and
    whether there is an entry per stock (then stock 0's columns come first, then stock 1's)."""
    blocks = [("cash", 1, False), ("close", 1, True), ("weights", 1, True)]
    blocks += [("indicators", len(INDICATORS), True)]
    blocks += [("turbulence", 2, False)] * turbulence
    blocks += [("momentum", len(MOMENTUM_WINDOWS), True)] * momentum
    return blocks


def market_features(data: MarketData, turbulence: bool, momentum: bool) -> np.ndarray:
    """(T, D): per day, the observation's market columns (module docstring), in its order."""
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
    ):
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
            # One set of market settings for both cuts, by keyword: the two functions order
            # their parameters differently.
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
                data = [
                    data,
                    *simulated_train_periods(simulated_markets, **market),
                ]
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
        self._shuffle = mode == "train" and shuffle_stocks
        # [balance, day, holdings (S)] and, shuffling, the episode's stock order (S).
        self.state_dim = 2 + s + s * int(self._shuffle)
        last_day = min(m.num_days for m in segments) - 1  # the last day an episode can reach
        if mode != "train" or episode_length is None:
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
        self.action_mode = action_mode
        self.rebalance_band = float(rebalance_band)
        self.risk_aversion = float(risk_aversion)
        self.random_start = mode == "train" and random_start
        # The days an episode may start on: in each market, those a whole episode fits after.
        offsets = np.cumsum([0] + [m.num_days for m in segments])
        self._starts = torch.as_tensor(
            np.concatenate(
                [
                    np.arange(o, o + m.num_days - length)
                    for o, m in zip(offsets[:-1], segments, strict=True)
                ]
            ),
            device=self.device,
        ).to(dtype)

        as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=self.device)  # noqa: E731
        self.prices = as_t(np.concatenate([m.close for m in segments])).to(dtype)  # (T, S)
        # Per day, everything of the observation that does not depend on the account.
        self._market_obs = as_t(
            np.concatenate([market_features(m, turbulence, momentum) for m in segments])
        ).to(torch.float32)
        # The observation's blocks (module docstring): (columns, whether per stock). Per
        # column: the stock it describes (-1: none) and the distance to the next stock's
        # column of its block, so a stock order maps every column at once.
        stock_of, stride = [], []
        for _, width, per_stock in observation_blocks(turbulence, momentum):
            n = width * s if per_stock else width
            stock_of += [c // width if per_stock else -1 for c in range(n)]
            stride += [width if per_stock else 0] * n
        obs_dim = len(stock_of)
        if self._shuffle:
            self._obs_stock = torch.tensor(stock_of, device=self.device)
            self._obs_stride = torch.tensor(stride, device=self.device)
            self._obs_columns = torch.arange(obs_dim, device=self.device)
        self.single_observation_space = gym.spaces.Box(
            -np.inf, np.inf, shape=(obs_dim,), dtype=np.float32
        )
        action_dim = s + 1 if action_mode == "weights" else s
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, shape=(action_dim,), dtype=np.float32)
        self._sell_factor = self._const(1.0 - self.transaction_cost)
        self._buy_factor = self._const(1.0 + self.transaction_cost)
        self._hmax = self._const(float(self.hmax))
        self._one_day = self._const(1.0)
        #: Account value (cash + holdings at close) after the last step, before any autoreset:
        #: the series a backtest records. A new tensor every step.
        self.last_account_value = torch.full(
            (num_envs,), self.initial_amount, device=self.device, dtype=dtype
        )
        #: Per sub-environment, the running episode's sums of daily returns and of their
        #: squares (``score="sharpe"``); the day's return of the last step.
        self.score = score
        self._return_sums = torch.zeros(num_envs, 2, device=self.device, dtype=dtype)
        self._day_return = torch.zeros(num_envs, device=self.device, dtype=dtype)

    @property
    def balance(self) -> torch.Tensor:
        return self.columns[0]

    @property
    def day(self) -> torch.Tensor:
        return self.columns[1]

    @property
    def holdings(self) -> torch.Tensor:
        return self._holdings(self.state)

    def _holdings(self, state: torch.Tensor) -> torch.Tensor:
        return state[:, 2 : 2 + self.num_stocks]

    def account_value(self, state: torch.Tensor | None = None) -> torch.Tensor:
        """Cash plus holdings at the current day's close, per sub-environment."""
        state = self.state if state is None else state
        price = self.prices.index_select(0, state[:, 1].long())
        return state[:, 0] + (self._holdings(state) * price).sum(1)

    def _initial_state(self, n: int) -> torch.Tensor:
        state = torch.zeros(n, self.state_dim, device=self.device, dtype=self.dtype)
        state[:, 0] = self.initial_amount
        if self.random_start and len(self._starts) > 1:
            draws = torch.randint(
                0, len(self._starts), (n,), generator=self.generator, device=self.device
            )
            state[:, 1] = self._starts[draws]
        if self._shuffle:
            draws = torch.rand(n, self.num_stocks, generator=self.generator, device=self.device)
            state[:, 2 + self.num_stocks :] = draws.argsort(1).to(self.dtype)
        return state

    def _stock_order(self, state: torch.Tensor) -> torch.Tensor:
        """(n, S): the data's stock shown in each slot of the observation and action."""
        return state[:, 2 + self.num_stocks :].long()

    def _unshuffle_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """The action with its per-stock entries put back in the data's order."""
        first = 1 if self.action_mode == "weights" else 0
        per_stock = actions[:, first:]
        ordered = torch.empty_like(per_stock).scatter_(1, self._stock_order(self.state), per_stock)
        return torch.cat([actions[:, :first], ordered], dim=1)

    def _physics_step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        balance, day = self.balance, self.day
        holdings = self.holdings
        price = self.prices.index_select(0, day.long())
        value_before = balance + (holdings * price).sum(1)
        if self._shuffle:
            actions = self._unshuffle_actions(actions)

        if self.action_mode == "weights":
            shares = self._rebalance_shares(actions, holdings, price, value_before)
        else:
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
        gain = value_after - value_before
        if self.score == "sharpe":  # the episode's Sharpe ratio is kept only when asked for
            self._day_return = gain / value_before
        if self.risk_aversion:  # (x - λ/2 x²) times the value before, x = gain / value before
            gain = gain - 0.5 * self.risk_aversion * gain * gain / value_before
        reward = gain * self.reward_scaling
        return reward, torch.zeros(self.num_envs, device=self.device, dtype=torch.bool)

    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, Info]:
        self._return_sums.zero_()
        return super().reset(seed)

    def _advance(
        self, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Info]:
        out = super()._advance(actions)
        if self.score == "sharpe":
            done, info = out[4], out[5]
            r = self._day_return
            self._return_sums += torch.stack([r, r * r], dim=1)
            if self._host_reads_free and not bool(done.any()):
                # No episode ended: nothing to score (the ratio of every step is most of the
                # per-step cost of a one-account evaluation).
                info["episode_score"] = torch.zeros_like(r)
                return out
            n = self._episode_length.to(self.dtype)  # days so far, this step's included
            total, squares = self._return_sums.unbind(1)
            mean = total / n
            var = (squares - n * mean * mean).clamp(min=0.0) / (n - 1).clamp(min=1.0)
            std = var.sqrt()
            sharpe = torch.where(
                std > 0, mean / std.clamp(min=1e-300) * TRADING_DAYS_PER_YEAR**0.5, 0.0
            )
            info["episode_score"] = sharpe * done
            self._return_sums.masked_fill_(done.unsqueeze(1), 0.0)
        return out

    def _rebalance_shares(
        self,
        actions: torch.Tensor,
        holdings: torch.Tensor,
        price: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        """Whole shares to trade (negative sells) toward the target weights of
        ``action_mode="weights"`` (module docstring)."""
        u = (actions.to(self.dtype).clamp(-1.0, 1.0) + 1.0) * 0.5
        invested, split = u[:, :1], u[:, 1:]
        total = split.sum(1, keepdim=True)
        split = torch.where(total > 0, split / total.clamp(min=1e-12), 1.0 / self.num_stocks)
        weights = invested * split
        # Buys pay the cost on top of the price: aim so the bought shares and their cost fit.
        target = (weights * value.unsqueeze(1) / (price * self._buy_factor)).floor()
        delta = target - holdings
        small = (delta.abs() * price) < self.rebalance_band * value.unsqueeze(1)
        return torch.where(small, 0.0, delta)

    def _observe(self, state: torch.Tensor) -> torch.Tensor:
        market = self._market_obs.index_select(0, state[:, 1].long())
        price = self.prices.index_select(0, state[:, 1].long())
        holdings = self._holdings(state)
        scale: torch.Tensor | float = 1.0 / self.initial_amount
        if self.action_mode == "weights":
            # Cash and holdings as fractions of the account: the current weights, on the same
            # scale however much the account has grown.
            scale = 1.0 / (state[:, :1] + (holdings * price).sum(1, keepdim=True))
        obs = torch.cat(
            [
                (state[:, :1] * scale).float(),
                market[:, : self.num_stocks],
                (holdings * price * scale).float(),
                market[:, self.num_stocks :],
            ],
            dim=1,
        )
        if not self._shuffle:
            return obs
        # Slot j of every per-stock block shows the data's stock order[j].
        stock = self._obs_stock.clamp(min=0).expand(len(state), -1)
        shown = self._stock_order(state).gather(1, stock)
        shift = (shown - self._obs_stock) * self._obs_stride * (self._obs_stock >= 0)
        return obs.gather(1, self._obs_columns + shift)
