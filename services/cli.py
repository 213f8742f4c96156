"""The ``podium`` command line.

Subcommands import their heavy dependencies (torch, the services) only when they run, so
``podium --help`` is instant and the control-plane commands never load torch.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError

if TYPE_CHECKING:
    from rich.console import Console

    from services.client import PodiumClient

app = typer.Typer(
    name="podium",
    help="Podium: tournament-based ensemble deep RL, on one machine or a Kubernetes cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print a one-line error (no traceback) and return the Exit to raise."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code)


def describe_validation(exc: ValidationError) -> str:
    from services.spec import describe_errors

    return "invalid configuration:\n" + "\n".join(describe_errors(exc))


@app.callback()
def _main() -> None:
    import logging

    from services import logs

    logs.configure()
    # httpx logs every request at INFO: noise under the CLI's own output.
    logging.getLogger("httpx").setLevel(logging.WARNING)


@app.command()
def train(
    env: Annotated[str, typer.Argument(help="Registered env name, e.g. CartPole-v1.")],
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="YAML file with run-config fields.")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help="Override a field: key.path=value (repeatable)."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("runs/train"),
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Train one agent: progress bar, checkpoints and a learning-curve PNG under OUT."""
    from services.overrides import ConfigError, load_yaml, parse_set
    from services.pod.algorithms.hyperparameters import HyperparameterError
    from services.registry import UnknownNameError

    try:
        # The user's layers (YAML, then each --set) are read once and merged in order over the
        # preset of the algorithm they name (services/pod/presets.py); the algorithm's trainer
        # is a registry lookup (services/pod/trainer.py).
        from services.pod.presets import train_config

        layers = [load_yaml(config)] if config is not None else []
        layers += [parse_set(assignment) for assignment in set_ or []]
        cfg = train_config(env, layers)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    except ValidationError as exc:
        raise fail(describe_validation(exc)) from None
    except (UnknownNameError, HyperparameterError) as exc:
        raise fail(str(exc)) from None
    if cfg.env != env:
        raise fail(f"the config names env {cfg.env!r} but the command names {env!r}")

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from services.plots import learning_curve
    from services.pod.fit import build
    from services.pod.fit import train as run_training

    try:
        trainer = build(cfg)
    except (UnknownNameError, TypeError, ValueError) as exc:
        raise fail(str(exc)) from None

    console = Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    metrics = (out / "metrics.jsonl").open("w")
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} steps"),
        TextColumn("{task.fields[rate]:>9,.0f} steps/s"),
        TextColumn("eval {task.fields[eval]}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
    )
    latest_eval = {"value": "–"}

    def on_progress(record: dict[str, float]) -> None:
        metrics.write(json.dumps(record) + "\n")
        if "eval_return" in record:
            latest_eval["value"] = f"{record['eval_return']:.1f}"
        rate = record["env_steps"] / max(record["train_seconds"], 1e-9)
        progress.update(task, completed=record["env_steps"], rate=rate, eval=latest_eval["value"])

    with progress:
        task = progress.add_task(env, total=cfg.total_env_steps, rate=0.0, eval="–")
        try:
            result = run_training(cfg, out_dir=out, on_progress=on_progress, trainer=trainer)
        finally:
            metrics.close()
    png = learning_curve(result.history, out / "learning_curve.png", env, cfg.target_return)
    best = result.best.mean if result.best else float("nan")
    steps = result.history[-1]["env_steps"] if result.history else 0
    if result.solved_at_env_steps is not None:
        console.print(
            f"[green]solved[/green] {env}: eval return {best:.1f} >= {cfg.target_return:g} "
            f"after {result.solved_at_env_steps:,} env steps, {result.train_seconds:.1f} s training"
        )
    else:
        console.print(f"{env}: best eval return {best:.1f} after {steps:,} env steps")
    console.print(f"checkpoints: {out / 'checkpoints'}   learning curve: {png}")


# -- the platform and its APIs ------------------------------------------------------------------
# Everything below talks HTTP (services.client) or runs the control plane (services.platform);
# none of it imports torch.

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
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead.")]


@contextlib.contextmanager
def api_errors() -> Iterator[None]:
    """ApiError -> its one-line message and exit code, never a traceback."""
    from services.client import ApiError

    try:
        yield
    except ApiError as exc:
        raise fail(exc.message, exc.exit_code) from None


