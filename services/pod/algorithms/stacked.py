"""What the off-policy algorithms share: P agents of one algorithm stacked (Fast PBT's layout,
Flajolet et al. 2022; one agent is a stack of one), their replay, and the K-step update.

* ``Stack``: the agents' trainable weights as rows of flat (P, n) tensors
  (services/pod/algorithms/flat.py), their targets beside, one ``BatchedAdam`` per optimised
  group, per-agent hyperparameters as (P,) tensors (the card's ``population.hyperparameters``:
  PBT's explore changes a tensor, never a program), and the moves of agent i to and from a
  single agent (its training files' format). Each algorithm's module (sac.py, ddpg.py, dqn.py)
  subclasses it and names it as the agent's ``Stack``: no table keyed by algorithm.
* An algorithm's update is one function over explicit state (the stack's tensors, updated in
  place; the batch drawn inside by counter-based draws), its losses run for every agent with
  ``vmap`` over ``functional_call`` of the template agent's modules. ``KStep`` runs ``K`` of
  them per learner call, eager or compiled, on a GPU one CUDA graph per call.
* ``StackedReplay``: one replay buffer per agent as (P, capacity, ...) tensors, each agent its
  own write position and fill level (a slot loaded from another pod's files keeps its own).

Why one update per compiled program and not K: inductor's compile time grows faster than
linearly with the unrolled graph, and a program of K updates would run the same kernels as K
calls of one; the CUDA graph is what makes the K updates one launch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.func import functional_call

from services.pod.algorithms.adam import BatchedAdam, adam_, clip_rows
from services.pod.algorithms.compiled import BoundProgram, Graphed, Program
from services.pod.algorithms.flat import Layout, flat_rows
from services.pod.algorithms.noise import ActionNoise
from services.pod.algorithms.replay_buffer import FIELDS, Batch, ReplayBuffer


class Stack:
    """P agents of one algorithm stacked (module docstring). A subclass defines the weights' groups
    (``groups``), the update (``update``: a ``Program`` of a module-level ``update(constants...,
    state, hp, replay, filled)``), its ``constants`` and acting (``explore``, ``deterministic``)."""

    #: The per-agent hyperparameters, (P,) tensors in ``hp``: the card's population names.
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ()
    #: The compiled (or eager) update of every agent.
    update: ClassVar[Program]
    #: Updates per actor update (TD3's policy delay); the update takes a ``delayed`` flag.
    policy_delay: int = 1
    #: Whether each agent counts its own updates (DQN's target period runs on them).
    slot_updates: ClassVar[bool] = False
    #: Exploration noise with a state per episode (DDPG's, TD3's and SAC's; DQN has none).
    noise: ActionNoise | None = None

    def __init__(self, agents: Sequence[Any]) -> None:
        self.size = p = len(agents)
        self.template = template = agents[0]
        self.configs = [a.config for a in agents]
        self.action_shape: tuple[int, ...] = template.action_shape
        self.device = next(template.parameters()).device
        self.layouts: dict[str, Layout] = {}
        self.flats: dict[str, torch.Tensor] = {}
        for group, (names, tensors) in self.groups(template).items():
            self.layouts[group] = Layout.of(names, tensors)
            self.flats[group] = torch.zeros(p, self.layouts[group].size, device=self.device)
        self.hp = {k: torch.zeros(p, device=self.device) for k in self.HYPERPARAMETERS}
        self.adams = {
            group: BatchedAdam(self.flats[group], self.hp["learning_rate"])
            for group in self.optimised
        }
        for i, agent in enumerate(agents):
            self.put(i, agent)

    # -- what a subclass says --------------------------------------------------------------
    #: The groups of weights that Adam steps (the others are targets).
    optimised: ClassVar[tuple[str, ...]] = ()

    def groups(self, agent: Any) -> dict[str, tuple[list[str], list[torch.Tensor]]]:
        """Group name → the agent's tensors in it (state-dict names, tensors), in the order of
        its optimiser (optimised groups) or its targets' (the others)."""
        raise NotImplementedError

    def constants(self, delayed: bool) -> tuple:
        """The update's leading arguments: the template's modules and the program's static
        choices (hashable, equal for an equal stack: a program's constants)."""
        raise NotImplementedError

    def set_hyperparameters(self, i: int, config: Any) -> None:
        """Agent i's (P,) tensors from ``config`` (its agent's config)."""
        for name in self.HYPERPARAMETERS:
            value = getattr(config, name, 0.0)
            self.hp[name][i] = math.inf if value is None else value
        self.configs[i] = config

    def check(self, agent: Any) -> None:
        """Refuse an agent that differs in what the stack's programs are fixed on."""

    # -- moving agents in and out ----------------------------------------------------------
    @torch.no_grad()
    def put(self, i: int, agent: Any) -> None:
        """Agent ``i`` becomes ``agent``: weights, targets, Adam state, hyperparameters."""
        self.check(agent)
        for group, (_, tensors) in self.groups(agent).items():
            self.flats[group][i] = torch.cat([t.detach().flatten() for t in tensors])
            if group in self.adams:
                self.adams[group].load_row(i, self.layouts[group], tensors, agent.optimizer.state)
        self.set_hyperparameters(i, agent.config)

    @torch.no_grad()
    def get(self, i: int, agent: Any) -> None:
        """Write agent ``i`` into ``agent`` (of the same shape): weights, targets, and its
        optimiser's state as a single agent's ``torch.optim.Adam`` holds it."""
        agent.optimizer.state.clear()
        for group, (_, tensors) in self.groups(agent).items():
            views = self.layouts[group].views(self.flats[group])
            for t, view in zip(tensors, views.values(), strict=True):
                t.copy_(view[i])
            if group in self.adams:
                state = self.adams[group].row_state(i, self.layouts[group], tensors)
                agent.optimizer.state.update(state)
        agent.optimizer.lr = self.configs[i].learning_rate  # exact, not the float32 tensor's

    def weights(self, i: int, agent: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``agent``'s weights and targets, and their views in slot ``i`` (the same order):
        what a copy makes ``agent`` act and evaluate as slot ``i``."""
        mine: list[torch.Tensor] = []
        theirs: list[torch.Tensor] = []
        for group, (_, tensors) in self.groups(agent).items():
            mine += tensors
            theirs += [v[i] for v in self.layouts[group].views(self.flats[group]).values()]
        return mine, theirs

    def copy(self, dst: int, src: int) -> None:
        """PBT's exploit inside the stack: agent ``dst`` becomes agent ``src`` (weights,
        targets, moments, step counts); hyperparameters are the caller's."""
        for group, flat in self.flats.items():
            if group in self.adams:
                self.adams[group].copy(dst, src)
            else:
                flat[dst] = flat[src]

    # -- the update ------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """The tensors the update reads and writes in place: each group's weights, each
        optimised group's moments and step counts."""
        out = dict(self.flats)
        for group, adam in self.adams.items():
            out[f"{group}_moments"] = adam.moments
            out[f"{group}_steps"] = adam.steps
        return out

    # -- acting ----------------------------------------------------------------------------
    def random_action(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return self.template.random_action(n, generator)

    def end_episodes(self, done: torch.Tensor) -> None:
        """The episodes of the (P * n) sub-environments where ``done`` ended."""
        if self.noise is not None:
            self.noise.reset(done)

    def explore(
        self, obs: torch.Tensor, generator: torch.Generator, env_steps: torch.Tensor
    ) -> torch.Tensor:
        """Exploring actions (P, n, ...) for (P, n, D) observations, agent p at ``env_steps[p]``."""
        raise NotImplementedError

    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """The deterministic env actions (P, n, ...) for observations (P, n, D)."""
        raise NotImplementedError


#: The stream of the minibatch draws (``draw_batch``'s uniforms); an update's other draws
#: (its action noise) take other streams of the same ``draws`` call.
BATCH_STREAM = 0


def draw_batch(replay: tuple[torch.Tensor, ...], filled: torch.Tensor, u: torch.Tensor) -> Batch:
    """A minibatch per agent from ``replay``'s fields (P, capacity, ...), drawn uniformly with
    replacement from each agent's ``filled`` (P,) rows by its uniforms ``u`` (P, batch) of
    ``BATCH_STREAM`` (an agent's own stream: its draws do not depend on the others')."""
    size = filled.unsqueeze(1)
    idx = (u * size).long().clamp_(max=size - 1)
    agents = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1)
    return Batch(*(field[agents, idx] for field in replay))


