"""Stock trading: a tournament's best agent against buy-and-hold and equal weight, held out.

For each synthetic market (regime x market seed; services/pod/trading/market.py) the days are cut
in time into train (60%), validation (20%) and backtest (20%). A tournament of P PPO agents
(services/pod/trading/tournament.py: hyperparameters drawn from SPACE, PBT's exploit/explore
after every round) trains on the train period; after every round each agent is scored by its
Sharpe on the validation period and the best (agent, round) snapshot is kept. Only that
snapshot, and the baselines, are then run on the backtest period, which neither training nor
selection has read. Everything pays the preset's transaction cost (0.1% of the value traded).

Reported per regime: medians over market seeds of the five metrics for the kept agent, one
agent trained alone for the same budget (slot 0's final policy: no selection, no early
stopping), buy-and-hold and equal weight rebalanced monthly; per-seed Sharpe ratios; and a plot
of the account values on the backtest period (``--plot``, needs the ``plots`` extra).

With ``--algorithm portfolio_gradient`` the agents are services/pod/algorithms/
portfolio_gradient.py's (a shared linear scorer per stock, trained by the exact gradient of the
train period's Sharpe ratio; the env of its preset,
services/contracts/algorithms/portfolio_gradient/presets/),
in the same tournament.

    python bench/stock_trading_tournament.py --out /tmp/st.json          # 3 regimes x 3 seeds
    python bench/stock_trading_tournament.py --regimes crash --seeds 0 --rounds 2   # quick look
    python bench/stock_trading_tournament.py --summarize /tmp/a.json /tmp/b.json \
        --plot docs/stock_trading_account_value.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from services.cli.overrides import ConfigError, deep_merge, parse_set
from services.contracts.algorithms.ppo.config import PPOConfig
from services.pod.trading.backtest import metrics
from services.pod.trading.market import REGIMES, MarketData, synthetic_market
from services.pod.trading.portfolio_gradient import PortfolioPlan
from services.pod.trading.tournament import (
    TournamentPlan,
    evaluate_market,
    sample_hyperparameters,
)
from services.pod.training.presets import preset

PRESET = preset("ppo", "StockTrading-v0")
#: The tournament's search space (each agent draws one value of each list).
SPACE = {
    "learning_rate": [1e-4, 3e-4, 1e-3],
    "ent_coef": [0.0, 0.001, 0.01],
    "gamma": [0.9, 0.97, 0.99],
}
#: ``--algorithm portfolio_gradient`` (services/pod/trading/portfolio_gradient.py): its
#: search space; its env is its own preset's (the PPO preset's plus the trailing-return
#: features that the trend markets reward; docs/benchmarks.md "Stock trading").
PORTFOLIO_SPACE = {"learning_rate": [0.02, 0.05, 0.1], "l2": [1e-4, 1e-3, 1e-2]}
#: Per algorithm: rounds, and env steps (PPO, per agent) or full-batch gradient steps a round.
ROUNDS = {"ppo": (6, 32768), "portfolio_gradient": (30, 10)}
KEYS = ("cumulative_return", "annual_return", "annual_volatility", "max_drawdown", "sharpe")
STRATEGIES = ("agent", "single agent", "buy-and-hold", "equal weight")


def market(
    regime: str, seed: int, config: dict = PRESET
) -> tuple[MarketData, dict, list[MarketData]]:
    """The synthetic market (``regime``, market ``seed``) with the preset's number of stocks,
    StockTradingEnv's other arguments of the preset, and the simulated markets it asks for."""
    env_kwargs = {
        k: v for k, v in config["env_kwargs"].items() if k not in ("market_seed", "regime")
    }
    num_stocks = int(env_kwargs.pop("num_stocks", 5))
    simulated = [
        synthetic_market(seed, num_stocks, regime=regime, replica=k)
        for k in range(int(env_kwargs.pop("simulated_markets", 0)))
    ]
    return synthetic_market(seed, num_stocks, regime=regime), env_kwargs, simulated


def config_of(algorithm: str) -> dict:
    """The preset the ``algorithm``'s tournament runs on
    (services/contracts/algorithms/*/presets/)."""
    return PRESET if algorithm == "ppo" else preset(algorithm, "StockTrading-v0")


def plan_of(
    seed: int,
    pods: int,
    rounds: int,
    round_steps: int,
    config: dict = PRESET,
    exploit: bool = True,
    algorithm: str = "ppo",
) -> TournamentPlan | PortfolioPlan:
    """The tournament of ``pods`` agents whose hyperparameters are drawn from SPACE, or
    PORTFOLIO_SPACE for the portfolio gradient (without ``exploit``: best of ``pods``)."""
    if algorithm == "portfolio_gradient":
        draws = sample_hyperparameters(PORTFOLIO_SPACE, pods, seed)
        return PortfolioPlan(draws, rounds, round_steps, exploit, seed)
    return TournamentPlan(
        PPOConfig.model_validate(config["ppo"]),
        sample_hyperparameters(SPACE, pods, seed),
        rounds=rounds,
        round_env_steps=round_steps,
        seed=seed,
        exploit=exploit,
    )


