"""Soft Actor-Critic (Haarnoja et al. 2018, with the learned temperature of the second paper):
the agent, its losses and update over explicit state, and its stack of P agents.

A squashed Gaussian actor a = tanh(u), u ~ N(μ(s), σ(s)²), twin critics and a temperature α
that keeps the policy's entropy near a target (−dim A):

    y      = r + γ (1 − terminated) (min_i Q'_i(s', a') − α log π(a'|s')),   a' ~ π(·|s')
    critics: min Σ_i (Q_i(s, a) − y)²
    actor:   min α log π(ã|s) − min_i Q_i(s, ã),                          ã ~ π(·|s)
    α:       min −log α · (log π(ã|s) + target entropy)
    targets: θ' ← (1 − τ) θ' + τ θ

All three losses are taken on the same batch before one optimiser step (each loss
backpropagates only into its own parameters). ``sac_update`` is the update of P stacked agents
(services/pod/algorithms/stacked.py), eager or compiled.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.algorithms.sac.config import SACConfig
from services.pod.algorithms.adam import AdamState
from services.pod.algorithms.compiled import Program, grad, per_agent
from services.pod.algorithms.counter_random import draws
from services.pod.algorithms.ddpg import ActorCritic, BoundedActor
from services.pod.algorithms.flat import Layout
from services.pod.algorithms.noise import ActionNoise
from services.pod.algorithms.policies import Activation, mlp
from services.pod.algorithms.replay_buffer import Batch
from services.pod.algorithms.stacked import BATCH_STREAM, Stack, adam_group_, call, draw_batch

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
        return self.to_env(torch.tanh(self.net(obs)[..., : self.act_dim]))


def target_entropy(config: SACConfig, action_dim: int) -> float:
    """The entropy the temperature steers towards: the config's, else -|A| (SAC's default)."""
    return config.target_entropy if config.target_entropy is not None else -float(action_dim)


class SAC(ActorCritic):
    name = "sac"
    Actor = SquashedGaussianActor
    n_critics = 2
    config: SACConfig

    def __init__(self, obs_space: gym.spaces.Box, action_space: gym.Space, config: SACConfig):
        super().__init__(obs_space, action_space, config)
        self.log_alpha = nn.Parameter(
            torch.tensor(math.log(config.init_alpha)), requires_grad=config.autotune_alpha
        )
        self.target_entropy = target_entropy(config, self.action_shape[0])
        if config.autotune_alpha:
            self._actor_params.append(self.log_alpha)
        self.optimizer = AdamState(
            [*self._actor_params, *self._critic_params], config.learning_rate
        )
        self._targets = list(self.critic_target.parameters())

    @torch.no_grad()
    def explore(self, obs: torch.Tensor, generator: torch.Generator, env_steps: int):
        eps = self.noise.sample(len(obs), generator, obs.device)
        return self.actor.sample(obs, generator, with_logp=False, eps=eps)[0]


class _Sampler(nn.Module):
    """``SquashedGaussianActor.sample`` (or ``deterministic``) as a module's forward, so that
    ``functional_call`` runs the single agent's own code on one agent's slice of the stack."""

    def __init__(self, actor: SquashedGaussianActor, mode: str) -> None:
        super().__init__()
        self.actor, self.mode = actor, mode

    def forward(self, obs: torch.Tensor, eps: torch.Tensor | None = None) -> Any:
        if self.mode == "deterministic":
            return self.actor.deterministic(obs)
        action, logp = self.actor.sample(obs, eps=eps, with_logp=self.mode == "logp")
        return (action, logp) if self.mode == "logp" else action


def sac_losses(
    sampler: nn.Module,
    critic_module: nn.Module,
    autotune: bool,
    params: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    log_alpha: torch.Tensor,
    hp: dict[str, torch.Tensor],
    batch: Batch,
    eps_next: torch.Tensor,
    eps: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """One agent's SAC losses (module docstring), run under ``vmap`` for all: their sum and
    the critic loss, actor loss and α. ``sampler``: a ``_Sampler`` of mode ``logp``."""
    actor = {k.removeprefix("policy."): v for k, v in params.items() if k.startswith("policy.")}
    critic = {k.removeprefix("critic."): v for k, v in params.items() if k.startswith("critic.")}
    alpha = log_alpha.detach().exp()
    with torch.no_grad():  # the soft clipped double-Q target; a truncation is bootstrapped
        next_action, next_logp = call(sampler, actor, batch.next_obs, eps_next)
        q_next = call(critic_module, targets, batch.next_obs, next_action).amin(0)
        soft_value = q_next - alpha * next_logp
        y = batch.reward + hp["gamma"] * (1 - batch.terminated) * soft_value
    q = call(critic_module, critic, batch.obs, batch.action)
    critic_loss = (q - y).square().mean(1).sum()
    action, logp = call(sampler, actor, batch.obs, eps)
    # The actor's gradient flows through the critics but must not train them.
    frozen = {k: v.detach() for k, v in critic.items()}
    q_pi = call(critic_module, frozen, batch.obs, action).amin(0)
    actor_loss = (alpha * logp - q_pi).mean()
    total = critic_loss + actor_loss
    if autotune:  # a fixed α has no loss (and no gradient) to take
        total = total - (log_alpha * (logp.detach() + hp["target_entropy"])).mean()
    return total, critic_loss.detach(), actor_loss.detach(), alpha


def sac_update(
    sampler: nn.Module,
    critic: nn.Module,
    layout: Layout,
    target_layout: Layout,
    autotune: bool,
    critic_start: int,
    batch_size: int,
    state: dict[str, torch.Tensor],
    hp: dict[str, torch.Tensor],
    replay: tuple[torch.Tensor, ...],
    filled: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One update of every agent on a minibatch it draws itself, in place on ``state``
    (``params``, ``targets``, their Adam moments and steps, ``fixed_log_alpha``, ``seed``,
    ``counter``). Returns each agent's stats, (P,) each."""
    flat, seed, counter = state["params"], state["seed"], state["counter"]
    a = sampler.actor.act_dim
    b = batch_size
    u, n = draws(seed, counter, {BATCH_STREAM: (b,)}, {1: (b, a), 2: (b, a)})
    batch, eps_next, eps = draw_batch(replay, filled, u[BATCH_STREAM]), n[1], n[2]
    params = layout.views(flat)
    targets = target_layout.views(state["targets"], "critic_target.")
    losses = per_agent(functools.partial(sac_losses, sampler, critic, autotune))

    def total(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple]:
        params = dict(params)  # a copy: grad reads the caller's dict for its output's shape
        log_alpha = params.pop("log_alpha") if autotune else state["fixed_log_alpha"]
        out = losses(params, targets, log_alpha, hp, batch, eps_next, eps)
        return out[0].sum(), out[1:]

    grads, (critic_loss, actor_loss, alpha) = grad(total)(params)
    adam_group_(state, "params", grads, params, hp["learning_rate"])
    with torch.no_grad():
        state["targets"].lerp_(flat[:, critic_start:], hp["tau"].unsqueeze(1))
    counter.add_(1)
    return {"critic_loss": critic_loss, "actor_loss": actor_loss, "alpha": alpha}


