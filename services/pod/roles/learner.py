"""The learner: turns what the worker collected into updates and owns everything that learns.

It is the single writer of the agent's state (weights, optimiser, normalisation statistics,
counters); workers and evaluators only ever read a snapshot of the policy. That one-way flow is
what lets the roles run fused in one process or as three containers. Two kinds, one per way of
learning (services/pod/roles/worker.py has the matching workers):

* ``RolloutLearner`` (on-policy, PPO): one update per rollout.
* ``ReplayLearner`` (off-policy): ``updates_per_step`` updates per env step (the
  update-to-data ratio), each on a fresh minibatch sampled from the replay buffer;
  ``KStepLearner`` pays the same schedule ``updates_per_call`` updates at a time with the
  compiled update (services/pod/algorithms/kstep.py); ``PopulationReplayLearner`` pays it for P
  stacked agents at once (services/pod/algorithms/stacked.py), either way. The schedule itself
  is ``UpdateSchedule``, which all three are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from services.pod.algorithms.kstep import KStep
from services.pod.algorithms.ppo import PPO
from services.pod.algorithms.replay_buffer import FIELDS, Batch, ReplayBuffer
from services.pod.algorithms.rollout import Rollout
from services.pod.algorithms.stacked import (
    POPULATIONS,
    PopulationDQN,
    PopulationSAC,
    PopulationTD3,
    StackedReplay,
)


class RolloutLearner:
    """PPO's learner: one update per rollout, the LR annealed by the budget consumed."""

    def __init__(self, agent: PPO, total_env_steps: int, world: int = 1) -> None:
        self.agent = agent
        self.total_env_steps = max(1, int(total_env_steps))
        self.env_steps = 0  # of all fused replicas together
        self.updates = 0
        #: Number of fused learner replicas, and the hook that averages them after each epoch
        #: (services/pod/training/fusion.py); one learner alone needs neither.
        self.world = world
        self.after_epoch: Callable[[], None] | None = None

    @property
    def policy(self):
        return self.agent.policy

    def update(self, rollout: Rollout) -> dict[str, float]:
        # Anneal by budget consumed, so a resumed run continues the same schedule.
        lr_fraction = max(0.0, 1.0 - self.env_steps / self.total_env_steps)
        stats = self.agent.update(rollout, lr_fraction=lr_fraction, after_epoch=self.after_epoch)
        self.env_steps += rollout.env_steps * self.world
        self.updates += 1
        return stats

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Snapshot of what workers and evaluators need (actor + obs statistics)."""
        return {k: v.detach().clone() for k, v in self.agent.policy.state_dict().items()}

    def counters(self) -> dict[str, int]:
        return {
            "env_steps": self.env_steps,
            "updates": self.updates,
            "total_env_steps": self.total_env_steps,
        }

    def load_counters(self, counters: dict[str, int]) -> None:
        self.env_steps = int(counters["env_steps"])
        self.updates = int(counters["updates"])


class ReplayAgent(Protocol):
    """What a ``ReplayLearner`` needs of an off-policy agent (services/pod/algorithms/)."""

    def update(
        self, batch: Batch, generator: torch.Generator, step: int
    ) -> dict[str, torch.Tensor]: ...


class UpdateSchedule:
    """The update-to-data ratio, as every replay learner pays it: once ``learning_starts`` env
    steps are in, each env step owes ``updates_per_step`` updates; what is short of a whole
    call of ``k`` updates (one update eager, ``updates_per_call`` compiled) stays owed, as
    ``update_debt``, for the next steps. It counts the env steps seen and, by the learner that
    pays them, the updates (the agents' schedules, such as TD3's policy delay and DQN's
    target period, count from ``updates``)."""

    def __init__(self, learning_starts: int, updates_per_step: float, k: int = 1) -> None:
        self.learning_starts, self.updates_per_step, self.k = learning_starts, updates_per_step, k
        self.env_steps = 0
        self.updates = 0
        self.update_debt = 0.0  # fractional updates owed to the update-to-data ratio

    def owed(self, env_steps: int) -> int:
        """Count ``env_steps`` new env steps; the calls of ``k`` updates now owed (taken off
        the debt: the caller runs them and counts them in ``updates``)."""
        self.env_steps += env_steps
        if self.env_steps < self.learning_starts:
            return 0
        self.update_debt += env_steps * self.updates_per_step
        calls = int(self.update_debt) // self.k
        # Whole updates off a float under 2**53 are exact: the same debt as paying one call
        # (or one update) at a time.
        self.update_debt -= calls * self.k
        return calls


class ReplayLearner(UpdateSchedule):
    """Pays the updates owed to the update-to-data ratio (``UpdateSchedule``), one at a time,
    each on a fresh minibatch of the replay buffer."""

    def __init__(
        self,
        agent: ReplayAgent,
        buffer: ReplayBuffer,
        generator: torch.Generator,
        learning_starts: int,
        updates_per_step: float,
        batch_size: int,
    ) -> None:
        super().__init__(learning_starts, updates_per_step)
        self.agent, self.buffer, self.generator = agent, buffer, generator
        self.batch_size = batch_size

    def learn(self, env_steps: int) -> dict[str, torch.Tensor]:
        """Count ``env_steps`` new env steps, then run the updates they owe; the last
        update's statistics (empty when none ran)."""
        stats: dict[str, torch.Tensor] = {}
        for _ in range(self.owed(env_steps)):
            self.updates += 1
            batch = self.buffer.sample(self.batch_size, self.generator)
            stats = self.agent.update(batch, self.generator, self.updates)
        return stats

    def sync(self) -> None:
        """Make the agent hold the whole learning state (before its files are written): it
        always does here."""

    def reloaded(self, seed: int) -> None:
        """The agent's state was loaded from files (and is to explore with ``seed``)."""

    def counters(self) -> dict[str, int | float]:
        return {
            "env_steps": self.env_steps,
            "updates": self.updates,
            "update_debt": self.update_debt,
        }

    def load_counters(self, counters: dict[str, int | float]) -> None:
        self.env_steps = int(counters["env_steps"])
        self.updates = int(counters["updates"])
        self.update_debt = float(counters["update_debt"])
        # Older files also hold "agent_updates": it always equalled "updates", so it is ignored.


