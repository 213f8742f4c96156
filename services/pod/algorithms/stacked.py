"""P off-policy agents of one shape stacked for batched updates: Fast PBT's layout (Flajolet et
al. 2022), what an off-policy population pod trains (services/pod/training/offpolicy_population.py)
and what a single agent's compiled K-step update runs on as a stack of one
(services/pod/algorithms/kstep.py).

Described for SAC (``PopulationSAC``); TD3 and DDPG (``PopulationTD3``) are the same with actors
and critics in two flat tensors, each with its own Adam (a single agent's actor steps only every
``policy_delay``-th update, so its Adam step count is its own); DQN (``PopulationDQN``) with its
Q-networks one flat tensor, their targets a second, and its ε schedule per agent:

* weights: the P agents' actors, twin critics and temperatures are one flat (P, N) tensor,
  in the order of a single ``SAC``'s optimiser (actor, log α, critics), so one
  ``BatchedAdam`` (services/pod/algorithms/batched_adam.py) steps them all, each agent with its
  own learning rate; the critics' targets are a second (P, N_critic) tensor, Polyak-averaged
  in one ``lerp`` with each agent's τ;
* the update: ``SAC.update``'s losses for one agent, run with ``torch.func.functional_call``
  on views of the flat tensor and ``vmap``-ed over the agent axis; the agents' losses are
  independent, so one backward of their sum gives every agent its own gradient (the actor's
  loss reads detached critics, as ``SAC.update``'s ``backward(inputs=...)`` does);
* per-agent hyperparameters are (P,) tensors (the card's ``population.hyperparameters``):
  changing one (PBT's explore) changes a tensor, never the program;
* replay: one buffer per agent held as (P, capacity, ...) tensors with a write position and
  fill level per agent (a slot loaded from another pod's files keeps its own), sampled in one
  gather for all agents.

The losses are module-level functions of the template modules and the agent's parameters (DQN's
gradient clip and target move functions of the stacked tensors), so that the compiled K-step
update (kstep.py) runs the same code as the eager ``update``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from services.contracts.algorithms.dqn import CARD as DQN_CARD
from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.algorithms.sac.config import SACConfig
from services.pod.algorithms.batched_adam import BatchedAdam
from services.pod.algorithms.ddpg import DDPG
from services.pod.algorithms.dqn import DQN
from services.pod.algorithms.noise import ActionNoise
from services.pod.algorithms.replay_buffer import FIELDS, Batch, ReplayBuffer
from services.pod.algorithms.sac import SAC, SquashedGaussianActor
from services.pod.algorithms.td3 import TD3

#: The (P,) tensors SAC's update reads: what its card lets vary (``init_alpha`` only sets an
#: agent's start), α's target resolved.
_TENSORS = ("learning_rate", "gamma", "tau", "target_entropy")
#: The per-agent (P,) tensors of a DDPG / TD3 population (DDPG's lack TD3's two: zero).
_TD3_TENSORS = ("learning_rate", "gamma", "tau", "exploration_noise", "policy_noise", "noise_clip")
#: The per-agent (P,) tensors of a DQN population: its card's ``population.hyperparameters``
#: (``max_grad_norm``'s None: no clipping, an infinite norm).
_DQN_TENSORS = DQN_CARD.population.hyperparameters if DQN_CARD.population else ()


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


@dataclass(frozen=True)
class Layout:
    """Where each of one agent's tensors lies in a row of a flat (P, N) tensor. Frozen and of
    plain tuples: the compiled K-step update (kstep.py) is specialised on it as a constant, and
    a stack rebuilt with the same shapes must hash and compare equal to reuse the program."""

    names: tuple[str, ...]  # state-dict names of the single agent, in its optimiser's order
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> Layout:
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += t.numel()
        return cls(tuple(names), tuple(tuple(t.shape) for t in tensors), tuple(offsets), total)

    def views(self, flat: torch.Tensor, prefix: str, start: int = 0) -> dict[str, torch.Tensor]:
        """name (without ``prefix``) → (P, *shape) view of ``flat`` from column ``start``."""
        p = flat.shape[0]
        return {
            name.removeprefix(prefix): flat[:, start + o : start + o + math.prod(s)].view(p, *s)
            for name, s, o in zip(self.names, self.shapes, self.offsets, strict=True)
        }


def flat_rows(tensors: Mapping[str, torch.Tensor], keys: Iterable[str]) -> torch.Tensor:
    """``tensors[k]`` (each (P, ...)) for ``keys`` in order, as one (P, n) tensor: the
    inverse of ``Layout.views`` (e.g. per-agent gradients into a flat row for Adam)."""
    rows = [tensors[k] for k in keys]
    return torch.cat([t.reshape(t.shape[0], -1) for t in rows], dim=1)


# -- the losses of one agent (run under ``vmap``), of its template modules and its parameters --
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
    """One agent's ``SAC.update`` losses: their sum, and the stats. ``sampler``: a
    ``_Sampler`` of mode ``logp`` over the template actor."""
    actor = {k.removeprefix("policy."): v for k, v in params.items() if k.startswith("policy.")}
    critic = {k.removeprefix("critic."): v for k, v in params.items() if k.startswith("critic.")}
    alpha = log_alpha.detach().exp()
    with torch.no_grad():  # the soft clipped double-Q target
        next_action, next_logp = functional_call(sampler, actor, (batch.next_obs, eps_next))
        q_next = functional_call(critic_module, targets, (batch.next_obs, next_action)).amin(0)
        soft_value = q_next - alpha * next_logp
        y = batch.reward + hp["gamma"] * (1 - batch.terminated) * soft_value
    q = functional_call(critic_module, critic, (batch.obs, batch.action))
    critic_loss = (q - y).square().mean(1).sum()
    action, logp = functional_call(sampler, actor, (batch.obs, eps))
    # The actor's gradient flows through the critics but must not train them.
    frozen = {k: v.detach() for k, v in critic.items()}
    q_pi = functional_call(critic_module, frozen, (batch.obs, action)).amin(0)
    actor_loss = (alpha * logp - q_pi).mean()
    total = critic_loss + actor_loss
    if autotune:
        total = total - (log_alpha * (logp.detach() + hp["target_entropy"])).mean()
    return total, critic_loss.detach(), actor_loss.detach(), alpha


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
    """One agent's DDPG / TD3 critic loss (TD3's target smoothed with ``eps``)."""
    with torch.no_grad():
        a = functional_call(actor_target, actor_t, (batch.next_obs,))
        if smoothing:
            clip = hp["noise_clip"]
            a = (a + (eps * hp["policy_noise"]).clamp(-clip, clip)).clamp(-1, 1)
        q_next = functional_call(critic_target, critic_t, (batch.next_obs, a)).amin(0)
        y = batch.reward + hp["gamma"] * (1 - batch.terminated) * q_next
    q = functional_call(critic_module, critic, (batch.obs, batch.action))
    return (q - y).square().mean(1).sum()


def td3_actor_loss(
    actor_module: nn.Module,
    critic_module: nn.Module,
    actor: dict[str, torch.Tensor],
    critic: dict[str, torch.Tensor],
    obs: torch.Tensor,
) -> torch.Tensor:
    """One agent's DDPG / TD3 actor loss: −Q_1 of the critics before this step, detached so
    that it trains no critic."""
    frozen = {k: v.detach() for k, v in critic.items()}
    action = functional_call(actor_module, actor, (obs,))
    return -functional_call(critic_module, frozen, (obs, action))[0].mean()


def dqn_loss(
    q_module: nn.Module,
    double: bool,
    params: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    gamma: torch.Tensor,
    batch: Batch,
) -> torch.Tensor:
    """One agent's ``DQN.update`` loss: Huber(Q(s, a) − y), y its ``td_target``."""
    with torch.no_grad():
        q_next = functional_call(q_module, targets, (batch.next_obs,))
        if double:
            best = functional_call(q_module, params, (batch.next_obs,)).argmax(-1, keepdim=True)
            v_next = q_next.gather(-1, best).squeeze(-1)
        else:
            v_next = q_next.amax(-1)
        y = batch.reward + gamma * (1 - batch.terminated) * v_next
    q = functional_call(q_module, params, (batch.obs,))
    q = q.gather(-1, batch.action.unsqueeze(-1)).squeeze(-1)
    return F.smooth_l1_loss(q, y)


