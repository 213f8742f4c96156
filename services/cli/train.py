"""``podium train``: one agent on this machine, with a progress bar, checkpoints and a
learning-curve PNG. The config is layered: the env's preset ← ``--config`` ← each ``--set``."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from services.cli.errors import CliError


def describe_validation(exc: ValidationError) -> str:
    from services.contracts.spec import describe_errors

    return "invalid configuration:\n" + "\n".join(describe_errors(exc))


def train(env: str, config: Path | None, sets: list[str], out: Path, quiet: bool) -> None:
    from services.cli.overrides import ConfigError, deep_merge, load_yaml, parse_set
    from services.pod.algorithms.offpolicy_config import OFF_POLICY_ALGORITHMS
    from services.registry import UnknownNameError

    try:
        # PPO trains on-policy (services/pod/train.py); sac, td3, ddpg and dqn through the
        # off-policy loop (services/pod/offpolicy.py). The user's layers (YAML, then each --set)
        # are read once and merged in order over the algorithm's preset.
        layers = [load_yaml(config)] if config is not None else []
        layers += [parse_set(assignment) for assignment in sets]

        def merged(defaults: dict[str, Any]) -> dict[str, Any]:
            return functools.reduce(deep_merge, layers, defaults)

        algorithm = merged({"algorithm": "ppo"}).get("algorithm")
        if algorithm in OFF_POLICY_ALGORITHMS:
            from services.pod import offpolicy

            cfg = offpolicy.OffPolicyConfig.model_validate(merged(offpolicy.preset(algorithm, env)))
            build, run_training = offpolicy.build, offpolicy.train_offpolicy
        else:
            from services.pod import train as onpolicy

            cfg = onpolicy.TrainConfig.model_validate(merged(onpolicy.preset(env)))
            build, run_training = onpolicy.build, onpolicy.train
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    except ValidationError as exc:
        raise CliError(describe_validation(exc)) from None
    if cfg.env != env:
        raise CliError(f"the config names env {cfg.env!r} but the command names {env!r}")

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from services.cli.plots import learning_curve

    try:
        roles = build(cfg)
    except (UnknownNameError, TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None

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
