"""The learner: turns what the worker collected into updates and owns everything that learns.

It is the single writer of the agent's state (weights, optimiser, normalisation statistics,
counters); workers and evaluators only ever read a snapshot of the policy. That one-way flow is
what lets the roles run fused in one process or as three containers. Two kinds, one per way of
learning (services/pod/roles/worker.py has the matching workers):

* ``RolloutLearner`` (on-policy, PPO): one update per rollout.
* ``ReplayLearner`` (off-policy): ``updates_per_step`` updates per env step (the
  update-to-data ratio), each on a fresh minibatch sampled from the replay buffer;
  ``KStepLearner`` pays the same schedule ``updates_per_call`` updates at a time with the
  compiled update (services/pod/algorithms/kstep.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from services.pod.algorithms.kstep import KStep
from services.pod.algorithms.ppo import PPO
from services.pod.algorithms.replay_buffer import FIELDS, Batch, ReplayBuffer
from services.pod.algorithms.rollout import Rollout
from services.pod.algorithms.stacked import POPULATIONS


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


class ReplayLearner:
    """Pays the updates owed to the update-to-data ratio once ``learning_starts`` env steps
    are in the buffer; counts env steps and updates (the agents' schedules, such as the
    policy delay and target updates, count from ``updates``)."""

    def __init__(
        self,
        agent: ReplayAgent,
        buffer: ReplayBuffer,
        generator: torch.Generator,
        learning_starts: int,
        updates_per_step: float,
        batch_size: int,
    ) -> None:
        self.agent, self.buffer, self.generator = agent, buffer, generator
        self.learning_starts, self.updates_per_step = learning_starts, updates_per_step
        self.batch_size = batch_size
        self.env_steps = 0
        self.updates = 0
        self.update_debt = 0.0  # fractional updates owed to the update-to-data ratio

    def learn(self, env_steps: int) -> dict[str, torch.Tensor]:
        """Count ``env_steps`` new env steps, then run the updates they owe; the last
        update's statistics (empty when none ran)."""
        self.env_steps += env_steps
        stats: dict[str, torch.Tensor] = {}
        if self.env_steps < self.learning_starts:
            return stats
        self.update_debt += env_steps * self.updates_per_step
        owed = int(self.update_debt)
        self.update_debt -= owed
        for _ in range(owed):
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
        self.env_steps += env_steps
        if self.env_steps < self.learning_starts:
            return {}
        self.update_debt += env_steps * self.updates_per_step
        stats: dict[str, torch.Tensor] = {}
        while self.update_debt >= self.k:
            self.update_debt -= self.k
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
