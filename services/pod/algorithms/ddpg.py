"""Deep Deterministic Policy Gradient (Lillicrap et al. 2016), and the pieces TD3 and SAC share.

DDPG learns a deterministic actor μ(s) and a critic Q(s, a) from replayed transitions:

    y = r + γ (1 − terminated) Q'(s', μ'(s'))          (target networks, primed)
    critic:  min (Q(s, a) − y)²
    actor:   max Q(s, μ(s))
    targets: θ' ← (1 − τ) θ' + τ θ                     (soft updates)

Actions are kept in [-1, 1] (a tanh head) inside the agent and in the replay buffer; only the
env sees them rescaled to its bounds. Exploration adds Gaussian noise to μ(s), independent or
correlated in time (``action_noise``, services/pod/algorithms/noise.py).
"""

from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from services.contracts.algorithms.ddpg.config import DDPGConfig
from services.pod.algorithms.base import OffPolicyAlgorithm
from services.pod.algorithms.noise import ActionNoise
from services.pod.algorithms.policies import Activation, Policy, mlp
from services.pod.algorithms.replay_buffer import Batch


@torch.no_grad()
def polyak_(target: list[torch.Tensor], online: list[torch.Tensor], tau: float) -> None:
    """θ' ← θ' + τ (θ − θ'), all tensors in one fused op."""
    torch._foreach_lerp_(target, online, tau)


def box_space(action_space: gym.Space, algorithm: str) -> gym.spaces.Box:
    if not isinstance(action_space, gym.spaces.Box):
        raise ValueError(f"{algorithm} needs a continuous (Box) action space, got {action_space}")
    if not (np.all(np.isfinite(action_space.low)) and np.all(np.isfinite(action_space.high))):
        raise ValueError(f"{algorithm} needs finite action bounds, got {action_space}")
    return action_space


class BoundedActor(nn.Module):
    """Maps actions in [-1, 1] (the agent's own scale) to the env's bounds."""

    def __init__(self, space: gym.spaces.Box) -> None:
        super().__init__()
        low = torch.as_tensor(space.low, dtype=torch.float32)
        high = torch.as_tensor(space.high, dtype=torch.float32)
        self.register_buffer("scale", (high - low) / 2)
        self.register_buffer("center", (high + low) / 2)

    def to_env(self, action: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.center, self.scale, action)


class DeterministicActor(BoundedActor):
    """μ(s) = tanh(MLP(s)), in [-1, 1]."""

    def __init__(
        self, obs_dim: int, space: gym.spaces.Box, hidden: list[int], activation: Activation
    ) -> None:
        super().__init__(space)
        self.net = mlp(obs_dim, hidden, int(np.prod(space.shape)), activation, out_gain=0.01)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(obs))

    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.to_env(self(obs))