def _client(
    url: str | None, token: str | None, leaderboard_url: str | None, data_dir: Path | None
) -> PodiumClient:
    from services.client import PodiumClient, resolve

    return PodiumClient(resolve(url, token, leaderboard_url, data_dir=data_dir))


def _console() -> Console:
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    if not console.is_terminal:  # CI logs: wide enough for the leaderboard table
        console.width = max(console.width, 160)
    return console


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


def _read_spec(path: Path) -> dict[str, Any]:
    """The spec file as a mapping (validated by the orchestrator, which may know more plugins
    than this machine)."""
    from services.spec import SpecError, read_spec_mapping

    try:
        return read_spec_mapping(path)
    except SpecError as exc:
        raise fail(str(exc)) from None


STATE_STYLE = {
    "pending": "yellow",
    "running": "cyan",
    "paused": "yellow",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "magenta",
    "budget_exhausted": "yellow",
}


def _fmt(value: float | None, spec: str = ".4g", none: str = "–") -> str:
    return none if value is None else format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Watch:
    """Polls an experiment (2 Hz) and its leaderboard (0.5 Hz) and renders its progress: a
    live panel on a terminal; in CI logs a line when the state, the number of pods or the best
    score changes, and every 10 s otherwise."""

    def __init__(self, client: PodiumClient, exp_id: str, console: Console, top: int = 5):
        from collections import deque

        self.client = client
        self.exp_id = exp_id
        self.console = console
        self.top = top
        self.samples: list[dict[str, Any]] = []
        self.rates: deque[tuple[float, int]] = deque()
        self.board: dict[str, Any] | None = None
        self.board_at = 0.0
        self.first_best: float | None = None
        self.last_line = ("", 0.0)

    def poll(self) -> dict[str, Any]:
        from services.client import ApiError

        exp = self.client.experiment(self.exp_id)
        now = time.time()
        steps = exp["progress"].get("env_steps")
        best = exp.get("best_score")
        if best is not None and self.first_best is None:
            self.first_best = best
        self.samples.append(
            {"t": now - exp["created_at"], "env_steps": steps, "best": best, "state": exp["state"]}
        )
        if steps is not None:
            self.rates.append((now, steps))
            while len(self.rates) > 2 and now - self.rates[0][0] > 10:
                self.rates.popleft()
        from services.client import TERMINAL

        due = now - self.board_at > 2.0 or exp["state"] in TERMINAL  # the final board, fresh
        if self.top and due and self.client.endpoints.leaderboard_url:
            self.board_at = now
            # Not registered yet, or the leaderboard is busy: keep the last board.
            with contextlib.suppress(ApiError):
                self.board = self.client.board(self.exp_id, limit=self.top)
        return exp

    def rate(self) -> float | None:
        if len(self.rates) < 2:
            return None
        (t0, s0), (t1, s1) = self.rates[0], self.rates[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    def render(self, exp: dict[str, Any]) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        prog = exp["progress"]
        state = exp["state"]
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        head = Text.assemble(
            (f"{exp['name']} ", "bold"),
            (f"({exp['id']})  ", "dim"),
            (state, STATE_STYLE.get(state, "")),
            (f"  {exp.get('reason') or ''}", "dim"),
        )
        grid.add_row("experiment", head)

        def bar_row(label: str, frac: float | None, text: str) -> None:
            if frac is None:
                grid.add_row(label, text)
                return
            row = Table.grid(padding=(0, 1))
            row.add_row(ProgressBar(total=1.0, completed=max(0.0, min(1.0, frac)), width=30), text)
            grid.add_row(label, row)

        best, target = exp.get("best_score"), prog.get("target_reward")
        frac = None
        if best is not None and target is not None and self.first_best is not None:
            # From 0 for positive rewards (CartPole), from the first score otherwise (Pendulum).
            base = 0.0 if target > 0 and self.first_best >= 0 else self.first_best
            span = target - base
            frac = 1.0 if span == 0 else (best - base) / span
        bar_row("best score", frac, f"{_fmt(best)} / target {_fmt(target)}")
        steps, total = prog.get("env_steps"), prog.get("total_env_steps")
        rate = self.rate()
        steps_text = f"{steps or 0:,}" + (f" / {total:,}" if total else "")
        if rate is not None:
            steps_text += f"   {rate:,.0f} env steps/s"
        bar_row("env steps", (steps or 0) / total if total else None, steps_text)
        live = [p for p in exp.get("pods", []) if p["phase"] in ("Pending", "Running")]
        launched = f"{prog.get('pods_launched', 0)}" + (
            f"/{prog['pods_budget']}" if prog.get("pods_budget") else ""
        )
        grid.add_row(
            "pods", f"{len(live)} running, {exp.get('desired_pods', 0)} wanted, {launched} launched"
        )
        wall = prog.get("wall_time_s")
        grid.add_row(
            "elapsed",
            _duration(prog.get("elapsed_s")) + (f" / {_duration(wall)}" if wall else ""),
        )
        parts: list[Any] = [grid]
        if self.board and self.board.get("candidates"):
            parts.append(board_table(self.board, self.top, title="leaderboard"))
        return Group(*parts)

    def line(self, exp: dict[str, Any]) -> str | None:
        prog = exp["progress"]
        live = sum(p["phase"] in ("Pending", "Running") for p in exp.get("pods", []))
        rate = self.rate()
        key = f"{exp['state']}|{live}|{exp.get('best_score')}"
        text = (
            f"[{_duration(prog.get('elapsed_s'))}] {exp['state']:<9} pods {live} "
            f"best {_fmt(exp.get('best_score'))}/{_fmt(prog.get('target_reward'))} "
            f"env steps {prog.get('env_steps') or 0:,}"
            + (f" ({rate:,.0f}/s)" if rate is not None else "")
        )
        now = time.monotonic()
        if key != self.last_line[0] or now - self.last_line[1] >= 10:
            self.last_line = (key, now)
            return text
        return None


def board_table(board: dict[str, Any], top: int, title: str | None = None) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", header_style="bold")
    for col, kw in (
        ("#", {"justify": "right", "no_wrap": True}),
        ("candidate", {"no_wrap": True, "min_width": 22}),
        ("score", {"justify": "right", "no_wrap": True, "min_width": 7}),
        ("± std", {"justify": "right", "no_wrap": True, "min_width": 5}),
        ("algorithm", {"no_wrap": True, "min_width": 9}),
        ("gen", {"justify": "right", "no_wrap": True}),
        ("pod", {"no_wrap": True, "min_width": 8}),
        ("env steps", {"justify": "right", "no_wrap": True, "min_width": 9}),
        ("hyperparameters", {"overflow": "fold", "ratio": 1}),
    ):
        table.add_column(col, **kw)
    for c in board.get("candidates", [])[:top]:
        hp = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in sorted(c.get("hyperparameters", {}).items())
        )
        table.add_row(
            str(c.get("rank") or ""),
            c["candidate_id"],
            f"{c['score']:.4g}",
            f"{c.get('eval', {}).get('std', 0.0):.3g}",
            c["algorithm"],
            str(c["generation"]),
            c["pod_id"],
            f"{c['env_steps']:,}",
            hp,
        )
    return table