class KStepLearner(ReplayLearner):
    """``ReplayLearner``'s schedule, paid ``k`` updates at a time by one ``KStep`` call on the
    agent as a stack of one (services/pod/algorithms/kstep.py). The agent's modules get the new
    weights and targets once per call (what the worker and evaluator read); its optimiser's
    state only when ``sync`` writes the whole stack back, before its training files are
    written. Its minibatches and noise come from the update's own counter-based stream, not
    ``generator`` (the worker's).
    """

    def __init__(
        self,
        agent: ReplayAgent,
        buffer: ReplayBuffer,
        generator: torch.Generator,
        learning_starts: int,
        updates_per_step: float,
        batch_size: int,
        k: int,
        seed: int,
        compile: bool,
    ) -> None:
        super().__init__(agent, buffer, generator, learning_starts, updates_per_step, batch_size)
        self.k = k
        self.stack = POPULATIONS[agent.name]([agent])  # type: ignore[attr-defined]
        replay = tuple(getattr(buffer, name).unsqueeze(0) for name in FIELDS)
        self.kstep = KStep(self.stack, replay, buffer.filled.view(1), batch_size, seed, compile)
        self._agent_tensors, self._slot_tensors = self.stack.weights(0, agent)

    def learn(self, env_steps: int) -> dict[str, torch.Tensor]:
        stats: dict[str, torch.Tensor] = {}
        for _ in range(self.owed(env_steps)):
            stats = self.kstep(self.k, self.updates + 1)
            self.updates += self.k
        if stats:  # the actor reads the new weights once per call
            with torch.no_grad():
                torch._foreach_copy_(self._agent_tensors, self._slot_tensors)
        return {name: value[0] for name, value in stats.items()}

    def sync(self) -> None:
        self.stack.get(0, self.agent)

    def reloaded(self, seed: int) -> None:
        self.stack.put(0, self.agent)
        self.kstep.reseed(seed)


