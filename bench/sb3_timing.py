"""What the benchmarks share: the machine line, SB3's timed learn(), Podium's timed run and
the per-seed SB3-vs-Podium comparison (bench/ppo_time_to_solve.py, bench/offpolicy_vs_sb3.py).

SB3 is evaluated deterministically every ``every`` env steps on its own env; the clock stops
while it evaluates and training stops at the first evaluation that reaches ``threshold``, as
Podium's own loop does (services/pod/training/fit.py).

torch is imported inside the functions that need it: bench/leaderboard_bench.py (torch-free,
like the control plane it measures) uses ``cpu_model`` too.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

Run = Callable[[int], tuple[float, int | None]]  # seed -> (seconds, env steps at solve)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def machine() -> str:
    import torch

    return f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}"


def timed_learn(
    model: Any, eval_env: Any, budget: int, threshold: float, every: int, episodes: int
) -> tuple[float, int | None]:
    """Train an SB3 ``model``; return (wall time excluding evaluation, env steps at solve)."""
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import sync_envs_normalization

    class StopWhenSolved(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.eval_seconds = 0.0
            self.next_eval = every
            self.solved_at: int | None = None

        def _on_step(self) -> bool:
            if self.num_timesteps < self.next_eval:
                return True
            self.next_eval += every
            start = time.perf_counter()
            # A VecNormalize eval env scores with the training env's current statistics.
            sync_envs_normalization(self.model.get_env(), eval_env)
            mean, _ = evaluate_policy(
                self.model, eval_env, n_eval_episodes=episodes, deterministic=True
            )
            self.eval_seconds += time.perf_counter() - start
            if mean >= threshold:
                self.solved_at = self.num_timesteps
                return False
            return True

    callback = StopWhenSolved()
    start = time.perf_counter()
    model.learn(budget, callback=callback)
    return time.perf_counter() - start - callback.eval_seconds, callback.solved_at


def timed_podium(
    config_cls: Any,
    train: Callable[[Any], Any],
    preset: dict[str, Any],
    seed: int,
    every: int,
    episodes: int,
    threshold: float,
) -> tuple[float, int | None]:
    """Train Podium's ``config_cls`` from ``preset`` with the benchmark's evaluation settings;
    return (wall time excluding evaluation, env steps at solve)."""
    cfg = config_cls.model_validate(
        {
            **preset,
            "seed": seed,
            "eval_every_steps": every,
            "eval_episodes": episodes,
            "target_return": threshold,
        }
    )
    result = train(cfg)
    return result.train_seconds, result.solved_at_env_steps


def compare(
    label: str,
    sb3: Run,
    podium: Run,
    seeds: Iterable[int],
    threads: int,
    load: bool,
    names: tuple[str, str] = ("sb3", "podium"),
) -> str:
    """For each seed SB3 then Podium, alternating, so machine noise hits both alike; prints a
    line per run (``load``: with the load average) and returns the table cells from SB3's
    median seconds on: medians, the speed-up and how many seeds solved."""
    import torch

    times: dict[str, list[float]] = {"sb3": [], "podium": []}
    steps: dict[str, list[float]] = {"sb3": [], "podium": []}
    seeds = list(seeds)
    for seed in seeds:
        for name, fn in (("sb3", sb3), ("podium", podium)):
            shown = names[0] if name == "sb3" else names[1]
            # Podium's loops set their own threads (1); SB3 gets ``threads``.
            torch.set_num_threads(threads)
            seconds, solved = fn(seed)
            times[name].append(seconds if solved is not None else float("inf"))
            steps[name].append(solved if solved is not None else float("inf"))
            suffix = f" (load {os.getloadavg()[0]:.1f})" if load else ""
            print(
                f"{label} seed {seed} {shown:>8}: {seconds:6.2f} s, solved at {solved}{suffix}",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in times.items()}
    # Both medians unsolved: no ratio (inf / inf); one side unsolved: the other is faster.
    if np.isinf(med["podium"]):
        speed_up = "-"
    elif np.isinf(med["sb3"]):
        speed_up = f"{names[0]} unsolved"
    else:
        speed_up = f"{med['sb3'] / med['podium']:.1f}x"
    return (
        f"| {med['sb3']:.2f} | {statistics.median(steps['sb3']):,.0f} "
        f"| {med['podium']:.2f} | {statistics.median(steps['podium']):,.0f} "
        f"| {speed_up} | "
        f"{sum(np.isfinite(times['sb3']))}/{len(seeds)}, "
        f"{sum(np.isfinite(times['podium']))}/{len(seeds)} |"
    )
