"""The DQN family: DQN (Mnih et al. 2015), Double DQN (van Hasselt et al. 2016), Dueling DQN
(Wang et al. 2016), and both together (D3QN), selected by the ``double`` / ``dueling`` flags.

    DQN:         y = r + γ (1 − terminated) max_a Q'(s', a)
    Double DQN:  y = r + γ (1 − terminated) Q'(s', argmax_a Q(s', a))
    loss:        Huber(Q(s, a) − y);  targets: θ' ← (1 − τ) θ' + τ θ
    Dueling:     Q(s, a) = V(s) + A(s, a) − mean_a A(s, ·)

Exploration is ε-greedy with ε decaying linearly over the first ``exploration_steps`` env
steps. ``dqn_update`` is the update of P stacked agents (services/pod/algorithms/stacked.py),
eager or compiled; each agent's targets move on its own update count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import ClassVar

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.contracts.algorithms.dqn import CARD as DQN_CARD
from services.contracts.algorithms.dqn.config import DQNConfig
from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.pod.algorithms.adam import AdamState
from services.pod.algorithms.base import OffPolicyAlgorithm
from services.pod.algorithms.compiled import Program, grad, per_agent
from services.pod.algorithms.counter_random import draws
from services.pod.algorithms.ddpg import frozen_copy
from services.pod.algorithms.flat import Layout
from services.pod.algorithms.policies import Activation, Policy, mlp
from services.pod.algorithms.replay_buffer import Batch
from services.pod.algorithms.stacked import BATCH_STREAM, Stack, adam_group_, call, draw_batch


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
    Stack: ClassVar[type[Stack]]

    def __init__(self, obs_space: gym.spaces.Box, action_space: gym.Space, config: DQNConfig):
        super().__init__()
        if not isinstance(action_space, gym.spaces.Discrete):
            raise ValueError(f"dqn needs a Discrete action space, got {action_space}")
        if int(action_space.start) != 0:
            raise ValueError("dqn needs a Discrete action space starting at 0")
        self.config = config
        self.action_shape: tuple[int, ...] = ()
        self.n_actions = int(action_space.n)
        obs_dim = int(np.prod(obs_space.shape))
        q = QNetwork(
            obs_dim, self.n_actions, config.hidden_sizes, config.activation, config.dueling
        )
        self.policy = Policy(q, tuple(obs_space.shape), normalize_obs=False)
        self.q_target = frozen_copy(q)
        self._params = list(q.parameters())
        self._targets = list(self.q_target.parameters())
        self.optimizer = AdamState(self._params, config.learning_rate)

    @property
    def q(self) -> QNetwork:
        return self.policy.actor

    def optimizers(self) -> dict[str, AdamState]:
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


def td_target(
    q_module: nn.Module,
    double: bool,
    params: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    gamma: torch.Tensor,
    batch: Batch,
) -> torch.Tensor:
    """One agent's y = r + γ (1 − terminated) V'(s') (Double DQN: Q' of the online network's
    greedy action): a truncated transition is bootstrapped."""
    with torch.no_grad():
        q_next = call(q_module, targets, batch.next_obs)
        if double:
            best = call(q_module, params, batch.next_obs).argmax(-1, keepdim=True)
            v_next = q_next.gather(-1, best).squeeze(-1)
        else:
            v_next = q_next.amax(-1)
        return batch.reward + gamma * (1 - batch.terminated) * v_next


def dqn_loss(
    q_module: nn.Module,
    double: bool,
    params: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    gamma: torch.Tensor,
    batch: Batch,
) -> torch.Tensor:
    """One agent's loss (run under ``vmap``): Huber(Q(s, a) − y)."""
    y = td_target(q_module, double, params, targets, gamma, batch)
    q = call(q_module, params, batch.obs)
    q = q.gather(-1, batch.action.unsqueeze(-1)).squeeze(-1)
    return F.smooth_l1_loss(q, y)


