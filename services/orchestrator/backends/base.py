"""The backend interface the reconciler drives: create, list by label, terminate, capacity.

A backend holds no experiment state of its own: everything it reports comes from what is
running (processes, Kubernetes pods), found by label, so an orchestrator that restarts adopts
the pods it finds instead of starting duplicates.
"""

from __future__ import annotations

import signal
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

from services.contracts.credentials import pod_token
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import OrchestratorSettings

#: Signals that mean a pod was stopped from outside (a person, an OOM killer, a node going
#: away), not by its own failure: each backend reports such an end as a disruption.
OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})

# Labels every training pod carries (Kubernetes labels; the local backend keeps the same keys).
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "podium-orchestrator"
EXPERIMENT_LABEL = "podium.dev/experiment"
POD_LABEL = "podium.dev/pod"

Phase = Literal["Pending", "Running", "Succeeded", "Failed"]

#: A pod's exit code for input that can never work (services/pod/__main__.py): permanent.
BAD_INPUT_EXIT = 2


def pod_identity_env(
    req: PodRequest, settings: OrchestratorSettings, compile_cache: str, tensorboard: str
) -> dict[str, str]:
    """What every backend tells a training pod of itself (its experiment, id, spec, share of
    the machine) and of the orchestrator's pod settings, with where its compile cache and
    TensorBoard files go: names of ``settings.SET_PER_POD``, which ``pod_env`` may not set."""
    return {
        "PODIUM_EXPERIMENT_ID": req.experiment_id,
        "PODIUM_POD_ID": req.pod_id,
        "PODIUM_SPEC": req.spec_json,
        "PODIUM_CPU": f"{req.resources.cpu:g}",
        "PODIUM_GPUS": str(req.resources.gpus),
        "PODIUM_POD_MALLOC": settings.pod_malloc,
        "PODIUM_POD_MKL_DISPATCH": settings.pod_mkl_dispatch,
        "PODIUM_COMPILE_CACHE_DIR": compile_cache,
        "PODIUM_TENSORBOARD_DIR": tensorboard,
    }


def pod_credential(settings: OrchestratorSettings, experiment_id: str) -> str | None:
    """The bearer token of ``experiment_id``'s pods: it works on that experiment's pod routes
    of the leaderboard only (services/contracts/credentials.py). None on an open leaderboard."""
    key = settings.leaderboard_token_value()
    return pod_token(key, experiment_id) if key else None


@dataclass(frozen=True)
class PodRequest:
    """Everything a backend needs to start one training pod."""

    experiment_id: str
    pod_id: str
    spec_json: str  # the experiment spec, handed to the pod as PODIUM_SPEC
    resources: Res
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the pod
    grace_s: float = 30.0
    #: An ensemble's algorithm for this pod (PODIUM_ALGORITHM), kept with the pod so that a
    #: pass (or a restarted orchestrator) reads it off the pods it lists.
    algorithm: str | None = None

    def pod_env(self) -> dict[str, str]:
        """``env`` with the pod's algorithm, where it has one."""
        return {**self.env, "PODIUM_ALGORITHM": self.algorithm} if self.algorithm else self.env


@dataclass
class PodInfo:
    experiment_id: str
    pod_id: str
    phase: Phase
    created_at: float
    resources: Res
    terminating: bool = False  # asked to stop (SIGTERM sent / deletionTimestamp set)
    exit_code: int | None = None
    reason: str | None = None
    algorithm: str | None = None  # PodRequest.algorithm
    #: Stopped from outside, not by its own fault (Kubernetes eviction, preemption, node
    #: shutdown): what happened, for the event. Such a failure is never counted as a crash.
    disruption: str | None = None

    @property
    def live(self) -> bool:
        """Still holding resources."""
        return self.phase in ("Pending", "Running")


class Backend(ABC):
    """One interface for local processes and Kubernetes pods."""

    #: A pod asked to stop may vanish, log and all, without ever being listed as ended
    #: (Kubernetes deletes a gracefully deleted pod's object once it exits): the reconciler
    #: keeps its log lines as it stops it.
    forgets_stopped_pods: bool = False

    def __init__(self) -> None:
        # Set whenever the backend sees a pod change, so the reconciler reacts at once.
        self.changed = threading.Event()

    @abstractmethod
    def capacity(self) -> Res:
        """What Podium may use in total: free capacity plus what Podium's pods hold now."""

    @abstractmethod
    def list_pods(self) -> list[PodInfo]:
        """Every Podium training pod this backend can see, live or finished."""

    @abstractmethod
    def create_pod(self, req: PodRequest) -> None: ...

    @abstractmethod
    def terminate_pod(self, experiment_id: str, pod_id: str, grace_s: float) -> None:
        """Graceful stop: SIGTERM (the pod reports, then exits), SIGKILL after ``grace_s``."""

    @abstractmethod
    def remove_pod(self, experiment_id: str, pod_id: str) -> None:
        """Forget a finished pod (its record / object); logs are kept where the backend can."""

    def pod_log_tail(self, experiment_id: str, pod_id: str, lines: int = 20) -> str:
        return ""

    def delete_experiment(self, experiment_id: str) -> None:  # noqa: B027
        """Optional per-experiment clean-up when an experiment is deleted."""

    def close(self) -> None:  # noqa: B027
        """Release watches/threads; running pods are left alone (a restart adopts them)."""
