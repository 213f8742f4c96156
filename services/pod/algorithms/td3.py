"""Twin Delayed DDPG (Fujimoto et al. 2018): DDPG with its three fixes for overestimation.

ã  = clip(μ'(s') + clip(ε, −c, c), −1, 1),  ε ~ N(0, σ̃²)      (target policy smoothing)
y  = r + γ (1 − terminated) min_i Q'_i(s', ã)                  (clipped double Q)
critics: min Σ_i (Q_i(s, a) − y)²
every ``policy_delay`` updates:                                 (delayed policy updates)
    actor: max Q_1(s, μ(s));  targets: θ' ← (1 − τ) θ' + τ θ
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from services.pod.algorithms.ddpg import (
    DeterministicActor,
    QCritic,
    box_space,
    frozen_copy,
    polyak_,
)
from services.pod.algorithms.policies import Activation, Policy
from services.pod.algorithms.replay_buffer import Batch


class TD3Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(1e-3, gt=0)
    gamma: float = Field(0.98, gt=0, le=1)
    tau: float = Field(0.005, gt=0, le=1, description="Soft target update rate.")
    hidden_sizes: list[int] = Field(default_factory=lambda: [256, 256], min_length=1)
    activation: Activation = "relu"
    exploration_noise: float = Field(0.1, ge=0, description="Std of the Gaussian action noise.")
    policy_noise: float = Field(0.2, ge=0, description="Std of the target policy smoothing.")
    noise_clip: float = Field(0.5, ge=0)
    policy_delay: int = Field(2, ge=1, description="Critic updates per actor update.")


class TD3(nn.Module):
    name = "td3"
    config_class = TD3Config
    discrete = False

    def __init__(self, obs_space: gym.spaces.Box, action_space: gym.Space, config: TD3Config):
        super().__init__()
        space = box_space(action_space, self.name)
        self.config = config
        obs_dim, act_dim = int(np.prod(obs_space.shape)), int(np.prod(space.shape))
        self.action_shape = (act_dim,)
        actor = DeterministicActor(obs_dim, space, config.hidden_sizes, config.activation)
        self.policy = Policy(actor, tuple(obs_space.shape), normalize_obs=False)
        self.critic = QCritic(obs_dim, act_dim, config.hidden_sizes, config.activation, n=2)
        self.actor_target = frozen_copy(actor)
        self.critic_target = frozen_copy(self.critic)
        self._actor_params = list(actor.parameters())
        self._critic_params = list(self.critic.parameters())
        self.optimizer = torch.optim.Adam(
            [*self._actor_params, *self._critic_params], lr=config.learning_rate, fused=True
        )
        self._targets = [*self.actor_target.parameters(), *self.critic_target.parameters()]
        self._online = [*self._actor_params, *self._critic_params]
        self.updates = 0

    @property
    def actor(self) -> DeterministicActor:
        return self.policy.actor

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"optimizer": self.optimizer}

    # -- acting --------------------------------------------------------------------------
    def random_action(self, n: int, generator: torch.Generator) -> torch.Tensor:
        device = self.actor.scale.device
        u = torch.rand((n, *self.action_shape), generator=generator, device=device)
        return u.mul_(2).sub_(1)

    @torch.no_grad()
    def explore(self, obs: torch.Tensor, generator: torch.Generator, env_steps: int):
        action = self.actor(obs)
        noise = torch.randn(action.shape, generator=generator, device=action.device)
        return action.add_(noise, alpha=self.config.exploration_noise).clamp_(-1, 1)

    def to_env(self, action: torch.Tensor) -> torch.Tensor:
        return self.actor.to_env(action)

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
