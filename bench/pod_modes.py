"""The pod's roles fused in one process vs as three processes (worker, learner, evaluator).

    python bench/pod_modes.py [--seeds 3] [--updates 150] [--envs CartPole-v1 Pendulum-v1]

Per env and seed, both modes run side by side in this process (fused first, then processes,
alternating by seed) on the env's preset with one torch thread per process:

- start-up: building the roles (the processes mode spawns two interpreters that import torch);
- throughput: env steps/s of ``--updates`` rollout+update steps after 5 warm-up steps;
- time to target (CartPole only): wall time to the first evaluation >= 475, evaluating every
  4,096 env steps (evaluation included, as in a pod's round).

Prints a markdown table of medians and the processes/fused ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from services.pod.multiprocess import ProcessRoles
from services.pod.runtime import FusedRoles
from services.pod.train import TrainConfig, preset

TARGET = {"CartPole-v1": 475.0}
EVAL_EVERY = 4096
MAX_STEPS = 100_000


def config(env: str, seed: int) -> TrainConfig:
    base = preset(env)
    base.update(seed=seed, eval_episodes=10, torch_threads=1)
    return TrainConfig.model_validate(base)


def measure(mode: str, env: str, seed: int, updates: int, processes: ProcessRoles | None):
    cfg = config(env, seed)
    start = time.perf_counter()
    roles = ProcessRoles(threads=1) if mode == "processes" and processes is None else processes
    roles = roles or FusedRoles()
    learner = roles.build(cfg)
    startup = time.perf_counter() - start
    for _ in range(5):
        roles.step()
    steps0 = learner.env_steps
    start = time.perf_counter()
    for _ in range(updates):
        roles.step()
    steps_per_s = (learner.env_steps - steps0) / (time.perf_counter() - start)
    solve_s = None
    if env in TARGET:
        learner = roles.build(cfg)
        start = time.perf_counter()
        next_eval = EVAL_EVERY
        while learner.env_steps < MAX_STEPS:
            roles.step()
            if learner.env_steps >= next_eval:
                next_eval += EVAL_EVERY
                if roles.evaluate().mean >= TARGET[env]:
                    solve_s = time.perf_counter() - start
                    break
    return startup, steps_per_s, solve_s, roles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "Pendulum-v1"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=150)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )
    rows = []
    for env in args.envs:
        results: dict[str, dict[str, list[float]]] = {
            m: {"startup": [], "sps": [], "solve": []} for m in ("fused", "processes")
        }
        for seed in range(args.seeds):
            order = ["fused", "processes"] if seed % 2 == 0 else ["processes", "fused"]
            for mode in order:
                # A fresh set of processes each time, so start-up is measured every seed.
                startup, sps, solve, roles = measure(mode, env, seed, args.updates, None)
                roles.close()
                results[mode]["startup"].append(startup)
                results[mode]["sps"].append(sps)
                if solve is not None:
                    results[mode]["solve"].append(solve)
                print(
                    f"{env} seed {seed} {mode}: start-up {startup:.2f}s, {sps:,.0f} steps/s, "
                    f"solve {solve if solve is None else round(solve, 2)}s",
                    flush=True,
                )
        med = {
            m: {k: statistics.median(v) if v else None for k, v in r.items()}
            for m, r in results.items()
        }
        rows.append((env, med, {m: len(r["solve"]) for m, r in results.items()}))

    print("\n| env | mode | start-up s | env steps/s | time to 475 s | solved |")
    print("|---|---|---|---|---|---|")
    for env, med, solved in rows:
        for mode in ("fused", "processes"):
            m = med[mode]
            solve = f"{m['solve']:.2f}" if m["solve"] is not None else "-"
            n = f"{solved[mode]}/{args.seeds}" if env in TARGET else "-"
            print(f"| {env} | {mode} | {m['startup']:.2f} | {m['sps']:,.0f} | {solve} | {n} |")
        ratio = med["processes"]["sps"] / med["fused"]["sps"]
        print(
            f"| {env} | processes/fused | | {ratio:.2f}x | "
            + (
                f"{med['processes']['solve'] / med['fused']['solve']:.2f}x"
                if med["fused"]["solve"] and med["processes"]["solve"]
                else ""
            )
            + " | |"
        )


if __name__ == "__main__":
    main()