def cancel_quietly(client: PodiumClient, exp_id: str) -> None:
    """Cancel, unless it has just ended by itself (409: nothing to cancel)."""
    from services.client import ApiError

    try:
        client.cancel(exp_id)
    except ApiError as exc:
        if exc.status != 409:
            raise


class WaitTimeoutError(Exception):
    """--timeout passed while waiting; the message is the experiment's state."""


def wait_for_end(
    watch: Watch,
    timeout: float | None,
    live: bool,
    interval: float = 0.5,
) -> dict[str, Any]:
    """Poll until the experiment has ended and its result is final (the last pod's final report
    counted); raises WaitTimeoutError after ``timeout`` seconds."""
    from services.client import TERMINAL

    deadline = time.monotonic() + timeout if timeout else None

    def ended(exp: dict[str, Any]) -> bool:
        return exp["state"] in TERMINAL and exp.get("result") is not None

    if live:
        from rich.live import Live

        exp = watch.poll()
        with Live(
            watch.render(exp), console=watch.console, refresh_per_second=4, transient=False
        ) as view:
            while not ended(exp):
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeoutError(exp["state"])
                time.sleep(interval)
                exp = watch.poll()
                view.update(watch.render(exp))
        return exp
    while True:
        exp = watch.poll()
        line = watch.line(exp)
        if line:
            watch.console.print(line)
        if ended(exp):
            return exp
        if deadline is not None and time.monotonic() > deadline:
            raise WaitTimeoutError(exp["state"])
        time.sleep(interval)


