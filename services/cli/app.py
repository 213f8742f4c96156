"""The ``podium`` command line: each command parses its options and delegates.

Commands import their heavy dependencies (torch, the services) only when they run, so ``podium
--help`` is instant and the control-plane commands never load torch. The work is in the modules
beside this one: ``train`` (one agent), ``algorithms`` (the algorithm cards), ``tournament``
(``up``, ``run``, ``submit``), ``live`` (the live view and tables), ``results`` (what a run writes),
``pod_logs``, ``client`` (the APIs), ``platform`` (the embedded platform), ``plots``, ``overrides``,
``precompile`` (``compile``).
Every failure is a ``CliError``: one line on stderr and a documented exit code (``errors``)."""

from __future__ import annotations

import contextlib
import enum
import inspect
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from services.cli.errors import CliError

if TYPE_CHECKING:
    from services.cli.client import PodiumClient

app = typer.Typer(
    name="podium",
    help="Podium: tournament-based ensemble deep RL, on one machine or a Kubernetes cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@contextlib.contextmanager
def reported() -> Iterator[None]:
    """A CliError → its message on stderr and its exit code, never a traceback."""
    try:
        yield
    except CliError as exc:
        typer.secho(f"error: {exc.message}", err=True, fg=typer.colors.RED)
        raise typer.Exit(exc.exit_code) from None


def _positive(value: float | None) -> float | None:
    if value is not None and not value > 0:  # also NaN
        raise typer.BadParameter(f"must be a number of seconds > 0, got {value:g}")
    return value


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, got {value:g}")
    return value


def _client(
    url: str | None, token: str | None, leaderboard_url: str | None, data_dir: Path | None
) -> PodiumClient:
    from services.cli.client import PodiumClient, resolve

    return PodiumClient(resolve(url, token, leaderboard_url, data_dir=data_dir))


@app.callback()
def _main() -> None:
    import logging

    from services import logs

    # The commands print for people; log records are for files and log shippers. Only errors
    # reach the terminal (not, say, each retry before "cannot reach the orchestrator"), unless
    # PODIUM_LOG_LEVEL asks for more; `podium up` and `podium run` log to DATA_DIR/podium.log.
    logs.configure(level=os.environ.get("PODIUM_LOG_LEVEL", "ERROR"))
    # httpx logs every request at INFO: noise under the CLI's own output.
    logging.getLogger("httpx").setLevel(logging.WARNING)


# -- options shared by the commands ---------------------------------------------------------------
UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="PODIUM_URL",
        show_default=False,
        help="Orchestrator URL. Default: the platform `podium up` runs on --data-dir, "
        "else http://127.0.0.1:8000.",
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar=["PODIUM_TOKEN", "PODIUM_API_TOKEN"],
        show_default=False,
        help="API bearer token (both services).",
    ),
]
LeaderboardUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--leaderboard-url",
        envvar="PODIUM_LEADERBOARD_URL",
        show_default=False,
        help="Leaderboard URL (leaderboard, export, progress).",
    ),
]
DataDirOpt = Annotated[
    Path,
    typer.Option(
        "--data-dir",
        envvar="PODIUM_DATA_DIR",
        help="The embedded platform's data directory (Redis, pod logs).",
    ),
]
PortOpt = Annotated[
    int, typer.Option(help="Orchestrator port (busy: an ephemeral one).", min=0, max=65535)
]
LeaderboardPortOpt = Annotated[int, typer.Option(help="Leaderboard port.", min=0, max=65535)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead.")]
SpecArg = Annotated[Path, typer.Argument(help="Experiment spec (YAML).", show_default=False)]


def _id_of(what: str, listing: str) -> Callable[[str | None], str | None]:
    """An argument's check: an id as the services write them; anything else (``../../etc``)
    is no experiment's or pod's, and would be read as the path of another route."""

    def check(value: str | None) -> str | None:
        from services.contracts.leaderboard import ID_PATTERN

        if value is not None and not re.match(ID_PATTERN, value):
            raise typer.BadParameter(f"{value[:64]!r} is not {what} id (`{listing}` lists them)")
        return value

    return check


_experiment_id = _id_of("an experiment", "podium status")


ExperimentArg = Annotated[
    str, typer.Argument(help="Experiment id.", show_default=False, callback=_experiment_id)
]
QuietOpt = Annotated[bool, typer.Option(help="No live panel: a line per change.")]
# `podium run`'s results and platform data; `podium compile` prepares the same places.
OutOpt = Annotated[
    Path | None,
    typer.Option(help="Results: plots, leaderboard, best agent. Default: runs/<spec name>."),
]
RunDataOpt = Annotated[
    Path | None,
    typer.Option(help="The platform's data (Redis, pod logs, compile cache). Default: OUT/data."),
]
VerboseOpt = Annotated[
    bool, typer.Option(help="Show the services' logs here, not in DATA_DIR/podium.log.")
]


# -- one agent ------------------------------------------------------------------------------------
@app.command()
def train(
    env: Annotated[str, typer.Argument(help="Registered env name, e.g. CartPole-v1.")],
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="YAML file with TrainConfig fields.")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help="Override a field: key.path=value (repeatable)."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("runs/train"),
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Train one agent: progress bar, checkpoints and a learning-curve PNG under OUT."""
    from services.cli.train import preload_malloc
    from services.cli.train import train as train_agent

    with reported():
        preload_malloc()  # before torch is imported: it may start this command anew
        # Processes the run starts (learner replicas, roles) log as this one does, for this
        # command only: a caller that runs it in-process keeps its own environment.
        level = os.environ.get("PODIUM_LOG_LEVEL")
        os.environ["PODIUM_LOG_LEVEL"] = level or "ERROR"
        try:
            train_agent(env, config, set_ or [], out, quiet)
        finally:
            if level is None:
                os.environ.pop("PODIUM_LOG_LEVEL", None)


@app.command()
def algorithms(
    names: Annotated[
        bool, typer.Option("--names", help="Also list each one's hyperparameter names.")
    ] = False,
) -> None:
    """The algorithms a pod trains, from their cards: family, actions, population, presets."""
    from services.cli.algorithms import show

    with reported():
        show(names)


# -- a trading agent, held out --------------------------------------------------------------------
class Period(enum.StrEnum):
    backtest = "backtest"
    validation = "validation"


@app.command()
def backtest(
    files: Annotated[
        Path,
        typer.Argument(
            metavar="DIR",
            help="A trading agent's training files: `podium export`'s directory, `podium "
            "run`'s OUT/best or `podium train`'s OUT/checkpoints/best.",
            show_default=False,
        ),
    ],
    period: Annotated[
        Period,
        typer.Option(help="backtest: the held-out days; validation: the days selection read."),
    ] = Period.backtest,
    plot: Annotated[
        Path | None, typer.Option(help="PNG of the account values.", show_default=False)
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the metrics as JSON.")] = False,
) -> None:
    """Backtest a StockTrading-v0 agent against buy-and-hold and equal weight (five metrics)."""
    from services.cli.backtest import backtest as run_backtest

    with reported():
        run_backtest(files, period.value, plot, json_)


# -- the embedded platform ------------------------------------------------------------------------
@app.command()
def up(
    data_dir: DataDirOpt = Path("data"),
    host: Annotated[str, typer.Option(help="Address both services bind.")] = "127.0.0.1",
    port: PortOpt = 8000,
    leaderboard_port: LeaderboardPortOpt = 8001,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="PODIUM_API_TOKEN",
            show_default=False,
            help="API token of the session (default: a random one).",
        ),
    ] = None,
    no_token: Annotated[
        bool, typer.Option("--no-token", help="Open API (single user on this machine).")
    ] = False,
    strict_ports: Annotated[
        bool, typer.Option(help="Fail instead of using an ephemeral port when one is busy.")
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run the whole platform here (embedded Redis, leaderboard, orchestrator) until Ctrl-C."""
    from services.cli import tournament
    from services.cli.platform import Platform

    platform = Platform(
        data_dir=data_dir,
        host=host,
        orchestrator_port=port,
        leaderboard_port=leaderboard_port,
        token=token,
        open_api=no_token,
        strict_ports=strict_ports,
    )
    with reported():
        tournament.up(platform, verbose)


@app.command()
def run(
    spec_file: SpecArg,
    out: OutOpt = None,
    data_dir: RunDataOpt = None,
    port: PortOpt = 8000,
    leaderboard_port: LeaderboardPortOpt = 8001,
    timeout: Annotated[
        float | None,
        typer.Option(
            help="Cancel after this many seconds (> 0).", show_default=False, callback=_positive
        ),
    ] = None,
    top: Annotated[int, typer.Option(help="Rows of the final leaderboard.", min=1)] = 10,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run one experiment on a platform started here, to its end, with live progress.

    Then print the leaderboard, save plots under OUT and export the best agent into OUT/best.
    """
    from services.cli import tournament

    with reported():
        code = tournament.run(
            spec_file, out, data_dir, (port, leaderboard_port), timeout, top, quiet, verbose
        )
    raise typer.Exit(code)


@app.command("compile")
def compile_(
    spec_file: SpecArg,
    out: OutOpt = None,
    data_dir: RunDataOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Compile the spec's programs into the cache `podium run SPEC` gives its pods.

    One short run with compile: on per distinct program: the pods then load them (compile: auto
    weighs a load, not a cold compile).
    """
    from services.cli.precompile import compile_spec

    with reported():
        raise typer.Exit(compile_spec(spec_file, out, data_dir, verbose))


# -- any platform, over its APIs ------------------------------------------------------------------
@app.command()
def submit(
    spec_file: SpecArg,
    wait: Annotated[bool, typer.Option(help="Follow the experiment until it ends.")] = False,
    min_reward: Annotated[
        float | None,
        typer.Option(
            help="CI gate (implies --wait): exit 0 only if the best score reached this.",
            show_default=False,
            callback=_finite,
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            help="Give up waiting after this many seconds (> 0).",
            show_default=False,
            callback=_positive,
        ),
    ] = None,
    cancel_on_timeout: Annotated[
        bool, typer.Option(help="Cancel the experiment when --timeout passes.")
    ] = True,
    quiet: QuietOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    leaderboard_url: LeaderboardUrlOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Submit an experiment; prints its id on stdout. With --wait, follow it to its end."""
    from services.cli import tournament

    with reported(), _client(url, token, leaderboard_url, data_dir) as client:
        show_board = bool(leaderboard_url or not url)
        code = tournament.submit(
            client, spec_file, wait, min_reward, timeout, cancel_on_timeout, quiet, show_board
        )
    raise typer.Exit(code)


@app.command()
def status(
    experiment: Annotated[
        str | None,
        typer.Argument(
            help="Experiment id (default: list them).", show_default=False, callback=_experiment_id
        ),
    ] = None,
    state: Annotated[
        str | None, typer.Option(help="List only experiments in this state.", show_default=False)
    ] = None,
    events: Annotated[
        int, typer.Option(help="Recent events shown for one experiment.", min=0)
    ] = 10,
    json_out: JsonOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """One experiment's state, progress, pods and recent events; or every experiment."""
    from services.cli import live

    console = live.stdout_console()
    with reported(), _client(url, token, None, data_dir) as client:
        if experiment is None:
            exps = client.experiments(state)
            if json_out:
                typer.echo(json.dumps(exps, indent=2))
            else:
                console.print(live.experiments_table(exps) if exps else "no experiments")
            return
        exp = client.experiment(experiment)
        recent = client.events(experiment)[-events:] if events else []
        if json_out:
            typer.echo(json.dumps({**exp, "events": recent}, indent=2))
        else:
            live.print_status(console, live.Watch(client, experiment, console, top=0), exp, recent)


@app.command()
def leaderboard(
    experiment: ExperimentArg,
    top: Annotated[int, typer.Option(help="Rows (default: the whole board, K).", min=0)] = 0,
    json_out: JsonOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    leaderboard_url: LeaderboardUrlOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """The experiment's leaderboard: best first, with score, algorithm, lineage, pod."""
    from services.cli import live

    with reported(), _client(url, token, leaderboard_url, data_dir) as client:
        board = client.board(experiment, limit=top or None)
    if json_out:
        typer.echo(board.model_dump_json(indent=2))
    else:
        live.print_board(live.stdout_console(), board, experiment)


@app.command()
def cancel(
    experiment: ExperimentArg,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Cancel an experiment: its pods make their final reports and stop."""
    from services.cli.client import TERMINAL
    from services.cli.live import stderr_console

    with reported(), _client(url, token, None, data_dir) as client:
        exp = client.cancel(experiment)
    if exp["state"] in TERMINAL:
        stderr_console().print(f"experiment {experiment}: {exp['state']} ({exp.get('reason')})")
    else:
        stderr_console().print(
            f"experiment {experiment}: cancel requested; its pods make their final reports and "
            f"stop (podium status {experiment})"
        )


@app.command()
def logs(
    experiment: ExperimentArg,
    pod: Annotated[
        str | None,
        typer.Argument(
            help="Pod id (default: every pod).",
            show_default=False,
            callback=_id_of("a pod", "podium status ID"),
        ),
    ] = None,
    tail: Annotated[int, typer.Option(help="Lines per pod.", min=1)] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines (local files).")
    ] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    leaderboard_url: LeaderboardUrlOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Pod logs, of running and ended pods.

    The embedded platform's files under DATA_DIR, else the orchestrator's API; an ended pod's
    last lines as it uploaded them when it exited.
    """
    from services.cli.pod_logs import show_logs

    with reported(), _client(url, token, leaderboard_url, data_dir) as client:
        show_logs(client, data_dir, experiment, pod, tail, follow)


@app.command()
def tensorboard(
    experiment: ExperimentArg,
    out: Annotated[
        Path | None,
        typer.Option(help="Directory (default: runs/<id>/tensorboard).", show_default=False),
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    leaderboard_url: LeaderboardUrlOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Download every pod's TensorBoard files into OUT/<pod id>/, for `tensorboard --logdir`.

    As each pod last uploaded them, sha256-checked.
    """
    out = out or Path("runs") / experiment / "tensorboard"
    with reported(), _client(url, token, leaderboard_url, data_dir) as client:
        pods = client.tensorboard(experiment, out)
    if not pods:
        from services.cli.errors import EXIT_NOT_REACHED

        with reported():
            raise CliError(
                f"no pod of experiment {experiment} kept TensorBoard files", EXIT_NOT_REACHED
            )
    # Plain lines (no wrapping): the command is to be copied.
    typer.echo(f"{len(pods)} pods' TensorBoard files in {out}; see them with", err=True)
    typer.echo(f"tensorboard --logdir {out}", err=True)


@app.command()
def export(
    experiment: ExperimentArg,
    out: Annotated[
        Path | None, typer.Option(help="Directory (default: runs/<id>/best).", show_default=False)
    ] = None,
    candidate: Annotated[
        str | None, typer.Option(help="A candidate id (default: the best).", show_default=False)
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    leaderboard_url: LeaderboardUrlOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Download an agent's training files (default: the best), verifying every sha256."""
    from services.cli.live import stderr_console

    out = out or Path("runs") / experiment / "best"
    with reported(), _client(url, token, leaderboard_url, data_dir) as client:
        cand = client.export(experiment, out, candidate)
    stderr_console().print(
        f"candidate {cand.candidate_id} (score {cand.score:.4g}, {cand.algorithm}, "
        f"generation {cand.generation}): {len(cand.files)} files verified into {out}"
    )


def flowing_help(app: typer.Typer) -> None:
    """Each command's help as its docstring's paragraphs of flowing text: typer's help keeps a
    docstring's line breaks, which break its lines mid-sentence at any other width. A paragraph
    that starts with ``\\b`` keeps its lines (click's mark for a preformatted one)."""
    for command in app.registered_commands:
        doc = inspect.cleandoc(command.help or getattr(command.callback, "__doc__", "") or "")
        paragraphs = [p if p.startswith("\b") else " ".join(p.split()) for p in doc.split("\n\n")]
        command.help = "\n\n".join(paragraphs)


flowing_help(app)
