"""The evaluator: scores a policy on deterministic episodes of its own env instance.

It never trains and never shares an env with the worker, so a score is not biased by the
worker's exploration noise or its half-finished episodes. It keeps the best snapshot seen.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from services.pod.algorithms.policies import Policy
from services.pod.envs.base import VecEnv


@dataclass
class EvalResult:
    mean: float
    std: float
    episodes: list[float] = field(default_factory=list)
    env_steps: int = 0

    def as_dict(self) -> dict[str, float | int | list[float]]:
        return {"mean": self.mean, "std": self.std, "episodes": self.episodes}


class Evaluator:
    """Runs ``env.num_envs`` episodes at once, one per sub-environment, deterministically."""

    def __init__(self, env: VecEnv, seed: int = 0, max_steps: int | None = None) -> None:
        self.env = env
        self.seed = seed
        self.max_steps = max_steps or env.max_episode_steps or 10_000
        self.best: EvalResult | None = None
        self.best_policy_state: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def evaluate(self, policy: Policy) -> EvalResult:
        env = self.env
        # Same seed every time: candidates are compared on the same start states.
        obs, _ = env.reset(seed=self.seed)
        returns = torch.zeros(env.num_envs, device=env.device)
        finished = torch.zeros(env.num_envs, device=env.device, dtype=torch.bool)
        steps = 0
        for t in range(self.max_steps):
            obs, _, term, trunc, info = env.step(policy.act_deterministic(obs))
            steps += env.num_envs
            done = (term | trunc) & ~finished
            returns = torch.where(done, info["episode_return"].float(), returns)
            finished |= done
            # Checking every step would sync a GPU each step; every 32 is plenty.
            if t % 32 == 31 and bool(finished.all()):
                break
        episodes = returns[finished].tolist()
        if not episodes:
            raise RuntimeError(f"no evaluation episode finished within {self.max_steps} steps")
        mean = sum(episodes) / len(episodes)
        std = math.sqrt(sum((r - mean) ** 2 for r in episodes) / len(episodes))
        result = EvalResult(mean=mean, std=std, episodes=episodes, env_steps=steps)
        if self.best is None or result.mean > self.best.mean:
            self.best = result
            self.best_policy_state = copy.deepcopy(policy.state_dict())
        return result
