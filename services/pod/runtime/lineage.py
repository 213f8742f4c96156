"""Who a slot's agent is on the leaderboard, and when PBT judges it.

A pod trains one agent per slot (one slot, or P in a population pod); each slot's agent has a
``Lineage``: its algorithm and hyperparameters, the candidate it descends from, its last score and
rank. PBT's exploit replaces an agent by a better parent once it is ready (``is_ready``) and the
generator's proposed parent scored better (``parent_is_better``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from services.contracts.leaderboard import SubmissionResponse
from services.contracts.spec import ExperimentSpec
from services.contracts.strategies import is_ready, pod_options
from services.pod.roles.evaluator import EvalResult


@dataclass
class Lineage:
    """A slot's agent on the leaderboard: lineage, last result, what is not reported yet."""

    pod_id: str  # the slot's pod id: the pod's, or ``<pod>.m<i>`` in a population
    algorithm: str = "ppo"
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    parent_id: str | None = None
    generation: int = 0
    candidate_id: str | None = None  # its last accepted submission
    score: float | None = None  # its last evaluation
    previous_score: float | None = None  # the one before (since it was built)
    rank: int | None = None
    reports: int = 0  # since it was built
    env_steps_at_start: int = 0  # the slot's env steps when it was built
    unreported_steps: int = 0

    def submission(
        self,
        env_steps: int,
        evaluation: EvalResult,
        trained_env_steps: int,
        batch_env_steps: int | None = None,
    ) -> dict[str, Any]:
        """The updater's submission for this agent's latest evaluation (without files):
        ``env_steps`` since the previous report (the experiment's budget), ``trained_env_steps``
        the agent's own (its learner's count, its parents' included), ``batch_env_steps`` what
        one of its steps trains (the unit of the orchestrator's env-step allowances)."""
        return {
            "submission_id": uuid.uuid4().hex,  # the same for every retry of this report
            "pod_id": self.pod_id,
            "algorithm": self.algorithm,
            "hyperparameters": self.hyperparameters,
            "parent_id": self.parent_id,
            "generation": self.generation,
            "env_steps": env_steps,
            "trained_env_steps": trained_env_steps,
            "batch_env_steps": batch_env_steps,
            "score": evaluation.mean,
            "eval": {
                "mean": evaluation.mean,
                "std": evaluation.std,
                "episodes": len(evaluation.episodes),
            },
        }

    def record(self, answer: SubmissionResponse, score: float) -> None:
        """Take in the updater's answer to a submission scored ``score``."""
        self.previous_score, self.score, self.rank = self.score, score, answer.rank
        self.reports += 1
        if answer.accepted:
            # The next report of this agent descends from the one just kept.
            self.candidate_id = answer.candidate_id
            self.parent_id, self.generation = self.candidate_id, self.generation + 1


@dataclass(frozen=True)
class ReadyRule:
    """PBT's "ready": the reports and env steps an agent needs since it was built before it is
    judged, and may be replaced by a better parent."""

    reports: int
    env_steps: int
    improving_margin: float | None = None  # protect_improving: unset
    higher_is_better: bool = True
    exploit_margin: float = 0.0

    @classmethod
    def of(cls, spec: ExperimentSpec) -> ReadyRule:
        """The generator's ``ready_reports`` / ``ready_env_steps`` / ``protect_improving`` /
        ``exploit_margin`` options, else their defaults (services/contracts/strategies.py,
        where PBT's whole decision is stated)."""
        options = pod_options(spec)
        return cls(
            options.ready_reports,
            options.ready_env_steps,
            options.protect_improving,
            spec.evaluation.higher_is_better,
            options.exploit_margin,
        )

    def is_ready(self, agent: Lineage, env_steps: int) -> bool:
        """Whether PBT should judge ``agent`` now (``env_steps``: its slot's count)."""
        return is_ready(
            agent,
            env_steps,
            self.reports,
            self.env_steps,
            self.improving_margin,
            self.higher_is_better,
        )
