"""Stock trading: a tournament's best agent against buy-and-hold and equal weight, held out.

For each synthetic market (regime x market seed; services/pod/trading/market.py) the days are cut
in time into train (60%), validation (20%) and backtest (20%). One population pod's trainer of P
agents (services/pod/training/: hyperparameters drawn from SPACE) trains on the train period;
after every round each agent is scored by the pod's evaluation, its Sharpe over one pass of the
validation period (``eval_env_kwargs: {mode: validation, score: sharpe}``), the best (agent,
round) snapshot is saved, and PBT inside the pod (services/pod/runtime/in_pod_pbt.py, the
spec's ``population.exploit`` with ``by: evaluation``) copies the best agents into the worst
quarter and explores their hyperparameters. Only the kept snapshot and the baselines are then
run on the backtest period (``podium backtest``'s ``backtest_candidate``), which neither
training nor selection has read. Everything pays the preset's transaction cost (0.1% of the
value traded).

Reported per regime: medians over market seeds of the five metrics for the kept agent, one
agent trained alone for the same budget (slot 0's final policy: no selection, no early
stopping), buy-and-hold and equal weight rebalanced monthly; per-seed Sharpe ratios; and a plot
of the account values on the backtest period (``--plot``, needs the ``plots`` extra).

With ``--algorithm portfolio_gradient`` the agents are the portfolio gradient's
(services/pod/trading/portfolio_gradient.py: a shared linear scorer per stock, trained by the
exact gradient of the train period's Sharpe ratio; the env of its preset,
services/contracts/algorithms/portfolio_gradient/presets/), in the same tournament.

    python bench/stock_trading_tournament.py --out /tmp/st.json          # 3 regimes x 3 seeds
    python bench/stock_trading_tournament.py --regimes crash --seeds 0 --rounds 2   # quick look
    python bench/stock_trading_tournament.py --summarize /tmp/a.json /tmp/b.json \
        --plot docs/stock_trading_account_value.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

# The pod's package before torch: it lets MKL choose its kernels by instruction sets.
import services.pod  # noqa: F401

# isort: split
import torch
from pydantic import TypeAdapter

from services.cli.overrides import ConfigError, deep_merge, parse_set
from services.contracts.search_space import SearchSpace
from services.contracts.strategies import PBTOptions, PopulationExploit
from services.pod.runtime.in_pod_pbt import InPodPBT
from services.pod.trading.backtest import backtest_candidate, metrics
from services.pod.trading.market import REGIMES
from services.pod.training.presets import preset
from services.pod.training.trainer import RunConfig, build_trainer, trainer_class

PRESET = preset("ppo", "StockTrading-v0")

#: Each algorithm's draws (each agent draws one value of each list) and what explore perturbs
#: (the spec's search space for PBT inside the pod; the other draws are copied from the parent).
SPACE = {
    "ppo": {
        "learning_rate": [1e-4, 3e-4, 1e-3],
        "ent_coef": [0.0, 0.001, 0.01],
        "gamma": [0.9, 0.97, 0.99],
    },
    "portfolio_gradient": {"learning_rate": [0.02, 0.05, 0.1], "l2": [1e-4, 1e-3, 1e-2]},
}
EXPLORED = {
    "ppo": {
        "learning_rate": {"type": "log_uniform", "low": 1e-5, "high": 1e-2},
        "ent_coef": {"type": "uniform", "low": 0.0, "high": 0.01},
    },
    "portfolio_gradient": {"learning_rate": {"type": "log_uniform", "low": 1e-3, "high": 1.0}},
}
#: Per algorithm: rounds, and env steps (PPO, per agent) or full-batch gradient steps a round.
ROUNDS = {"ppo": (6, 32768), "portfolio_gradient": (30, 10)}
#: PBT inside the pod at its defaults (the worst quarter copies the top quarter; factors 0.8
#: and 1.2), by evaluation, explore stepping the values (no resampling).
PBT = PBTOptions(truncation=0.25, ready_env_steps=0, resample_probability=0.0)
KEYS = ("cumulative_return", "annual_return", "annual_volatility", "max_drawdown", "sharpe")
STRATEGIES = ("agent", "single agent", "buy-and-hold", "equal weight")


def config_of(algorithm: str) -> dict:
    """The preset the ``algorithm``'s tournament runs on
    (services/contracts/algorithms/*/presets/)."""
    return PRESET if algorithm == "ppo" else preset(algorithm, "StockTrading-v0")


def sample_hyperparameters(
    space: Mapping[str, Sequence[float]], count: int, seed: int
) -> list[dict[str, float]]:
    """``count`` draws, each value uniformly from its list of ``space`` (a grid's choices)."""
    rng = np.random.default_rng(seed)
    return [{k: float(rng.choice(list(v))) for k, v in space.items()} for _ in range(count)]


def run_market(
    regime: str,
    seed: int,
    pods: int,
    rounds: int,
    round_steps: int,
    config: dict,
    exploit: bool = True,
    algorithm: str = "ppo",
    on_round: Callable[[int, list[float], int], None] | None = None,
) -> dict:
    """The tournament on the market (``config``: the preset with ``--set`` on top), the kept
    agent and slot 0's final agent backtested. ``on_round(round, scores, env_steps)``: called
    with every agent's validation Sharpe and the round's env steps (all agents) after each
    round (a benchmark's clock)."""
    env_kwargs = {**config["env_kwargs"], "market_seed": seed, "regime": regime}
    per_round = round_steps if algorithm == "ppo" else None  # set once the trainer is built
    budget = rounds * round_steps if algorithm == "ppo" else config["total_env_steps"]
    cls = trainer_class(algorithm, pods)

    def run_config(hyperparameters: Mapping[str, Any], slot: int) -> RunConfig:
        return cls.config_class.model_validate(
            {
                **config,
                "algorithm": algorithm,
                "env": "StockTrading-v0",
                "env_kwargs": env_kwargs,
                "eval_env_kwargs": {"mode": "validation", "score": "sharpe"},
                "eval_episodes": 1,  # the validation pass is deterministic
                "total_env_steps": budget,  # PPO's annealing, if on
                "seed": seed * 1000 + slot,
                algorithm: {**config.get(algorithm, {}), **hyperparameters},
            }
        )

    draws = sample_hyperparameters(SPACE[algorithm], pods, seed)
    hyperparameters = [dict(d) for d in draws]
    start = time.perf_counter()
    trainer = build_trainer([run_config(h, i) for i, h in enumerate(hyperparameters)])
    per_round = per_round or round_steps * trainer.step_env_steps
    rule = PopulationExploit(every_env_steps=per_round, by="evaluation", pbt=PBT)
    explored = TypeAdapter(SearchSpace).validate_python(EXPLORED[algorithm])
    pbt = InPodPBT(rule, explored, pods, str(seed))
    pbt.rng = random.Random(seed)  # PBT's draws (parents, factors): the market's seed
    kept: dict[str, Any] = {"sharpe": -np.inf}
    history: list[list[float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):
            end = (round_ + 1) * per_round
            while trainer.env_steps < end:
                trainer.step()
            scores = [r.mean for r in trainer.evaluate()]
            history.append(scores)
            if on_round is not None:
                on_round(round_, scores, per_round * pods)
            leader = int(np.argmax(scores))
            if scores[leader] > kept["sharpe"]:
                kept = {"slot": leader, "round": round_, "sharpe": scores[leader]}
                trainer.save(leader, Path(tmp) / "kept")
            if exploit and round_ < rounds - 1:
                # Slot ``dst`` trains ``src``'s agent with the explored values, its own seed.
                copies = pbt.select(
                    trainer,
                    hyperparameters,
                    [0] * pods,
                    lambda h, src, dst: run_config(h, dst),
                    scores,  # this round's evaluation: the rule's ``by``
                )
                for copy in copies:
                    hyperparameters[copy.dst] = copy.hyperparameters
        trainer.save(0, Path(tmp) / "single")
        trainer.close()
        seconds = time.perf_counter() - start
        # From here on the backtest period is read, and only to report.
        agent = backtest_candidate(Path(tmp) / "kept")
        single = backtest_candidate(Path(tmp) / "single")
    values = {**agent.values, "single agent": single.values["agent"]}
    record = {
        "regime": regime,
        "seed": seed,
        "algorithm": algorithm,
        "seconds": seconds,
        "kept": kept,
        "validation_history": history,
        "dates": [str(d) for d in agent.dates],
        "values": {k: values[k].tolist() for k in STRATEGIES},
        "metrics": {k: asdict(metrics(values[k])) for k in STRATEGIES},
    }
    m = record["metrics"]
    print(
        f"{regime} seed {seed}: {seconds:.1f} s, kept slot {kept['slot']} round {kept['round']} "
        f"(validation Sharpe {kept['sharpe']:.2f}); backtest Sharpe "
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
        space = SPACE[args.algorithm]
        print(f"torch {torch.__version__}; {args.algorithm}; {config}; {space}", flush=True)
        markets = (
            [tuple(m.split(":")) for m in args.markets.split(",")]
            if args.markets
            else [(r, s) for r in args.regimes.split(",") for s in args.seeds.split(",")]
        )
        exploit, algorithm = not args.no_exploit, args.algorithm
        steps = (args.pods, rounds, round_steps, config, exploit, algorithm)
        records = [run_market(regime, int(seed), *steps) for regime, seed in markets]
        if args.out:
            args.out.write_text(json.dumps(records))
    print(table(records))
    if args.plot:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
