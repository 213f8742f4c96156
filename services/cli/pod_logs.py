"""``podium logs``: the embedded platform's pod log files under DATA_DIR (with ``--follow``),
else the orchestrator's pod-logs endpoint; with no pod running, the last lines the orchestrator kept
of the experiment's ended pods."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import typer

from services.cli.client import PodiumClient
from services.cli.errors import EXIT_NOT_REACHED, CliError


def show_logs(
    client: PodiumClient,
    data_dir: Path,
    experiment: str,
    pod: str | None,
    tail: int,
    follow: bool,
) -> None:
    """``client`` is asked only when DATA_DIR holds no log of the experiment."""
    pods_dir = data_dir / "experiments" / experiment / "pods"
    files = (
        sorted(pods_dir.glob("*.log"), key=lambda p: p.stat().st_mtime) if pods_dir.is_dir() else []
    )
    if not files:
        if follow:
            raise CliError(f"--follow reads local pod logs and there are none under {pods_dir}")
        _remote(client, experiment, pod, tail)
        return
    if pod is not None:
        files = [f for f in files if f.stem == pod]
        if not files:
            raise CliError(f"no log of pod {pod!r} in {pods_dir}", EXIT_NOT_REACHED)
    positions: dict[Path, int] = {}
    for path in files:
        with open(path, errors="replace") as f:
            lines = deque(f, maxlen=tail)
            positions[path] = f.tell()
        if len(files) > 1:
            typer.secho(f"==> pod {path.stem} <==", bold=True)
        typer.echo("".join(lines), nl=False)
    if follow:
        _follow(pods_dir, pod, positions)


def _remote(client: PodiumClient, experiment: str, pod: str | None, tail: int) -> None:
    pods = (
        [pod] if pod is not None else [p["pod_id"] for p in client.experiment(experiment)["pods"]]
    )
    if not pods:
        _ended(client, experiment, tail)
        return
    for pod_id in pods:
        if len(pods) > 1:
            typer.secho(f"==> pod {pod_id} <==", bold=True)
        typer.echo(client.pod_logs(experiment, pod_id, tail), nl=False)


def _ended(client: PodiumClient, experiment: str, tail: int) -> None:
    """No pod runs now (the experiment ended, or is between pods): the last lines the
    orchestrator kept of its ended pods, so that a gate that just failed shows why."""
    ended = client.ended_pods(experiment, tail)
    if not ended:
        raise CliError(
            f"experiment {experiment} has no pods now, and no logs of ended pods were kept",
            EXIT_NOT_REACHED,
        )
    typer.echo(
        f"experiment {experiment} has no pods now: the last lines of its {len(ended)} most "
        "recently ended pods, kept by the orchestrator",
        err=True,
    )
    for p in ended:
        how = "stopped" if p["stopped"] else str(p["phase"]).lower()
        if p.get("reason"):
            how += f", {p['reason']}"
        typer.secho(f"==> pod {p['pod_id']} (ended: {how}) <==", bold=True)
        typer.echo(p["log"] + "\n" if p["log"] else "(no log)\n", nl=False)


def _follow(pods_dir: Path, pod: str | None, positions: dict[Path, int]) -> None:
    try:
        while True:
            time.sleep(0.5)
            for path in sorted(pods_dir.glob("*.log")):
                if pod is not None and path.stem != pod:
                    continue
                with open(path, errors="replace") as f:
                    f.seek(positions.get(path, 0))
                    new = f.read()
                    positions[path] = f.tell()
                for line in new.splitlines():
                    typer.echo(f"[{path.stem}] {line}" if pod is None else line)
    except KeyboardInterrupt:
        return
