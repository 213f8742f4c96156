"""Deep Deterministic Policy Gradient (Lillicrap et al. 2016), and the pieces TD3 and SAC share:
the agent, DDPG's and TD3's losses and update over explicit state, and their stack of P agents.

DDPG learns a deterministic actor μ(s) and a critic Q(s, a) from replayed transitions:

    y = r + γ (1 − terminated) Q'(s', μ'(s'))          (target networks, primed)
    critic:  min (Q(s, a) − y)²
    actor:   max Q(s, μ(s))
    targets: θ' ← (1 − τ) θ' + τ θ                     (soft updates)

Actions are kept in [-1, 1] (a tanh head) inside the agent and in the replay buffer; only the
env sees them rescaled to its bounds. Exploration adds Gaussian noise to μ(s), independent or
correlated in time (``action_noise``, services/pod/algorithms/noise.py). ``td3_update``, the
update of P stacked agents (services/pod/algorithms/stacked.py), eager or compiled, serves DDPG
and TD3 (td3.py: this agent with twin critics, a smoothed target action and a policy delay).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from services.contracts.algorithms.ddpg.config import DDPGConfig
from services.pod.algorithms.adam import AdamState
from services.pod.algorithms.base import OffPolicyAlgorithm
from services.pod.algorithms.compiled import Program, grad, per_agent
from services.pod.algorithms.counter_random import draws
from services.pod.algorithms.flat import Layout
from services.pod.algorithms.noise import ActionNoise
from services.pod.algorithms.policies import Activation, Policy, mlp
from services.pod.algorithms.replay_buffer import Batch
from services.pod.algorithms.stacked import BATCH_STREAM, Stack, adam_group_, call, draw_batch


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


def frozen_copy(module: nn.Module) -> nn.Module:
    """A target network: same weights, no gradients."""
    target = copy.deepcopy(module)
    target.requires_grad_(False)
    return target


def uniform_action(
    n: int, shape: tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Uniform actions in [-1, 1] (the actors' normalised action range), before learning."""
    return torch.rand((n, *shape), generator=generator, device=device).mul_(2).sub_(1)