@app.command()
def up(
    data_dir: DataDirOpt = Path("data"),
    host: Annotated[str, typer.Option(help="Address both services bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Orchestrator port (busy: an ephemeral one).")] = 8000,
    leaderboard_port: Annotated[int, typer.Option(help="Leaderboard port.")] = 8001,
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
) -> None:
    """Run the whole platform here (embedded Redis, leaderboard, orchestrator) until Ctrl-C."""
    from services.platform import Platform, PlatformError

    console = _console()
    platform = Platform(
        data_dir=data_dir,
        host=host,
        orchestrator_port=port,
        leaderboard_port=leaderboard_port,
        token=token,
        open_api=no_token,
        strict_ports=strict_ports,
    )
    _interrupt_on_signals()
    try:
        platform.start()
    except PlatformError as exc:
        raise fail(str(exc), 3) from None
    try:
        o, lb = platform.orchestrator_url, platform.leaderboard_url
        console.print(f"[bold green]Podium is up[/] (data: {platform.data_dir})")
        console.print(f"  orchestrator  {o}   API docs {o}/api/v1/docs   metrics {o}/metrics")
        console.print(f"  leaderboard   {lb}   API docs {lb}/api/v1/docs   metrics {lb}/metrics")
        console.print(f"  token         {platform.token or '(none: the API is open)'}")
        console.print(
            "Commands run in this directory find it by themselves, e.g.\n"
            "  podium submit examples/cartpole.yaml --wait\n"
            "From elsewhere:\n"
            f"  export PODIUM_URL={o} PODIUM_LEADERBOARD_URL={lb}"
            + (f" PODIUM_TOKEN={platform.token}" if platform.token else "")
        )
        console.print("Ctrl-C stops it (pods make their final reports first).")
        while platform.healthy():
            time.sleep(0.5)
        console.print("[red]a service stopped unexpectedly; shutting down[/]")
        raise typer.Exit(3)
    except KeyboardInterrupt:
        console.print("stopping: pods finish their final reports, then the services stop …")
    finally:
        _shield_signals()
        platform.stop()
        console.print("stopped.")


@app.command()
def run(
    spec_file: Annotated[Path, typer.Argument(help="Experiment spec (YAML).", show_default=False)],
    out: Annotated[
        Path | None,
        typer.Option(help="Results: plots, leaderboard, best agent. Default: runs/<spec name>."),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="The platform's data (Redis, pod logs). Default: OUT/data."),
    ] = None,
    port: Annotated[int, typer.Option(help="Orchestrator port (busy: ephemeral).")] = 8000,
    leaderboard_port: Annotated[int, typer.Option(help="Leaderboard port.")] = 8001,
    timeout: Annotated[
        float | None, typer.Option(help="Cancel after this many seconds.", show_default=False)
    ] = None,
    top: Annotated[int, typer.Option(help="Rows of the final leaderboard.")] = 10,
    quiet: Annotated[bool, typer.Option(help="No live panel: a line per change.")] = False,
    verbose: Annotated[bool, typer.Option(help="Show the services' logs.")] = False,
) -> None:
    """Start the platform, run one experiment to its end with live progress, then print the
    leaderboard, save plots under OUT and export the best agent into OUT/best."""
    from services import logs
    from services.client import EXIT_NOT_REACHED, EXIT_TIMEOUT, TERMINAL, reached
    from services.platform import Platform, PlatformError
    from services.spec import SpecError, load_spec

    try:
        spec = load_spec(spec_file)
    except SpecError as exc:
        raise fail(str(exc)) from None
    out = out or Path("runs") / spec.name
    data_dir = data_dir or out / "data"
    console = _console()
    if not verbose:  # the live panel shows what matters; service logs would tear it
        logs.configure(level="ERROR")
    platform = Platform(
        data_dir=data_dir, orchestrator_port=port, leaderboard_port=leaderboard_port
    )
    _interrupt_on_signals()
    try:
        platform.start()
    except PlatformError as exc:
        raise fail(str(exc), 3) from None
    interrupted = timed_out = False
    collected: dict[str, Any] = {}
    try:
        client = _client(platform.orchestrator_url, platform.token, platform.leaderboard_url, None)
        with api_errors():
            # An earlier run killed outright leaves its experiment unfinished in DATA_DIR; it
            # would resume now and compete with this one for the machine.
            for stale in client.experiments():
                if stale["state"] not in TERMINAL:
                    cancel_quietly(client, stale["id"])
                    console.print(
                        f"cancelled unfinished experiment {stale['id']} of an earlier run"
                    )
            exp = client.submit(spec.model_dump(mode="json"))
        exp_id = exp["id"]
        console.print(
            f"submitted [bold]{spec.name}[/] as experiment {exp_id} "
            f"(orchestrator {platform.orchestrator_url}, API docs "
            f"{platform.orchestrator_url}/api/v1/docs)"
        )
        watch = Watch(client, exp_id, console, top=5)
        live = console.is_terminal and not quiet
        with api_errors():
            try:
                exp = wait_for_end(watch, timeout, live)
            except (KeyboardInterrupt, WaitTimeoutError) as exc:
                interrupted = isinstance(exc, KeyboardInterrupt)
                timed_out = not interrupted
                why = "interrupted" if interrupted else f"timeout ({timeout:g}s)"
                console.print(f"{why}: cancelling; pods make their final reports (Ctrl-C: skip)")
                cancel_quietly(client, exp_id)
                exp = wait_for_end(watch, None, live=False)
            collected = _collect(client, exp_id, exp, out, console)
    except KeyboardInterrupt:
        interrupted = True
        console.print("interrupted again: stopping the platform")
    finally:
        _shield_signals()
        platform.stop()
    if not collected:
        raise typer.Exit(130)
    exp = collected["experiment"]
    _write_plots(
        watch.samples,
        collected,
        out,
        spec.name,
        spec.target_reward,
        console,
        spec.evaluation.higher_is_better,
    )
    board = collected.get("board")
    if board and board.get("candidates"):
        console.print(board_table(board, top, title=f"final leaderboard of {spec.name}"))
    ok, why = reached(exp, None)
    console.print(f"results: {out}   pod logs: podium logs {exp_id} --data-dir {data_dir}")
    if interrupted:
        console.print(f"[magenta]interrupted[/]: {why}")
        raise typer.Exit(130)
    if timed_out:
        raise fail(f"timed out after {timeout:g}s: {why}", EXIT_TIMEOUT)
    if not ok:
        raise fail(why, EXIT_NOT_REACHED)
    console.print(f"[green]{why}[/]")


