"""Orchestrator configuration (``PODIUM_*`` environment variables, see services/settings.py).

Lists and mappings (pod command, node selector, tolerations) are read from the environment as
JSON, e.g. ``PODIUM_K8S_NODE_SELECTOR='{"gpu": "a100"}'``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator

from services import machine
from services.contracts.credentials import PLATFORM_SECRETS
from services.malloc import check_choice
from services.settings import PodiumSettings

#: What the orchestrator and its backends set in each training pod's environment, from the
#: experiment, the pod and their own settings: ``pod_env`` may not set them.
SET_PER_POD = frozenset(
    {
        "PODIUM_EXPERIMENT_ID", "PODIUM_POD_ID", "PODIUM_SPEC", "PODIUM_POD_DIR", "PODIUM_CPU",
        "PODIUM_GPUS", "PODIUM_ALGORITHM", "PODIUM_MAX_ENV_STEPS", "PODIUM_TERMINATION_GRACE_S",
        "PODIUM_LEADERBOARD_URL", "PODIUM_POD_MALLOC", "PODIUM_POD_MKL_DISPATCH",
        "PODIUM_COMPILE_CACHE_DIR", "PODIUM_TENSORBOARD_DIR", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD",
        "PODIUM_METRICS_PORT",
    }
)  # fmt: skip


def _memory_bytes() -> int:
    """The machine's memory, or this process's cgroup limit where that is less."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 8 << 30
    return min(physical, machine.memory_bytes() or physical)


def _gpu_count() -> int:
    # NVIDIA device nodes; the control plane never imports torch/CUDA to count GPUs.
    return sum(1 for p in Path("/dev").glob("nvidia[0-9]*"))


