"""The evaluator: scores policies on deterministic episodes of their own env instance, never
the worker's, so a score is not biased by the worker's exploration noise or half-finished
episodes. ``evaluate_groups`` scores the P agents of a population at once, each on its slice of
one batched env (any ``VecEnv``); ``greedy_scores`` does the same on a functional env with a
pure function of a few steps (``greedy_steps``: compiled, one program whatever the episode
length); one agent is a group of one. Every agent starts from the states an env of the
episode count reset with the evaluation seed starts from (``VecEnv.reset``), so candidates
compare on equal terms and a population's agent scores what a single agent would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.pod.algorithms import policies as pi
from services.pod.algorithms.ppo import PPOShape, normalize
from services.pod.envs.base import VecEnv
from services.pod.envs.functional import FunctionalEnv

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
    the env reports one (a trading env's Sharpe ratio). Every evaluation starts from the states
    of ``seed``, every group from those of the first (``VecEnv.reset``'s ``groups``)."""
    per_group = env.num_envs // groups
    # A plugin env written before ``groups`` still evaluates one agent.
    obs, _ = env.reset(seed=seed, groups=groups) if groups > 1 else env.reset(seed=seed)
    returns = torch.zeros(env.num_envs, device=env.device)
    finished = torch.zeros(env.num_envs, device=env.device, dtype=torch.bool)
    steps = 0
    limit = max_steps or env.max_episode_steps or 10_000
    for t in range(limit):
        obs, _, term, trunc, info = env.step(act(obs))
        steps += per_group
        done = (term | trunc) & ~finished
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


#: Steps after which an evaluation of an env without a time limit stops.
MAX_EVAL_STEPS = 10_000
#: Steps per call of the evaluation program, few: the compile grows with them, evaluations are
#: seldom. The host checks between calls whether any episode runs (no cacheable ``while_loop``).
EVAL_CHUNK = 4
Carry = tuple[torch.Tensor, ...]


def greedy_steps(
    shape: PPOShape,
    env: FunctionalEnv,
    params: torch.Tensor,
    obs_mean: torch.Tensor,
    obs_var: torch.Tensor,
    limit: int,
    carry: Carry,
) -> Carry:
    """``EVAL_CHUNK`` steps of greedy episodes (see ``greedy_scores``). Once every episode has
    ended a step changes nothing, so running past the last one is harmless."""
    stats = {"obs_mean": obs_mean, "obs_var": obs_var}
    views = shape.layout.views(params)
    t, state, returns, length, alive, scores = carry
    for _ in range(EVAL_CHUNK):
        obs = normalize(shape, stats, env.observe(state))
        new, reward, terminated = env.step(state, pi.mode(shape.policy, views, obs))
        returns = returns + reward.to(returns.dtype) * alive
        length = length + alive.to(length.dtype)
        ended = terminated | (t + 1 >= limit)
        score = env.episode_score(new, length)
        score = returns if score is None else score.to(returns.dtype)
        scores = torch.where(alive & ended, score, scores)
        t = t + alive.any().to(t.dtype)
        alive = alive & ~ended
        state = torch.where(alive.unsqueeze(-1), new, state)
    return t, state, returns, length, alive, scores


def greedy_scores(
    shape: PPOShape,
    env: FunctionalEnv,
    params: torch.Tensor,
    obs_mean: torch.Tensor,
    obs_var: torch.Tensor,
    start: torch.Tensor,
    steps: Callable[..., Carry] = greedy_steps,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One greedy episode per start state (P, N, state_dim) of every agent on ``env``: the
    scores (P, N) (the returns, or the env's ``episode_score``) and the vector steps taken
    (0-dim). An episode still running at the time limit is truncated there; a finished one's
    state is held, so every quantity stays finite. ``steps``: ``greedy_steps`` or its program."""
    limit = env.max_episode_steps or MAX_EVAL_STEPS
    p, n = start.shape[0], start.shape[1]
    zeros = torch.zeros(p, n, dtype=torch.float64, device=start.device)
    carry = (
        torch.zeros((), dtype=torch.int64, device=start.device),
        start,
        zeros,
        torch.zeros(p, n, dtype=torch.int64, device=start.device),
        torch.ones(p, n, dtype=torch.bool, device=start.device),
        zeros.clone(),
    )
    while bool(carry[4].any()):
        carry = steps(shape, env, params, obs_mean, obs_var, limit, carry)
    return carry[-1], carry[0]


def results(scores: torch.Tensor, steps: torch.Tensor) -> list[EvalResult]:
    """One ``EvalResult`` per agent from ``greedy_scores``' output (the one host read)."""
    rows, taken = scores.tolist(), int(steps)
    out = []
    for episodes in rows:
        mean = sum(episodes) / len(episodes)
        std = math.sqrt(sum((r - mean) ** 2 for r in episodes) / len(episodes))
        out.append(EvalResult(mean, std, episodes, env_steps=taken * len(episodes)))
    return out