def _collect(
    client: PodiumClient, exp_id: str, exp: dict[str, Any], out: Path, console: Console
) -> dict[str, Any]:
    """Everything the run's results need, read while the platform is still up."""
    from services.client import ApiError

    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, Any] = {
        "experiment": exp,
        "board": None,
        "lineage": None,
        "submissions": None,
        "candidates": [],
    }
    (out / "experiment.json").write_text(json.dumps(exp, indent=2))
    try:
        got["board"] = client.board(exp_id)
        got["submissions"] = client.submissions(exp_id)
        got["lineage"] = client.lineage(exp_id)
        nodes = sorted(got["lineage"]["nodes"], key=lambda n: n.get("created_at", 0.0))
        # The newest few hundred, with their hyperparameters, for candidates.json.
        got["candidates"] = [client.candidate(exp_id, n["candidate_id"]) for n in nodes[-500:]]
    except ApiError as exc:
        console.print(f"[yellow]leaderboard not read[/]: {exc.message}")
    for name, file in (
        ("board", "leaderboard"),
        ("lineage", "lineage"),
        ("submissions", "submissions"),
        ("candidates", "candidates"),
    ):
        if got[name] is not None:
            (out / f"{file}.json").write_text(json.dumps(got[name], indent=2))
    if got["board"] and got["board"].get("candidates"):
        try:
            cand = client.export(exp_id, out / "best")
            console.print(
                f"best agent {cand['candidate_id']} (score {cand['score']:.4g}) exported to "
                f"{out / 'best'}"
            )
        except ApiError as exc:
            console.print(f"[yellow]best agent not exported[/]: {exc.message}")
    return got