def run_market(
    regime: str,
    seed: int,
    plan: TournamentPlan | PortfolioPlan,
    config: dict = PRESET,
    algorithm: str = "ppo",
) -> dict:
    """``plan``'s tournament on the market (its ``config``'s env), the kept agent backtested."""
    data, env_kwargs, simulated = market(regime, seed, config)
    start = time.perf_counter()
    report = evaluate_market(data, env_kwargs, plan, simulated)
    seconds = time.perf_counter() - start
    result = report.tournament
    record = {
        "regime": regime,
        "seed": seed,
        "algorithm": algorithm,
        "seconds": seconds,
        "kept": {"slot": result.slot, "round": result.round, "sharpe": result.validation_sharpe},
        "validation_history": result.history,
        "dates": [str(d) for d in report.backtest_dates],
        "values": {k: v.tolist() for k, v in report.backtest_values.items()},
        "metrics": {k: metrics(v).as_dict() for k, v in report.backtest_values.items()},
    }
    m = record["metrics"]
    print(
        f"{regime} seed {seed}: {seconds:.0f} s, kept slot {result.slot} round {result.round} "
        f"(validation Sharpe {result.validation_sharpe:.2f}); backtest Sharpe "
        + ", ".join(f"{k} {m[k]['sharpe']:.2f}" for k in STRATEGIES),
        flush=True,
    )
    return record


def _regimes(records: list[dict]) -> list[str]:
    return sorted({r["regime"] for r in records}, key=REGIMES.index)


def table(records: list[dict]) -> str:
    fmt = {"sharpe": "{:.2f}"}
    lines = [
        "| market | strategy | " + " | ".join(KEYS) + " | Sharpe per seed |",
        "|---|---|" + "---:|" * (len(KEYS) + 1),
    ]
    for regime in _regimes(records):
        rows = sorted((r for r in records if r["regime"] == regime), key=lambda r: r["seed"])
        for who in STRATEGIES:
            cells = []
            for key in KEYS:
                median = statistics.median(r["metrics"][who][key] for r in rows)
                cells.append(fmt.get(key, "{:.1%}").format(median))
            seeds = " / ".join(f"{r['metrics'][who]['sharpe']:.2f}" for r in rows)
            lines.append(
                f"| {regime} ({len(rows)} seeds) | {who} | " + " | ".join(cells) + f" | {seeds} |"
            )
    wins = sum(
        r["metrics"]["agent"]["sharpe"] > r["metrics"]["buy-and-hold"]["sharpe"] for r in records
    )
    lines.append("")
    lines.append(f"agent Sharpe > buy-and-hold Sharpe on {wins} of {len(records)} markets")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    regimes = _regimes(records)
    seeds = sorted({r["seed"] for r in records})
    fig, axes = plt.subplots(
        len(seeds), len(regimes), figsize=(4.5 * len(regimes), 2.8 * len(seeds)), squeeze=False
    )
    for r in records:
        ax = axes[seeds.index(r["seed"])][regimes.index(r["regime"])]
        dates = np.array(r["dates"], dtype="datetime64[D]")
        for who in STRATEGIES:
            values = np.asarray(r["values"][who]) / 1e6
            ax.plot(dates, values, label=f"{who} ({r['metrics'][who]['sharpe']:.2f})", lw=1)
        ax.set_title(f"{r['regime']}, seed {r['seed']}", fontsize=9)
        ax.xaxis.set_major_locator(mdates.MonthLocator(bymonth=(1, 7)))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%Y-%m"))
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, title="Sharpe", title_fontsize=6)
    for ax in axes[:, 0]:
        ax.set_ylabel("account value ($M)", fontsize=8)
    fig.suptitle("StockTrading-v0, backtest period (held out), 0.1% transaction cost", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", default="trend,mean_reversion,crash")
    parser.add_argument("--seeds", default="0,1,2", help="market seeds, comma-separated")
    parser.add_argument("--markets", help="regime:seed,... (instead of regimes x seeds)")
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument(
        "--algorithm",
        choices=sorted(ROUNDS),
        default="ppo",
        help="PPO agents, or the portfolio gradient's (each on its preset)",
    )
    parser.add_argument("--rounds", type=int, help="default: 6 (ppo), 30 (portfolio_gradient)")
    parser.add_argument(
        "--round-steps",
        type=int,
        help="env steps per agent (ppo, default 32768) or gradient steps (portfolio_gradient, "
        "default 10) a round",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override the preset as `podium train --set` does (repeatable), "
        "e.g. --set env_kwargs.momentum=true",
    )
    parser.add_argument(
        "--no-exploit",
        action="store_true",
        help="no PBT exploit: the P agents train apart, the best snapshot is kept (best of P, "
        "batched as the tournament is)",
    )
    parser.add_argument("--out", type=Path, help="write the records (JSON) here")
    parser.add_argument("--summarize", type=Path, nargs="+", help="merge records, no training")
    parser.add_argument("--plot", type=Path, help="PNG of the account values")
    args = parser.parse_args()
    if args.summarize:
        records = [r for p in args.summarize for r in json.loads(p.read_text())]
    else:
        torch.set_num_threads(1)
        config = config_of(args.algorithm)
        rounds, round_steps = ROUNDS[args.algorithm]
        try:
            for item in args.set:
                config = deep_merge(config, parse_set(item))
        except ConfigError as e:
            parser.error(str(e))
        rounds, round_steps = args.rounds or rounds, args.round_steps or round_steps
        plan_args = (args.pods, rounds, round_steps, config, not args.no_exploit, args.algorithm)
        space = PORTFOLIO_SPACE if args.algorithm == "portfolio_gradient" else SPACE
        print(f"torch {torch.__version__}; {args.algorithm}; {config}; {space}", flush=True)
        markets = (
            [tuple(m.split(":")) for m in args.markets.split(",")]
            if args.markets
            else [(r, s) for r in args.regimes.split(",") for s in args.seeds.split(",")]
        )
        records = [
            run_market(regime, int(seed), plan_of(int(seed), *plan_args), config, args.algorithm)
            for regime, seed in markets
        ]
        if args.out:
            args.out.write_text(json.dumps(records))
    print(table(records))
    if args.plot:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
