"""The ``podium`` command line.

Subcommands import their heavy dependencies (torch, the services) only when they run, so
``podium --help`` is instant and the control-plane commands never load torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

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
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  {where}: {err['msg']}")
    return "invalid configuration:\n" + "\n".join(lines)


@app.callback()
def _main() -> None:
    from services import logs

    logs.configure()


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
    from services.overrides import ConfigError, layered
    from services.registry import UnknownNameError

    try:
        from services.pod.train import TrainConfig, preset

        cfg = TrainConfig.model_validate(layered(preset(env), config, set_ or []))
    except ConfigError as exc:
        raise fail(str(exc)) from None
    except ValidationError as exc:
        raise fail(describe_validation(exc)) from None
    if cfg.env != env:
        raise fail(f"the config names env {cfg.env!r} but the command names {env!r}")

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from services.plots import learning_curve
    from services.pod.train import build
    from services.pod.train import train as run_training

    try:
        roles = build(cfg)
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
            result = run_training(cfg, out_dir=out, on_progress=on_progress, roles=roles)
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


if __name__ == "__main__":
    app()