class PopulationReplayLearner(UpdateSchedule):
    """The learner of P stacked agents and their ``StackedReplay``: the schedule of a single
    agent's learner (``UpdateSchedule``) paid for every agent at once, one batched update per
    update owed (``ReplayLearner``) or ``k`` at a time by one call of ``kstep``, the compiled
    update (``KStepLearner``). The agents share its clock (``env_steps``, ``updates``).

    Each slot's own counters are the clock plus the offset of the files the slot was loaded
    from (``place``): kept on the host, for the slot's training files, and on the device
    (``slot_env_steps``, ``slot_updates``, counted in place), for what reads them every step,
    DQN's ε schedule (the worker) and its target period (here), without a copy from the host
    each time."""

    def __init__(
        self,
        population: PopulationSAC | PopulationTD3 | PopulationDQN,
        replay: StackedReplay,
        generator: torch.Generator,
        learning_starts: int,
        updates_per_step: float,
        batch_size: int,
        kstep: KStep | None = None,
        k: int = 1,
    ) -> None:
        super().__init__(learning_starts, updates_per_step, k if kstep is not None else 1)
        self.population, self.replay, self.generator = population, replay, generator
        self.batch_size, self.kstep = batch_size, kstep
        # DQN's targets move on each slot's own update count, as a single DQN pod's do; the
        # other agents' schedules (TD3's policy delay) run on the population's.
        self.slot_steps = isinstance(population, PopulationDQN)
        p, device = replay.p, replay.device
        self.offsets = [(0, 0)] * p  # each slot's (env steps, updates) less the clock's
        self.slot_env_steps = torch.zeros(p, dtype=torch.int64, device=device)
        self.slot_updates = torch.zeros(p, dtype=torch.int64, device=device)

    def learn(self, env_steps: int) -> dict[str, torch.Tensor]:
        """Count ``env_steps`` new env steps of every agent, then run the updates they owe;
        the last update's statistics, (P,) each (empty when none ran)."""
        calls = self.owed(env_steps)
        self.slot_env_steps.add_(env_steps)
        stats: dict[str, torch.Tensor] = {}
        for _ in range(calls):
            stats = self._update() if self.kstep is None else self._k_updates(self.kstep)
        return stats

    def _update(self) -> dict[str, torch.Tensor]:
        """One update of every agent, eager, on a fresh minibatch of each one's replay."""
        self.updates += 1
        self.slot_updates.add_(1)
        batch = self.replay.sample(self.batch_size, self.generator)
        step = self.slot_updates if self.slot_steps else self.updates
        return self.population.update(batch, self.generator, step)

    def _k_updates(self, kstep: KStep) -> dict[str, torch.Tensor]:
        """``k`` updates of every agent, one call of the K-step update; it numbers them from
        the population's count (and DQN's from each slot's own)."""
        slot_updates = self.slot_updates if self.slot_steps else None
        stats = kstep(self.k, self.updates + 1, slot_updates)
        self.updates += self.k
        self.slot_updates.add_(self.k)
        return stats

    def slot_counters(self, slot: int) -> tuple[int, int]:
        """Slot ``slot``'s env steps and updates (read on the host: no sync)."""
        env_steps, updates = self.offsets[slot]
        return self.env_steps + env_steps, self.updates + updates

    def place(self, slot: int, env_steps: int, updates: int) -> None:
        """Slot ``slot`` goes on from ``env_steps`` and ``updates`` (its files' counters, or
        zero for a fresh agent)."""
        self.offsets[slot] = (env_steps - self.env_steps, updates - self.updates)
        self.slot_env_steps[slot] = env_steps
        self.slot_updates[slot] = updates