class QCritic(nn.Module):
    """``n`` independent state-action critics Q_i(s, a); returns (n, B)."""

    def __init__(
        self, obs_dim: int, act_dim: int, hidden: list[int], activation: Activation, n: int = 1
    ) -> None:
        super().__init__()
        self.qs = nn.ModuleList(mlp(obs_dim + act_dim, hidden, 1, activation) for _ in range(n))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = torch.cat((obs, action), dim=-1)
        return torch.stack([q(x).squeeze(-1) for q in self.qs])

    def q1(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """Q_1(s, a) alone, (B,): the actor's objective needs no other head."""
        return self.qs[0](torch.cat((obs, action), dim=-1)).squeeze(-1)


def frozen_copy(module: nn.Module) -> nn.Module:
    """A target network: same weights, no gradients."""
    target = copy.deepcopy(module)
    target.requires_grad_(False)
    return target


def uniform_action(
    n: int, shape: tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Uniform actions in [-1, 1] (the actors' normalised action range), before learning."""
    u = torch.rand((n, *shape), generator=generator, device=device)
    return u.mul_(2).sub_(1)


class DDPG(OffPolicyAlgorithm, nn.Module):
    """The DDPG agent: actor, critic, their targets and one optimiser."""

    name = "ddpg"
    discrete = False
    n_critics = 1  # TD3 is this agent with two, a smoothed target action and a policy delay

    def __init__(
        self, obs_space: gym.spaces.Box, action_space: gym.Space, config: DDPGConfig
    ) -> None:
        super().__init__()
        space = box_space(action_space, self.name)
        self.config = config
        obs_dim, act_dim = int(np.prod(obs_space.shape)), int(np.prod(space.shape))
        self.action_shape = (act_dim,)
        actor = DeterministicActor(obs_dim, space, config.hidden_sizes, config.activation)
        self.policy = Policy(actor, tuple(obs_space.shape), normalize_obs=False)
        self.critic = QCritic(
            obs_dim, act_dim, config.hidden_sizes, config.activation, n=self.n_critics
        )
        self.actor_target = frozen_copy(actor)
        self.critic_target = frozen_copy(self.critic)
        self._actor_params = list(actor.parameters())
        self._critic_params = list(self.critic.parameters())
        # In the targets' order, so one fused lerp updates every target.
        self._online = [*self._actor_params, *self._critic_params]
        self._targets = [*self.actor_target.parameters(), *self.critic_target.parameters()]
        self.optimizer = torch.optim.Adam(self._online, lr=config.learning_rate, fused=True)
        self.noise = ActionNoise.of(config, self.action_shape)

    @property
    def actor(self) -> DeterministicActor:
        return self.policy.actor

    @property
    def policy_delay(self) -> int:
        """Critic updates per actor (and target) update: DDPG updates both every time."""
        return 1

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"optimizer": self.optimizer}

    # -- acting --------------------------------------------------------------------------
    def random_action(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return uniform_action(n, self.action_shape, generator, self.actor.scale.device)

    @torch.no_grad()
    def explore(self, obs: torch.Tensor, generator: torch.Generator, env_steps: int):
        action = self.actor(obs)
        noise = self.noise.sample(len(action), generator, action.device)
        return action.add_(noise, alpha=self.config.exploration_noise).clamp_(-1, 1)

    def end_episodes(self, done: torch.Tensor) -> None:
        self.noise.reset(done)

    def to_env(self, action: torch.Tensor) -> torch.Tensor:
        return self.actor.to_env(action)

    # -- learning ------------------------------------------------------------------------
    @torch.no_grad()
    def next_action(self, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        """a' = μ'(s'), the target policy's action the TD target bootstraps from."""
        return self.actor_target(batch.next_obs)

    @torch.no_grad()
    def td_target(self, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        """y = r + γ (1 − terminated) min_i Q'_i(s', a'): a truncated transition is
        bootstrapped (with one critic the min is Q' itself)."""
        q_next = self.critic_target(batch.next_obs, self.next_action(batch, generator)).amin(0)
        return batch.reward + self.config.gamma * (1 - batch.terminated) * q_next

    def update(
        self, batch: Batch, generator: torch.Generator, step: int
    ) -> dict[str, torch.Tensor]:
        """Update number ``step`` (1-based, counted by the caller): the critics every time,
        the actor and the targets every ``policy_delay``-th."""
        y = self.td_target(batch, generator)
        critic_loss = (self.critic(batch.obs, batch.action) - y).square().mean(1).sum()
        self.optimizer.zero_grad(set_to_none=True)
        critic_loss.backward(inputs=self._critic_params)
        stats = {"critic_loss": critic_loss.detach()}
        delayed = step % self.policy_delay == 0
        if delayed:
            # Q_1 of the critics before this step, as in TD3's simultaneous form;
            # backward(inputs=...) keeps the actor's gradient out of the critics.
            actor_loss = -self.critic.q1(batch.obs, self.actor(batch.obs)).mean()
            actor_loss.backward(inputs=self._actor_params)
            stats["actor_loss"] = actor_loss.detach()
        self.optimizer.step()  # skips parameters without a gradient (the actor, between delays)
        if delayed:
            polyak_(self._targets, self._online, self.config.tau)
        return stats
