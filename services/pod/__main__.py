"""``python -m services.pod``: one training pod, as the orchestrator starts it.

    python -m services.pod --experiment ID --pod-id ID

Everything else comes from the environment the orchestrator sets (``PODIUM_SPEC``, the
experiment spec as JSON, the leaderboard's URL, the pod's share of the machine, its budget, its
directories): ``PodSettings`` below says what each variable does. ``PODIUM_POD_MALLOC`` picks
the allocator (services/malloc.py): ``python -m services.pod`` starts itself anew with it
preloaded. The pod's worker, learner and evaluator run in this one process
(services/pod/roles/).

Exit codes: 0 after a stop (SIGTERM/SIGINT: final report made, unless it came during a
compile), 2 for bad input (the message names what is wrong), 1 when training fails.
"""

from __future__ import annotations

from services.malloc import AllocatorError, reexec_with_allocator, running_allocator

# First of all, ``python -m services.pod`` starts itself anew with its allocator preloaded
# (unless it runs with one already): the imports below, done before that, would be done twice.
_allocator_error: str | None = None
if __name__ == "__main__":
    try:
        reexec_with_allocator()
    except AllocatorError as exc:
        _allocator_error = str(exc)

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.contracts.spec import ExperimentSpec, describe_errors
from services.logs import configure, get_logger, keep_tail
from services.pod import mkl_dispatch
from services.pod.runtime import activity  # imports no torch
from services.pod.runtime.compile_cache import use_compile_cache  # imports no torch
from services.startup import importing

if TYPE_CHECKING:
    from services.pod.runtime.rounds import PodRuntime

log = get_logger("services.pod")


class PodSettings(BaseSettings):
    """The pod's environment contract (set by the orchestrator's backends)."""

    model_config = SettingsConfigDict(env_prefix="PODIUM_", extra="ignore")

    pod_dir: Path | None = None
    compile_cache_dir: Path | None = Field(
        default=None,
        description="torch.compile's (inductor's) cache, on a volume that outlives the pod so "
        "that a restart or a PBT child loads compiled programs instead of compiling; unset: "
        "<pod_dir>/compile-cache, or torch's default (lost with the container) without one.",
    )

    torch_threads: int = Field(
        default=1,
        ge=1,
        description="Intra-op threads. Small networks run fastest on one (more threads only "
        "add synchronisation to their tiny ops, docs/benchmarks.md); raise it for large nets.",
    )
    experiment_id: str | None = None
    pod_id: str | None = None
    spec: str = Field(description="The experiment spec as JSON.")
    leaderboard_url: str = Field(description="http://leaderboard:8001")
    api_token: SecretStr | None = None
    cpu: float = Field(default=1.0, gt=0, description="The pod's share of the CPUs.")
    gpus: int = Field(default=0, ge=0, description="GPUs granted; > 0: trains on cuda.")
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535, description="Serve /metrics here; 0: any free port."
    )
    termination_grace_s: float = Field(
        default=30.0, ge=0, description="Time to make the final report after SIGTERM."
    )
    max_env_steps: int | None = Field(
        default=None,
        ge=0,
        description="Env steps this pod may still take (all its agents together) before the "
        "experiment's budget is spent; unset: no limit.",
    )
    algorithm: str | None = Field(
        default=None,
        max_length=64,
        description="The algorithm of the experiment's ensemble this pod trains (the "
        "orchestrator keeps each one's share of the pods); unset: the generator draws it.",
    )
    tensorboard_dir: Path | None = Field(
        default=None,
        description="Where the pod writes its TensorBoard event files (its curves and "
        "hyperparameters); unset: none written.",
    )
    compile_wait_s: float = Field(
        default=900.0,
        ge=0,
        description="How long the pod waits for another pod of the experiment to compile the "
        "programs it needs (then loads them) before it compiles them itself.",
    )
    pod_log_lines: int = Field(
        default=200,
        ge=0,
        le=100_000,
        description="Last log lines the pod keeps in the leaderboard's blob store when it "
        "exits (`podium logs` of an ended pod); 0: none.",
    )
    pod_files_interval_s: float = Field(
        default=60.0,
        gt=0,
        description="How often (at most, after a report) the pod uploads its TensorBoard "
        "files while it runs; it always does before it exits.",
    )

    def compile_cache(self) -> Path | None:
        return self.compile_cache_dir or (self.pod_dir and self.pod_dir / "compile-cache")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.pod", description=__doc__)
    parser.add_argument("--experiment", help="experiment id (default: $PODIUM_EXPERIMENT_ID)")
    parser.add_argument("--pod-id", help="this pod's id (default: $PODIUM_POD_ID)")
    return parser.parse_args(argv)


class BadInputError(ValueError):
    pass


