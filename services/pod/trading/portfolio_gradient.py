"""Portfolio gradient: FinRL's policy gradient over an EIIE policy, for StockTrading-v0's
target-weight actions (``action_mode="weights"``). The account's daily returns are a closed form
of the weights (``net_returns``), so the exact gradient of the train period's Sharpe ratio
replaces PPO's sampled estimate. Here: the per-stock scorer of P agents (``PortfolioPolicy``),
their full-batch Adam (``PortfolioLearner``) and the pod algorithm ``portfolio_gradient``
(trained by portfolio_trainer.py, one agent or a population). Reference: docs/trading.md, "The
portfolio-gradient agent".
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import gymnasium as gym
import torch
from torch import nn

from services.contracts.algorithms.portfolio_gradient.config import PortfolioGradientConfig
from services.pod.algorithms.adam import BatchedAdam
from services.pod.trading.env import ACCOUNT_BLOCKS, market_features, observation_blocks
from services.pod.trading.market import (
    TRADING_DAYS_PER_YEAR,
    MarketData,
)

_ADAM_BETAS, _ADAM_EPS = (0.9, 0.999), 1e-8
#: The invested fraction of a fresh agent, sigmoid(3) = 95%: buy-and-hold's exposure, split
#: equally (the scores start at zero).
_INITIAL_INVESTED_LOGIT = 3.0


@dataclass(frozen=True)
class FeatureLayout:
    """Where the features are in StockTradingEnv's market columns and observation."""

    num_stocks: int
    turbulence: bool
    momentum: bool

    @classmethod
    def of(cls, num_stocks: int, env_kwargs: Mapping[str, object]) -> FeatureLayout:
        if env_kwargs.get("action_mode") != "weights":
            raise ValueError("the portfolio gradient trains target weights: action_mode=weights")
        if env_kwargs.get("shuffle_stocks"):
            raise ValueError("the portfolio gradient's scorer is shared by the stocks already")
        return cls(num_stocks, bool(env_kwargs.get("turbulence")), bool(env_kwargs.get("momentum")))

    @classmethod
    def of_spaces(cls, observation_space: gym.Space, action_space: gym.Space) -> FeatureLayout:
        """The layout of a weights-mode StockTradingEnv with these spaces: its action is the
        invested fraction and one share per stock, and the observation's width tells ``turbulence``
        and ``momentum`` apart (the four widths differ). What rebuilds a trained policy from its
        spaces (services/pod/trading/backtest.py, after the run config's ``action_mode=weights`` is
        checked: a shares-mode env's spaces can read as another weights-mode layout)."""
        (obs_dim,), (act_dim,) = observation_space.shape, action_space.shape  # type: ignore[misc]
        s = act_dim - 1
        for turbulence, momentum in itertools.product((False, True), repeat=2):
            blocks = observation_blocks(turbulence, momentum)
            if s >= 1 and sum(w * (s if per else 1) for _, w, per in blocks) == obs_dim:
                return cls(s, turbulence, momentum)
        raise ValueError(
            f"spaces {observation_space}, {action_space} are not a weights-mode StockTrading-v0's"
        )

    @functools.cached_property  # read on every step of an evaluation
    def per_stock(self) -> int:
        """F: each stock's features."""
        return self._market_width(per_stock=True)

    @functools.cached_property
    def market_wide(self) -> int:
        """G: the market-wide features."""
        return self._market_width(per_stock=False)

    def _market_width(self, per_stock: bool) -> int:
        blocks = observation_blocks(self.turbulence, self.momentum)
        return sum(w for name, w, per in blocks if per == per_stock and name not in ACCOUNT_BLOCKS)

    @functools.cached_property
    def _market_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._columns(account=False)

    @functools.cached_property
    def _observation_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._columns(account=True)

    def _columns(self, account: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the per-stock features (S, F) and the market-wide ones (G,) sit among the
        observation's columns (``account``) or the market's (``market_features``: the same
        without the account's blocks), read off the env's ``observation_blocks``."""
        s = self.num_stocks
        stock: list[list[int]] = [[] for _ in range(s)]
        market: list[int] = []
        at = 0
        for name, width, per_stock in observation_blocks(self.turbulence, self.momentum):
            if name in ACCOUNT_BLOCKS and not account:
                continue
            if name not in ACCOUNT_BLOCKS and per_stock:
                for j, features in enumerate(stock):
                    features.extend(range(at + j * width, at + (j + 1) * width))
            elif name not in ACCOUNT_BLOCKS:
                market.extend(range(at, at + width))
            at += width * s if per_stock else width
        return torch.tensor(stock, dtype=torch.long), torch.tensor(market, dtype=torch.long)

    def split(self, market: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Market columns (..., D) -> per-stock features (..., S, F) and market-wide (..., G)."""
        stock, wide = self._market_columns
        return market[..., stock], market[..., wide]

    def observed(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """StockTradingEnv's observations (..., D) -> the same features as ``split``'s."""
        stock, wide = self._observation_columns
        return obs[..., stock], obs[..., wide]


@dataclass
class PeriodData:
    """One period as the gradient reads it: features (T, S, F) and (T, G), closes (T, S)."""

    stock: torch.Tensor
    market: torch.Tensor
    close: torch.Tensor

    @classmethod
    def of(cls, data: MarketData, layout: FeatureLayout) -> PeriodData:
        columns = market_features(data, layout.turbulence, layout.momentum)
        stock, market = layout.split(torch.as_tensor(columns, dtype=torch.float64))
        return cls(stock, market, torch.as_tensor(data.close, dtype=torch.float64))


class PortfolioPolicy(nn.Module):
    """P agents' (or one agent's) parameters ``params`` (P, F + G + 1): the stock scorer's F
    weights, then the invested fraction's G weights and bias; and the train period's feature
    statistics. All buffers, not ``nn.Parameter``: the portfolio gradient steps them with its
    own Adam (``BatchedAdam``), and a checkpoint's ``actor.safetensors`` is this state."""

    params: torch.Tensor
    stock_mean: torch.Tensor
    stock_std: torch.Tensor
    market_mean: torch.Tensor
    market_std: torch.Tensor

    def __init__(self, layout: FeatureLayout, agents: int = 1) -> None:
        super().__init__()
        self.layout = layout
        f, g = layout.per_stock, layout.market_wide
        params = torch.zeros(agents, f + g + 1, dtype=torch.float64)
        params[:, -1] = _INITIAL_INVESTED_LOGIT
        self.register_buffer("params", params)
        self.register_buffer("stock_mean", torch.zeros(f, dtype=torch.float64))
        self.register_buffer("stock_std", torch.ones(f, dtype=torch.float64))
        self.register_buffer("market_mean", torch.zeros(g, dtype=torch.float64))
        self.register_buffer("market_std", torch.ones(g, dtype=torch.float64))

    def fit_statistics(self, data: PeriodData) -> None:
        """Read the features' scale off ``data`` (the train period)."""
        flat = data.stock.reshape(-1, self.layout.per_stock)
        self.stock_mean.copy_(flat.mean(0))
        self.stock_std.copy_(flat.std(0).clamp_min(1e-8))
        if self.layout.market_wide:
            self.market_mean.copy_(data.market.mean(0))
            self.market_std.copy_(data.market.std(0).clamp_min(1e-8))

    def normalize(
        self, stock: torch.Tensor, market: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw features (T, S, F), (T, G) on the scale the parameters read."""
        x = (stock - self.stock_mean) / self.stock_std
        return x, (market - self.market_mean) / self.market_std

    def weights(
        self, x: torch.Tensor, g: torch.Tensor, params: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each agent's target weights (P, T, S) for normalised features (T, S, F), (T, G) that
        every agent reads, or (P, T, S, F), (P, T, G): each agent its own rows; with ``params``
        (P, F + G + 1) instead of the policy's own (to differentiate)."""
        p = self.params if params is None else params
        f = self.layout.per_stock
        scores = (x * p[:, None, None, :f]).sum(-1)
        invested = torch.sigmoid((g * p[:, None, f:-1]).sum(-1) + p[:, -1:])
        return invested.unsqueeze(-1) * torch.softmax(scores, -1)

    def agent(self, i: int) -> PortfolioPolicy:
        """Agent ``i`` alone (a copy)."""
        alone = PortfolioPolicy(self.layout).to(self.params.device)
        alone.load_state_dict({**self.state_dict(), "params": self.params[i : i + 1]})
        return alone

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> torch.Tensor:
        """StockTradingEnv's action (weights mode) for observations (N, D), agent i acting on
        the i-th equal slice of the rows (one agent: all of them): the invested fraction ``f``
        as ``2f - 1``, each stock's share ``u`` of it as ``2u - 1``."""
        mine = obs.double().reshape(len(self.params), -1, obs.shape[-1])  # (P, N / P, D)
        stock, market = self.layout.observed(mine)
        w = self.weights(*self.normalize(stock, market)).reshape(len(obs), -1)
        invested = w.sum(-1, keepdim=True)
        return torch.cat([2 * invested - 1, 2 * w / invested - 1], -1).float()

    #: The name evaluators call (services/pod/algorithms/policies.py): this policy is deterministic.
    act_deterministic = act


class PortfolioLearner:
    """Full-batch Adam on the train period's Sharpe (minus an L2 penalty on the scorer's
    weights) for every agent of ``policy``, each its own learning rate and L2 (P,)."""

    def __init__(
        self,
        policy: PortfolioPolicy,
        train: PeriodData,
        cost: float,
        lr: torch.Tensor,
        l2: torch.Tensor,
    ) -> None:
        self.policy, self.train, self.cost, self.l2 = policy, train, cost, l2
        # Updates the policy's params in place; holds ``lr`` by reference.
        self.adam = BatchedAdam(policy.params, lr, betas=_ADAM_BETAS, eps=_ADAM_EPS)
        self.features_changed()

    @classmethod
    def of(
        cls,
        policy: PortfolioPolicy,
        train: PeriodData,
        cost: float,
        agents: Sequence[PortfolioGradientConfig],
    ) -> PortfolioLearner:
        """The learner of ``policy``'s agents, agent i with ``agents[i]``'s hyperparameters."""

        def column(name: str) -> torch.Tensor:
            values = [getattr(a, name) for a in agents]
            return torch.tensor(values, dtype=torch.float64, device=policy.params.device)

        return cls(policy, train, cost, column("learning_rate"), column("l2"))

    def features_changed(self) -> None:
        """The policy's feature statistics changed (fitted, or loaded): normalise once, not on
        every step, since the train period does not change."""
        self.x, self.g = self.policy.normalize(self.train.stock, self.train.market)

    def step(self) -> torch.Tensor:
        """One Adam step; returns each agent's train Sharpe before it."""
        params = self.policy.params.detach().requires_grad_(True)
        returns = net_returns(
            self.policy.weights(self.x, self.g, params), self.train.close, self.cost
        )
        train_sharpe = sharpe(returns)
        penalty = self.l2 * params[:, : self.policy.layout.per_stock].square().sum(-1)
        (grad,) = torch.autograd.grad((penalty - train_sharpe).sum(), params)
        self.adam.step(grad)
        return train_sharpe.detach()


def net_returns(weights: torch.Tensor, close: torch.Tensor, cost: float) -> torch.Tensor:
    """Daily returns (P, T - 1) of accounts that hold ``weights`` (P, T, S) from each close
    to the next, paying ``cost`` on every change of weight (the first day's from cash)."""
    held = weights[:, :-1]
    gross = (held * (close[1:] / close[:-1] - 1)).sum(-1)
    turnover = torch.cat([held[:, :1], held[:, 1:] - held[:, :-1]], 1).abs().sum(-1)
    return gross - cost * turnover


def sharpe(returns: torch.Tensor) -> torch.Tensor:
    """Annualised Sharpe ratio of each row of daily returns (services.pod.trading.backtest's)."""
    return returns.mean(-1) / returns.std(-1).clamp_min(1e-12) * math.sqrt(TRADING_DAYS_PER_YEAR)


class PortfolioGradient:
    """What the registry finds under ``portfolio_gradient`` (services/pod/training/trainer.py's
    ``Algorithm``): one agent per pod, trained by services/pod/trading/portfolio_trainer.py.
    Built from a weights-mode StockTrading-v0's spaces, ``policy`` is the agent that acts (a
    backtest loads its ``actor.safetensors`` into it, services/pod/trading/backtest.py)."""

    name: ClassVar[str] = "portfolio_gradient"

    def __init__(
        self, observation_space: gym.Space, action_space: gym.Space, config: PortfolioGradientConfig
    ) -> None:
        self.config = config
        self.policy = PortfolioPolicy(FeatureLayout.of_spaces(observation_space, action_space))
