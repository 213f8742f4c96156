"""Twin Delayed DDPG (Fujimoto et al. 2018): DDPG with its three fixes for overestimation.

ã  = clip(μ'(s') + clip(ε, −c, c), −1, 1),  ε ~ N(0, σ̃²)      (target policy smoothing)
y  = r + γ (1 − terminated) min_i Q'_i(s', ã)                  (clipped double Q)
critics: min Σ_i (Q_i(s, a) − y)²
every ``policy_delay`` updates:                                 (delayed policy updates)
    actor: max Q_1(s, μ(s));  targets: θ' ← (1 − τ) θ' + τ θ
"""

from __future__ import annotations

import gymnasium as gym
import torch

from services.pod.algorithms.ddpg import DDPG, polyak_
from services.pod.algorithms.offpolicy_config import TD3Config
from services.pod.algorithms.replay_buffer import Batch


class TD3(DDPG):
    """DDPG with twin critics, target policy smoothing and delayed actor updates."""

    name = "td3"
    config_class = TD3Config
    n_critics = 2
    config: TD3Config

    def __init__(self, obs_space: gym.spaces.Box, action_space: gym.Space, config: TD3Config):
        super().__init__(obs_space, action_space, config)
        self.updates = 0

    # -- learning ------------------------------------------------------------------------
    @torch.no_grad()
    def td_target(self, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        """Clipped double-Q target of the smoothed target policy; truncation bootstraps."""
        cfg = self.config
        mu_next = self.actor_target(batch.next_obs)
        eps = torch.randn(mu_next.shape, generator=generator, device=mu_next.device)
        smoothed = mu_next + (eps * cfg.policy_noise).clamp_(-cfg.noise_clip, cfg.noise_clip)
        q_next = self.critic_target(batch.next_obs, smoothed.clamp_(-1, 1)).amin(0)
        return batch.reward + cfg.gamma * (1 - batch.terminated) * q_next

    def update(self, batch: Batch, generator: torch.Generator) -> dict[str, torch.Tensor]:
        cfg = self.config
        y = self.td_target(batch, generator)
        critic_loss = (self.critic(batch.obs, batch.action) - y).square().mean(1).sum()
        self.optimizer.zero_grad(set_to_none=True)
        critic_loss.backward(inputs=self._critic_params)
        stats = {"critic_loss": critic_loss.detach()}
        self.updates += 1
        delayed = self.updates % cfg.policy_delay == 0
        if delayed:
            # Q_1 of the critics before this step, as in the paper's simultaneous form;
            # backward(inputs=...) keeps the actor's gradient out of the critics.
            actor_loss = -self.critic.qs[0](torch.cat((batch.obs, self.actor(batch.obs)), -1))
            actor_loss = actor_loss.mean()
            actor_loss.backward(inputs=self._actor_params)
            stats["actor_loss"] = actor_loss.detach()
        self.optimizer.step()  # parameters without a gradient (the actor, mostly) are skipped
        if delayed:
            polyak_(self._targets, self._online, cfg.tau)
        return stats