def clip_rows_(grad: torch.Tensor, max_norm: torch.Tensor) -> torch.Tensor:
    """``DQN.update``'s ``clip_grad_norm_`` for every agent, in place: row p (agent p's whole
    gradient) scaled to a norm of at most ``max_norm[p]`` (infinite: not clipped)."""
    scale = (max_norm / (grad.norm(dim=1) + 1e-6)).clamp(max=1.0)
    return grad.mul_(scale.unsqueeze(1))


def move_dqn_targets_(
    targets: torch.Tensor, online: torch.Tensor, hp: dict[str, torch.Tensor], step: torch.Tensor
) -> None:
    """``DQN.update``'s target move for every agent, in place: agent p's targets step towards
    its online weights by its τ where its update number ``step[p]`` (or one for all) is a
    multiple of its ``target_update_every``."""
    due = torch.remainder(step, hp["target_update_every"]) == 0
    targets.lerp_(online, (hp["tau"] * due).unsqueeze(1))


class StackedReplay:
    """P replay buffers as (P, capacity, ...) tensors; each agent its own write position and
    fill level (host ints: the loop knows them without a sync)."""

    def __init__(self, p: int, template: ReplayBuffer) -> None:
        self.p, self.capacity, self.device = p, template.capacity, template.device
        for name in FIELDS:
            store = getattr(template, name)
            setattr(
                self, name, torch.zeros((p, *store.shape), dtype=store.dtype, device=self.device)
            )
        self.pos = [0] * p
        self.size = [0] * p
        # The fill levels on the device too, for a compiled update that samples by itself.
        self.filled = torch.zeros(p, dtype=torch.int64, device=self.device)
        # The write positions on the device too: ``add`` runs every env step, and a position
        # tensor made from the host ints there would be a host-to-device copy each time.
        self._pos = torch.zeros(p, dtype=torch.int64, device=self.device)
        self._agents = torch.arange(p, device=self.device)

    @torch.no_grad()
    def add(self, *values: torch.Tensor) -> None:
        """Append N transitions per agent (each value (P, N, ...)), each agent at its own
        position, overwriting its oldest once its ring is full."""
        n = values[0].shape[1]
        if n > self.capacity:  # only the newest ``capacity`` survive
            values = tuple(v[:, n - self.capacity :] for v in values)
            n = self.capacity
        rows = (self._pos.unsqueeze(1) + torch.arange(n, device=self.device)) % self.capacity
        for name, value in zip(FIELDS, values, strict=True):
            store = getattr(self, name)
            store[self._agents.unsqueeze(1), rows] = value.to(store.dtype)
        self.pos = [(q + n) % self.capacity for q in self.pos]
        self.size = [min(s + n, self.capacity) for s in self.size]
        self._pos.add_(n).remainder_(self.capacity)
        self.filled.add_(n).clamp_(max=self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        """``batch_size`` transitions per agent, drawn uniformly with replacement from that
        agent's filled rows; each field (P, B, ...)."""
        if min(self.size) == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        size = self.filled.double()  # self.size on the device: no copy from the host a sample
        u = torch.rand((self.p, batch_size), generator=generator, device=self.device)
        idx = (u.double() * size.unsqueeze(1)).long().clamp_max_(size.long().unsqueeze(1) - 1)
        agents = self._agents.unsqueeze(1)
        return Batch(*(getattr(self, name)[agents, idx] for name in FIELDS))

    def get(self, i: int, buffer: ReplayBuffer) -> None:
        """Copy agent ``i``'s buffer into the single-agent ``buffer``."""
        for name in FIELDS:
            getattr(buffer, name).copy_(getattr(self, name)[i])
        buffer.pos, buffer.size = self.pos[i], self.size[i]
        buffer.filled.fill_(buffer.size)

    @property
    def fields(self) -> tuple[torch.Tensor, ...]:
        """The replay fields, (P, capacity, ...) each, in ``FIELDS`` order."""
        return tuple(getattr(self, name) for name in FIELDS)

    def put(self, i: int, buffer: ReplayBuffer) -> None:
        """Make agent ``i``'s buffer the single-agent ``buffer``."""
        for name in FIELDS:
            getattr(self, name)[i].copy_(getattr(buffer, name))
        self.pos[i], self.size[i] = buffer.pos, buffer.size
        self._pos[i] = buffer.pos
        self.filled[i] = buffer.size


class PopulationSAC:
    """P SAC agents stacked (see the module docstring): ``update`` is one gradient step of
    every agent, ``explore`` and ``deterministic`` act for all of them on (P, n, D)
    observations. ``get(i, agent)`` / ``put(i, agent)`` move agent i, weights and Adam state,
    to and from a single ``SAC``."""

    def __init__(self, agents: Sequence[SAC]) -> None:
        self.size = p = len(agents)
        self.template = template = agents[0]
        self.configs = [a.config for a in agents]
        self.autotune = template.config.autotune_alpha
        names = {id(t): n for n, t in template.named_parameters()}
        trainable = [*template._actor_params, *template._critic_params]
        self.layout = Layout.of([names[id(t)] for t in trainable], trainable)
        critics = [n for n in self.layout.names if n.startswith("critic.")]
        self.critic_start = self.layout.offsets[self.layout.names.index(critics[0])]
        targets = list(template.critic_target.named_parameters())
        self.target_layout = Layout.of(
            [f"critic_target.{n}" for n, _ in targets], [t for _, t in targets]
        )
        device = template.log_alpha.device
        self.flat = torch.zeros(p, self.layout.size, device=device)
        self.targets = torch.zeros(p, self.target_layout.size, device=device)
        # A fixed α is no parameter of the optimiser: kept apart, never stepped.
        self.fixed_log_alpha = torch.zeros(p, device=device)
        self.hp = {k: torch.zeros(p, device=device) for k in _TENSORS}
        self.optimizer = BatchedAdam(self.flat, self.hp["learning_rate"])
        self._sample = _Sampler(template.actor, "logp")
        self._explore = _Sampler(template.actor, "action")
        self._mode = _Sampler(template.actor, "deterministic")
        # Built once: acting runs them every env step.
        self._act_explore = vmap(
            lambda params, o, e: functional_call(self._explore, params, (o, e))
        )
        self._act_mode = vmap(lambda params, o: functional_call(self._mode, params, (o,)))
        self.noise = ActionNoise.of(template.config, template.action_shape)
        self.action_shape = template.action_shape
        self._update = vmap(partial(sac_losses, self._sample, template.critic, self.autotune))
        for i, agent in enumerate(agents):
            self.put(i, agent)

    # -- moving agents in and out -----------------------------------------------------------
    def _trainable(self, agent: SAC) -> list[torch.Tensor]:
        return [*agent._actor_params, *agent._critic_params]

    @torch.no_grad()
    def put(self, i: int, agent: SAC) -> None:
        """Agent ``i`` becomes ``agent``: weights, targets, temperature, Adam state and its
        hyperparameters."""
        if agent.config.autotune_alpha != self.autotune:
            raise HyperparameterError("sac.autotune_alpha must be the same for every agent")
        params = self._trainable(agent)
        self.flat[i] = torch.cat([t.detach().flatten() for t in params])
        self.targets[i] = torch.cat([t.flatten() for t in agent.critic_target.parameters()])
        self.fixed_log_alpha[i] = agent.log_alpha.detach()
        self.optimizer.load_row(i, params, agent.optimizer.state)
        self.configs[i] = agent.config
        self.set_hyperparameters(i, agent.config, agent.target_entropy)

    def set_hyperparameters(self, i: int, config: SACConfig, target_entropy: float) -> None:
        self.hp["learning_rate"][i] = config.learning_rate
        self.hp["gamma"][i] = config.gamma
        self.hp["tau"][i] = config.tau
        self.hp["target_entropy"][i] = target_entropy
        self.configs[i] = config

    @torch.no_grad()
    def get(self, i: int, agent: SAC) -> None:
        """Write agent ``i`` into ``agent`` (a ``SAC`` of the same shape): weights, targets,
        temperature and its optimiser's state, as a single agent's ``Adam`` holds it."""
        params = self._trainable(agent)
        for t, view in zip(params, self.layout.views(self.flat, "").values(), strict=True):
            t.copy_(view[i])
        for t, view in zip(
            agent.critic_target.parameters(),
            self.target_layout.views(self.targets, "").values(),
            strict=True,
        ):
            t.copy_(view[i])
        if not self.autotune:
            agent.log_alpha.copy_(self.fixed_log_alpha[i])
        agent.optimizer.state.clear()
        agent.optimizer.state.update(self.optimizer.row_state(i, params))
        for group in agent.optimizer.param_groups:
            group["lr"] = self.configs[i].learning_rate  # exact, not the float32 tensor's

    def weights(self, i: int, agent: SAC) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``agent``'s weights and targets, and their views in slot ``i`` (the same order): what
        a copy makes ``agent`` act and evaluate as slot ``i``."""
        views = list(self.layout.views(self.flat, "").values())
        targets = list(self.target_layout.views(self.targets, "").values())
        return (
            [*self._trainable(agent), *agent.critic_target.parameters()],
            [v[i] for v in (*views, *targets)],
        )

    # -- acting -----------------------------------------------------------------------------
    def _actor_params(self) -> dict[str, torch.Tensor]:
        views = self.layout.views(self.flat.detach(), "policy.")
        return {k: v for k, v in views.items() if k.startswith("actor.")}

    def end_episodes(self, done: torch.Tensor) -> None:
        """The episodes of the (P * n) sub-environments where ``done`` ended."""
        self.noise.reset(done)

    @torch.no_grad()
    def explore(
        self,
        obs: torch.Tensor,
        generator: torch.Generator,
        env_steps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Exploring actions in [-1, 1], (P, n, A), for observations (P, n, D) (``env_steps``:
        unused, SAC's exploration has no schedule)."""
        p, n = obs.shape[:2]
        eps = self.noise.sample(p * n, generator, obs.device).view(p, n, *self.action_shape)
        return self._act_explore(self._actor_params(), obs, eps)

    @torch.no_grad()
    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """Env actions of the deterministic policies, (P, n, A), for observations (P, n, D)."""
        return self._act_mode(self._actor_params(), obs)

    # -- learning ---------------------------------------------------------------------------
    def update(
        self,
        batch: Batch,
        generator: torch.Generator | None = None,
        step: int = 1,
        noise: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """One gradient step of every agent, agent p on ``batch``'s p-th rows (each field
        (P, B, ...)); ``step`` (the update's number) is unused, as in ``SAC.update``;
        ``noise``: the reparameterisation draws (next, current), each (P, B, A), else drawn
        from ``generator``. Returns each agent's stats, (P,) each."""
        p, b = batch.reward.shape
        if noise is None:
            shape = (p, b, *self.action_shape)
            noise = (
                torch.randn(shape, generator=generator, device=self.flat.device),
                torch.randn(shape, generator=generator, device=self.flat.device),
            )
        # The views are the leaves: a gradient with respect to the flat tensor itself would
        # cost a zero-filled (P, N) tensor per view (slice_backward), a quarter of the step.
        params = {k: v.requires_grad_() for k, v in self.layout.views(self.flat, "").items()}
        leaves = list(params.values())
        targets = self.target_layout.views(self.targets, "critic_target.")
        log_alpha = params.pop("log_alpha") if self.autotune else self.fixed_log_alpha
        total, critic_loss, actor_loss, alpha = self._update(
            params, targets, log_alpha, self.hp, batch, *noise
        )
        grads = torch.autograd.grad(total.sum(), leaves)
        torch.cat([g.reshape(p, -1) for g in grads], dim=1, out=self.optimizer.grad)
        self.optimizer.step()
        with torch.no_grad():
            online = self.flat.detach()[:, self.critic_start :]
            self.targets.lerp_(online, self.hp["tau"].unsqueeze(1))
        return {"critic_loss": critic_loss, "actor_loss": actor_loss, "alpha": alpha}


class PopulationTD3:
    """P DDPG or TD3 agents stacked, as ``PopulationSAC`` stacks SAC's: actors and critics
    each one flat (P, N) tensor with its own ``BatchedAdam`` (a single agent's Adam steps the
    actor only every ``policy_delay``-th update, so the actor's step count is its own), their
    targets two more; ``update`` is ``DDPG.update`` / ``TD3.update`` for every agent."""

    def __init__(self, agents: Sequence[DDPG]) -> None:
        self.size = p = len(agents)
        self.template = template = agents[0]
        self.configs = [a.config for a in agents]
        self.smoothing = isinstance(template, TD3)
        self.policy_delay = template.policy_delay
        names = {id(t): n for n, t in template.named_parameters()}
        actor, critic = template._actor_params, template._critic_params
        self.actor_layout = Layout.of([names[id(t)] for t in actor], actor)
        self.critic_layout = Layout.of([names[id(t)] for t in critic], critic)
        device = template.actor.scale.device
        self.actor_flat = torch.zeros(p, self.actor_layout.size, device=device)
        self.critic_flat = torch.zeros(p, self.critic_layout.size, device=device)
        self.actor_target = torch.zeros_like(self.actor_flat)
        self.critic_target = torch.zeros_like(self.critic_flat)
        self.hp = {k: torch.zeros(p, device=device) for k in _TD3_TENSORS}
        self.actor_adam = BatchedAdam(self.actor_flat, self.hp["learning_rate"])
        self.critic_adam = BatchedAdam(self.critic_flat, self.hp["learning_rate"])
        self.noise = ActionNoise.of(template.config, template.action_shape)
        self.action_shape = template.action_shape
        self._critic_losses = vmap(
            partial(
                td3_critic_loss,
                template.actor_target,
                template.critic_target,
                template.critic,
                self.smoothing,
            )
        )
        self._actor_losses = vmap(partial(td3_actor_loss, template.actor, template.critic))
        self._act = vmap(lambda params, o: functional_call(self.template.actor, params, (o,)))
        for i, agent in enumerate(agents):
            self.put(i, agent)

    def _groups(self, agent: DDPG):
        return (
            (agent._actor_params, self.actor_flat, self.actor_adam, self.actor_layout),
            (agent._critic_params, self.critic_flat, self.critic_adam, self.critic_layout),
        )

    @torch.no_grad()
    def put(self, i: int, agent: DDPG) -> None:
        """Agent ``i`` becomes ``agent``: weights, targets, Adam state, hyperparameters."""
        for params, flat, adam, _ in self._groups(agent):
            flat[i] = torch.cat([t.detach().flatten() for t in params])
            adam.load_row(i, params, agent.optimizer.state)
        self.actor_target[i] = torch.cat([t.flatten() for t in agent.actor_target.parameters()])
        self.critic_target[i] = torch.cat([t.flatten() for t in agent.critic_target.parameters()])
        self.set_hyperparameters(i, agent.config)

    def set_hyperparameters(self, i: int, config: Any) -> None:
        for k in _TD3_TENSORS:
            self.hp[k][i] = getattr(config, k, 0.0)
        self.configs[i] = config

    @torch.no_grad()
    def get(self, i: int, agent: DDPG) -> None:
        """Write agent ``i`` into ``agent`` (of the same shape), its optimiser's state as a
        single agent's ``Adam`` holds it."""
        agent.optimizer.state.clear()
        for params, flat, adam, layout in self._groups(agent):
            for t, view in zip(params, layout.views(flat, "").values(), strict=True):
                t.copy_(view[i])
            agent.optimizer.state.update(adam.row_state(i, params))
        for target, flat, layout in (
            (agent.actor_target, self.actor_target, self.actor_layout),
            (agent.critic_target, self.critic_target, self.critic_layout),
        ):
            for t, view in zip(target.parameters(), layout.views(flat, "").values(), strict=True):
                t.copy_(view[i])
        for group in agent.optimizer.param_groups:
            group["lr"] = self.configs[i].learning_rate

    def weights(self, i: int, agent: DDPG) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``agent``'s weights and targets, and their views in slot ``i`` (the same order)."""
        mine: list[torch.Tensor] = []
        theirs: list[torch.Tensor] = []
        for module, flat, layout in (
            (agent.actor, self.actor_flat, self.actor_layout),
            (agent.critic, self.critic_flat, self.critic_layout),
            (agent.actor_target, self.actor_target, self.actor_layout),
            (agent.critic_target, self.critic_target, self.critic_layout),
        ):
            mine += list(module.parameters())
            theirs += [v[i] for v in layout.views(flat, "").values()]
        return mine, theirs

    def _actor_params(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.actor_layout.views(flat, "policy.actor.")

    def end_episodes(self, done: torch.Tensor) -> None:
        """The episodes of the (P * n) sub-environments where ``done`` ended."""
        self.noise.reset(done)

    @torch.no_grad()
    def explore(
        self,
        obs: torch.Tensor,
        generator: torch.Generator,
        env_steps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """μ(s) plus each agent's scaled noise, clipped to [-1, 1]; (P, n, A) (``env_steps``:
        unused, the noise has no schedule)."""
        p, n = obs.shape[:2]
        action = self._act(self._actor_params(self.actor_flat), obs)
        noise = self.noise.sample(p * n, generator, obs.device).view(p, n, *self.action_shape)
        scale = self.hp["exploration_noise"].view(p, 1, 1)
        return action.addcmul_(noise, scale).clamp_(-1, 1)

    @torch.no_grad()
    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.template.to_env(self._act(self._actor_params(self.actor_flat), obs))

    def update(
        self,
        batch: Batch,
        generator: torch.Generator | None = None,
        step: int = 1,
        noise: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Update number ``step`` of every agent: the critics every time, the actors and the
        targets every ``policy_delay``-th; ``noise``: TD3's target smoothing draws
        (P, B, A), else drawn from ``generator``."""
        p, b = batch.reward.shape
        if noise is None:
            shape = (p, b, *self.action_shape)
            device = self.actor_flat.device
            noise = (
                torch.randn(shape, generator=generator, device=device)
                if self.smoothing
                else torch.zeros(shape, device=device)
            )
        critic = {
            k: v.requires_grad_()
            for k, v in self.critic_layout.views(self.critic_flat, "critic.").items()
        }
        actor_t = self._actor_params(self.actor_target)
        critic_t = self.critic_layout.views(self.critic_target, "critic.")
        critic_loss = self._critic_losses(actor_t, critic, critic_t, self.hp, batch, noise)
        stats = {"critic_loss": critic_loss.detach()}
        leaves = list(critic.values())
        total = critic_loss.sum()
        delayed = step % self.policy_delay == 0
        if delayed:
            actor = {k: v.requires_grad_() for k, v in self._actor_params(self.actor_flat).items()}
            actor_loss = self._actor_losses(actor, critic, batch.obs)
            stats["actor_loss"] = actor_loss.detach()
            total = total + actor_loss.sum()
            leaves += list(actor.values())
        grads = torch.autograd.grad(total, leaves)
        n = len(critic)
        torch.cat([g.reshape(p, -1) for g in grads[:n]], dim=1, out=self.critic_adam.grad)
        self.critic_adam.step()
        if delayed:
            torch.cat([g.reshape(p, -1) for g in grads[n:]], dim=1, out=self.actor_adam.grad)
            self.actor_adam.step()
            tau = self.hp["tau"].unsqueeze(1)
            with torch.no_grad():
                self.actor_target.lerp_(self.actor_flat, tau)
                self.critic_target.lerp_(self.critic_flat, tau)
        return stats


class PopulationDQN:
    """P DQN agents (double, dueling: as the template) stacked: their Q-networks one flat
    (P, N) tensor with one ``BatchedAdam``, their targets a second, moved every agent's own
    ``target_update_every``-th update with its own τ; gradients clipped to each agent's
    ``max_grad_norm``; ε-greedy with each agent's ε schedule on its own env steps. ``update``
    is ``DQN.update`` for every agent."""

    def __init__(self, agents: Sequence[DQN]) -> None:
        self.size = p = len(agents)
        self.template = template = agents[0]
        self.configs = [a.config for a in agents]
        self.double = template.config.double
        self.n_actions = template.n_actions
        self.action_shape = template.action_shape
        names = {id(t): n for n, t in template.named_parameters()}
        self.layout = Layout.of([names[id(t)] for t in template._params], template._params)
        device = template._params[0].device
        self.flat = torch.zeros(p, self.layout.size, device=device)
        self.targets = torch.zeros_like(self.flat)
        self.hp = {k: torch.zeros(p, device=device) for k in _DQN_TENSORS}
        # ε as the single agent computes it, in double precision; update numbers are integers.
        for k in ("epsilon_start", "epsilon_end", "exploration_steps"):
            self.hp[k] = self.hp[k].double()
        self.hp["target_update_every"] = self.hp["target_update_every"].long()
        self.optimizer = BatchedAdam(self.flat, self.hp["learning_rate"])
        self._losses = vmap(partial(dqn_loss, template.q, self.double))
        self._q = vmap(lambda params, o: functional_call(self.template.q, params, (o,)))
        for i, agent in enumerate(agents):
            self.put(i, agent)

    def _check(self, agent: DQN) -> None:
        cfg, mine = agent.config, self.template.config
        for name in ("double", "dueling"):
            if getattr(cfg, name) != getattr(mine, name):
                raise HyperparameterError(f"dqn.{name} must be the same for every agent")

    @torch.no_grad()
    def put(self, i: int, agent: DQN) -> None:
        """Agent ``i`` becomes ``agent``: weights, targets, Adam state, hyperparameters."""
        self._check(agent)
        params = agent._params
        self.flat[i] = torch.cat([t.detach().flatten() for t in params])
        self.targets[i] = torch.cat([t.flatten() for t in agent._targets])
        self.optimizer.load_row(i, params, agent.optimizer.state)
        self.set_hyperparameters(i, agent.config)

    def set_hyperparameters(self, i: int, config: Any) -> None:
        for k in _DQN_TENSORS:
            value = getattr(config, k)
            self.hp[k][i] = math.inf if value is None else value
        self.configs[i] = config

    @torch.no_grad()
    def get(self, i: int, agent: DQN) -> None:
        """Write agent ``i`` into ``agent`` (of the same shape), its optimiser's state as a
        single agent's ``Adam`` holds it."""
        for t, view in zip(agent._params, self.layout.views(self.flat, "").values(), strict=True):
            t.copy_(view[i])
        for t, view in zip(
            agent._targets, self.layout.views(self.targets, "").values(), strict=True
        ):
            t.copy_(view[i])
        agent.optimizer.state.clear()
        agent.optimizer.state.update(self.optimizer.row_state(i, agent._params))
        for group in agent.optimizer.param_groups:
            group["lr"] = self.configs[i].learning_rate

    def weights(self, i: int, agent: DQN) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``agent``'s weights and targets, and their views in slot ``i`` (the same order)."""
        views = [v[i] for flat in (self.flat, self.targets) for v in self._views(flat).values()]
        return [*agent._params, *agent._targets], views

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.layout.views(flat, "policy.actor.")

    # -- acting -----------------------------------------------------------------------------
    def epsilon(self, env_steps: torch.Tensor) -> torch.Tensor:
        """Each agent's ε (P,) at its own env steps (P,): ``DQN.epsilon`` of each."""
        hp = self.hp
        frac = (env_steps.double() / hp["exploration_steps"]).clamp(max=1.0)
        return hp["epsilon_start"] + frac * (hp["epsilon_end"] - hp["epsilon_start"])

    def random_action(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return self.template.random_action(n, generator)

    def end_episodes(self, done: torch.Tensor) -> None:
        """ε-greedy has no state over time."""

    @torch.no_grad()
    def explore(
        self, obs: torch.Tensor, generator: torch.Generator, env_steps: torch.Tensor
    ) -> torch.Tensor:
        """ε-greedy actions (P, n) for observations (P, n, D), agent p with its ε at its
        ``env_steps[p]``."""
        greedy = self.deterministic(obs)
        explore = torch.rand(greedy.shape, generator=generator, device=obs.device)
        explore = explore < self.epsilon(env_steps).float().unsqueeze(1)
        random = self.random_action(greedy.numel(), generator).view(greedy.shape)
        return torch.where(explore, random, greedy)

    @torch.no_grad()
    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """The greedy actions (P, n) for observations (P, n, D)."""
        return self._q(self._views(self.flat.detach()), obs).argmax(-1)

    # -- learning ---------------------------------------------------------------------------
    def update(
        self, batch: Batch, generator: torch.Generator | None = None, step: Any = 1
    ) -> dict[str, torch.Tensor]:
        """One gradient step of every agent, agent p on ``batch``'s p-th rows; ``step``: the
        update's number (1-based), one for all or each agent's own (P,): agent p's target
        moves when it is a multiple of its ``target_update_every``. Returns the losses (P,)."""
        p = batch.reward.shape[0]
        params = {k: v.requires_grad_() for k, v in self._views(self.flat).items()}
        targets = self._views(self.targets)
        loss = self._losses(params, targets, self.hp["gamma"], batch)
        grads = torch.autograd.grad(loss.sum(), list(params.values()))
        grad = self.optimizer.grad
        torch.cat([g.reshape(p, -1) for g in grads], dim=1, out=grad)
        with torch.no_grad():
            clip_rows_(grad, self.hp["max_grad_norm"])
        self.optimizer.step()
        with torch.no_grad():
            step = torch.as_tensor(step, device=self.flat.device)
            move_dqn_targets_(self.targets, self.flat.detach(), self.hp, step)
        return {"loss": loss.detach()}


#: The population class of each algorithm that trains as one.
POPULATIONS: dict[str, type] = {
    "sac": PopulationSAC,
    "td3": PopulationTD3,
    "ddpg": PopulationTD3,
    "dqn": PopulationDQN,
}
