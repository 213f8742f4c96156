"""Soft Actor-Critic (Haarnoja et al. 2018, with the learned temperature of the second paper).

A squashed Gaussian actor a = tanh(u), u ~ N(μ(s), σ(s)²), twin critics and a temperature α
that keeps the policy's entropy near a target (−dim A):

    y      = r + γ (1 − terminated) (min_i Q'_i(s', a') − α log π(a'|s')),   a' ~ π(·|s')
    critics: min Σ_i (Q_i(s, a) − y)²
    actor:   min α log π(ã|s) − min_i Q_i(s, ã),                          ã ~ π(·|s)
    α:       min −log α · (log π(ã|s) + target entropy)
    targets: θ' ← (1 − τ) θ' + τ θ

All three losses are taken on the same batch before one optimiser step (each loss
backpropagates only into its own parameters), which costs one Adam kernel per update.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.contracts.algorithms.sac.config import SACConfig
from services.pod.algorithms.base import OffPolicyAlgorithm
from services.pod.algorithms.ddpg import (
    BoundedActor,
    QCritic,
    box_space,
    frozen_copy,
    polyak_,
    uniform_action,
)
from services.pod.algorithms.noise import ActionNoise
from services.pod.algorithms.policies import Activation, Policy, mlp
from services.pod.algorithms.replay_buffer import Batch

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
_LOG_2 = math.log(2.0)


class SquashedGaussianActor(BoundedActor):
    """π(a|s): tanh of a Gaussian whose mean and log-std come from one MLP."""

    log_std_min, log_std_max = -5.0, 2.0

    def __init__(
        self, obs_dim: int, space: gym.spaces.Box, hidden: list[int], activation: Activation
    ) -> None:
        super().__init__(space)
        self.act_dim = int(np.prod(space.shape))
        self.net = mlp(obs_dim, hidden, 2 * self.act_dim, activation, out_gain=0.01)

    def sample(
        self,
        obs: torch.Tensor,
        generator: torch.Generator | None = None,
        with_logp: bool = True,
        eps: torch.Tensor | None = None,
    ):
        """(a, log π(a|s)) of a reparameterised sample a = tanh(μ + σ ε); the log-prob is
        None when ``with_logp`` is False (acting needs only a, once per env step). ``eps``:
        the standard-normal draws to use (exploration's, correlated in time), else fresh."""
        mean, log_std = self.net(obs).chunk(2, dim=-1)
        log_std = log_std.clamp(self.log_std_min, self.log_std_max)
        if eps is None:
            eps = torch.randn(mean.shape, generator=generator, device=obs.device)
        u = mean + eps * log_std.exp()
        if not with_logp:
            return torch.tanh(u), None
        # log N(u) − log|d tanh(u)/du|, with log(1 − tanh²u) = 2 (log 2 − u − softplus(−2u)).
        logp = -0.5 * eps.square() - log_std - _LOG_SQRT_2PI
        logp = logp - 2 * (_LOG_2 - u - F.softplus(-2 * u))
        return torch.tanh(u), logp.sum(-1)

    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        mean = self.net(obs)[..., : self.act_dim]
        return self.to_env(torch.tanh(mean))


def target_entropy(config: SACConfig, action_dim: int) -> float:
    """The entropy the temperature steers towards: the config's, else -|A| (SAC's default)."""
    return config.target_entropy if config.target_entropy is not None else -float(action_dim)


class SAC(OffPolicyAlgorithm, nn.Module):
    name = "sac"
    discrete = False

    def __init__(self, obs_space: gym.spaces.Box, action_space: gym.Space, config: SACConfig):
        super().__init__()
        space = box_space(action_space, self.name)
        self.config = config
        obs_dim, act_dim = int(np.prod(obs_space.shape)), int(np.prod(space.shape))
        self.action_shape = (act_dim,)
        actor = SquashedGaussianActor(obs_dim, space, config.hidden_sizes, config.activation)
        self.policy = Policy(actor, tuple(obs_space.shape), normalize_obs=False)
        self.critic = QCritic(obs_dim, act_dim, config.hidden_sizes, config.activation, n=2)
        self.critic_target = frozen_copy(self.critic)
        self.log_alpha = nn.Parameter(
            torch.tensor(math.log(config.init_alpha)), requires_grad=config.autotune_alpha
        )
        self.target_entropy = target_entropy(config, act_dim)
        self._actor_params = list(actor.parameters())
        self._critic_params = list(self.critic.parameters())
        if config.autotune_alpha:
            self._actor_params.append(self.log_alpha)
        self.optimizer = torch.optim.Adam(
            [*self._actor_params, *self._critic_params], lr=config.learning_rate, fused=True
        )
        self._targets = list(self.critic_target.parameters())
        self.noise = ActionNoise.of(config, self.action_shape)

    @property
    def actor(self) -> SquashedGaussianActor:
        return self.policy.actor

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"optimizer": self.optimizer}

    # -- acting --------------------------------------------------------------------------
    def random_action(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return uniform_action(n, self.action_shape, generator, self.actor.scale.device)

    @torch.no_grad()
    def explore(self, obs: torch.Tensor, generator: torch.Generator, env_steps: int):
        eps = self.noise.sample(len(obs), generator, obs.device)
        return self.actor.sample(obs, generator, with_logp=False, eps=eps)[0]

    def end_episodes(self, done: torch.Tensor) -> None:
        self.noise.reset(done)

    def to_env(self, action: torch.Tensor) -> torch.Tensor:
        return self.actor.to_env(action)

    # -- learning ------------------------------------------------------------------------
    @torch.no_grad()
    def td_target(
        self, batch: Batch, generator: torch.Generator, alpha: torch.Tensor
    ) -> torch.Tensor:
        """Soft clipped double-Q target; a truncated transition is bootstrapped."""
        next_action, next_logp = self.actor.sample(batch.next_obs, generator)
        q_next = self.critic_target(batch.next_obs, next_action).amin(0)
        soft_value = q_next - alpha * next_logp
        return batch.reward + self.config.gamma * (1 - batch.terminated) * soft_value

    def update(
        self, batch: Batch, generator: torch.Generator, step: int
    ) -> dict[str, torch.Tensor]:
        """One update of critics, actor and α; ``step`` (the update's number) is unused."""
        cfg = self.config
        alpha = self.log_alpha.detach().exp()
        y = self.td_target(batch, generator, alpha)
        critic_loss = (self.critic(batch.obs, batch.action) - y).square().mean(1).sum()

        action, logp = self.actor.sample(batch.obs, generator)
        actor_loss = (alpha * logp - self.critic(batch.obs, action).amin(0)).mean()
        policy_loss = actor_loss
        if cfg.autotune_alpha:  # a fixed α has no loss (and no gradient) to take
            alpha_loss = -(self.log_alpha * (logp.detach() + self.target_entropy)).mean()
            policy_loss = actor_loss + alpha_loss

        self.optimizer.zero_grad(set_to_none=True)
        critic_loss.backward(inputs=self._critic_params)
        # The actor's gradient flows through the critics but must not train them.
        policy_loss.backward(inputs=self._actor_params)
        self.optimizer.step()
        polyak_(self._targets, self._critic_params, cfg.tau)
        return {
            "critic_loss": critic_loss.detach(),
            "actor_loss": actor_loss.detach(),
            "alpha": alpha,
        }
