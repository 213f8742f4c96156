"""``python -m services.pod``: one training pod, as the orchestrator starts it.

    python -m services.pod --experiment ID --pod-id ID [--role all] [--mode fused|processes]

Everything else comes from the environment the orchestrator sets: ``PODIUM_SPEC`` (the
experiment spec as JSON), ``PODIUM_LEADERBOARD_URL``, ``PODIUM_API_TOKEN``, ``PODIUM_POD_DIR``,
``PODIUM_CPU`` (the pod's CPU share), ``PODIUM_TORCH_THREADS`` (default 1), ``PODIUM_GPUS``
(> 0: train on ``cuda``), and optionally ``PODIUM_METRICS_PORT`` (serve /metrics; 0 = any
free port), ``PODIUM_POD_MODE`` (``fused`` or ``processes``), ``PODIUM_TERMINATION_GRACE_S``.

Exit codes: 0 after a stop (SIGTERM/SIGINT: final report made), 2 for bad input (the message
names what is wrong), 1 when training fails (the error is the last log line).

``--role``: ``all`` (default) runs worker, learner and evaluator in this pod process (fused or
as child processes, ``--mode``). On Kubernetes the pod's three containers are started with
``--role worker|learner|evaluator``: the learner container runs the pod with its worker and
evaluator as child processes sharing its memory; the worker and evaluator containers do not
train yet (they wait for the pod to stop) — see docs/benchmarks.md for why the roles share one
container for now.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.logs import configure, get_logger
from services.spec import ExperimentSpec

log = get_logger("services.pod")


class PodSettings(BaseSettings):
    """The pod's environment contract (set by the orchestrator's backends)."""

    model_config = SettingsConfigDict(env_prefix="PODIUM_", extra="ignore")

    experiment_id: str | None = None
    pod_id: str | None = None
    spec: str = Field(description="The experiment spec as JSON.")
    leaderboard_url: str = Field(description="http://leaderboard:8001")
    api_token: SecretStr | None = None
    pod_dir: Path | None = None
    cpu: float = Field(default=1.0, gt=0)
    gpus: int = Field(default=0, ge=0)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    pod_mode: Literal["fused", "processes"] = "fused"
    termination_grace_s: float = Field(default=30.0, gt=0)
    torch_threads: int = Field(
        default=1,
        ge=1,
        description="Intra-op threads. Small networks run fastest on one (measured: a Pendulum "
        "pod on 2 threads of a shared 2-core machine was ~50x slower); raise it for large nets.",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.pod", description=__doc__)
    parser.add_argument("--experiment", help="experiment id (default: $PODIUM_EXPERIMENT_ID)")
    parser.add_argument("--pod-id", help="this pod's id (default: $PODIUM_POD_ID)")
    parser.add_argument("--role", choices=["all", "worker", "learner", "evaluator"], default="all")
    parser.add_argument(
        "--mode",
        choices=["fused", "processes"],
        help="roles in one process, or worker and evaluator as child processes "
        "(default: $PODIUM_POD_MODE or fused)",
    )
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
        fields = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
        )
        raise BadInputError(f"PODIUM_SPEC is not a valid experiment spec: {fields}") from exc
    return settings, spec, experiment, pod_id


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    try:
        settings, spec, experiment, pod_id = _settings(args)
    except BadInputError as exc:
        log.error("bad input", error=str(exc))
        return 2
    # Imported after the environment is checked: torch takes a second or two to import.
    from services.pod.runtime import HyperparameterError, check_hyperparameter_names

    try:
        check_hyperparameter_names(list(spec.search_space))
    except HyperparameterError as exc:
        log.error("bad input", error=f"search_space: {exc}")
        return 2
    log.info("pod starting", experiment=experiment, pod=pod_id, role=args.role)
    if args.role in ("worker", "evaluator"):
        return _wait_for_stop(args.role)

    import torch

    from services.pod.leaderboard_client import LeaderboardClient
    from services.pod.metrics import PodMetrics
    from services.pod.multiprocess import ProcessRoles
    from services.pod.runtime import FusedRoles, PodRuntime

    threads = settings.torch_threads
    torch.set_num_threads(threads)
    device = "cuda" if settings.gpus > 0 and torch.cuda.is_available() else "cpu"
    mode = args.mode or ("processes" if args.role == "learner" else settings.pod_mode)
    metrics = PodMetrics(experiment, pod_id)
    if settings.metrics_port is not None:
        metrics.serve(settings.metrics_port, settings.pod_dir, pod_id)
    token = settings.api_token.get_secret_value() if settings.api_token else None
    client = LeaderboardClient(settings.leaderboard_url, experiment, token)
    work_dir = settings.pod_dir / pod_id if settings.pod_dir else None
    runtime = PodRuntime(
        experiment,
        pod_id,
        spec,
        client,
        ProcessRoles(threads) if mode == "processes" else FusedRoles(),
        work_dir=work_dir,
        metrics=metrics,
        device=device,
        threads=threads,
        grace_s=settings.termination_grace_s,
    )

    def on_signal(signum: int, _frame: object) -> None:
        runtime.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("pod started", mode=mode, device=device, threads=threads)
    try:
        runtime.run()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        if runtime.stopping:
            # Asked to stop: the orchestrator does not count this exit as a failure.
            log.error("final report failed", error=error, exc_info=True)
            return 0
        log.error("pod failed", error=error, exc_info=True)
        return 1
    finally:
        runtime.close()
    log.info("pod stopped", rounds=runtime.rounds, submissions=len(runtime.submissions))
    return 0


def _wait_for_stop(role: str) -> int:
    log.warning(
        "this role runs as a child process of the learner container; waiting for the stop",
        role=role,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
