"""Fixed trading rules on the stock-trading task's periods: what the synthetic markets leave
to be learnt, measured without any learning.

For each market (regime x seed, the periods of the StockTrading-v0 preset: train 60%,
validation 20%, backtest 20%) and one period, the Sharpe ratio of:

- ``buy-and-hold``: equal cash per stock on the period's first day, never traded;
- ``momentum``: every month, weights proportional to each stock's positive trailing one-year
  log-return (cash when none is positive);
- ``vol target``: equal weights, every week the invested fraction set to 12% over the last
  21 days' annualised volatility of the equal-weight index (at most 1).

Every trade pays the preset's 0.1%. The rules read prices up to the day they trade only (the
trailing windows reach back before the period, as the env's features do).

    python bench/trading_rules.py --period validation --seeds 0,1,2,3,4,5,6,7,8,9
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import numpy as np

from services.pod.trading.backtest import buy_and_hold, metrics, rebalanced
from services.pod.trading.env import split_periods
from services.pod.trading.market import synthetic_market
from services.pod.training.presets import preset

PRESET = preset("ppo", "StockTrading-v0")
COST = float(PRESET["env_kwargs"]["transaction_cost"])
Rule = Callable[[np.ndarray], np.ndarray]  # closes up to a day -> that day's target weights


def momentum(history: np.ndarray) -> np.ndarray:
    trailing = np.maximum(np.log(history[-1] / history[-253:][0]), 0.0)
    total = trailing.sum()
    return trailing / total if total > 0 else np.zeros(history.shape[1])


def vol_target(history: np.ndarray) -> np.ndarray:
    index = np.diff(np.log(history[-22:]), axis=0).mean(1)
    vol = index.std() * np.sqrt(252) if len(index) > 1 else 0.0
    fraction = min(1.0, 0.12 / vol) if vol > 0 else 1.0
    return np.full(history.shape[1], fraction / history.shape[1])


def on_period(rule: Rule, close: np.ndarray, first: int) -> Callable[[int], np.ndarray]:
    """The rule's weights on day ``t`` of the period from day ``first``, from the prices up
    to that day (reaching back before the period)."""
    return lambda t: rule(close[: first + t + 1])


#: name -> (rule, rebalance every n days)
RULES: dict[str, tuple[Rule, int]] = {"momentum": (momentum, 21), "vol target": (vol_target, 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", default="trend,mean_reversion,crash")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--period", choices=("validation", "backtest"), default="validation")
    args = parser.parse_args()
    kwargs = PRESET["env_kwargs"]
    print(f"period {args.period}; cost {COST:g}; Sharpe medians over seeds, wins vs buy-and-hold")
    print("| market | buy-and-hold | momentum | vol target |")
    print("|---|---:|---:|---:|")
    for regime in args.regimes.split(","):
        sharpe: dict[str, list[float]] = {"bh": [], "momentum": [], "vol target": []}
        for seed in map(int, args.seeds.split(",")):
            data = synthetic_market(seed, int(kwargs["num_stocks"]), regime=regime)
            periods = split_periods(data, None, float(kwargs["validation_fraction"]))
            first = int(np.searchsorted(data.dates, periods[args.period].dates[0]))
            stop = first + periods[args.period].num_days
            period = data.close[first:stop]
            sharpe["bh"].append(metrics(buy_and_hold(period, transaction_cost=COST)).sharpe)
            for name, (rule, every) in RULES.items():
                weights = on_period(rule, data.close, first)
                values = rebalanced(period, weights, transaction_cost=COST, rebalance_every=every)
                sharpe[name].append(metrics(values).sharpe)
        cells = [f"{statistics.median(sharpe['bh']):.2f}"]
        for name in RULES:
            wins = sum(a > b for a, b in zip(sharpe[name], sharpe["bh"], strict=True))
            n = len(sharpe[name])
            cells.append(f"{statistics.median(sharpe[name]):.2f} ({wins}/{n})")
        print(f"| {regime} ({len(sharpe['bh'])} seeds) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
