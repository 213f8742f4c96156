"""Tournaments from the command line: ``podium up`` (the embedded platform until Ctrl-C),
``podium run`` (the platform, one experiment to its end, its results) and ``podium submit``
(an experiment on any platform, followed to its end with ``--wait``: the CI/CD gate)."""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.cli.client import TERMINAL, PodiumClient, reached, resolve
from services.cli.errors import (
    EXIT_API,
    EXIT_INTERRUPTED,
    EXIT_NOT_REACHED,
    EXIT_TIMEOUT,
    CliError,
)
from services.cli.live import (
    WaitTimeoutError,
    Watch,
    board_table,
    cancel_quietly,
    stderr_console,
    wait_for_end,
)
from services.cli.outputs import output_dir
from services.cli.platform import Platform, PlatformError
from services.cli.results import cold_compile_reason, collect, write_plots
from services.malloc import NONE_FOUND

if TYPE_CHECKING:
    from services.contracts.spec import ExperimentSpec

LOG_FILE = "podium.log"  # under the platform's data directory


def read_spec(path: Path) -> dict[str, Any]:
    """The spec file as a mapping of JSON values (validated by the orchestrator, which may
    know more plugins than this machine)."""
    from services.contracts.spec import SpecError, read_spec_mapping

    try:
        return read_spec_mapping(path)
    except SpecError as exc:
        raise CliError(str(exc)) from None


def _interrupt_on_signals() -> None:
    """SIGINT and SIGTERM (docker stop, kill) stop the platform cleanly. SIGINT is set
    explicitly: a process started in the background by a shell inherits it ignored."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, handler)


def _shield_signals() -> None:
    """While the platform stops: another Ctrl-C or SIGTERM must not cut it short (pods would
    be left to the next start to adopt)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def check_fits(platform: Platform, spec: ExperimentSpec) -> None:
    """Refuse a spec whose one pod asks more than this machine has: the embedded platform's
    capacity does not grow while it runs, so the experiment would wait, pending, forever."""
    from services.contracts.spec import parse_quantity

    cpu, gpus, memory = platform.orchestrator_settings("http://127.0.0.1").local_capacity()
    r = spec.resources
    for name, need, have, shown in (
        ("cpu", r.cpu, cpu, f"{cpu:g}"),
        ("gpus", r.gpus, gpus, f"{gpus}"),
        ("memory", parse_quantity(r.memory), memory, f"{memory / 2**30:.1f}Gi"),
    ):
        if need > have:
            raise CliError(
                f"resources.{name}: each pod asks {getattr(r, name)}, this machine has {shown} "
                f"(PODIUM_CAPACITY_{name.upper()} sets what the embedded platform counts); "
                "its pods would never start"
            )


def _start(platform: Platform) -> None:
    _interrupt_on_signals()
    try:
        platform.start()
    except PlatformError as exc:
        raise CliError(str(exc), EXIT_API) from None


def service_logs(data_dir: Path, verbose: bool) -> Path | None:
    """Send the services' log records (this process runs them) to DATA_DIR/podium.log as JSON
    lines, keeping the terminal for the banner, the live panel and errors; with ``verbose``, to
    stderr instead. Returns the file, or None for stderr."""
    from services import logs

    level = os.environ.get("PODIUM_LOG_LEVEL", "INFO")
    if verbose:
        logs.configure(level=level)
        return None
    path = Path(data_dir).resolve() / LOG_FILE
    logs.configure(level=level, file=path)
    return path


def finds_it(data_dir: Path) -> str:
    """Which commands find the platform of ``data_dir`` by its session file (the commands'
    ``--data-dir``, default ``data`` in the working directory)."""
    if data_dir == Path("data").resolve():
        return "Commands run in this directory find it by themselves"
    here = shlex.quote(str(data_dir))
    return f"Commands given --data-dir {here} (or PODIUM_DATA_DIR={here}) find it by themselves"


def up(platform: Platform, verbose: bool = False) -> None:
    """Run the platform until Ctrl-C or SIGTERM, or until a service stops by itself."""
    console = stderr_console()
    log_file = service_logs(platform.data_dir, verbose)
    _start(platform)
    try:
        o, lb = platform.orchestrator_url, platform.leaderboard_url
        console.print(f"[bold green]Podium is up[/] (data: {platform.data_dir})")
        console.print(f"  orchestrator  {o}   API docs {o}/api/v1/docs   metrics {o}/metrics")
        console.print(f"  leaderboard   {lb}   API docs {lb}/api/v1/docs   metrics {lb}/metrics")
        console.print(f"  token         {platform.token or '(none: the API is open)'}")
        if platform.pods_malloc:
            console.print(f"  pods' malloc  {platform.pods_malloc}", soft_wrap=True, markup=False)
        if log_file is not None:
            console.print(f"  logs          {log_file}   (--verbose shows them here)")
        console.print(
            f"{finds_it(platform.data_dir)}, e.g.\n"
            "  podium submit examples/cartpole.yaml --wait\n"
            "From elsewhere:\n"
            f"  export PODIUM_URL={o} PODIUM_LEADERBOARD_URL={lb}"
            + (f" PODIUM_TOKEN={platform.token}" if platform.token else "")
        )
        console.print("Ctrl-C stops it (pods make their final reports first).")
        while platform.healthy():
            time.sleep(0.5)
        console.print("[red]a service stopped unexpectedly; shutting down[/]")
        raise CliError("a service stopped unexpectedly", EXIT_API)
    except KeyboardInterrupt:
        console.print("stopping: pods finish their final reports, then the services stop …")
    finally:
        _shield_signals()
        platform.stop()
        console.print("stopped.")


