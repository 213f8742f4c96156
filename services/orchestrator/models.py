"""Response models of the experiments API."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from services.contracts.spec import ExperimentSpec
from services.orchestrator.store import Experiment

State = Literal[
    "pending", "running", "paused", "succeeded", "failed", "cancelled", "budget_exhausted"
]
#: What an experiment shows: a state, or ``invalid`` for a stored record that no longer
#: validates (the reason says why; it can only be deleted).
ShownState = Literal[
    "pending",
    "running",
    "paused",
    "succeeded",
    "failed",
    "cancelled",
    "budget_exhausted",
    "invalid",
]


class PodOut(BaseModel):
    pod_id: str
    phase: str
    created_at: float
    reason: str | None = None
    algorithm: str | None = Field(
        default=None,
        description="The ensemble algorithm the orchestrator gave it (None: a single "
        "algorithm, or a pod started before the orchestrator assigned them).",
    )


class EndedPodLogOut(BaseModel):
    """An ended pod's last log lines, kept by the orchestrator after the pod is gone."""

    pod_id: str
    phase: str = Field(
        description="How it ended: Succeeded or Failed; Running: a pod whose lines were read "
        "as it was asked to stop, on a backend that forgets stopped pods (Kubernetes)."
    )
    stopped: bool = Field(
        description="It was asked to stop (scaled in, or its experiment ended or was paused)."
    )
    reason: str | None = Field(default=None, description="e.g. `exit code 3`, `OOMKilled`.")
    algorithm: str | None = None
    ended_at: float = Field(description="When the orchestrator saw it end (epoch seconds).")
    log: str = Field(description="Its last lines (the `tail` asked for, of those kept).")


class ProgressOut(BaseModel):
    env_steps: int | None = None
    total_env_steps: int | None = None
    elapsed_s: float | None = None
    wall_time_s: float | None = None
    pods_launched: int = 0
    pods_budget: int | None = None
    best_score: float | None = None
    target_return: float | None = None


class ExperimentOut(BaseModel):
    id: str
    name: str
    state: ShownState
    reason: str | None = None
    intent: str = Field(
        default="run",
        description="What was last asked of it (run, pause, cancel): the answer to a cancel, "
        "pause or resume holds it at once, `state` follows within a reconcile pass.",
    )
    priority: int
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    desired_pods: int = 0
    pods: list[PodOut] = []
    best_score: float | None = None
    best: dict[str, Any] | None = None
    progress: ProgressOut
    last_failure: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    spec: ExperimentSpec | None = None  # None only for an invalid record

    @classmethod
    def of(cls, exp: Experiment) -> ExperimentOut:
        if exp.spec is None or exp.invalid:
            return cls(
                id=exp.id,
                name=exp.spec.name if exp.spec else "(invalid record)",
                state="invalid",
                reason=exp.invalid,
                priority=exp.spec.priority if exp.spec else 0,
                created_at=exp.created_at,
                progress=ProgressOut(),
                spec=exp.spec,
            )
        s = exp.status
        best, best_score = s.best, s.best_score
        started = s.started_at
        end = s.finished_at or time.time()
        spec = exp.spec
        return cls(
            id=exp.id,
            name=spec.name,
            state=exp.state,  # type: ignore[arg-type]
            reason=s.reason,
            intent=exp.intent,
            priority=spec.priority,
            created_at=exp.created_at,
            started_at=started,
            finished_at=s.finished_at,
            desired_pods=s.desired_pods,
            pods=[PodOut(**p.model_dump()) for p in s.pods],
            best_score=best_score,
            best=best,
            progress=ProgressOut(
                env_steps=s.env_steps,
                total_env_steps=spec.budget.total_env_steps,
                elapsed_s=(end - started) if started else None,
                wall_time_s=spec.budget.wall_time_s,
                pods_launched=s.pods_launched,
                pods_budget=spec.budget.pods_launched,
                best_score=best_score,
                target_return=spec.target_return,
            ),
            last_failure=s.last_failure.model_dump() if s.last_failure else None,
            result=s.result.model_dump(exclude_unset=True) if s.result else None,
            spec=spec,
        )


class EventOut(BaseModel):
    id: str
    type: str
    message: str
    pod_id: str | None = None
    ts: float
