"""What the SB3 side-by-side benchmarks share: the machine line and SB3's timed learn().

SB3 is evaluated deterministically every ``every`` env steps on its own env; the clock stops
while it evaluates and training stops at the first evaluation that reaches ``threshold``, as
Podium's own loops do (services/pod/train.py, services/pod/offpolicy.py).
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import torch


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def timed_learn(
    model: Any, eval_env: Any, budget: int, threshold: float, every: int, episodes: int
) -> tuple[float, int | None]:
    """Train an SB3 ``model``; return (wall time excluding evaluation, env steps at solve)."""
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.evaluation import evaluate_policy

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
