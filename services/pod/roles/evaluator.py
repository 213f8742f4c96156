"""The evaluator: scores policies on deterministic episodes of their own env instance.

It never trains and never shares an env with the worker, so a score is not biased by the
worker's exploration noise or its half-finished episodes. ``evaluate_groups`` scores the P
agents of a population at once, each on its slice of one batched env; ``Evaluator`` scores
one policy and keeps the best snapshot seen.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.pod.algorithms.policies import Policy
from services.pod.envs.base import TorchVecEnv, VecEnv

#: Deterministic actions for a batch of raw observations.
Act = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class EvalResult:
    mean: float
    std: float
    episodes: list[float] = field(default_factory=list)
    env_steps: int = 0


@torch.no_grad()
def evaluate_groups(
    env: VecEnv, act: Act, groups: int = 1, seed: int = 0, max_steps: int | None = None
) -> list[EvalResult]:
    """One episode per sub-environment; group g (of ``groups``) owns the g-th equal slice of
    ``env`` and gets its own result: the episodes' returns, or their ``episode_score`` where
    the env reports one (services/pod/envs/base.py).

    Every evaluation starts from the same states (``seed``), so candidates compare on equal terms.
    With several groups on a torch-native env, every group starts from the states an env of one
    group's size reset with ``seed`` starts from: each scores what a single agent with its weights
    would. (Other envs seed each sub-environment apart: each group gets its own start states.)"""
    per_group = env.num_envs // groups
    obs, _ = env.reset(seed=seed)
    if isinstance(env, TorchVecEnv) and groups > 1:
        # The subclass hooks of TorchVecEnv, exactly as its reset() uses them.
        env.generator.manual_seed(int(seed))
        start = env._initial_state(per_group)
        env.state.copy_(start.repeat(groups, *([1] * (start.dim() - 1))))
        obs = env._observe(env.state)
    returns = torch.zeros(env.num_envs, device=env.device)
    finished = torch.zeros(env.num_envs, device=env.device, dtype=torch.bool)
    steps = 0
    limit = max_steps or env.max_episode_steps or 10_000
    for t in range(limit):
        obs, _, term, trunc, info = env.step(act(obs))
        steps += per_group
        done = (term | trunc) & ~finished
        # An env whose episodes are judged by something other than their return (a trading
        # env's Sharpe ratio) reports it as ``episode_score``.
        score = info.get("episode_score", info["episode_return"])
        returns = torch.where(done, score.float(), returns)
        finished |= done
        # Checking every step would sync a GPU each step; every 32 is plenty.
        if t % 32 == 31 and bool(finished.all()):
            break
    results = []
    for g in range(groups):
        mine = slice(g * per_group, (g + 1) * per_group)
        episodes = returns[mine][finished[mine]].tolist()
        if not episodes:
            which = f"agent {g}: " if groups > 1 else ""
            raise RuntimeError(f"{which}no evaluation episode finished within {limit} steps")
        mean = sum(episodes) / len(episodes)
        std = math.sqrt(sum((r - mean) ** 2 for r in episodes) / len(episodes))
        results.append(EvalResult(mean=mean, std=std, episodes=episodes, env_steps=steps))
    return results


class Evaluator:
    """Runs ``env.num_envs`` episodes at once, one per sub-environment, deterministically."""

    def __init__(self, env: VecEnv, seed: int = 0, max_steps: int | None = None) -> None:
        self.env = env
        self.seed = seed
        self.max_steps = max_steps
        self.best: EvalResult | None = None
        self.best_policy_state: dict[str, torch.Tensor] | None = None

    def evaluate(self, policy: Policy) -> EvalResult:
        [result] = evaluate_groups(
            self.env, policy.act_deterministic, seed=self.seed, max_steps=self.max_steps
        )
        if self.best is None or result.mean > self.best.mean:
            self.best = result
            self.best_policy_state = copy.deepcopy(policy.state_dict())
        return result
