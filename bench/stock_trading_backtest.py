"""Stock trading: PPO trained on the synthetic market's train period, backtested on the held-out
period against buy-and-hold (equal cash per stock on the first day).

Training is ``services.pod.fit.train`` on ``StockTrading-v0`` (train mode: one-year episodes
from random start days); the backtest is one deterministic pass over the last 20% of the
synthetic market (the dates after the split), which training never sees. Medians over seeds.

    python bench/stock_trading_backtest.py                  # 5 seeds, 300k env steps each
    python bench/stock_trading_backtest.py --seeds 1 --steps 20000   # quick look
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.pod.backtest import buy_and_hold, metrics, run_backtest
from services.pod.envs.stock_trading import StockTradingEnv
from services.pod.fit import build, train
from services.pod.onpolicy import PPORunConfig
from services.pod.presets import preset

#: The StockTrading-v0 preset (services/pod/presets/ppo/) is what this bench trains and reports.
PPO_SETTINGS = preset("ppo", "StockTrading-v0")["ppo"]
ENV_KWARGS = {"market_seed": 0, "num_stocks": 5, "episode_length": 252}
KEYS = ("cumulative_return", "annual_return", "annual_volatility", "sharpe", "max_drawdown")


def backtest(env: StockTradingEnv, policy) -> tuple[dict[str, float], dict[str, float]]:
    """(agent, buy-and-hold) metrics over one pass of ``env``'s period."""
    agent = metrics(run_backtest(env, policy.act_deterministic)).as_dict()
    baseline = buy_and_hold(env.data.close, env.initial_amount, env.transaction_cost)
    return agent, metrics(baseline).as_dict()


def run(seed: int, steps: int) -> dict[str, dict[str, float]]:
    config = PPORunConfig(
        env="StockTrading-v0",
        env_kwargs=ENV_KWARGS,
        ppo=PPO_SETTINGS,
        total_env_steps=steps,
        eval_every_steps=max(steps // 5, 1),
        seed=seed,
    )
    trainer = build(config)
    start = time.perf_counter()
    result = train(config, trainer=trainer)
    seconds = time.perf_counter() - start
    policy = trainer.learner.policy
    agent, baseline = backtest(StockTradingEnv(mode="backtest", **ENV_KWARGS), policy)
    # The same pass over the whole train period (in-sample), to see the generalisation gap.
    train_kwargs = {**ENV_KWARGS, "episode_length": None, "random_start": False}
    in_sample, in_sample_baseline = backtest(StockTradingEnv(mode="train", **train_kwargs), policy)
    last_eval = next(r["eval_return"] for r in reversed(result.history) if "eval_return" in r)
    print(
        f"seed {seed}: {seconds:.0f} s, train-period eval return {last_eval:.2f}; backtest "
        f"agent Sharpe {agent['sharpe']:.2f} MDD {agent['max_drawdown']:.1%} cum "
        f"{agent['cumulative_return']:.1%} | buy-and-hold Sharpe {baseline['sharpe']:.2f} MDD "
        f"{baseline['max_drawdown']:.1%} cum {baseline['cumulative_return']:.1%}; in-sample "
        f"Sharpe {in_sample['sharpe']:.2f} vs {in_sample_baseline['sharpe']:.2f}",
        flush=True,
    )
    return {
        "agent": agent,
        "buy_and_hold": baseline,
        "agent (train period)": in_sample,
        "buy_and_hold (train period)": in_sample_baseline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; PPO {PPO_SETTINGS}; env {ENV_KWARGS}")
    runs = [run(seed, args.steps) for seed in range(args.seeds)]
    env = StockTradingEnv(num_envs=1, mode="backtest", **ENV_KWARGS)
    print(f"\nbacktest {env.data.dates[0]} .. {env.data.dates[-1]} ({env.data.num_days} days)")
    print("| | " + " | ".join(KEYS) + " |")
    print("|---" * (len(KEYS) + 1) + "|")
    for who in runs[0]:
        cells = []
        for key in KEYS:
            values = [r[who][key] for r in runs]
            fmt = "{:.2f}" if key == "sharpe" else "{:.1%}"
            median = fmt.format(statistics.median(values))
            cells.append(f"{median} ({' / '.join(fmt.format(v) for v in values)})")
        print(f"| {who} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