class SACStack(Stack):
    """P SAC agents stacked (services/pod/algorithms/stacked.py): the actors, temperatures
    and twin critics one flat tensor in a single ``SAC``'s optimiser's order (one Adam), the
    critics' targets a second, Polyak-averaged with each agent's τ."""

    HYPERPARAMETERS = ("learning_rate", "gamma", "tau", "target_entropy")
    update = Program(sac_update, "sac_update")
    optimised = ("params",)

    def __init__(self, agents: Sequence[SAC]) -> None:
        template = agents[0]
        self.autotune = template.config.autotune_alpha
        # A fixed α is no parameter of the optimiser: kept apart, never stepped.
        self.fixed_log_alpha = torch.zeros(len(agents), device=template.log_alpha.device)
        self._sample = _Sampler(template.actor, "logp")
        self._explore = _Sampler(template.actor, "action")
        self._mode = _Sampler(template.actor, "deterministic")
        # Built once: acting runs them every env step.
        self._act_explore = per_agent(lambda params, o, e: call(self._explore, params, o, e))
        self._act_mode = per_agent(lambda params, o: call(self._mode, params, o))
        self.noise = ActionNoise.of(template.config, template.action_shape)
        super().__init__(agents)
        params = self.layouts["params"]
        critics = [n for n in params.names if n.startswith("critic.")]
        self.critic_start = params.offsets[params.names.index(critics[0])]

    def groups(self, agent: SAC) -> dict[str, tuple[list[str], list[torch.Tensor]]]:
        names = {id(t): n for n, t in agent.named_parameters()}
        trainable = [*agent._actor_params, *agent._critic_params]
        targets = list(agent.critic_target.named_parameters())
        return {
            "params": ([names[id(t)] for t in trainable], trainable),
            "targets": ([f"critic_target.{n}" for n, _ in targets], [t for _, t in targets]),
        }

    def check(self, agent: SAC) -> None:
        if agent.config.autotune_alpha != self.autotune:
            raise HyperparameterError("sac.autotune_alpha must be the same for every agent")

    @torch.no_grad()
    def put(self, i: int, agent: SAC) -> None:
        super().put(i, agent)
        self.fixed_log_alpha[i] = agent.log_alpha.detach()

    @torch.no_grad()
    def get(self, i: int, agent: SAC) -> None:
        super().get(i, agent)
        if not self.autotune:
            agent.log_alpha.copy_(self.fixed_log_alpha[i])

    @torch.no_grad()
    def copy(self, dst: int, src: int) -> None:
        super().copy(dst, src)
        self.fixed_log_alpha[dst] = self.fixed_log_alpha[src]

    def set_hyperparameters(self, i: int, config: SACConfig) -> None:
        super().set_hyperparameters(i, config)
        self.hp["target_entropy"][i] = target_entropy(config, math.prod(self.action_shape))

    def state(self) -> dict[str, torch.Tensor]:
        return {**super().state(), "fixed_log_alpha": self.fixed_log_alpha}

    def constants(self, delayed: bool) -> tuple:
        return (
            self._sample,
            self.template.critic,
            self.layouts["params"],
            self.layouts["targets"],
            self.autotune,
            self.critic_start,
        )

    # -- acting -----------------------------------------------------------------------------
    def _actor_params(self) -> dict[str, torch.Tensor]:
        views = self.layouts["params"].views(self.flats["params"].detach(), "policy.")
        return {k: v for k, v in views.items() if k.startswith("actor.")}

    @torch.no_grad()
    def explore(
        self, obs: torch.Tensor, generator: torch.Generator, env_steps: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Exploring actions in [-1, 1], (P, n, A) (SAC's exploration has no schedule)."""
        p, n = obs.shape[:2]
        eps = self.noise.sample(p * n, generator, obs.device).view(p, n, *self.action_shape)
        return self._act_explore(self._actor_params(), obs, eps)

    @torch.no_grad()
    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        return self._act_mode(self._actor_params(), obs)


SAC.Stack = SACStack
