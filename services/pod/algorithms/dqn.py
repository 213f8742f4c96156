"""The DQN family: DQN (Mnih et al. 2015), Double DQN (van Hasselt et al. 2016), Dueling DQN
(Wang et al. 2016), and both together (D3QN), selected by the ``double`` / ``dueling`` flags.

    DQN:         y = r + γ (1 − terminated) max_a Q'(s', a)
    Double DQN:  y = r + γ (1 − terminated) Q'(s', argmax_a Q(s', a))
    loss:        Huber(Q(s, a) − y);  targets: θ' ← (1 − τ) θ' + τ θ
    Dueling:     Q(s, a) = V(s) + A(s, a) − mean_a A(s, ·)

Exploration is ε-greedy with ε decaying linearly over the first ``exploration_steps`` env
steps.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.contracts.algorithms.dqn.config import DQNConfig
from services.pod.algorithms.base import OffPolicyAlgorithm
from services.pod.algorithms.ddpg import frozen_copy, polyak_
from services.pod.algorithms.policies import Activation, Policy, mlp
from services.pod.algorithms.replay_buffer import Batch


class QNetwork(nn.Module):
    """Q(s, ·) for every discrete action; the greedy action is what it plays deterministically."""

    def __init__(
        self, obs_dim: int, n: int, hidden: list[int], activation: Activation, dueling: bool
    ) -> None:
        super().__init__()
        self.dueling = dueling
        # With dueling heads the trunk's last layer is the value and advantage streams at once.
        self.net = mlp(obs_dim, hidden, n + 1 if dueling else n, activation)
        self.n = n

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.net(obs)
        if not self.dueling:
            return out
        value, advantage = out[..., :1], out[..., 1:]
        return value + advantage - advantage.mean(-1, keepdim=True)

    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        return self(obs).argmax(-1)


class DQN(OffPolicyAlgorithm, nn.Module):
    name = "dqn"
    discrete = True

    def __init__(self, obs_space: gym.spaces.Box, action_space: gym.Space, config: DQNConfig):
        super().__init__()
        if not isinstance(action_space, gym.spaces.Discrete):
            raise ValueError(f"dqn needs a Discrete action space, got {action_space}")
        if int(action_space.start) != 0:
            raise ValueError("dqn needs a Discrete action space starting at 0")
        self.config = config
        self.action_shape: tuple[int, ...] = ()
        self.n_actions = int(action_space.n)
        q = QNetwork(
            int(np.prod(obs_space.shape)),
            self.n_actions,
            config.hidden_sizes,
            config.activation,
            config.dueling,
        )
        self.policy = Policy(q, tuple(obs_space.shape), normalize_obs=False)
        self.q_target = frozen_copy(q)
        self._params = list(q.parameters())
        self._targets = list(self.q_target.parameters())
        self.optimizer = torch.optim.Adam(self._params, lr=config.learning_rate, fused=True)

    @property
    def q(self) -> QNetwork:
        return self.policy.actor

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"optimizer": self.optimizer}

    # -- acting --------------------------------------------------------------------------
    def epsilon(self, env_steps: int) -> float:
        cfg = self.config
        frac = min(1.0, env_steps / cfg.exploration_steps)
        return cfg.epsilon_start + frac * (cfg.epsilon_end - cfg.epsilon_start)

    def random_action(self, n: int, generator: torch.Generator) -> torch.Tensor:
        device = self._params[0].device
        return torch.randint(0, self.n_actions, (n,), generator=generator, device=device)

    @torch.no_grad()
    def explore(self, obs: torch.Tensor, generator: torch.Generator, env_steps: int):
        greedy = self.q(obs).argmax(-1)
        explore = torch.rand(greedy.shape, generator=generator, device=obs.device)
        explore = explore < self.epsilon(env_steps)
        return torch.where(explore, self.random_action(len(greedy), generator), greedy)

    def to_env(self, action: torch.Tensor) -> torch.Tensor:
        return action

    # -- learning ------------------------------------------------------------------------
    @torch.no_grad()
    def td_target(self, batch: Batch) -> torch.Tensor:
        """y = r + γ (1 − terminated) V'(s'): a truncated transition is bootstrapped."""
        q_next = self.q_target(batch.next_obs)
        if self.config.double:
            best = self.q(batch.next_obs).argmax(-1, keepdim=True)
            v_next = q_next.gather(-1, best).squeeze(-1)
        else:
            v_next = q_next.amax(-1)
        return batch.reward + self.config.gamma * (1 - batch.terminated) * v_next

    def update(
        self, batch: Batch, generator: torch.Generator, step: int
    ) -> dict[str, torch.Tensor]:
        """Update number ``step`` (1-based, counted by the caller); the targets move every
        ``target_update_every``-th."""
        cfg = self.config
        y = self.td_target(batch)
        q = self.q(batch.obs).gather(-1, batch.action.unsqueeze(-1)).squeeze(-1)
        loss = F.smooth_l1_loss(q, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self._params, cfg.max_grad_norm, foreach=True)
        self.optimizer.step()
        if step % cfg.target_update_every == 0:
            polyak_(self._targets, self._params, cfg.tau)
        return {"loss": loss.detach()}
