"""``podium logs``: the embedded platform's pod log files under DATA_DIR (with ``--follow``),
else the orchestrator's pod-logs endpoint; for a pod that has ended, the last lines it uploaded
to the leaderboard's blob store as it exited (services/pod/runtime/pod_files.py: its final report
and its last line included), else those the orchestrator kept when the pod ended."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import typer

from services.cli.client import PodiumClient
from services.cli.errors import EXIT_API, EXIT_NOT_REACHED, CliError
from services.contracts.artifacts import PodFile

#: Ended pods shown without a pod id when the orchestrator kept none of them.
ENDED_SHOWN = 8


def local_pods_dir(data_dir: Path, experiment: str) -> Path:
    """Where the embedded platform's local backend keeps the experiment's pod logs
    (``<pod>.log``) under DATA_DIR."""
    return data_dir / "experiments" / experiment / "pods"


def show_logs(
    client: PodiumClient,
    data_dir: Path,
    experiment: str,
    pod: str | None,
    tail: int,
    follow: bool,
) -> None:
    """``client`` is asked only when DATA_DIR holds no log of the experiment."""
    pods_dir = local_pods_dir(data_dir, experiment)
    files = sorted(pods_dir.glob("*.log"), key=lambda p: p.stat().st_mtime)
    if not files:
        if follow:
            raise CliError(f"--follow reads local pod logs and there are none under {pods_dir}")
        try:
            _remote(client, experiment, pod, tail)
        except CliError as exc:
            if exc.exit_code != EXIT_API:
                raise
            # Both places were asked: say so, or a user who named --data-dir reads only of URLs.
            raise CliError(f"no pod logs under {pods_dir}; {exc.message}", EXIT_API) from None
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
    live = [p["pod_id"] for p in client.experiment(experiment)["pods"]]
    if pod is not None and pod not in live:
        uploaded = _uploaded(client, experiment)
        if pod in uploaded:  # an ended pod's own last lines
            typer.echo(_last(client.pod_log(experiment, uploaded[pod]), tail), nl=False)
            return
    pods = [pod] if pod is not None else live
    if not pods:
        _ended(client, experiment, tail)
        return
    for pod_id in pods:
        if len(pods) > 1:
            typer.secho(f"==> pod {pod_id} <==", bold=True)
        typer.echo(client.pod_logs(experiment, pod_id, tail), nl=False)


def _uploaded(client: PodiumClient, experiment: str) -> dict[str, PodFile]:
    """Pod id -> the log lines it uploaded; {} where the leaderboard cannot be asked (only
    the orchestrator's URL given, and the one it knows does not resolve from here)."""
    try:
        return {f.pod_id: f for f in client.pod_files(experiment, "log")}
    except CliError as exc:
        typer.echo(f"(the pods' own last lines are not readable: {exc.message})", err=True)
        return {}


def _last(text: str, lines: int) -> str:
    kept = text.splitlines()[-lines:]
    return "".join(line + "\n" for line in kept) if kept else "(no log)\n"


def _ended(client: PodiumClient, experiment: str, tail: int) -> None:
    """No pod runs now (the experiment ended, or is between pods): the last lines of its most
    recently ended pods (those the orchestrator kept a record of), each as the pod uploaded
    them when it exited, else as the orchestrator read them when the pod ended; so that a gate
    that just failed shows why."""
    ended = client.ended_pods(experiment, tail)
    uploaded = _uploaded(client, experiment)
    if not ended and not uploaded:
        raise CliError(
            f"experiment {experiment} has no pods now, and no logs of ended pods were kept",
            EXIT_NOT_REACHED,
        )
    # Pods the orchestrator kept no record of (it keeps the newest few) but that uploaded
    # their lines: the newest of them, up to as many as it keeps.
    known = {p["pod_id"] for p in ended}
    rest = [f for f in uploaded.values() if f.pod_id not in known]
    shown = rest[-max(len(ended), ENDED_SHOWN) :]
    typer.echo(
        f"experiment {experiment} has no pods now: the last lines of its "
        f"{len(ended) + len(shown)} most recently ended pods",
        err=True,
    )
    for f in shown:
        typer.secho(f"==> pod {f.pod_id} (ended) <==", bold=True)
        typer.echo(_last(client.pod_log(experiment, f), tail), nl=False)
    for p in ended:
        how = "stopped" if p["stopped"] else str(p["phase"]).lower()
        if p.get("reason"):
            how += f", {p['reason']}"
        typer.secho(f"==> pod {p['pod_id']} (ended: {how}) <==", bold=True)
        if p["pod_id"] in uploaded:
            typer.echo(_last(client.pod_log(experiment, uploaded[p["pod_id"]]), tail), nl=False)
        else:
            typer.echo(p["log"] + "\n" if p["log"] else "(no log)\n", nl=False)
    if len(rest) > len(shown):
        typer.echo(
            f"{len(rest) - len(shown)} more ended pods kept their last lines: "
            f"podium logs {experiment} POD",
            err=True,
        )


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