def adam_group_(
    state: dict[str, torch.Tensor], group: str, grads: dict[str, torch.Tensor],
    views: dict[str, torch.Tensor], lr: torch.Tensor, max_norm: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Adam on the rows of ``group`` in a stack's ``state`` (``Stack.state``), ``grads`` the
    gradient of its ``views``, each agent's clipped to ``max_norm`` where given."""
    rows = flat_rows(grads, views)
    if max_norm is not None:
        rows = clip_rows(rows, max_norm)
    moments = state[f"{group}_moments"]
    adam_(state[group], rows, moments[0], moments[1], state[f"{group}_steps"], lr)


class KStep:
    """K updates of a stack per call, each one call of its update (compiled, or the same function
    eager). ``replay``: the agents' replay fields, (P, capacity, ...) each, and ``filled`` (P,)
    int64 their fill levels, tensors the caller keeps updating in place; ``seeds``: each agent's
    random stream (``reseed`` gives a reloaded slot its own). On CUDA, compiled, a call's K updates
    are one graph (``Graphed``: the first call compiles and warms up, the second captures)."""

    def __init__(
        self,
        stack: Stack,
        replay: tuple[torch.Tensor, ...],
        filled: torch.Tensor,
        batch_size: int,
        seeds: Sequence[int],
    ) -> None:
        self.stack, self.replay, self.filled, self.batch_size = stack, replay, filled, batch_size
        self.device = device = filled.device
        self.seed = torch.tensor(list(seeds), dtype=torch.int64, device=device)
        self.counter = torch.zeros((), dtype=torch.int64, device=device)
        self.state = {
            **stack.state(),
            "seed": self.seed,
            "counter": self.counter,
            # Each slot's count of updates before this one (DQN's target timing): set every
            # call, a tensor the program (and a CUDA graph) reads in place.
            "slot_updates": torch.zeros(stack.size, dtype=torch.int64, device=device),
        }
        self._graphs: dict[Hashable, Graphed] = {}
        #: The update program for each kind of update (``delayed`` or not): one graph each.
        self._programs: dict[bool, BoundProgram] = {}
        #: The kinds of update (``delayed`` or not) that ran compiled: the programs built.
        self.compiled_kinds: set[bool] = set()

    def reseed(self, slot: int, seed: int) -> None:
        self.seed[slot] = seed

    def one(self, delayed: bool, compiled: bool) -> dict[str, torch.Tensor]:
        """One update of every agent (``delayed``: TD3's actor and targets too)."""
        stack = self.stack
        args = (
            *stack.constants(delayed),
            self.batch_size,
            self.state,
            stack.hp,
            self.replay,
            self.filled,
        )
        if compiled:
            if delayed not in self._programs:
                self._programs[delayed] = stack.update.bind(self.device)
            out = self._programs[delayed](*args)
            self.compiled_kinds.add(delayed)
            return out
        return stack.update.fn(*args)

    def _run(self, k: int, first: int, compiled: bool) -> dict[str, torch.Tensor]:
        stats: dict[str, torch.Tensor] = {}
        for step in range(first, first + k):
            out = self.one(step % self.stack.policy_delay == 0, compiled)
            # The stats of the last update; the actor's loss of the last delayed one.
            stats = {**stats, **out}
        return stats

    def __call__(
        self,
        k: int,
        first: int,
        compiled: bool,
        slot_updates: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Updates number ``first`` to ``first + k - 1`` (1-based, as the learner counts) of
        every agent; the stats of the last, (P,) each. ``slot_updates`` (P,) int64: each
        agent's own count of the updates before this call, where agents count their updates
        apart (``Stack.slot_updates``); default ``first - 1`` for every agent."""
        updates = self.state["slot_updates"]
        # Outside the CUDA graph: a replay reads the tensor, the copy sets it.
        if slot_updates is None:
            updates.fill_(first - 1)
        else:
            updates.copy_(slot_updates)
        if not compiled or self.device.type != "cuda":
            return self._run(k, first, compiled)
        key = (k, first % self.stack.policy_delay)
        if key not in self._graphs:
            self._graphs[key] = Graphed(
                lambda: self._run(k, first, True), f"{type(self.stack).__name__} update"
            )
        return self._graphs[key]()


class StackedReplay:
    """P replay buffers as (P, capacity, ...) tensors; each agent its own write position and
    fill level (host ints: the loop knows them without a sync)."""

    def __init__(self, p: int, template: ReplayBuffer) -> None:
        self.p, self.capacity, self.device = p, template.capacity, template.device
        for name in FIELDS:
            store = getattr(template, name)
            setattr(self, name, store.new_zeros((p, *store.shape)))
        self.pos = [0] * p
        self.size = [0] * p
        # The fill levels on the device too, for the update that samples by itself.
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

    def copy(self, dst: int, src: int) -> None:
        """PBT's exploit: agent ``dst``'s replay becomes agent ``src``'s."""
        for name in FIELDS:
            getattr(self, name)[dst] = getattr(self, name)[src]
        self.pos[dst], self.size[dst] = self.pos[src], self.size[src]
        self._pos[dst] = self._pos[src]
        self.filled[dst] = self.filled[src]


def call(module: nn.Module, params: dict[str, torch.Tensor], *args: Any) -> Any:
    """``module(*args)`` with ``params`` (one agent's row of a stack) as its parameters: the
    single agent's own code on a stack's weights (the agents' modules tie no weights)."""
    return functional_call(module, params, args, tie_weights=False)