def _settings(args: argparse.Namespace) -> tuple[PodSettings, ExperimentSpec, str, str]:
    try:
        settings = PodSettings()
    except ValidationError as exc:
        missing = ", ".join(
            "PODIUM_" + str(e["loc"][0]).upper() + f" ({e['msg']})" for e in exc.errors()
        )
        raise BadInputError(f"bad pod environment: {missing}") from exc
    experiment = args.experiment or settings.experiment_id
    pod_id = args.pod_id or settings.pod_id
    if not experiment or not pod_id:
        raise BadInputError("give --experiment and --pod-id (or PODIUM_EXPERIMENT_ID/_POD_ID)")
    try:
        spec = ExperimentSpec.model_validate(json.loads(settings.spec))
    except json.JSONDecodeError as exc:
        raise BadInputError(f"PODIUM_SPEC is not valid JSON: {exc}") from exc
    except ValidationError as exc:
        fields = "; ".join(line.strip() for line in describe_errors(exc))
        raise BadInputError(f"PODIUM_SPEC is not a valid experiment spec: {fields}") from exc
    if settings.algorithm is not None and spec.algorithms.get(settings.algorithm, 0) <= 0:
        raise BadInputError(
            f"PODIUM_ALGORITHM {settings.algorithm!r} is not in the spec's algorithms "
            f"({', '.join(sorted(spec.algorithms))})"
        )
    return settings, spec, experiment, pod_id


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure()
    tail = keep_tail(200)  # its last lines outlive the pod (pod_files.py); resized below
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    try:
        settings, spec, experiment, pod_id = _settings(args)
    except BadInputError as exc:
        log.error("bad input", error=str(exc))
        return 2
    # Before torch is imported: its inductor config reads the cache switches at import.
    cache_dir = use_compile_cache(settings.compile_cache())
    activity.start()  # "starting", until the round loop says what it does
    with importing(freeze=True):  # after the environment is checked: torch takes seconds
        from services.pod.runtime.rounds import HyperparameterError, check_hyperparameter_names

    try:
        check_hyperparameter_names(list(spec.search_space))
    except HyperparameterError as exc:
        log.error("bad input", error=f"search_space: {exc}")
        return 2
    log.info("pod starting", experiment=experiment, pod=pod_id)

    import torch

    from services.api_client import LeaderboardClient
    from services.pod.runtime.gpu_check import gpu_problem
    from services.pod.runtime.metrics import PodMetrics
    from services.pod.runtime.pod_files import PodFiles
    from services.pod.runtime.rounds import PodRuntime, RuntimeSettings

    threads = settings.torch_threads
    torch.set_num_threads(threads)
    # Inductor compiles kernels in parallel workers, as many as the machine has CPUs by
    # default: a pod's share of them is what it may use (read when inductor is first imported).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, int(settings.cpu))))
    # Granted GPUs it cannot use (a CPU build of torch, no driver in the container), a pod
    # would train far slower on the CPU and hold the GPUs for nobody: it stops and says why.
    if (problem := gpu_problem(settings.gpus)) is not None:
        log.error("bad input", error=problem)
        return 2
    device = "cuda" if settings.gpus > 0 else "cpu"
    metrics = PodMetrics(experiment, pod_id, spec.evaluation.higher_is_better)
    if settings.metrics_port is not None:
        metrics.serve(settings.metrics_port, settings.pod_dir, pod_id)
    token = settings.api_token.get_secret_value() if settings.api_token else None
    client = LeaderboardClient(settings.leaderboard_url, experiment, token)
    runtime_settings = RuntimeSettings(
        work_dir=settings.pod_dir / pod_id if settings.pod_dir else None,
        device=device,
        threads=threads,
        grace_s=settings.termination_grace_s,
        max_env_steps=settings.max_env_steps,
        algorithm=settings.algorithm,
        tensorboard_dir=settings.tensorboard_dir,
        compile_cache_dir=cache_dir,
        compile_wait_s=settings.compile_wait_s,
        started_at=process_start(),
    )
    tail.resize(max(settings.pod_log_lines, 1))
    files = PodFiles(
        client,
        pod_id,
        settings.tensorboard_dir,
        tail if settings.pod_log_lines else None,
        settings.pod_files_interval_s,
    )
    runtime = PodRuntime(experiment, pod_id, spec, client, runtime_settings, metrics, files)

    def on_signal(_signum: int, frame: object) -> None:
        abandon = not runtime.stopping and activity.compiling(frame)  # not a final report's
        runtime.stop()
        if abandon:
            raise activity.CompileStopped  # up to ``_run``

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    malloc = running_allocator()  # what the orchestrator's pod_malloc gave it (services/malloc.py)
    log.info(
        "pod started",
        agents=spec.population.agents_per_pod,
        device=device,
        threads=threads,
        malloc=malloc.name,
        malloc_library=malloc.library and str(malloc.library),
        mkl_dispatch=mkl_dispatch.state(),
    )
    try:
        code = _run(runtime)
    finally:
        files.final()  # after its last line: the TensorBoard files and the log tail
        client.close()
    return code


def _run(runtime: PodRuntime) -> int:
    """The round loop to its end; the exit code, its reason the log's last line."""
    from services.api_client import ExperimentConfigError
    from services.pod.runtime.rounds import HyperparameterError
    from services.registry import PluginError

    try:
        runtime.run()
    except activity.CompileStopped:
        log.warning("stopped while compiling: no final report (activity.CompileStopped)")
        return 0
    except (HyperparameterError, PluginError, ExperimentConfigError) as exc:  # DQN on Pendulum
        log.error("bad input", error=str(exc))
        return 2
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        if runtime.stopping:
            # Asked to stop: the orchestrator does not count this exit as a failure.
            log.error("final report failed", error=error, exc_info=True)
            return 0
        log.error("pod failed", error=error, exc_info=True)
        return 1
    finally:
        runtime.close(keep_client=True)
    log.info(
        "pod stopped",
        rounds=runtime.rounds,
        submissions=len(runtime.submissions),
        env_steps=runtime.env_steps,
        startup_s={k: round(v, 3) for k, v in runtime.startup.items()},
    )
    return 0


def process_start() -> float:
    """When this process started (epoch seconds), its start-up's origin; on Linux from /proc's
    uptime (psutil adds /proc/stat's boot time, whole seconds: up to a second early)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        try:
            return psutil.Process().create_time()
        except psutil.Error:
            return time.time()


def setting_error() -> int | None:
    """2 (bad input, logged) for an allocator or MKL setting that cannot work, else None."""
    if error := _allocator_error or mkl_dispatch.setting_error():
        configure()
        log.error("bad input", error=error)
        return 2
    return None


if __name__ == "__main__":
    sys.exit(setting_error() or main())
