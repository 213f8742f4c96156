"""K gradient updates of off-policy agents per learner call, each update one compiled program
(Fast PBT, Flajolet et al. 2022; LeanRL's compiled SAC and TD3), for a stack of P agents
(services/pod/algorithms/stacked.py; a single agent is a stack of one).

One update is everything ``SAC.update`` / ``TD3.update`` / ``DDPG.update`` / ``DQN.update``
does, in one ``torch.compile(fullgraph=True)`` function: the minibatch indices drawn from each
agent's filled rows, the noise draws, critic, actor (TD3: every ``policy_delay``-th update) and
temperature losses (DQN: the Huber TD loss, double or not, and each agent's gradient clip),
their gradients (``torch.func.grad``), Adam, and the targets' move (DQN: each agent's on its
own update count, every ``target_update_every``-th). Nothing in it reads the host or allocates
state: weights, targets, Adam's moments and step counts, the random counter, the fill levels
and DQN's update counts are tensors updated in place, and the hyperparameters PBT varies
(learning rate, γ, τ, target entropy, policy noise; DQN's target period and gradient clip) are
(P,) tensors, so a PBT explore changes numbers, never the program. On a GPU the K updates of
one call are captured as one CUDA graph (``torch.cuda.graph``) and replayed, one launch per
call.

Why one update per compiled program and not K: inductor's compile time grows faster than
linearly with the unrolled graph (docs/benchmarks.md, "Off-policy K-step updates"), and a
program of K updates would run the same kernels as K calls of one; the CUDA graph is what makes
the K updates one launch.

Randomness is counter-based (services/pod/algorithms/counter_random.py): the same numbers
compiled or eager, on any device, with no generator state for dynamo to refuse or for a CUDA
graph to freeze; the counter is a tensor the update increments.

Whether a run compiles is ``ReplayLoopConfig.compile``: ``off`` keeps the eager loop of single
updates (``SAC.update``, a ``torch.Generator``); ``on`` compiles; ``auto`` decides by
``AUTO_UPDATES`` below. A missing compiler or a failed compile runs the same K-step update
eager (one log line, services/pod/algorithms/compiled.py's ``Compiled``); a failed CUDA graph
capture runs the updates uncaptured (one log line).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.func import vmap

from services.logs import get_logger
from services.pod.algorithms.compiled import Compiled, CompileMode, compiler_missing
from services.pod.algorithms.counter_random import normal, uniform
from services.pod.algorithms.replay_buffer import Batch
from services.pod.algorithms.stacked import (
    Layout,
    PopulationDQN,
    PopulationSAC,
    PopulationTD3,
    clip_rows_,
    dqn_loss,
    flat_rows,
    move_dqn_targets_,
    sac_losses,
    td3_actor_loss,
    td3_critic_loss,
)

log = get_logger(__name__)


#: The algorithms with a compiled K-step update (plugins train eager).
COMPILED: frozenset[str] = frozenset({"sac", "td3", "ddpg", "dqn"})


# -- when ``auto`` compiles ------------------------------------------------------------------
@dataclass(frozen=True)
class UpdatesRule:
    """One device's measurement (docs/benchmarks.md, "Off-policy K-step updates"): ms per
    gradient step of a SAC agent, eager (``SAC.update``) and compiled, and the cold compile."""

    eager_ms: float
    compiled_ms: float
    compile_s: float

    def pays_after(self) -> float:
        """Updates after which the compiled run has saved its compile (inf: never)."""
        saved = self.eager_ms - self.compiled_ms
        return math.inf if saved <= 0 else self.compile_s * 1e3 / saved


#: What ``compile: auto`` reads, per device type: compile when the run's updates exceed
#: ``pays_after``. Both rows are one 256x256 SAC agent, batch 256, eager ``SAC.update`` against
#: the compiled update, the compile cold (bench/population_vmap.py --kstep; docs/benchmarks.md,
#: "Off-policy K-step updates"). CPU: this project's 2-core machine, one thread: the compiled
#: update is faster at every size measured, but its compile (a minute and more on a loaded
#: 2-core machine) pays only over tens of thousands of updates, more than a CI-sized run has.
#: CUDA: an H200, where the K updates of a call replay as one CUDA graph: it pays within a few
#: thousand updates.
#: DQN reads the same rows: its CPU break-even, measured alike, is in the SAC row's range and
#: decides the same way; on CUDA it is unmeasured.
AUTO_UPDATES: dict[str, UpdatesRule | None] = {
    "cpu": UpdatesRule(eager_ms=8.11, compiled_ms=6.74, compile_s=91.0),
    "cuda": UpdatesRule(eager_ms=5.93, compiled_ms=0.33, compile_s=21.0),
}


def should_compile_updates(
    mode: CompileMode, device: torch.device | str, total_updates: float
) -> bool:
    """Resolve ``mode`` for a run of about ``total_updates`` gradient steps on ``device``,
    logging why a requested compile cannot happen."""
    if mode == "off":
        return False
    if mode == "auto":
        rule = AUTO_UPDATES.get(torch.device(device).type)
        if rule is None or total_updates <= rule.pays_after():  # None: nobody measured it
            return False
    if reason := compiler_missing(device):
        log.warning("compile.unavailable", mode=mode, reason=reason, fallback="eager")
        return False
    return True


def draw_batch(
    replay: tuple[torch.Tensor, ...],
    filled: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    batch_size: int,
) -> Batch:
    """``batch_size`` transitions per agent from ``replay``'s fields (P, capacity, ...), drawn
    uniformly with replacement from each agent's ``filled`` (P,) rows."""
    p = replay[0].shape[0]
    u = uniform(seed, counter, 0, (p, batch_size))
    size = filled.unsqueeze(1)
    idx = (u * size).long().clamp_(max=size - 1)
    agents = torch.arange(p, device=idx.device).unsqueeze(1)
    return Batch(*(field[agents, idx] for field in replay))