class ActorCritic(OffPolicyAlgorithm, nn.Module):
    """What the DDPG, TD3 and SAC agents share: an ``Actor`` in [-1, 1] behind ``policy``,
    ``n_critics`` Q critics and their target, one optimiser (the subclass's), the noise."""

    discrete = False
    n_critics: ClassVar[int]
    Actor: ClassVar[Callable[..., BoundedActor]]
    Stack: ClassVar[type[Stack]]
    optimizer: AdamState

    def __init__(self, obs_space: gym.spaces.Box, action_space: gym.Space, config) -> None:
        super().__init__()
        space = box_space(action_space, self.name)
        self.config = config
        obs_dim, act_dim = int(np.prod(obs_space.shape)), int(np.prod(space.shape))
        self.action_shape = (act_dim,)
        actor = self.Actor(obs_dim, space, config.hidden_sizes, config.activation)
        self.policy = Policy(actor, tuple(obs_space.shape), normalize_obs=False)
        self.critic = QCritic(
            obs_dim, act_dim, config.hidden_sizes, config.activation, n=self.n_critics
        )
        self.critic_target = frozen_copy(self.critic)
        self._actor_params = list(actor.parameters())
        self._critic_params = list(self.critic.parameters())
        self.noise = ActionNoise.of(config, self.action_shape)

    @property
    def actor(self) -> Any:
        return self.policy.actor

    def optimizers(self) -> dict[str, AdamState]:
        return {"optimizer": self.optimizer}

    def random_action(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return uniform_action(n, self.action_shape, generator, self.actor.scale.device)

    def end_episodes(self, done: torch.Tensor) -> None:
        self.noise.reset(done)

    def to_env(self, action: torch.Tensor) -> torch.Tensor:
        return self.actor.to_env(action)


class DDPG(ActorCritic):
    """The DDPG agent: actor, critic, their targets and one optimiser."""

    name = "ddpg"
    Actor = DeterministicActor
    n_critics = 1  # TD3 is this agent with two, a smoothed target action and a policy delay
    #: TD3's target policy smoothing.
    smoothing = False
    config: DDPGConfig

    def __init__(
        self, obs_space: gym.spaces.Box, action_space: gym.Space, config: DDPGConfig
    ) -> None:
        super().__init__(obs_space, action_space, config)
        self.actor_target = frozen_copy(self.actor)
        # In the targets' order, so one fused lerp updates every target.
        self._online = [*self._actor_params, *self._critic_params]
        self._targets = [*self.actor_target.parameters(), *self.critic_target.parameters()]
        self.optimizer = AdamState(self._online, config.learning_rate)

    @property
    def policy_delay(self) -> int:
        """Critic updates per actor (and target) update: DDPG updates both every time."""
        return 1

    @torch.no_grad()
    def explore(self, obs: torch.Tensor, generator: torch.Generator, env_steps: int):
        action = self.actor(obs)
        noise = self.noise.sample(len(action), generator, action.device)
        return action.add_(noise, alpha=self.config.exploration_noise).clamp_(-1, 1)


def td_target(
    actor_target: nn.Module,
    critic_target: nn.Module,
    smoothing: bool,
    actor_t: dict[str, torch.Tensor],
    critic_t: dict[str, torch.Tensor],
    hp: dict[str, torch.Tensor],
    batch: Batch,
    eps: torch.Tensor,
) -> torch.Tensor:
    """One agent's y = r + γ (1 − terminated) min_i Q'_i(s', a'), a' the target actor's action
    (TD3: smoothed with clipped noise ``eps``): a truncated transition is bootstrapped."""
    with torch.no_grad():
        a = call(actor_target, actor_t, batch.next_obs)
        if smoothing:
            clip = hp["noise_clip"]
            a = (a + (eps * hp["policy_noise"]).clamp(-clip, clip)).clamp(-1, 1)
        q_next = call(critic_target, critic_t, batch.next_obs, a).amin(0)
        return batch.reward + hp["gamma"] * (1 - batch.terminated) * q_next


def td3_critic_loss(
    actor_target: nn.Module,
    critic_target: nn.Module,
    critic_module: nn.Module,
    smoothing: bool,
    actor_t: dict[str, torch.Tensor],
    critic: dict[str, torch.Tensor],
    critic_t: dict[str, torch.Tensor],
    hp: dict[str, torch.Tensor],
    batch: Batch,
    eps: torch.Tensor,
) -> torch.Tensor:
    """One agent's critic loss (run under ``vmap``): Σ_i (Q_i(s, a) − y)²."""
    y = td_target(actor_target, critic_target, smoothing, actor_t, critic_t, hp, batch, eps)
    q = call(critic_module, critic, batch.obs, batch.action)
    return (q - y).square().mean(1).sum()


def td3_actor_loss(
    actor_module: nn.Module,
    critic_module: nn.Module,
    actor: dict[str, torch.Tensor],
    critic: dict[str, torch.Tensor],
    obs: torch.Tensor,
) -> torch.Tensor:
    """One agent's actor loss: −Q_1 of the critics before this step, detached: it trains none."""
    frozen = {k: v.detach() for k, v in critic.items()}
    action = call(actor_module, actor, obs)
    return -call(critic_module, frozen, obs, action)[0].mean()


def td3_update(
    modules: tuple[nn.Module, nn.Module, nn.Module, nn.Module],
    actor_layout: Layout,
    critic_layout: Layout,
    smoothing: bool,
    delayed: bool,
    batch_size: int,
    state: dict[str, torch.Tensor],
    hp: dict[str, torch.Tensor],
    replay: tuple[torch.Tensor, ...],
    filled: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One update of every DDPG or TD3 agent (``delayed``: this update steps the actors and
    the targets too) on a minibatch it draws itself, in place on ``state``. ``modules``: the
    template's actor, actor target, critic and critic target."""
    actor_m, actor_target_m, critic_m, critic_target_m = modules
    seed, counter = state["seed"], state["counter"]
    p, b = state["critic"].shape[0], batch_size
    a = replay[1].shape[-1]
    u, n = draws(seed, counter, {BATCH_STREAM: (b,)}, {1: (b, a)} if smoothing else None)
    batch = draw_batch(replay, filled, u[BATCH_STREAM])
    noise = n[1] if smoothing else batch.action.new_zeros(p, b, a)
    critic = critic_layout.views(state["critic"], "critic.")
    critic_t = critic_layout.views(state["critic_target"], "critic.")
    actor = actor_layout.views(state["actor"], "policy.actor.")
    actor_t = actor_layout.views(state["actor_target"], "policy.actor.")
    critic_losses = per_agent(
        functools.partial(td3_critic_loss, actor_target_m, critic_target_m, critic_m, smoothing)
    )
    actor_losses = per_agent(functools.partial(td3_actor_loss, actor_m, critic_m))

    def total(critic: dict, actor: dict) -> tuple[torch.Tensor, tuple]:
        critic_loss = critic_losses(actor_t, critic, critic_t, hp, batch, noise)
        if not delayed:
            return critic_loss.sum(), (critic_loss,)
        actor_loss = actor_losses(actor, critic, batch.obs)
        return critic_loss.sum() + actor_loss.sum(), (critic_loss, actor_loss)

    (g_critic, g_actor), aux = grad(total, argnums=(0, 1))(critic, actor)
    adam_group_(state, "critic", g_critic, critic, hp["learning_rate"])
    stats = {"critic_loss": aux[0]}
    if delayed:
        adam_group_(state, "actor", g_actor, actor, hp["learning_rate"])
        tau = hp["tau"].unsqueeze(1)
        with torch.no_grad():
            state["actor_target"].lerp_(state["actor"], tau)
            state["critic_target"].lerp_(state["critic"], tau)
        stats["actor_loss"] = aux[1]
    counter.add_(1)
    return stats


class DDPGStack(Stack):
    """P DDPG or TD3 agents stacked (services/pod/algorithms/stacked.py): actors, critics and
    their targets four flat tensors, actors and critics each with its own Adam (a single
    agent's Adam steps the actor every ``policy_delay``-th update: its step count is its own)."""

    HYPERPARAMETERS = (
        "learning_rate", "gamma", "tau", "exploration_noise", "policy_noise", "noise_clip",
    )  # fmt: skip
    update = Program(td3_update, "td3_update")
    optimised = ("actor", "critic")

    def __init__(self, agents: Sequence[DDPG]) -> None:
        template = agents[0]
        self.smoothing = template.smoothing
        self.policy_delay = template.policy_delay
        self.noise = ActionNoise.of(template.config, template.action_shape)
        self._act = per_agent(lambda params, o: call(template.actor, params, o))
        super().__init__(agents)

    def groups(self, agent: DDPG) -> dict[str, tuple[list[str], list[torch.Tensor]]]:
        names = {id(t): n for n, t in agent.named_parameters()}
        actor, critic = agent._actor_params, agent._critic_params
        actor_names = [names[id(t)] for t in actor]
        critic_names = [names[id(t)] for t in critic]
        return {
            "actor": (actor_names, actor),
            "critic": (critic_names, critic),
            "actor_target": (actor_names, list(agent.actor_target.parameters())),
            "critic_target": (critic_names, list(agent.critic_target.parameters())),
        }

    def constants(self, delayed: bool) -> tuple:
        t = self.template
        modules = (t.actor, t.actor_target, t.critic, t.critic_target)
        layouts = self.layouts
        return (modules, layouts["actor"], layouts["critic"], self.smoothing, delayed)

    def _actor_params(self) -> dict[str, torch.Tensor]:
        return self.layouts["actor"].views(self.flats["actor"], "policy.actor.")

    @torch.no_grad()
    def explore(
        self, obs: torch.Tensor, generator: torch.Generator, env_steps: torch.Tensor | None = None
    ) -> torch.Tensor:
        """μ(s) plus each agent's scaled noise, clipped to [-1, 1]; (P, n, A)."""
        p, n = obs.shape[:2]
        action = self._act(self._actor_params(), obs)
        noise = self.noise.sample(p * n, generator, obs.device).view(p, n, *self.action_shape)
        return action.addcmul_(noise, self.hp["exploration_noise"].view(p, 1, 1)).clamp_(-1, 1)

    @torch.no_grad()
    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.template.to_env(self._act(self._actor_params(), obs))


DDPG.Stack = DDPGStack
