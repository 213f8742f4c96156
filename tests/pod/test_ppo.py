"""PPO: GAE against a direct computation (its learning within an env-step budget, from the
presets: tests/pod/test_presets_solve.py)."""

from __future__ import annotations

import pytest
import torch

from services.pod.algorithms.ppo import gae
from services.pod.config import PPORunConfig
from services.pod.training.fit import train
from services.pod.training.presets import preset


def reference_gae(rewards, values, dones, next_value, gamma, lam):
    """GAE written the slow, obvious way: per env, per step, sum of discounted TD errors."""
    steps, envs = rewards.shape
    adv = torch.zeros(steps, envs, dtype=torch.float64)
    for n in range(envs):
        for t in range(steps):
            total, discount = 0.0, 1.0
            for k in range(t, steps):
                following = next_value[n] if k == steps - 1 else values[k + 1, n]
                delta = rewards[k, n] + gamma * following * (not dones[k, n]) - values[k, n]
                total += discount * delta
                if dones[k, n]:
                    break
                discount *= gamma * lam
            adv[t, n] = total
    return adv


def test_gae_matches_direct_sum():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(7, 3, generator=g, dtype=torch.float64)
    values = torch.randn(7, 3, generator=g, dtype=torch.float64)
    next_value = torch.randn(3, generator=g, dtype=torch.float64)
    dones = torch.rand(7, 3, generator=g) < 0.3
    adv, returns = gae(rewards, values, dones, next_value, 0.97, 0.9)
    expected = reference_gae(rewards, values, dones, next_value, 0.97, 0.9)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, expected + values)


def test_unknown_algorithm_lists_known_names():
    from services.registry import UnknownNameError

    cfg = PPORunConfig.model_validate({**preset("ppo", "CartPole-v1"), "algorithm": "a2c-magic"})
    with pytest.raises(UnknownNameError, match="known: .*ppo"):
        train(cfg)
