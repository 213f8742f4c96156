"""Portfolio gradient: FinRL's policy gradient over an EIIE policy, for StockTrading-v0's
target-weight actions (``action_mode="weights"``), as a tournament of P agents in one process.

An account that holds the weights ``w_t`` (per stock, the rest cash) from one close to the
next earns a known function of them: ``R_t = w_t · r_t - c |w_t - w_{t-1}|₁``, with ``r_t`` the
stocks' returns to the next close and ``c`` the transaction cost. The market does not depend
on the account (no market impact), so the Sharpe ratio of ``R`` over a whole period is a
differentiable function of the policy's parameters, and its exact gradient over the whole
train period replaces PPO's estimate from sampled actions (Jiang, Xu & Liang 2017, "A Deep
Reinforcement Learning Framework for the Financial Portfolio Management Problem"; FinRL's
``portfolio_optimization`` PolicyGradient). On the synthetic trend markets PPO's estimate,
through actions of std 0.6, does not find the per-stock momentum that a fixed rule profits
from; this gradient does (docs/benchmarks.md, "Session 17").

Policy (EIIE: one scorer shared by every stock): stock s's score is a linear function of its
own features (close / 30-day mean, the four indicators and, with ``momentum``, the three
trailing returns), the split between the stocks is the softmax of the scores, and the invested
fraction a logistic function of the market-wide features (with ``turbulence``: turbulence and
realised volatility). A shared scorer sees every stock-day as a sample of one rule, and cannot
learn "the stock in slot 3 rises" from the train period.

The tournament: P agents (each its own learning rate and L2 penalty) climb their train Sharpe
in lock-step, full-batch Adam, ``round_steps`` steps a round; after each round every agent is
scored by its Sharpe on the validation period (the same closed form, fractional shares), the
best (agent, round) snapshot is kept, and the worst quarter restart from the round's best
with its learning rate times 0.8 or 1.25 (PBT's exploit and explore), as
``services.pod.trading_tournament`` does for PPO. The kept policy acts in StockTradingEnv
(``PortfolioPolicy.act``), where a backtest pays whole shares and the env's costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from services.pod.envs.market import (
    INDICATORS,
    MOMENTUM_WINDOWS,
    TRADING_DAYS_PER_YEAR,
    MarketData,
)
from services.pod.envs.stock_trading import market_features

#: What an agent of the tournament may set (``learning_rate`` required, ``l2`` default 0).
HYPERPARAMETERS = ("learning_rate", "l2")
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

    @property
    def per_stock(self) -> int:
        return 1 + len(INDICATORS) + len(MOMENTUM_WINDOWS) * self.momentum

    @property
    def market_wide(self) -> int:
        return 2 * self.turbulence

    def split(self, market: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Market columns (..., D) -> per-stock features (..., S, F) and market-wide (..., G)."""
        s, k = self.num_stocks, len(INDICATORS)
        lead = market.shape[:-1]
        parts = [market[..., :s].unsqueeze(-1), market[..., s : s + k * s].reshape(*lead, s, k)]
        end = s + k * s + self.market_wide
        if self.momentum:
            parts.append(market[..., end:].reshape(*lead, s, len(MOMENTUM_WINDOWS)))
        return torch.cat(parts, -1), market[..., s + k * s : end]

    def market_of_observation(self, obs: torch.Tensor) -> torch.Tensor:
        """The market columns of StockTradingEnv's observation ``[cash, close / mean (S),
        weights (S), the rest]``: without the account's own entries."""
        s = self.num_stocks
        return torch.cat([obs[..., 1 : 1 + s], obs[..., 1 + 2 * s :]], -1)


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


