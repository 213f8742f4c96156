"""Twin Delayed DDPG (Fujimoto et al. 2018): DDPG with its three fixes for overestimation.

ã  = clip(μ'(s') + clip(ε, −c, c), −1, 1),  ε ~ N(0, σ̃²)      (target policy smoothing)
y  = r + γ (1 − terminated) min_i Q'_i(s', ã)                  (clipped double Q)
critics: min Σ_i (Q_i(s, a) − y)²
every ``policy_delay`` updates:                                 (delayed policy updates)
    actor: max Q_1(s, μ(s));  targets: θ' ← (1 − τ) θ' + τ θ

DDPG's target and update already take the min over the critics and a policy delay; TD3 sets
two critics, its own delay and the smoothed target action.
"""

from __future__ import annotations

import torch

from services.contracts.algorithms.td3.config import TD3Config
from services.pod.algorithms.ddpg import DDPG
from services.pod.algorithms.replay_buffer import Batch


class TD3(DDPG):
    """DDPG with twin critics, target policy smoothing and delayed actor updates."""

    name = "td3"
    n_critics = 2
    config: TD3Config

    @property
    def policy_delay(self) -> int:
        return self.config.policy_delay

    @torch.no_grad()
    def next_action(self, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        """ã: the target policy's action with clipped Gaussian noise (target smoothing)."""
        cfg = self.config
        mu_next = self.actor_target(batch.next_obs)
        eps = torch.randn(mu_next.shape, generator=generator, device=mu_next.device)
        smoothed = mu_next + (eps * cfg.policy_noise).clamp_(-cfg.noise_clip, cfg.noise_clip)
        return smoothed.clamp_(-1, 1)
