"""Do the presets generalise? Every built-in torch-native env with every algorithm that fits
its action space, trained from its defaults exactly as ``podium train ENV --set algorithm=X``
builds its config (services/pod/training/presets.py ``train_config``, then
services/pod/training/fit.py), over several seeds: env steps to the solve threshold (each env
card's target, services/contracts/envs.py). MuJoCo HalfCheetah-v5 through EnvPool is in the
default pairs when the ``envpool`` extra is installed.

    python bench/presets_solve.py [--pairs ppo:CartPole-v1 sac:MountainCarContinuous-v0 ...]
                                  [--seeds 0 1 2] [--set key=value ...] [--jsonl FILE]

Each pair trains within its preset's ``total_env_steps`` (the documented budget; ``--set
total_env_steps=N`` changes it for every pair). Prints one line per run and a markdown table:
runs solved / seeds, median env steps to target (over all seeds, an unsolved run counting as
never: the median is "—" when half or more never solve), and the budget.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The pod's package before torch: it lets MKL choose its kernels by instruction sets.
import services.pod  # noqa: F401

# isort: split
import torch

from services.cli.overrides import parse_set
from services.contracts.algorithms.card import card_names
from services.contracts.algorithms.hyperparameters import misfits
from services.pod.training.fit import train
from services.pod.training.presets import train_config

#: The built-in torch-native envs with a solve threshold (StockTrading-v0 has none: it is
#: judged by a backtest, bench/stock_trading_backtest.py), and the MuJoCo task with presets.
ENVS = ("CartPole-v1", "Acrobot-v1", "Pendulum-v1", "MountainCarContinuous-v0") + (
    ("envpool:HalfCheetah-v5",) if importlib.util.find_spec("envpool") else ()
)


def all_pairs() -> list[tuple[str, str]]:
    """(algorithm, env) for every built-in algorithm that fits each env."""
    return [
        (algorithm, env)
        for env in ENVS
        for algorithm in card_names()
        if not misfits(env, [algorithm])
    ]


def run(algorithm: str, env: str, seed: int, layers: list[dict], progress: bool) -> dict:
    config = train_config(env, [{"algorithm": algorithm, "seed": seed}, *layers])

    def report(record: dict[str, float]) -> None:
        if progress and "eval_return" in record:
            print(
                f"  {algorithm} {env} seed {seed}: {record['env_steps']:,.0f} env steps, "
                f"eval {record['eval_return']:.1f}",
                file=sys.stderr,
                flush=True,
            )

    start = time.perf_counter()
    result = train(config, on_progress=report)
    return {
        "algorithm": algorithm,
        "env": env,
        "seed": seed,
        "budget": config.total_env_steps,
        "target": config.target_return,
        "default_target_return": result.solved_at_env_steps,
        "best": result.best.mean if result.best else None,
        "train_seconds": round(result.train_seconds, 1),
        "wall_seconds": round(time.perf_counter() - start, 1),
    }


def median_steps(steps: list[int | None]) -> float | None:
    """Median env steps to target, an unsolved run counting as infinitely many."""
    ranked = sorted(float("inf") if s is None else s for s in steps)
    value = statistics.median(ranked)
    return None if value == float("inf") else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="*", help="algorithm:env (default: every pair)")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--jsonl", help="append each run's record to this file")
    parser.add_argument("--progress", action="store_true", help="print every evaluation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pairs = [tuple(p.split(":", 1)) for p in args.pairs] if args.pairs else all_pairs()
    layers = [parse_set(s) for s in args.sets]
    rows = []
    for algorithm, env in pairs:
        records = []
        for seed in args.seeds:
            record = run(algorithm, env, seed, layers, args.progress)
            print(json.dumps(record), flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as out:
                    out.write(json.dumps(record) + "\n")
            records.append(record)
        steps = [r["default_target_return"] for r in records]
        median = median_steps(steps)
        solved = sum(s is not None for s in steps)
        rows.append(
            f"| {algorithm} | {env} | {records[0]['target']:g} | {records[0]['budget']:,} "
            f"| {solved}/{len(steps)} | {'—' if median is None else f'{median:,.0f}'} "
            f"| {', '.join('—' if s is None else f'{s:,}' for s in steps)} |"
        )
    print("\n| algorithm | env | target | budget | solved | median env steps | per seed |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
