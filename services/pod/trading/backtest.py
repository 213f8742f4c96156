"""Backtest metrics of a trading agent (pyfolio/empyrical's, which FinRL reports), the
baselines it is compared with (buy-and-hold and equal weight rebalanced, both paying the env's
transaction costs), and ``podium backtest``'s run of an agent's training files. Formulas:
docs/trading.md, "Backtests".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from services.pod.trading.env import StockTradingEnv
from services.pod.trading.market import TRADING_DAYS_PER_YEAR

if TYPE_CHECKING:
    from services.pod.algorithms.policies import Policy
    from services.pod.training.trainer import RunConfig

#: The periods an agent is backtested on (train is where it learned).
Period = Literal["backtest", "validation"]


@dataclass(frozen=True)
class BacktestMetrics:
    cumulative_return: float
    annual_return: float
    annual_volatility: float
    sharpe: float
    max_drawdown: float
    calmar: float
    days: int


def metrics(
    account_values: np.ndarray | list[float], periods_per_year: int = TRADING_DAYS_PER_YEAR
) -> BacktestMetrics:
    """The metrics (docs/trading.md) of one account-value series (>= 2 values)."""
    values = np.asarray(account_values, dtype=np.float64)
    if values.ndim != 1 or len(values) < 2:
        raise ValueError("account_values must be a 1-D series of at least 2 values")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError("account_values must be finite and > 0")
    returns = values[1:] / values[:-1] - 1.0
    n = len(returns)
    growth = values[-1] / values[0]
    annual_return = growth ** (periods_per_year / n) - 1.0
    std = float(returns.std(ddof=1)) if n > 1 else 0.0
    sharpe = float(returns.mean()) / std * math.sqrt(periods_per_year) if std > 0 else math.nan
    drawdown = float((values / np.maximum.accumulate(values) - 1.0).min())
    calmar = annual_return / -drawdown if drawdown < 0 else math.nan
    return BacktestMetrics(
        cumulative_return=float(growth - 1.0),
        annual_return=float(annual_return),
        annual_volatility=std * math.sqrt(periods_per_year),
        sharpe=sharpe,
        max_drawdown=drawdown,
        calmar=float(calmar),
        days=n,
    )


def sharpe_of(values: np.ndarray) -> float:
    """Sharpe of one account-value series; a flat series (all cash) scores 0, not NaN."""
    sharpe = metrics(values).sharpe
    return 0.0 if math.isnan(sharpe) else sharpe


def buy_and_hold(
    close: np.ndarray, initial_amount: float = 1_000_000.0, transaction_cost: float = 0.001
) -> np.ndarray:
    """Account values of the baseline: equal cash per stock, whole shares bought at the first
    close (paying the transaction cost), then held. ``close``: (T, S); returns (T,)."""
    close = np.asarray(close, dtype=np.float64)
    per_stock = initial_amount / close.shape[1]
    shares = np.floor(per_stock / (close[0] * (1.0 + transaction_cost)))
    cash = initial_amount - float((shares * close[0]).sum()) * (1.0 + transaction_cost)
    return cash + close @ shares


def equal_weight(
    close: np.ndarray,
    initial_amount: float = 1_000_000.0,
    transaction_cost: float = 0.001,
    rebalance_every: int = 21,
) -> np.ndarray:
    """Account values (T,) of the baseline that holds equal weights of ``close`` (T, S),
    rebalanced on the first day and every ``rebalance_every`` days (``rebalanced``)."""
    close = np.asarray(close, dtype=np.float64)
    equal = np.full(close.shape[1], 1.0 / close.shape[1])
    return rebalanced(close, lambda _t: equal, initial_amount, transaction_cost, rebalance_every)


def rebalanced(
    close: np.ndarray,
    weights: Callable[[int], np.ndarray],
    initial_amount: float = 1_000_000.0,
    transaction_cost: float = 0.001,
    rebalance_every: int = 21,
) -> np.ndarray:
    """Account values of a strategy that sets the target ``weights(t)`` (fractions of the
    account per stock, summing to at most 1, the rest in cash) on day ``t`` of ``close``
    every ``rebalance_every`` days, from the first. Fractional shares; a rebalance pays
    ``transaction_cost`` on the value traded, ``sum_s |w_s V - h_s p_s|`` at the account value
    ``V`` before the trade (the cost itself is not re-traded). ``close``: (T, S); returns (T,)."""
    close = np.asarray(close, dtype=np.float64)
    if rebalance_every < 1:
        raise ValueError(f"rebalance_every must be >= 1, got {rebalance_every}")
    shares = np.zeros(close.shape[1])
    cash = float(initial_amount)
    values = np.empty(len(close))
    for t, price in enumerate(close):
        value = cash + float(shares @ price)
        if t % rebalance_every == 0:
            w = weights(t)
            value -= transaction_cost * float(np.abs(w * value - shares * price).sum())
            shares, cash = w * value / price, value * (1.0 - float(w.sum()))
        values[t] = cash + float(shares @ price)
    return values


@torch.no_grad()
def run_backtest_batch(
    env: StockTradingEnv, act: Callable[[torch.Tensor], torch.Tensor]
) -> np.ndarray:
    """Account values (days + 1, num_envs) of every sub-environment over one episode of
    ``env`` (a validation- or backtest-mode env gives its whole period), acting with
    ``act(obs) -> actions``: one policy per sub-environment, or several side by side."""
    obs, _ = env.reset()
    values = [env.account_value().double().cpu().numpy()]
    assert env.max_episode_steps is not None
    for _ in range(env.max_episode_steps):
        obs, _, _, _, _ = env.step(act(obs))
        values.append(env.last_account_value.double().cpu().numpy())
    return np.stack(values)


def run_backtest(env: StockTradingEnv, act: Callable[[torch.Tensor], torch.Tensor]) -> np.ndarray:
    """Account values of sub-environment 0 over one episode of ``env``."""
    return run_backtest_batch(env, act)[:, 0]


#: Evaluation settings of the env, not the market or the account: a backtest sets its own.
_SCORING_KWARGS = ("mode", "score")


@dataclass
class CandidateBacktest:
    """A trained agent and the baselines over one period of its market."""

    period: str
    dates: np.ndarray
    #: Strategy → account values (one per day, the first day's value included): ``agent``,
    #: ``buy-and-hold``, ``equal weight``, all paying the agent's env's transaction cost.
    values: dict[str, np.ndarray]
    config: dict[str, Any]  # the agent's run config (hyperparameters.json)


def load_policy(directory: Path) -> tuple[RunConfig, Policy]:
    """A trading agent's training files (``podium export``, ``podium run``'s ``best/``,
    ``podium train``'s checkpoints): its run config and its policy, verified and parsed from
    safetensors and JSON only. The algorithm is looked up by its registered name. Raises
    ``CheckpointError`` for defective files, ``ValueError`` for an agent of another env,
    ``pydantic.ValidationError`` / ``HyperparameterError`` for a config this Podium refuses,
    ``TypeError`` for env arguments the env does not take."""
    from services.contracts.training_files import CheckpointError
    from services.pod.training.checkpoint import load_into, read_files
    from services.pod.training.trainer import algorithm_class, trainer_class

    files = read_files(directory)
    hyper = files.documents.get("hyperparameters")
    if not isinstance(hyper, dict) or "actor" not in files.tensors:
        raise CheckpointError(f"{directory}: no hyperparameters.json or actor.safetensors")
    algorithm = str(files.manifest.get("algorithm") or hyper.get("algorithm"))
    config = trainer_class(algorithm).config_class.model_validate({**hyper, "device": "cpu"})
    if config.env != StockTradingEnv.spec_id:  # before anything of that env is built
        raise ValueError(
            f"{directory}: the agent was trained on {config.env}; a backtest needs "
            f"{StockTradingEnv.spec_id}"
        )
    # The spaces do not depend on the period: the backtest period's env gives them.
    env = period_env(config, "backtest")
    agent = algorithm_class(algorithm)(
        env.single_observation_space, env.single_action_space, config.agent_config
    )
    load_into(agent.policy, files.tensors["actor"], "actor.safetensors")
    return config, agent.policy.eval()


def period_env(config: RunConfig, period: Period) -> StockTradingEnv:
    """One account on ``period`` of the market ``config``'s env was configured with; the
    validation period as the agent's evaluation saw it (``eval_env_kwargs`` on top)."""
    if period not in ("backtest", "validation"):
        raise ValueError(f"period must be 'backtest' or 'validation', got {period!r}")
    kwargs = {**config.env_kwargs, **(config.eval_env_kwargs if period == "validation" else {})}
    kwargs = {k: v for k, v in kwargs.items() if k not in _SCORING_KWARGS}
    return StockTradingEnv(num_envs=1, mode=period, **kwargs)


def backtest_candidate(directory: Path, period: Period = "backtest") -> CandidateBacktest:
    """Run a trading agent's training files deterministically over ``period`` (``backtest``,
    the held-out days; or ``validation``) of the market its env was configured with, beside
    buy-and-hold and equal weight (errors: ``load_policy``'s)."""
    config, policy = load_policy(directory)
    env = period_env(config, period)
    cost, close = env.transaction_cost, env.data.close
    values = {
        "agent": run_backtest(env, policy.act_deterministic),
        "buy-and-hold": buy_and_hold(close, env.initial_amount, cost),
        "equal weight": equal_weight(close, env.initial_amount, cost),
    }
    return CandidateBacktest(period, env.data.dates, values, config.model_dump(mode="json"))