def _write_plots(
    samples: list[dict[str, Any]],
    got: dict[str, Any],
    out: Path,
    name: str,
    target: float | None,
    console: Console,
    higher_is_better: bool = True,
) -> None:
    """best_score.png and candidates.png from the leaderboard's log of every report (the CLI's
    polls only when it could not be read: they miss what happens between two polls),
    lineage.png from the lineage."""
    from services import plots

    with (out / "progress.jsonl").open("w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    exp = got["experiment"]
    start = exp.get("created_at")
    submissions = got.get("submissions")
    if submissions is not None and start is not None:
        series = plots.best_so_far(submissions, start, higher_is_better, exp.get("finished_at"))
    else:
        series = plots.best_from_polls(samples)
    written = [plots.tournament_progress(series, out / "best_score.png", name, target)]
    written.append(plots.pod_curves(submissions or [], out / "candidates.png", name, target, start))
    if got.get("lineage") is not None:
        written.append(plots.lineage_tree(got["lineage"]["nodes"], out / "lineage.png", name))
    console.print("plots: " + "  ".join(str(p) for p in written))


@app.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(help="Experiment spec (YAML).", show_default=False)],
    wait: Annotated[bool, typer.Option(help="Follow the experiment until it ends.")] = False,
    min_reward: Annotated[
        float | None,
        typer.Option(
            help="CI gate (implies --wait): exit 0 only if the best score reached this.",
            show_default=False,
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(help="Give up waiting after this many seconds.", show_default=False),
    ] = None,
    cancel_on_timeout: Annotated[
        bool, typer.Option(help="Cancel the experiment when --timeout passes.")
    ] = True,
    quiet: Annotated[bool, typer.Option(help="No live panel: a line per change.")] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    leaderboard_url: LeaderboardUrlOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Submit an experiment; prints its id on stdout. With --wait, follow it to its end."""
    from services.client import EXIT_NOT_REACHED, EXIT_TIMEOUT, reached

    body = _read_spec(spec_file)
    console = _console()
    with api_errors(), _client(url, token, leaderboard_url, data_dir) as client:
        exp = client.submit(body)
        typer.echo(exp["id"])
        console.print(f"submitted {exp['name']} as experiment {exp['id']} ({exp['state']})")
        if not wait and min_reward is None:
            return
        watch = Watch(client, exp["id"], console, top=5 if leaderboard_url or not url else 0)
        try:
            exp = wait_for_end(watch, timeout, console.is_terminal and not quiet)
        except WaitTimeoutError as exc:
            msg = f"timed out after {timeout:g}s waiting for experiment {exp['id']} ({exc})"
            if cancel_on_timeout:
                cancel_quietly(client, exp["id"])
                msg += "; cancelled it"
            else:
                msg += f"; still running (podium cancel {exp['id']})"
            raise fail(msg, EXIT_TIMEOUT) from None
        except KeyboardInterrupt:
            console.print(f"stopped waiting; experiment {exp['id']} goes on (podium status)")
            raise typer.Exit(130) from None
    ok, why = reached(exp, min_reward)
    if not ok:
        raise fail(why, EXIT_NOT_REACHED)
    console.print(f"[green]{why}[/]")


@app.command()
def status(
    experiment: Annotated[
        str | None, typer.Argument(help="Experiment id (default: list them).", show_default=False)
    ] = None,
    state: Annotated[
        str | None, typer.Option(help="List only experiments in this state.", show_default=False)
    ] = None,
    events: Annotated[int, typer.Option(help="Recent events shown for one experiment.")] = 10,
    json_out: JsonOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """One experiment's state, progress, pods and recent events; or every experiment."""
    from rich.table import Table

    console = _stdout()
    with api_errors(), _client(url, token, None, data_dir) as client:
        if experiment is None:
            exps = client.experiments(state)
            if json_out:
                typer.echo(json.dumps(exps, indent=2))
                return
            table = Table(header_style="bold")
            for col in ("id", "name", "state", "best", "target", "pods", "env steps", "elapsed"):
                table.add_column(col)
            for e in exps:
                p = e["progress"]
                table.add_row(
                    e["id"],
                    e["name"],
                    f"[{STATE_STYLE.get(e['state'], '')}]{e['state']}[/]",
                    _fmt(e.get("best_score")),
                    _fmt(p.get("target_reward")),
                    str(sum(x["phase"] in ("Pending", "Running") for x in e["pods"])),
                    f"{p.get('env_steps') or 0:,}",
                    _duration(p.get("elapsed_s")),
                )
            console.print(table if exps else "no experiments")
            return
        exp = client.experiment(experiment)
        recent = client.events(experiment)[-events:] if events else []
        if json_out:
            typer.echo(json.dumps({**exp, "events": recent}, indent=2))
            return
        watch = Watch(client, experiment, console, top=0)
        console.print(watch.render(exp))
        if exp.get("last_failure"):
            lf = exp["last_failure"]
            console.print(f"[red]last failure[/] pod {lf.get('pod_id')}: {lf.get('reason')}")
            if lf.get("log_tail"):
                console.print(lf["log_tail"], markup=False)
        for ev in recent:
            stamp = time.strftime("%H:%M:%S", time.localtime(ev["ts"]))
            pod = f" [{ev['pod_id']}]" if ev.get("pod_id") else ""
            console.print(f"{stamp} {ev['type']}{pod}: {ev['message']}", markup=False)


def _stdout() -> Console:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 160)
    return console


