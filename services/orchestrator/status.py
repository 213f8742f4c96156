"""What the reconciler records of an experiment: its status, typed.

Stored as JSON in the experiment's hash (``status``, see store.py) and read back by every
pass and by the API. Only the fields ever set are written (``exclude_unset``), so the stored
JSON is the same as when the status was a plain dict; unknown keys are ignored and every field
has a default, so a status written by an older version still loads.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PENDING = "pending"


class _Stored(BaseModel):
    # Validated on assignment too: a reconciler bug that stores the wrong type fails where it
    # is made, not when the record is next read (it would then show as invalid).
    model_config = ConfigDict(extra="ignore", validate_assignment=True)


class PodStatus(_Stored):
    """A live pod as the last pass saw it (the API's ``pods``)."""

    pod_id: str
    phase: str
    created_at: float
    reason: str | None = None
    algorithm: str | None = None


class EndedPodLog(_Stored):
    """An ended pod's last log lines, kept with its experiment (store.py ``podlogs``) after the
    backend forgot the pod, so that ``podium logs`` can still show why it ended."""

    pod_id: str
    # Succeeded / Failed as the backend last saw it; Running: its lines were read as it was
    # asked to stop (Kubernetes deletes such a pod itself once it exits).
    phase: str
    stopped: bool = False  # asked to stop (scale-in, the experiment's end), not its own doing
    reason: str | None = None
    algorithm: str | None = None
    ended_at: float
    log: str = ""  # its last lines (bounded: ended_pod_log_lines, ended_pod_log_bytes)


class LastFailure(_Stored):
    """The last pod that failed: the reason and its log lines, kept for the user."""

    pod_id: str
    reason: str
    log_tail: str = ""


class ExperimentResult(_Stored):
    """The outcome, written once the experiment is finalized (what CI gates read)."""

    state: str
    reason: str | None = None
    best: dict[str, Any] | None = None
    env_steps: int | None = None
    pods_launched: int = 0
    finished_at: float | None = None


class ExperimentStatus(_Stored):
    state: str = PENDING
    reason: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    #: Ended and the pods' final reports are in (``result`` is then set).
    finalized: bool = False
    result: ExperimentResult | None = None
    desired_pods: int = 0
    pods: list[PodStatus] = Field(default_factory=list)
    pods_launched: int = 0
    #: Registered with the leaderboard (progress is read from then on).
    registered: bool = False
    best: dict[str, Any] | None = None  # the leaderboard's best candidate
    env_steps: int | None = None  # the leaderboard's count of the pods' env steps
    #: pod id → the env steps it was allowed (``PODIUM_MAX_ENV_STEPS``), live pods only.
    allowances: dict[str, int] = Field(default_factory=dict)
    #: The env steps of the reports in the leaderboard's submission log as last read, and
    #: those of each pod with an allowance among them.
    logged_env_steps: int | None = None
    reported: dict[str, int] = Field(default_factory=dict)
    #: Env steps one pod trains per step, as seen in its reports (the largest over the
    #: pods): allowances are handed out in whole units of it. None until a pod reported.
    batch_env_steps: int | None = None
    #: Every pod that reported trains ``batch_env_steps``: running pods' allowances count as
    #: the whole batches they can train.
    batch_uniform: bool = False
    consecutive_failures: int = 0
    last_failure_at: float | None = None
    last_failure: LastFailure | None = None
    #: Failed pods whose replacements have not started yet (for the events).
    to_replace: list[str] = Field(default_factory=list)
    #: No pod is created before this (epoch seconds): the crash-loop backoff.
    next_launch_at: float | None = None

    @property
    def best_score(self) -> float | None:
        score = self.best.get("score") if self.best else None
        return float(score) if score is not None else None

    def to_json(self) -> str:
        data = self.model_dump(mode="json", exclude_unset=True)
        data["state"] = self.state  # always stored (the store's Lua reads it)
        return json.dumps(data)