def dqn_update(
    q_module: nn.Module,
    layout: Layout,
    double: bool,
    batch_size: int,
    state: dict[str, torch.Tensor],
    hp: dict[str, torch.Tensor],
    replay: tuple[torch.Tensor, ...],
    filled: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One update of every agent on a minibatch it draws itself, in place on ``state``: the
    Huber loss, each agent's gradient clipped to its ``max_grad_norm``, Adam, and each agent's
    targets moved by its τ where its update number (``slot_updates`` + 1) is a multiple of its
    ``target_update_every``. Returns each agent's loss, (P,)."""
    flat, seed, counter = state["q"], state["seed"], state["counter"]
    u, _ = draws(seed, counter, {BATCH_STREAM: (batch_size,)})
    batch = draw_batch(replay, filled, u[BATCH_STREAM])
    params = layout.views(flat, "policy.actor.")
    targets = layout.views(state["q_target"], "policy.actor.")
    losses = per_agent(functools.partial(dqn_loss, q_module, double))

    def total(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss = losses(params, targets, hp["gamma"], batch)
        return loss.sum(), loss

    grads, loss = grad(total)(params)
    adam_group_(state, "q", grads, params, hp["learning_rate"], hp["max_grad_norm"])
    updates = state["slot_updates"]
    updates.add_(1)
    with torch.no_grad():
        due = torch.remainder(updates, hp["target_update_every"]) == 0
        state["q_target"].lerp_(flat, (hp["tau"] * due).unsqueeze(1))
    counter.add_(1)
    return {"loss": loss}


class DQNStack(Stack):
    """P DQN agents (double, dueling: as the template) stacked: their Q-networks one flat
    tensor with one Adam, their targets a second; ε-greedy, each agent on its own env steps."""

    HYPERPARAMETERS = DQN_CARD.population.hyperparameters if DQN_CARD.population else ()
    update = Program(dqn_update, "dqn_update")
    optimised = ("q",)
    slot_updates = True

    def __init__(self, agents: Sequence[DQN]) -> None:
        template = agents[0]
        self.double = template.config.double
        self.n_actions = template.n_actions
        self._q = per_agent(lambda params, o: call(template.q, params, o))
        super().__init__(agents)
        # ε as the single agent computes it, in double precision; update numbers are integers.
        for k in ("epsilon_start", "epsilon_end", "exploration_steps"):
            self.hp[k] = self.hp[k].double()
        self.hp["target_update_every"] = self.hp["target_update_every"].long()
        for i, agent in enumerate(agents):
            self.set_hyperparameters(i, agent.config)

    def groups(self, agent: DQN) -> dict[str, tuple[list[str], list[torch.Tensor]]]:
        names = {id(t): n for n, t in agent.named_parameters()}
        mine = [names[id(t)] for t in agent._params]
        return {"q": (mine, agent._params), "q_target": (mine, agent._targets)}

    def check(self, agent: DQN) -> None:
        mine = self.template.config
        for name in ("double", "dueling"):
            if getattr(agent.config, name) != getattr(mine, name):
                raise HyperparameterError(f"dqn.{name} must be the same for every agent")

    def constants(self, delayed: bool) -> tuple:
        return (self.template.q, self.layouts["q"], self.double)

    def _views(self) -> dict[str, torch.Tensor]:
        return self.layouts["q"].views(self.flats["q"].detach(), "policy.actor.")

    def epsilon(self, env_steps: torch.Tensor) -> torch.Tensor:
        """Each agent's ε (P,) at its own env steps (P,): ``DQN.epsilon`` of each."""
        hp = self.hp
        frac = (env_steps.double() / hp["exploration_steps"]).clamp(max=1.0)
        return hp["epsilon_start"] + frac * (hp["epsilon_end"] - hp["epsilon_start"])

    @torch.no_grad()
    def explore(
        self, obs: torch.Tensor, generator: torch.Generator, env_steps: torch.Tensor
    ) -> torch.Tensor:
        """ε-greedy actions (P, n), agent p with its ε at its ``env_steps[p]``."""
        greedy = self.deterministic(obs)
        explore = torch.rand(greedy.shape, generator=generator, device=obs.device)
        explore = explore < self.epsilon(env_steps).float().unsqueeze(1)
        random = self.random_action(greedy.numel(), generator).view(greedy.shape)
        return torch.where(explore, random, greedy)

    @torch.no_grad()
    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """The greedy actions (P, n) for observations (P, n, D)."""
        return self._q(self._views(), obs).argmax(-1)


DQN.Stack = DQNStack