def run(
    spec_file: Path,
    out: Path | None,
    data_dir: Path | None,
    ports: tuple[int, int],
    timeout: float | None,
    top: int,
    quiet: bool,
    verbose: bool,
) -> int:
    """Start the platform, run one experiment to its end with live progress, then print the
    leaderboard, save plots under OUT and export the best agent into OUT/best."""
    from services.contracts.spec import SpecError, load_spec

    try:
        spec = load_spec(spec_file)
    except SpecError as exc:
        raise CliError(str(exc)) from None
    out = out or Path("runs") / spec.name
    data_dir = data_dir or out / "data"
    console = stderr_console()
    platform = Platform(data_dir=data_dir, orchestrator_port=ports[0], leaderboard_port=ports[1])
    check_fits(platform, spec)  # before anything is made: a refused run leaves nothing
    output_dir(out, "--out")
    output_dir(data_dir, "--data-dir")
    # The live panel shows what matters; service logs on the terminal would tear it.
    service_logs(data_dir, verbose)
    _start(platform)
    interrupted = timed_out = False
    collected: dict[str, Any] = {}
    try:
        urls = (platform.orchestrator_url, platform.token, platform.leaderboard_url)
        client = PodiumClient(resolve(*urls))
        # An earlier run killed outright leaves its experiment unfinished in DATA_DIR; it
        # would resume now and compete with this one for the machine.
        for stale in client.experiments():
            if stale["state"] not in TERMINAL:
                cancel_quietly(client, stale["id"])
                console.print(f"cancelled unfinished experiment {stale['id']} of an earlier run")
        exp_id = client.submit(spec.model_dump(mode="json"))["id"]
        console.print(
            f"submitted [bold]{spec.name}[/] as experiment {exp_id} "
            f"(orchestrator {platform.orchestrator_url}, API docs "
            f"{platform.orchestrator_url}/api/v1/docs)"
        )
        if NONE_FOUND in platform.pods_malloc and not quiet:  # they train slower: say so
            console.print(f"pods' malloc: {platform.pods_malloc}", soft_wrap=True, markup=False)
        watch = Watch(client, exp_id, console, top=5)
        live = console.is_terminal and not quiet
        try:
            exp = wait_for_end(watch, timeout, live)
        except (KeyboardInterrupt, WaitTimeoutError) as exc:
            interrupted = isinstance(exc, KeyboardInterrupt)
            timed_out = not interrupted
            why = "interrupted" if interrupted else f"timeout ({timeout:g}s)"
            console.print(f"{why}: cancelling; pods make their final reports (Ctrl-C: skip)")
            cancel_quietly(client, exp_id)
            exp = wait_for_end(watch, None, live=False)
        collected = collect(client, exp_id, exp, out, console)
    except KeyboardInterrupt:
        interrupted = True
        console.print("interrupted again: stopping the platform")
    finally:
        _shield_signals()
        platform.stop()
    if not collected:
        return EXIT_INTERRUPTED
    exp = collected["experiment"]
    higher = spec.evaluation.higher_is_better
    write_plots(watch.samples, collected, out, spec.name, spec.target_return, console, higher)
    board = collected.get("board")
    if board and board.candidates:
        title = f"final leaderboard of {spec.name}"
        console.print(board_table(board, top, title, width=console.width))
    ok, why = reached(exp, None)
    console.print(f"results: {out}   pod logs: podium logs {exp_id} --data-dir {data_dir}")
    if not quiet and (eager := cold_compile_reason(data_dir, exp_id)):  # later runs: faster
        again = (
            f"podium compile {shlex.quote(str(spec_file))} --data-dir {shlex.quote(str(data_dir))}"
        )
        console.print(
            f"trained eager, not compiled ({eager}): `{again}` compiles the spec's programs once, "
            "for its later runs on this data directory to load",
            soft_wrap=True,
            markup=False,
        )
    if interrupted:
        console.print(f"[magenta]interrupted[/]: {why}")
        return EXIT_INTERRUPTED
    if timed_out:
        raise CliError(f"timed out after {timeout:g}s: {why}", EXIT_TIMEOUT)
    if not ok:
        raise CliError(why, EXIT_NOT_REACHED)
    console.print(f"[green]{why}[/]")
    return 0


def submit(
    client: PodiumClient,
    spec_file: Path,
    wait: bool,
    min_reward: float | None,
    timeout: float | None,
    cancel_on_timeout: bool,
    quiet: bool,
    show_board: bool,
) -> int:
    """Submit; print the id on stdout; with ``wait``, follow the experiment to its end and
    judge it (``min_reward``: the CI gate)."""
    import typer

    body = read_spec(spec_file)
    console = stderr_console()
    exp = client.submit(body)
    typer.echo(exp["id"])
    console.print(f"submitted {exp['name']} as experiment {exp['id']} ({exp['state']})")
    if not wait and min_reward is None:
        return 0
    watch = Watch(client, exp["id"], console, top=5 if show_board else 0)
    try:
        exp = wait_for_end(watch, timeout, console.is_terminal and not quiet)
    except WaitTimeoutError as exc:
        msg = f"timed out after {timeout:g}s waiting for experiment {exp['id']} ({exc})"
        if cancel_on_timeout:
            cancel_quietly(client, exp["id"])
            msg += "; cancelled it"
        else:
            msg += f"; still running (podium cancel {exp['id']})"
        raise CliError(msg, EXIT_TIMEOUT) from None
    except KeyboardInterrupt:
        console.print(f"stopped waiting; experiment {exp['id']} goes on (podium status)")
        return EXIT_INTERRUPTED
    ok, why = reached(exp, min_reward)
    if not ok:
        raise CliError(why, EXIT_NOT_REACHED)
    console.print(f"[green]{why}[/]")
    return 0