@dataclass
class PortfolioPolicy:
    """P agents' (or one agent's) parameters ``params`` (P, F + G + 1): the stock scorer's F
    weights, then the invested fraction's G weights and bias; and the train period's feature
    statistics."""

    layout: FeatureLayout
    params: torch.Tensor
    stock_mean: torch.Tensor
    stock_std: torch.Tensor
    market_mean: torch.Tensor
    market_std: torch.Tensor

    @property
    def stock_weights(self) -> torch.Tensor:
        return self.params[:, : self.layout.per_stock]

    def normalize(
        self, stock: torch.Tensor, market: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw features (T, S, F), (T, G) on the scale the parameters read."""
        x = (stock - self.stock_mean) / self.stock_std
        return x, (market - self.market_mean) / self.market_std

    def weights(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Each agent's target weights (P, T, S) for normalised features (T, S, F), (T, G)."""
        f = self.layout.per_stock
        scores = (x * self.params[:, None, None, :f]).sum(-1)
        invested = torch.sigmoid((g * self.params[:, None, f:-1]).sum(-1) + self.params[:, -1:])
        return invested.unsqueeze(-1) * torch.softmax(scores, -1)

    def agent(self, i: int) -> PortfolioPolicy:
        """Agent ``i`` alone (a copy)."""
        return replace(self, params=self.params[i : i + 1].detach().clone())

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> torch.Tensor:
        """StockTradingEnv's action (weights mode) for observations (N, D), one agent: the
        invested fraction ``f`` as ``2f - 1``, each stock's share ``u`` of it as ``2u - 1``."""
        stock, market = self.layout.split(self.layout.market_of_observation(obs.double()))
        w = self.weights(*self.normalize(stock, market))[0]
        invested = w.sum(-1, keepdim=True)
        return torch.cat([2 * invested - 1, 2 * w / invested - 1], -1).float()


def net_returns(weights: torch.Tensor, close: torch.Tensor, cost: float) -> torch.Tensor:
    """Daily returns (P, T - 1) of accounts that hold ``weights`` (P, T, S) from each close
    to the next, paying ``cost`` on every change of weight (the first day's from cash)."""
    held = weights[:, :-1]
    gross = (held * (close[1:] / close[:-1] - 1)).sum(-1)
    turnover = torch.cat([held[:, :1], held[:, 1:] - held[:, :-1]], 1).abs().sum(-1)
    return gross - cost * turnover


def sharpe(returns: torch.Tensor) -> torch.Tensor:
    """Annualised Sharpe ratio of each row of daily returns (services.pod.backtest's)."""
    return returns.mean(-1) / returns.std(-1).clamp_min(1e-12) * math.sqrt(TRADING_DAYS_PER_YEAR)


@dataclass(frozen=True)
class PortfolioPlan:
    """A tournament of ``len(hyperparameters)`` agents (each ``learning_rate`` and ``l2``)."""

    hyperparameters: Sequence[Mapping[str, float]]
    rounds: int = 30
    round_steps: int = 10
    exploit: bool = True
    seed: int = 0


@dataclass
class PortfolioResult:
    """The kept (agent, round) snapshot, every round's validation Sharpe per agent, and every
    agent as it ended (``final.agent(0)``: one agent of the same budget, no selection)."""

    policy: PortfolioPolicy
    slot: int
    round: int
    validation_sharpe: float
    history: list[list[float]]
    final: PortfolioPolicy


def run_portfolio_tournament(
    train: MarketData,
    validation: MarketData,
    env_kwargs: Mapping[str, object],
    plan: PortfolioPlan,
    on_round: Callable[[int, list[float]], None] | None = None,
) -> PortfolioResult:
    """Train the plan's agents on ``train``, keep the snapshot with the best Sharpe on
    ``validation`` (module docstring). Reads neither any other period nor any randomness
    but PBT's choice of perturbation (``plan.seed``)."""
    p = len(plan.hyperparameters)
    if p < 1 or plan.rounds < 1 or plan.round_steps < 1:
        raise ValueError("need agents, rounds >= 1 and round_steps >= 1")
    for h in plan.hyperparameters:
        if "learning_rate" not in h or not set(h) <= set(HYPERPARAMETERS):
            raise ValueError(f"an agent's hyperparameters are {HYPERPARAMETERS}, got {dict(h)}")
    layout = FeatureLayout.of(train.num_stocks, env_kwargs)
    cost = float(env_kwargs.get("transaction_cost", 0.001))  # type: ignore[arg-type]
    data, held_out = PeriodData.of(train, layout), PeriodData.of(validation, layout)
    flat = data.stock.reshape(-1, layout.per_stock)
    params = torch.zeros(p, layout.per_stock + layout.market_wide + 1, dtype=torch.float64)
    params[:, -1] = _INITIAL_INVESTED_LOGIT
    policy = PortfolioPolicy(
        layout,
        params,  # Adam updates it in place
        flat.mean(0),
        flat.std(0).clamp_min(1e-8),
        data.market.mean(0),
        data.market.std(0).clamp_min(1e-8),
    )
    x, g = policy.normalize(data.stock, data.market)  # once: the features do not change
    held_x, held_g = policy.normalize(held_out.stock, held_out.market)
    lr = torch.tensor([float(h["learning_rate"]) for h in plan.hyperparameters]).double()
    l2 = torch.tensor([float(h.get("l2", 0.0)) for h in plan.hyperparameters]).double()
    adam = BatchedAdam(params, lr)
    rng = np.random.default_rng(plan.seed)
    kept: tuple[float, int, int, PortfolioPolicy] | None = None  # Sharpe, slot, round, policy
    history: list[list[float]] = []
    for round_ in range(plan.rounds):
        for _ in range(plan.round_steps):
            tracked = replace(policy, params=params.detach().requires_grad_(True))
            returns = net_returns(tracked.weights(x, g), data.close, cost)
            penalty = l2 * tracked.stock_weights.square().sum(-1)
            (grad,) = torch.autograd.grad((penalty - sharpe(returns)).sum(), tracked.params)
            adam.step(grad)
        with torch.no_grad():
            scores = sharpe(net_returns(policy.weights(held_x, held_g), held_out.close, cost))
        history.append(scores.tolist())
        if on_round is not None:
            on_round(round_, history[-1])
        leader = int(np.argmax(history[-1]))
        if kept is None or history[-1][leader] > kept[0]:
            kept = (history[-1][leader], leader, round_, policy.agent(leader))
        if plan.exploit and p >= 4 and round_ < plan.rounds - 1:
            for loser in np.argsort(history[-1])[: p // 4]:
                adam.copy(int(loser), leader, lr_factor=float(rng.choice([0.8, 1.25])))
    assert kept is not None
    score, slot, round_, snapshot = kept
    return PortfolioResult(snapshot, slot, round_, score, history, policy)


class BatchedAdam:
    """Adam for P agents' parameters (P, N), updated in place, each agent its own step count
    and learning rate (P,)."""

    def __init__(self, params: torch.Tensor, lr: torch.Tensor) -> None:
        self.params, self.lr = params, lr
        self.moments = torch.zeros(2, *params.shape, dtype=params.dtype)
        self.steps = torch.zeros(len(params), dtype=params.dtype)

    def step(self, grad: torch.Tensor) -> None:
        (b1, b2), m, v = _ADAM_BETAS, self.moments[0], self.moments[1]
        self.steps += 1
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        m_hat = m / (1 - b1**self.steps).unsqueeze(1)
        v_hat = v / (1 - b2**self.steps).unsqueeze(1)
        self.params.sub_(self.lr.unsqueeze(1) * m_hat / (v_hat.sqrt() + _ADAM_EPS))

    def copy(self, loser: int, leader: int, lr_factor: float) -> None:
        """PBT's exploit and explore: ``loser`` restarts from ``leader`` (its parameters and
        Adam state) with the leader's learning rate times ``lr_factor``."""
        self.params[loser] = self.params[leader]
        self.moments[:, loser] = self.moments[:, leader]
        self.steps[loser] = self.steps[leader]
        self.lr[loser] = self.lr[leader] * lr_factor