# -- Adam in tensor ops ----------------------------------------------------------------------------
def adam_(
    params: torch.Tensor,
    grad: torch.Tensor,
    moments: torch.Tensor,
    steps: torch.Tensor,
    lr: torch.Tensor,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> None:
    """``BatchedAdam.step`` (torch's Adam, each row its own learning rate and step count) on
    the same tensors, in plain tensor ops inductor can fuse, in place."""
    b1, b2 = betas
    steps.add_(1)
    m, v = moments[0], moments[1]
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    bias1 = 1 - torch.pow(b1, steps)
    bias2 = 1 - torch.pow(b2, steps)
    rate = (lr / bias1).unsqueeze(1)
    denom = (v.sqrt() / bias2.sqrt().unsqueeze(1)).add_(eps)
    params.sub_(rate * m / denom)


# -- one update of a stack (compiled) --------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What an update's program is specialised on besides tensor shapes: the agents' layouts
    (constants: a stack rebuilt with the same shapes compares equal), the batch size and the
    algorithm's switch."""

    #: SAC: the trainable weights (actor, log α, critics); TD3 / DDPG: the critics; DQN: the
    #: Q-networks (and their targets).
    layout: Layout
    #: SAC: the critics' targets; TD3 / DDPG: the actor; DQN: ``layout`` again.
    other: Layout
    batch_size: int
    action_dim: int
    flag: bool  # SAC: α is learned; TD3: target smoothing; DQN: double Q-learning
    critic_start: int = 0  # SAC: the critics' first column of the flat weights


def sac_update(
    sampler: nn.Module,
    critic: nn.Module,
    shape: Shape,
    state: dict[str, torch.Tensor],
    hp: dict[str, torch.Tensor],
    replay: tuple[torch.Tensor, ...],
    filled: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One ``PopulationSAC.update`` of every agent on a minibatch it draws itself; ``state``:
    ``flat``, ``targets``, ``moments``, ``steps``, ``fixed_log_alpha``, ``seed``, ``counter``,
    updated in place. Returns each agent's stats, (P,) each."""
    flat, seed, counter = state["flat"], state["seed"], state["counter"]
    p, b, a = flat.shape[0], shape.batch_size, shape.action_dim
    batch = draw_batch(replay, filled, seed, counter, b)
    eps_next, eps = normal(seed, counter, 1, (p, b, a)), normal(seed, counter, 2, (p, b, a))
    params = shape.layout.views(flat, "")
    targets = shape.other.views(state["targets"], "critic_target.")
    losses = vmap(partial(sac_losses, sampler, critic, shape.flag))

    def total(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple]:
        params = dict(params)  # a copy: grad reads the caller's dict for its output's shape
        log_alpha = params.pop("log_alpha") if shape.flag else state["fixed_log_alpha"]
        out = losses(params, targets, log_alpha, hp, batch, eps_next, eps)
        return out[0].sum(), out[1:]

    grads, (critic_loss, actor_loss, alpha) = torch.func.grad(total, has_aux=True)(params)
    adam_(
        flat,
        flat_rows(grads, params),
        state["moments"],
        state["steps"],
        hp["learning_rate"],
    )
    with torch.no_grad():
        state["targets"].lerp_(flat[:, shape.critic_start :], hp["tau"].unsqueeze(1))
    counter.add_(1)
    return {"critic_loss": critic_loss, "actor_loss": actor_loss, "alpha": alpha}


def td3_update(
    modules: tuple[nn.Module, nn.Module, nn.Module, nn.Module],
    shape: Shape,
    delayed: bool,
    state: dict[str, torch.Tensor],
    hp: dict[str, torch.Tensor],
    replay: tuple[torch.Tensor, ...],
    filled: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One ``PopulationTD3.update`` of every agent (DDPG's or TD3's; ``delayed``: this update
    steps the actors and the targets too) on a minibatch it draws itself. ``modules``: the
    template's actor, actor target, critic and critic target; ``state``: ``actor``,
    ``critic``, ``actor_target``, ``critic_target``, ``actor_moments``, ``actor_steps``,
    ``critic_moments``, ``critic_steps``, ``seed``, ``counter``, updated in place."""
    actor_m, actor_target_m, critic_m, critic_target_m = modules
    seed, counter = state["seed"], state["counter"]
    p, b, a = state["critic"].shape[0], shape.batch_size, shape.action_dim
    batch = draw_batch(replay, filled, seed, counter, b)
    noise = normal(seed, counter, 1, (p, b, a)) if shape.flag else batch.action.new_zeros(p, b, a)
    critic = shape.layout.views(state["critic"], "critic.")
    critic_t = shape.layout.views(state["critic_target"], "critic.")
    actor = shape.other.views(state["actor"], "policy.actor.")
    actor_t = shape.other.views(state["actor_target"], "policy.actor.")
    critic_losses = vmap(
        partial(td3_critic_loss, actor_target_m, critic_target_m, critic_m, shape.flag)
    )
    actor_losses = vmap(partial(td3_actor_loss, actor_m, critic_m))

    def total(critic: dict, actor: dict) -> tuple[torch.Tensor, tuple]:
        critic_loss = critic_losses(actor_t, critic, critic_t, hp, batch, noise)
        if not delayed:
            return critic_loss.sum(), (critic_loss,)
        actor_loss = actor_losses(actor, critic, batch.obs)
        return critic_loss.sum() + actor_loss.sum(), (critic_loss, actor_loss)

    (g_critic, g_actor), aux = torch.func.grad(total, argnums=(0, 1), has_aux=True)(critic, actor)
    lr = hp["learning_rate"]
    adam_(
        state["critic"],
        flat_rows(g_critic, critic),
        state["critic_moments"],
        state["critic_steps"],
        lr,
    )
    stats = {"critic_loss": aux[0]}
    if delayed:
        adam_(
            state["actor"],
            flat_rows(g_actor, actor),
            state["actor_moments"],
            state["actor_steps"],
            lr,
        )
        tau = hp["tau"].unsqueeze(1)
        with torch.no_grad():
            state["actor_target"].lerp_(state["actor"], tau)
            state["critic_target"].lerp_(state["critic"], tau)
        stats["actor_loss"] = aux[1]
    counter.add_(1)
    return stats


def dqn_update(
    q_module: nn.Module,
    shape: Shape,
    state: dict[str, torch.Tensor],
    hp: dict[str, torch.Tensor],
    replay: tuple[torch.Tensor, ...],
    filled: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One ``PopulationDQN.update`` of every agent on a minibatch it draws itself: Huber loss
    (double Q-learning where ``shape.flag``), each agent's gradient clipped to its
    ``max_grad_norm``, Adam, and each agent's targets moved on its own update count. ``state``:
    ``flat``, ``targets``, ``moments``, ``steps``, ``slot_updates`` (P,) int64 (each agent's
    count of updates before this one), ``seed``, ``counter``, updated in place. Returns each
    agent's loss, (P,)."""
    flat, seed, counter = state["flat"], state["seed"], state["counter"]
    batch = draw_batch(replay, filled, seed, counter, shape.batch_size)
    params = shape.layout.views(flat, "policy.actor.")
    targets = shape.other.views(state["targets"], "policy.actor.")
    losses = vmap(partial(dqn_loss, q_module, shape.flag))

    def total(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss = losses(params, targets, hp["gamma"], batch)
        return loss.sum(), loss

    grads, loss = torch.func.grad(total, has_aux=True)(params)
    grad = clip_rows_(flat_rows(grads, params), hp["max_grad_norm"])
    adam_(flat, grad, state["moments"], state["steps"], hp["learning_rate"])
    updates = state["slot_updates"]
    updates.add_(1)
    with torch.no_grad():
        move_dqn_targets_(state["targets"], flat, hp, updates)
    counter.add_(1)
    return {"loss": loss}


class _CompiledUpdate(Compiled):
    """``Compiled`` with static shapes (a P, batch or network change compiles a new program
    rather than a dynamic one) and no CUDA graph trees: ``KStep`` captures the K updates of a
    call as one graph itself."""

    def _for_device(self, device: torch.device) -> Callable[..., Any]:
        if device.type not in self._compiled:
            self._compiled[device.type] = torch.compile(self.fn, fullgraph=True, dynamic=False)
        return self._compiled[device.type]


#: Module-level, so one process shares the programs: a pod that rebuilds its agent (a PBT
#: child) or its stack reuses them; the modules are arguments, their parameters unused.
SAC_UPDATE = _CompiledUpdate(sac_update, "sac_update")
TD3_UPDATE = _CompiledUpdate(td3_update, "td3_update")
DQN_UPDATE = _CompiledUpdate(dqn_update, "dqn_update")


class KStep:
    """K updates of a stack per call, each one program (compiled, or the same function eager).

    ``replay``: the agents' replay fields, (P, capacity, ...) each, and ``filled`` (P,) int64
    their fill levels, both tensors the caller keeps updating in place; ``seed``: the random
    stream's seed (a PBT child reseeds with ``reseed``); ``cuda_graph``: on CUDA, capture each
    call's K updates as one graph (from a call's third time on: the first compiles and warms
    up, the second captures)."""

    def __init__(
        self,
        stack: PopulationSAC | PopulationTD3 | PopulationDQN,
        replay: tuple[torch.Tensor, ...],
        filled: torch.Tensor,
        batch_size: int,
        seed: int,
        compile: bool,
        cuda_graph: bool = True,
    ) -> None:
        self.stack, self.replay, self.filled, self.compile = stack, replay, filled, compile
        device = filled.device
        self.device = device
        self.seed = torch.tensor(seed, dtype=torch.int64, device=device)
        self.counter = torch.zeros((), dtype=torch.int64, device=device)
        action_dim = math.prod(stack.action_shape)
        self.policy_delay = 1
        if isinstance(stack, PopulationSAC):
            self.shape = Shape(
                stack.layout,
                stack.target_layout,
                batch_size,
                action_dim,
                stack.autotune,
                critic_start=stack.critic_start,
            )
            self.state = {
                "flat": stack.flat,
                "targets": stack.targets,
                "moments": stack.optimizer.moments,
                "steps": stack.optimizer.steps,
                "fixed_log_alpha": stack.fixed_log_alpha,
                "seed": self.seed,
                "counter": self.counter,
            }
        elif isinstance(stack, PopulationDQN):
            self.shape = Shape(stack.layout, stack.layout, batch_size, action_dim, stack.double)
            self.state = {
                "flat": stack.flat,
                "targets": stack.targets,
                "moments": stack.optimizer.moments,
                "steps": stack.optimizer.steps,
                # Each slot's own count of updates, for its target timing: set every call (a
                # tensor the program, and a CUDA graph, reads in place).
                "slot_updates": torch.zeros(stack.size, dtype=torch.int64, device=device),
                "seed": self.seed,
                "counter": self.counter,
            }
        else:
            self.shape = Shape(
                stack.critic_layout,
                stack.actor_layout,
                batch_size,
                action_dim,
                stack.smoothing,
            )
            self.state = {
                "actor": stack.actor_flat,
                "critic": stack.critic_flat,
                "actor_target": stack.actor_target,
                "critic_target": stack.critic_target,
                "actor_moments": stack.actor_adam.moments,
                "actor_steps": stack.actor_adam.steps,
                "critic_moments": stack.critic_adam.moments,
                "critic_steps": stack.critic_adam.steps,
                "seed": self.seed,
                "counter": self.counter,
            }
            t = stack.template
            self.modules = (t.actor, t.actor_target, t.critic, t.critic_target)
            self.policy_delay = stack.policy_delay
        p = self.replay[0].shape[0]
        self._key = f"P={p} batch={batch_size} layout={hash(self.shape):x}"
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, dict]] = {}
        self._warm: set[Hashable] = set()
        self._graph_failed: str | None = None if cuda_graph else "not asked for"

    def reseed(self, seed: int) -> None:
        self.seed.fill_(seed)

    def one(self, delayed: bool) -> dict[str, torch.Tensor]:
        """One update of every agent (``delayed``: TD3's actor and targets too)."""
        if isinstance(self.stack, PopulationSAC):
            args: tuple = (self.stack._sample, self.stack.template.critic, self.shape)
            fn = SAC_UPDATE
        elif isinstance(self.stack, PopulationDQN):
            args = (self.stack.template.q, self.shape)
            fn = DQN_UPDATE
        else:
            args = (self.modules, self.shape, delayed)
            fn = TD3_UPDATE
        args = (*args, self.state, self.stack.hp, self.replay, self.filled)
        if self.compile:
            # A failure is remembered per program: dynamo refuses a function's ninth program
            # (``recompile_limit``), which must not turn off the ones compiled before it.
            return fn(self._key, self.device, *args)
        return fn.fn(*args)

    def _run(self, k: int, first: int) -> dict[str, torch.Tensor]:
        stats: dict[str, torch.Tensor] = {}
        for step in range(first, first + k):
            out = self.one(step % self.policy_delay == 0)
            # The stats of the last update; the actor's loss of the last delayed one.
            stats = {**stats, **out}
        return stats

    def __call__(
        self, k: int, first: int, slot_updates: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Updates number ``first`` to ``first + k - 1`` (1-based, as the learner counts) of
        every agent; the stats of the last, (P,) each. ``slot_updates`` (P,) int64, DQN's: each
        agent's own count of the updates before this call, where agents count their updates
        apart (a population's slot loaded from files goes on from its count), so agent i's
        updates are numbered ``slot_updates[i] + 1`` on; its targets move on those numbers.
        Default: ``first - 1`` for every agent. The other algorithms ignore it."""
        if (updates := self.state.get("slot_updates")) is not None:
            # Outside the CUDA graph: a replay reads the tensor, the copy sets it.
            if slot_updates is None:
                updates.fill_(first - 1)
            else:
                updates.copy_(slot_updates)
        if self.device.type != "cuda" or self._graph_failed is not None:
            return self._run(k, first)
        key = (k, first % self.policy_delay)
        if key in self._graphs:
            graph, out = self._graphs[key]
            graph.replay()
            return out
        if key not in self._warm:
            # The first call compiles and warms the allocator and cuBLAS on a side stream, as
            # capture requires; its updates are real.
            self._warm.add(key)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                out = self._run(k, first)
            torch.cuda.current_stream(self.device).wait_stream(side)
            return out
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = self._run(k, first)
        except Exception as exc:  # any capture failure means: run the updates uncaptured
            self._graph_failed = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            log.warning(
                "compile.cuda_graph_failed",
                function="kstep",
                error=self._graph_failed,
                fallback="uncaptured",
            )
            torch.cuda.synchronize(self.device)
            return self._run(k, first)
        self._graphs[key] = (graph, out)
        graph.replay()  # capturing recorded the updates; replaying runs them
        return out