class OrchestratorSettings(PodiumSettings):
    backend: Literal["local", "kubernetes"] = Field(
        default="local", description="Where training pods run."
    )
    # Capacity of the local backend; unset means "this machine".
    capacity_cpu: float | None = Field(default=None, gt=0)
    capacity_gpus: int | None = Field(
        default=None,
        ge=0,
        description="GPUs of the local backend (unset: this machine's); on Kubernetes with a "
        "DRA claim template, the claimable GPUs (unset: as many as pods ask for).",
    )
    capacity_memory: str | None = Field(default=None, description="Kubernetes quantity, 16Gi.")
    # Upper bounds on what one spec may request per pod (checked by the API).
    max_pod_cpu: float = Field(default=64.0, gt=0)
    max_pod_gpus: int = Field(default=8, ge=0)
    max_pod_memory: str = "512Gi"
    max_pods_per_experiment: int = Field(default=256, ge=1)

    reconcile_interval_s: float = Field(default=2.0, gt=0)
    reconcile_failures_unready: int = Field(
        default=3, ge=1, description="/readyz answers 503 after this many failed passes in a row."
    )
    backoff_initial_s: float = Field(default=1.0, ge=0)
    backoff_max_s: float = Field(default=60.0, ge=0)
    crash_loop_limit: int = Field(
        default=5, ge=1, description="Consecutive pod failures after which an experiment fails."
    )
    pod_healthy_after_s: float = Field(
        default=60.0, ge=0, description="A pod running this long resets the failure count."
    )
    termination_grace_s: float = Field(
        default=30.0, ge=0, description="SIGTERM → SIGKILL grace for scale-in and stops."
    )
    create_concurrency: int = Field(
        default=16, ge=1, le=128, description="Pod creations issued in parallel."
    )
    create_per_pass: int = Field(
        default=64,
        ge=1,
        description="Pods one reconcile pass creates at most; the next pass, run at once, "
        "creates more. Keeps a pass short while a large experiment scales up.",
    )
    progress_poll_s: float = Field(
        default=2.0, ge=0, description="How often the leaderboard is asked for scores/steps."
    )

    leaderboard_url: str | None = Field(default=None, description="http://leaderboard:8001")
    leaderboard_concurrency: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Leaderboard calls in flight at once (never waited on by a reconcile pass).",
    )
    leaderboard_breaker_failures: int = Field(
        default=5, ge=1, description="Failed leaderboard calls in a row that open the breaker."
    )
    leaderboard_breaker_reset_s: float = Field(
        default=10.0, gt=0, description="How long an open breaker fails calls at once."
    )
    leaderboard_token: SecretStr | None = None
    pod_mode: Literal["fused"] = Field(
        default="fused",
        description="How a pod runs its worker, learner and evaluator: fused, in one process "
        "(on Kubernetes: one container). The only value; any other is refused at start-up.",
    )

    ended_pod_logs: int = Field(
        default=8,
        ge=0,
        le=100,
        description="Ended pods per experiment whose last log lines the orchestrator keeps "
        "(the newest; in Redis, deleted with the experiment) for `podium logs`; 0: none.",
    )
    ended_pod_log_lines: int = Field(
        default=200, ge=1, le=10_000, description="Lines kept of each ended pod's log."
    )
    ended_pod_log_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=1024 * 1024,
        description="At most this many bytes kept of each ended pod's log (its last ones).",
    )

    # Local backend: argv template; {experiment_id}, {pod_id} and {spec_path} are substituted.
    pod_command: list[str] | None = None
    pod_launcher: bool = Field(
        default=True,
        description="Local backend, default pod command: start CPU pods as forks of one process "
        "that imported torch once (services/pod/runtime/launcher.py), not as new interpreters.",
    )
    pod_malloc: str = Field(
        default="auto",
        description="The malloc pods run with, preloaded through LD_PRELOAD (services/malloc.py; "
        "the local backend preloads it into its pods and the pod launcher, a Kubernetes pod "
        "into itself, as PODIUM_POD_MALLOC). auto: tcmalloc, else jemalloc, where the machine "
        "(or the pod image) has one (a compiled training step allocates anew on every call: "
        "docs/benchmarks.md); system: the system's; or the absolute path of an allocator's "
        "shared library.",
    )
    pod_mkl_dispatch: Literal["auto", "vendor"] = Field(
        default="auto",
        description="How MKL, torch's CPU matmul library, picks its kernels in the pods "
        "(services/pod/mkl_dispatch.py; handed to each pod and the pod launcher as "
        "PODIUM_POD_MKL_DISPATCH). auto: by the CPU's instruction sets, on non-Intel x86-64 CPUs "
        "too (MKL's own rule runs its generic kernels there, at a third to a half of the "
        "rate: docs/benchmarks.md); vendor: MKL's own rule.",
    )
    pod_memory_limit: Literal["auto", "cgroup", "watch", "off"] = Field(
        default="auto",
        description="Local backend: how each pod is held to its spec's resources.memory "
        "(services/orchestrator/backends/memory.py). cgroup: a memory cgroup per pod (the "
        "kernel kills it over the limit; refused at start where none can be made); watch: its "
        "memory sampled, its processes killed over the limit; auto: cgroup where one can be "
        "made, else watch; off: no limit. A pod killed for its memory counts as a crash.",
    )
    pod_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment every training pod gets, on either backend (JSON): the pods' "
        "own settings (PodSettings in services/pod/__main__.py, e.g. PODIUM_COMPILE_WAIT_S, "
        "PODIUM_POD_LOG_LINES, PODIUM_POD_FILES_INTERVAL_S, PODIUM_TORCH_THREADS) or any "
        "other variable, but none the platform sets for each pod (refused, naming it).",
    )
    # Kubernetes backend.
    pod_image: str = "ghcr.io/podium-rl/podium-pod:0.1.0"  # release.yml publishes it (appVersion)
    pod_image_cpu: str | None = Field(
        default=None,
        description="Image of pods that request no GPU (the release's `-cpu` build: no CUDA "
        "libraries to pull); None: pod_image for every pod.",
    )
    pod_image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent",
        description="Training pods' imagePullPolicy (the chart passes image.pullPolicy): "
        "Always where a pod image's tag is pushed again.",
    )
    k8s_namespace: str | None = Field(
        default=None, description="Default: the service account's namespace, else 'default'."
    )
    k8s_node_selector: dict[str, str] = Field(default_factory=dict)
    k8s_tolerations: list[dict[str, Any]] = Field(default_factory=list)
    k8s_priority_class: str | None = None
    k8s_pod_service_account: str | None = Field(
        default=None, description="Service account of training pods (no API token is mounted)."
    )
    k8s_capacity_refresh_s: float = Field(
        default=5.0, ge=0, description="How long a capacity reading (nodes, pods, quotas) lasts."
    )
    k8s_shared_memory: str = Field(
        default="2Gi",
        description="Size of a training pod's /dev/shm, a memory-backed emptyDir (a "
        "container's own is 64 MiB; torch's shared-memory tensors live there).",
    )
    k8s_compile_cache_claim: str | None = Field(
        default=None,
        description="A ReadWriteMany PersistentVolumeClaim mounted into every training pod as "
        "torch.compile's cache (PODIUM_COMPILE_CACHE_DIR), kept across experiments. None: an "
        "emptyDir per pod; either way an experiment's pods share what the first of them "
        "compiled through the leaderboard's blob store.",
    )
    k8s_pod_metrics_port: int = Field(
        default=9400,
        ge=0,
        le=65535,
        description="Port on which every training pod serves /metrics (its container port "
        "'metrics', which the chart's PodMonitor scrapes); 0: pods serve no metrics.",
    )
    k8s_gpu_claim_template: str | None = Field(
        default=None,
        description="DRA ResourceClaimTemplate whose claim gives a training pod's container "
        "its GPUs, instead of nvidia.com/gpu limits (the NVIDIA device plugin).",
    )

    host: str = "127.0.0.1"
    port: int = 8000

    @field_validator("pod_env")
    @classmethod
    def _pod_env(cls, value: dict[str, str]) -> dict[str, str]:
        if taken := sorted(set(value) & (SET_PER_POD | PLATFORM_SECRETS)):
            raise ValueError(
                f"pod_env may not set {', '.join(taken)}: the platform sets "
                f"{'it' if len(taken) == 1 else 'them'} for each pod (or keeps it from pods)"
            )
        return value

    @field_validator("pod_malloc")
    @classmethod
    def _pod_malloc(cls, value: str) -> str:
        # The form only (also where the library cannot be, on Kubernetes); the local backend
        # checks the file when it starts. AllocatorError is a ValueError: a validation error.
        return check_choice(value)

    def leaderboard_token_value(self) -> str | None:
        if self.leaderboard_token is not None:
            return self.leaderboard_token.get_secret_value()
        return self.token()

    def local_capacity(self) -> tuple[float, int, int]:
        from services.contracts.spec import parse_quantity

        cpu = self.capacity_cpu if self.capacity_cpu is not None else machine.cpus()
        gpus = self.capacity_gpus if self.capacity_gpus is not None else _gpu_count()
        mem = (
            parse_quantity(self.capacity_memory)
            if self.capacity_memory is not None
            else _memory_bytes()
        )
        return cpu, gpus, int(mem)