@app.command()
def leaderboard(
    experiment: Annotated[str, typer.Argument(help="Experiment id.", show_default=False)],
    top: Annotated[int, typer.Option(help="Rows (default: the whole board, K).")] = 0,
    json_out: JsonOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    leaderboard_url: LeaderboardUrlOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """The experiment's leaderboard: best first, with score, algorithm, lineage, pod."""
    with api_errors(), _client(url, token, leaderboard_url, data_dir) as client:
        board = client.board(experiment, limit=top or None)
    if json_out:
        typer.echo(json.dumps(board, indent=2))
        return
    console = _stdout()
    if not board.get("candidates"):
        console.print(f"the leaderboard of {experiment} is empty")
        return
    stats = board["stats"]
    console.print(
        board_table(board, len(board["candidates"]), title=f"leaderboard of {experiment}")
    )
    console.print(
        f"{stats['size']}/{stats['top_k']} candidates, score mean {_fmt(stats['score_mean'])} "
        f"± {_fmt(stats['score_std'])}, algorithms {stats['algorithms']}"
    )


@app.command()
def cancel(
    experiment: Annotated[str, typer.Argument(help="Experiment id.", show_default=False)],
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Cancel an experiment: its pods make their final reports and stop."""
    with api_errors(), _client(url, token, None, data_dir) as client:
        exp = client.cancel(experiment)
    from services.client import TERMINAL

    if exp["state"] in TERMINAL:
        _console().print(f"experiment {experiment}: {exp['state']} ({exp.get('reason')})")
    else:
        _console().print(
            f"experiment {experiment}: cancel requested; its pods make their final reports and "
            f"stop (podium status {experiment})"
        )


@app.command()
def logs(
    experiment: Annotated[str, typer.Argument(help="Experiment id.", show_default=False)],
    pod: Annotated[
        str | None, typer.Argument(help="Pod id (default: every pod).", show_default=False)
    ] = None,
    tail: Annotated[int, typer.Option(help="Lines per pod.")] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines (local files).")
    ] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = Path("data"),
) -> None:
    """Pod logs: the embedded platform's files under DATA_DIR, else the orchestrator's API."""
    from collections import deque

    pods_dir = data_dir / "experiments" / experiment / "pods"
    files = (
        sorted(pods_dir.glob("*.log"), key=lambda p: p.stat().st_mtime) if pods_dir.is_dir() else []
    )
    if not files:
        if follow:
            raise fail(f"--follow reads local pod logs and there are none under {pods_dir}")
        with api_errors(), _client(url, token, None, data_dir) as client:
            if pod is not None:
                pods = [pod]
            else:
                pods = [p["pod_id"] for p in client.experiment(experiment)["pods"]]
            if not pods:
                raise fail(f"experiment {experiment} has no pods now", 1)
            for pod_id in pods:
                if len(pods) > 1:
                    typer.secho(f"==> pod {pod_id} <==", bold=True)
                typer.echo(client.pod_logs(experiment, pod_id, tail), nl=False)
        return
    if pod is not None:
        files = [f for f in files if f.stem == pod]
        if not files:
            raise fail(f"no log of pod {pod!r} in {pods_dir}", 1)
    positions: dict[Path, int] = {}
    for path in files:
        with open(path, errors="replace") as f:
            lines = deque(f, maxlen=tail)
            positions[path] = f.tell()
        if len(files) > 1:
            typer.secho(f"==> pod {path.stem} <==", bold=True)
        typer.echo("".join(lines), nl=False)
    if not follow:
        return
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


@app.command()
def export(
    experiment: Annotated[str, typer.Argument(help="Experiment id.", show_default=False)],
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
    out = out or Path("runs") / experiment / "best"
    with api_errors(), _client(url, token, leaderboard_url, data_dir) as client:
        cand = client.export(experiment, out, candidate)
    _console().print(
        f"candidate {cand['candidate_id']} (score {cand['score']:.4g}, {cand['algorithm']}, "
        f"generation {cand['generation']}): {len(cand['files'])} files verified into {out}"
    )


if __name__ == "__main__":
    app()
