"""The off-policy population trainer: P SAC, TD3 or DDPG agents ("slots") trained together in
one process.

What a pod with ``population.agents_per_pod: P`` (P > 1) trains for an off-policy algorithm
whose card declares a population (SAC, TD3, DDPG; not DQN). Fast PBT's layout (Flajolet et al.
2022), described for SAC (``PopulationSAC``); TD3 and DDPG (``PopulationTD3``) are the same with
actors and critics in two flat tensors, each with its own Adam (a single agent's actor steps
only every ``policy_delay``-th update, so its Adam step count is its own):

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
  gather for all agents;
* acting: one batched env of P * num_envs sub-environments; agent p owns the slice
  [p * num_envs, (p + 1) * num_envs), and its evaluation episodes the p-th slice of the
  evaluation env (``evaluate_groups``).

Each slot saves and loads exactly the training files a single-agent pod of its algorithm
writes
(services/pod/training/offpolicy.py ``save_offpolicy_files`` / ``load_offpolicy_files``:
weights, optimiser, replay buffer, counters), so PBT's exploit copies a slot from any pod's files
and ``podium export`` loads a slot's. A slot's counters are the population's plus the offset of
the files it was loaded from. Settings that shape the networks, the data or the loop are shared
by the agents (refused when they differ: ``HyperparameterError`` naming the field).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch import nn
from torch.func import functional_call, vmap

from services.contracts.algorithms.card import AlgorithmCard, card
from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.algorithms.offpolicy import ReplayLoopConfig
from services.contracts.algorithms.sac.config import SACConfig
from services.logs import get_logger
from services.pod.algorithms.batched_adam import BatchedAdam
from services.pod.algorithms.ddpg import DDPG, uniform_action
from services.pod.algorithms.noise import ActionNoise
from services.pod.algorithms.replay_buffer import FIELDS, Batch, ReplayBuffer
from services.pod.algorithms.sac import SAC, SquashedGaussianActor
from services.pod.algorithms.spaces import check_action_space
from services.pod.algorithms.td3 import TD3
from services.pod.roles.evaluator import EvalResult, evaluate_groups
from services.pod.roles.learner import ReplayLearner
from services.pod.training.offpolicy import (
    OffPolicyConfig,
    OffPolicyTrainer,
    load_offpolicy_files,
    save_offpolicy_files,
)
from services.pod.training.trainer import (
    Counters,
    Roles,
    Trainer,
    algorithm_class,
    train_in_process,
)

log = get_logger(__name__)

#: The (P,) tensors SAC's update reads: what its card lets vary (``init_alpha`` only sets an
#: agent's start), α's target resolved.
_TENSORS = ("learning_rate", "gamma", "tau", "target_entropy")


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


@dataclass
class _Layout:
    """Where each of one agent's tensors lies in a row of a flat (P, N) tensor."""

    names: list[str]  # state-dict names of the single agent, in its optimiser's order
    shapes: list[torch.Size]
    offsets: list[int]
    size: int

    @classmethod
    def of(cls, names: list[str], tensors: list[torch.Tensor]) -> _Layout:
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += t.numel()
        return cls(names, [t.shape for t in tensors], offsets, total)

    def views(self, flat: torch.Tensor, prefix: str, start: int = 0) -> dict[str, torch.Tensor]:
        """name (without ``prefix``) → (P, *shape) view of ``flat`` from column ``start``."""
        p = flat.shape[0]
        return {
            name.removeprefix(prefix): flat[:, start + o : start + o + s.numel()].view(p, *s)
            for name, s, o in zip(self.names, self.shapes, self.offsets, strict=True)
        }


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
        self._agents = torch.arange(p, device=self.device)

    @torch.no_grad()
    def add(self, *values: torch.Tensor) -> None:
        """Append N transitions per agent (each value (P, N, ...)), each agent at its own
        position, overwriting its oldest once its ring is full."""
        n = values[0].shape[1]
        if n > self.capacity:  # only the newest ``capacity`` survive
            values = tuple(v[:, n - self.capacity :] for v in values)
            n = self.capacity
        pos = torch.tensor(self.pos, device=self.device)
        rows = (pos.unsqueeze(1) + torch.arange(n, device=self.device)) % self.capacity
        for name, value in zip(FIELDS, values, strict=True):
            store = getattr(self, name)
            store[self._agents.unsqueeze(1), rows] = value.to(store.dtype)
        self.pos = [(q + n) % self.capacity for q in self.pos]
        self.size = [min(s + n, self.capacity) for s in self.size]

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        """``batch_size`` transitions per agent, drawn uniformly with replacement from that
        agent's filled rows; each field (P, B, ...)."""
        if min(self.size) == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        size = torch.tensor(self.size, device=self.device, dtype=torch.float64)
        u = torch.rand((self.p, batch_size), generator=generator, device=self.device)
        idx = (u.double() * size.unsqueeze(1)).long().clamp_max_(size.long().unsqueeze(1) - 1)
        agents = self._agents.unsqueeze(1)
        return Batch(*(getattr(self, name)[agents, idx] for name in FIELDS))

    def get(self, i: int, buffer: ReplayBuffer) -> None:
        """Copy agent ``i``'s buffer into the single-agent ``buffer``."""
        for name in FIELDS:
            getattr(buffer, name).copy_(getattr(self, name)[i])
        buffer.pos, buffer.size = self.pos[i], self.size[i]

    def put(self, i: int, buffer: ReplayBuffer) -> None:
        """Make agent ``i``'s buffer the single-agent ``buffer``."""
        for name in FIELDS:
            getattr(self, name)[i].copy_(getattr(buffer, name))
        self.pos[i], self.size[i] = buffer.pos, buffer.size


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
        self.layout = _Layout.of([names[id(t)] for t in trainable], trainable)
        critics = [n for n in self.layout.names if n.startswith("critic.")]
        self.critic_start = self.layout.offsets[self.layout.names.index(critics[0])]
        targets = list(template.critic_target.named_parameters())
        self.target_layout = _Layout.of(
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
        self.noise = ActionNoise.of(template.config, template.action_shape)
        self.action_shape = template.action_shape
        self._update = vmap(self._losses)
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
        state = agent.optimizer.state
        opt = self.optimizer
        if all(t in state and "step" in state[t] for t in params):
            opt.steps[i] = float(state[params[0]]["step"])
            for k, key in enumerate(("exp_avg", "exp_avg_sq")):
                opt.moments[k, i] = torch.cat([state[t][key].flatten() for t in params])
        else:  # an optimiser that never stepped
            opt.steps[i] = 0.0
            opt.moments[:, i] = 0.0
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
        opt = self.optimizer
        agent.optimizer.state.clear()
        steps = float(opt.steps[i])
        if steps > 0:
            m = self.layout.views(opt.exp_avg, "")
            v = self.layout.views(opt.exp_avg_sq, "")
            for t, name in zip(params, self.layout.names, strict=True):
                agent.optimizer.state[t] = {
                    # As torch's fused Adam keeps it: a float32 tensor on the parameter's device.
                    "step": torch.tensor(steps, dtype=torch.float32, device=t.device),
                    "exp_avg": m[name][i].clone(),
                    "exp_avg_sq": v[name][i].clone(),
                }
        for group in agent.optimizer.param_groups:
            group["lr"] = self.configs[i].learning_rate  # exact, not the float32 tensor's

    # -- acting -----------------------------------------------------------------------------
    def _actor_params(self) -> dict[str, torch.Tensor]:
        views = self.layout.views(self.flat.detach(), "policy.")
        return {k: v for k, v in views.items() if k.startswith("actor.")}

    @torch.no_grad()
    def explore(self, obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Exploring actions in [-1, 1], (P, n, A), for observations (P, n, D)."""
        p, n = obs.shape[:2]
        eps = self.noise.sample(p * n, generator, obs.device).view(p, n, *self.action_shape)
        run = vmap(lambda params, o, e: functional_call(self._explore, params, (o, e)))
        return run(self._actor_params(), obs, eps)

    @torch.no_grad()
    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """Env actions of the deterministic policies, (P, n, A), for observations (P, n, D)."""
        run = vmap(lambda params, o: functional_call(self._mode, params, (o,)))
        return run(self._actor_params(), obs)

    # -- learning ---------------------------------------------------------------------------
    def _losses(
        self,
        params: dict[str, torch.Tensor],
        targets: dict[str, torch.Tensor],
        log_alpha: torch.Tensor,
        hp: dict[str, torch.Tensor],
        batch: Batch,
        eps_next: torch.Tensor,
        eps: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """One agent's ``SAC.update`` losses (run under ``vmap``): their sum, and the stats."""
        actor = {k.removeprefix("policy."): v for k, v in params.items() if k.startswith("policy.")}
        critic = {
            k.removeprefix("critic."): v for k, v in params.items() if k.startswith("critic.")
        }
        alpha = log_alpha.detach().exp()
        with torch.no_grad():  # the soft clipped double-Q target
            next_action, next_logp = functional_call(
                self._sample, actor, (batch.next_obs, eps_next)
            )
            q_next = functional_call(
                self.template.critic, targets, (batch.next_obs, next_action)
            ).amin(0)
            soft_value = q_next - alpha * next_logp
            y = batch.reward + hp["gamma"] * (1 - batch.terminated) * soft_value
        q = functional_call(self.template.critic, critic, (batch.obs, batch.action))
        critic_loss = (q - y).square().mean(1).sum()
        action, logp = functional_call(self._sample, actor, (batch.obs, eps))
        # The actor's gradient flows through the critics but must not train them.
        frozen = {k: v.detach() for k, v in critic.items()}
        q_pi = functional_call(self.template.critic, frozen, (batch.obs, action)).amin(0)
        actor_loss = (alpha * logp - q_pi).mean()
        total = critic_loss + actor_loss
        if self.autotune:
            total = total - (log_alpha * (logp.detach() + hp["target_entropy"])).mean()
        return total, critic_loss.detach(), actor_loss.detach(), alpha

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
        self.actor_layout = _Layout.of([names[id(t)] for t in actor], actor)
        self.critic_layout = _Layout.of([names[id(t)] for t in critic], critic)
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
        self._critic_losses = vmap(self._critic_loss)
        self._actor_losses = vmap(self._actor_loss)
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
        state = agent.optimizer.state
        for params, flat, adam, _ in self._groups(agent):
            flat[i] = torch.cat([t.detach().flatten() for t in params])
            if all(t in state and "step" in state[t] for t in params):
                adam.steps[i] = float(state[params[0]]["step"])
                for k, key in enumerate(("exp_avg", "exp_avg_sq")):
                    adam.moments[k, i] = torch.cat([state[t][key].flatten() for t in params])
            else:  # never stepped (an actor before its first delayed update)
                adam.steps[i] = 0.0
                adam.moments[:, i] = 0.0
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
            steps = float(adam.steps[i])
            if steps == 0:
                continue
            m, v = layout.views(adam.exp_avg, ""), layout.views(adam.exp_avg_sq, "")
            for t, name in zip(params, layout.names, strict=True):
                agent.optimizer.state[t] = {
                    "step": torch.tensor(steps, dtype=torch.float32, device=t.device),
                    "exp_avg": m[name][i].clone(),
                    "exp_avg_sq": v[name][i].clone(),
                }
        for target, flat, layout in (
            (agent.actor_target, self.actor_target, self.actor_layout),
            (agent.critic_target, self.critic_target, self.critic_layout),
        ):
            for t, view in zip(target.parameters(), layout.views(flat, "").values(), strict=True):
                t.copy_(view[i])
        for group in agent.optimizer.param_groups:
            group["lr"] = self.configs[i].learning_rate

    def _actor_params(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.actor_layout.views(flat, "policy.actor.")

    @torch.no_grad()
    def explore(self, obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """μ(s) plus each agent's scaled noise, clipped to [-1, 1]; (P, n, A)."""
        p, n = obs.shape[:2]
        action = self._act(self._actor_params(self.actor_flat), obs)
        noise = self.noise.sample(p * n, generator, obs.device).view(p, n, *self.action_shape)
        scale = self.hp["exploration_noise"].view(p, 1, 1)
        return action.addcmul_(noise, scale).clamp_(-1, 1)

    @torch.no_grad()
    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.template.to_env(self._act(self._actor_params(self.actor_flat), obs))

    def _critic_loss(self, actor_t, critic, critic_t, hp, batch: Batch, eps) -> torch.Tensor:
        with torch.no_grad():  # DDPG's / TD3's target, smoothed for TD3
            a = functional_call(self.template.actor_target, actor_t, (batch.next_obs,))
            if self.smoothing:
                clip = hp["noise_clip"]
                a = (a + (eps * hp["policy_noise"]).clamp(-clip, clip)).clamp(-1, 1)
            q_next = functional_call(
                self.template.critic_target, critic_t, (batch.next_obs, a)
            ).amin(0)
            y = batch.reward + hp["gamma"] * (1 - batch.terminated) * q_next
        q = functional_call(self.template.critic, critic, (batch.obs, batch.action))
        return (q - y).square().mean(1).sum()

    def _actor_loss(self, actor, critic, obs: torch.Tensor) -> torch.Tensor:
        # Q_1 of the critics before this step; detached, so the actor's loss trains no critic.
        frozen = {k: v.detach() for k, v in critic.items()}
        action = functional_call(self.template.actor, actor, (obs,))
        return -functional_call(self.template.critic, frozen, (obs, action))[0].mean()

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


#: The per-agent (P,) tensors of a DDPG / TD3 population (DDPG's lack TD3's two: zero).
_TD3_TENSORS = ("learning_rate", "gamma", "tau", "exploration_noise", "policy_noise", "noise_clip")
#: The population class of each algorithm that trains as one.
POPULATIONS: dict[str, type] = {"sac": PopulationSAC, "td3": PopulationTD3, "ddpg": PopulationTD3}


def _varied(algorithm: str) -> tuple[str, ...]:
    found = card(algorithm).population
    return found.hyperparameters if found else ()


#: Fields every agent of a population shares (they shape the networks, the data or the loop).
def _shared(config: OffPolicyConfig) -> dict[str, Any]:
    agent = config.agent_config.model_dump(exclude=set(_varied(config.algorithm)))
    loop = {k: getattr(config, k) for k in ReplayLoopConfig.model_fields}
    run = {
        k: getattr(config, k)
        for k in ("env", "env_kwargs", "eval_env_kwargs", "device", "eval_episodes")
    }
    return {**{f"{config.algorithm}.{k}": v for k, v in agent.items()}, **loop, **run}


class OffPolicyPopulationTrainer(Trainer[OffPolicyConfig]):
    """``len(configs)`` SAC, TD3 or DDPG agents in one process; ``step`` is one vector step of
    every agent's slice of the env and the updates it owes (the update-to-data ratio)."""

    config_class = OffPolicyConfig
    one_update_per_step = False
    loop_hyperparameters: ClassVar[tuple[str, ...]] = OffPolicyTrainer.loop_hyperparameters
    pod_defaults: ClassVar = OffPolicyTrainer.pod_defaults

    @classmethod
    def for_algorithm(cls, card: AlgorithmCard) -> type[Trainer]:
        if card.name not in POPULATIONS:
            raise HyperparameterError(
                f"population pods (population.agents_per_pod > 1) of the off-policy family "
                f"train {', '.join(sorted(POPULATIONS))} only, not {card.name}"
            )
        return cls

    def __init__(self, configs: Sequence[OffPolicyConfig], roles: Roles | None = None) -> None:
        first = configs[0]
        train_in_process(
            roles,
            "off-policy populations train fused: every role in this process",
            algorithm=first.algorithm,
        )
        self.size = p = len(configs)
        self.configs = list(configs)
        for config in configs:
            self._check(config)
        self.env, self.eval_env = first.make_envs(first.num_envs, slots=p)
        try:
            check_action_space(first.algorithm, self.env.single_action_space)
        except ValueError:
            self.close()
            raise
        self.device = self.env.device
        singles = [self._single(c) for c in configs]
        self.population = POPULATIONS[first.algorithm]([agent for agent, _ in singles])
        self.replay = StackedReplay(p, singles[0][1])
        # Exploration noise, random actions and minibatches of every agent.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(first.seed)
        self.obs: torch.Tensor | None = None
        self._env_steps = self._updates = 0
        self.update_debt = 0.0
        self.offsets = [Counters(0, 0) for _ in configs]
        self.return_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.episodes = torch.zeros((), device=self.device, dtype=torch.int64)
        self._stats: dict[str, torch.Tensor] = {}

    def _check(self, config: OffPolicyConfig) -> None:
        """Refuse a config whose shared settings differ from the first slot's, naming them."""
        first = self.configs[0].algorithm
        if config.algorithm != first or first not in POPULATIONS:
            raise HyperparameterError(
                f"algorithm: this population pod trains {first}, not {config.algorithm}"
            )
        mine, theirs = _shared(config), _shared(self.configs[0])
        if differ := sorted(k for k in mine if mine[k] != theirs[k]):
            raise HyperparameterError(
                f"population.agents_per_pod = {self.size}: {', '.join(differ)} differ between "
                f"the agents of a population, which share them; it may vary "
                f"{', '.join(_varied(config.algorithm))}"
            )

    def _single(self, config: OffPolicyConfig) -> tuple[SAC, ReplayBuffer]:
        """A fresh single agent and an empty buffer of the population's shape, seeded as a
        single-agent pod seeds its agent."""
        torch.manual_seed(config.seed)
        env = self.env
        algorithm = algorithm_class(config.algorithm)
        agent = algorithm(
            env.single_observation_space, env.single_action_space, config.agent_config
        )
        buffer = ReplayBuffer(
            config.buffer_size,
            tuple(env.single_observation_space.shape),
            agent.action_shape,
            device=self.device,
        )
        return agent.to(self.device), buffer

    # -- the clock ---------------------------------------------------------------------------
    @property
    def env_steps(self) -> int:
        return self._env_steps

    @property
    def updates(self) -> int:
        return self._updates

    @property
    def step_env_steps(self) -> int:
        return self.configs[0].num_envs

    def counters(self, slot: int) -> Counters:
        offset = self.offsets[slot]
        return Counters(self._env_steps + offset.env_steps, self._updates + offset.updates)

    # -- training ----------------------------------------------------------------------------
    def step(self) -> None:
        cfg, p, n = self.configs[0], self.size, self.configs[0].num_envs
        pop = self.population
        if self.obs is None:
            self.obs, _ = self.env.reset(seed=cfg.seed + self._env_steps)
            pop.noise.reset(torch.ones(p * n, dtype=torch.bool, device=self.device))
        obs = self.obs.view(p, n, -1)
        if self._env_steps < cfg.learning_starts:
            action = uniform_action(p * n, pop.action_shape, self.generator, self.device)
            action = action.view(p, n, *pop.action_shape)
        else:
            action = pop.explore(obs, self.generator)
        flat_action = action.reshape(p * n, *pop.action_shape)
        next_obs, reward, terminated, truncated, info = self.env.step(
            pop.template.to_env(flat_action)
        )
        self.replay.add(
            obs,
            action,
            reward.view(p, n),
            info["final_obs"].view(p, n, -1),
            terminated.view(p, n),
        )
        self.obs = next_obs
        self.return_sum += info["episode_return"].sum()
        done = terminated | truncated
        self.episodes += done.sum()
        pop.noise.reset(done)
        self._env_steps += n
        self._learn(n)

    def _learn(self, env_steps: int) -> None:
        """``ReplayLearner.learn``'s schedule, for every agent at once."""
        cfg = self.configs[0]
        if self._env_steps < cfg.learning_starts:
            return
        self.update_debt += env_steps * cfg.updates_per_step
        owed = int(self.update_debt)
        self.update_debt -= owed
        for _ in range(owed):
            self._updates += 1
            batch = self.replay.sample(cfg.batch_size, self.generator)
            self._stats = self.population.update(batch, self.generator, self._updates)

    def progress(self) -> dict[str, float]:
        """The agents' last losses averaged; the mean return of every agent's episodes."""
        record = {k: float(v.mean()) for k, v in self._stats.items()}
        if episodes := int(self.episodes):
            record["train_return"] = float(self.return_sum) / episodes
            self.return_sum.zero_()
            self.episodes.zero_()
        return record

    def evaluate(self) -> list[EvalResult]:
        p = self.size

        def act(obs: torch.Tensor) -> torch.Tensor:
            action = self.population.deterministic(obs.view(p, obs.shape[0] // p, -1))
            return action.reshape(obs.shape[0], *action.shape[2:])

        return evaluate_groups(self.eval_env, act, groups=p, seed=self.configs[0].evaluation_seed)

    def config(self, slot: int) -> OffPolicyConfig:
        return self.configs[slot]

    # -- training files ----------------------------------------------------------------------
    def _view(self, config: OffPolicyConfig) -> _SlotView:
        """A single-agent trainer's parts (what the training files are read from and written
        to), of the population's shape."""
        agent, buffer = self._single(config)
        generator = torch.Generator(device=self.device)
        learner = ReplayLearner(
            agent,
            buffer,
            generator,
            config.learning_starts,
            config.updates_per_step,
            config.batch_size,
        )
        return _SlotView(agent, buffer, generator, learner, _NoWorker())

    def save(self, slot: int, directory: Path) -> None:
        config, counters = self.configs[slot], self.counters(slot)
        view = self._view(config)
        self.population.get(slot, view.agent)
        self.replay.get(slot, view.buffer)
        view.generator.set_state(self.generator.get_state())
        view.learner.env_steps, view.learner.updates = counters.env_steps, counters.updates
        view.learner.update_debt = self.update_debt
        save_offpolicy_files(directory, cast(OffPolicyTrainer, view), config)

    def _place(self, slot: int, view: _SlotView, config: OffPolicyConfig) -> None:
        self.population.put(slot, view.agent)
        self.replay.put(slot, view.buffer)
        self.configs[slot] = config
        self.offsets[slot] = Counters(
            view.learner.env_steps - self._env_steps, view.learner.updates - self._updates
        )

    def load(self, slot: int, directory: Path, config: OffPolicyConfig) -> None:
        self._check(config)
        view = self._view(config)
        load_offpolicy_files(directory, cast(OffPolicyTrainer, view))
        # The slot trains with ``config``'s hyperparameters (PBT's explore), not its files'.
        view.agent.config = config.agent_config
        if isinstance(view.agent, SAC):
            view.agent.target_entropy = _target_entropy(config.sac, view.agent.action_shape)
        self._place(slot, view, config)

    def reset(self, slot: int, config: OffPolicyConfig) -> None:
        self._check(config)
        self._place(slot, self._view(config), config)

    def close(self) -> None:
        for env in (getattr(self, "env", None), getattr(self, "eval_env", None)):
            if env is not None:
                env.close()
        self.env = self.eval_env = None  # type: ignore[assignment]


def _target_entropy(config: SACConfig, action_shape: tuple[int, ...]) -> float:
    if config.target_entropy is not None:
        return config.target_entropy
    return -float(math.prod(action_shape))


class _NoWorker:
    """``load_offpolicy_files`` starts the worker's episodes afresh; a slot has no worker."""

    obs: torch.Tensor | None = None


@dataclass
class _SlotView:
    """What ``save_offpolicy_files`` / ``load_offpolicy_files`` read of a single-agent
    trainer."""

    agent: SAC
    buffer: ReplayBuffer
    generator: torch.Generator
    learner: ReplayLearner
    worker: _NoWorker


__all__ = ["OffPolicyPopulationTrainer", "PopulationSAC", "PopulationTD3", "StackedReplay"]
