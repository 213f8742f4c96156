"""The learner: turns rollouts into updates and owns everything that learns.

It is the single writer of the agent's state (weights, optimiser, normalisation statistics,
counters); workers and evaluators only ever read a snapshot of the policy. That one-way flow is
what lets the three roles run fused in one process or as three containers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.pod.algorithms.ppo import PPO
from services.pod.worker import Rollout


class Learner:
    def __init__(self, agent: PPO, total_env_steps: int, world: int = 1) -> None:
        self.agent = agent
        self.total_env_steps = max(1, int(total_env_steps))
        self.env_steps = 0  # of all fused replicas together
        self.updates = 0
        #: Number of fused learner replicas, and the hook that averages them after each epoch
        #: (services/pod/fusion.py); one learner alone needs neither.
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
