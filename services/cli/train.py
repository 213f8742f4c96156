"""``podium train``: one agent on this machine, with a progress bar, checkpoints and a
learning-curve PNG. The config is layered: the env's preset ← ``--config`` ← each ``--set``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from services.cli.errors import CliError
from services.cli.outputs import output_dir
from services.contracts.algorithms.card import CardError, card_names, layered_algorithm


def describe_validation(exc: ValidationError, fields: dict[str, set[str]] | None = None) -> str:
    """The errors, one a line; with ``fields`` (where each setting of the run's config is: ""
    for the top level, else its section), a setting given in the wrong place says where it
    is, e.g. ``sac.compile``: ``compile`` is the off-policy loop's, a top-level setting."""
    from services.contracts.spec import describe_errors

    lines = describe_errors(exc)
    for err in exc.errors() if fields else ():
        if err["type"] == "extra_forbidden" and len(err["loc"]) <= 2:
            *given, name = map(str, err["loc"])
            homes = [s for s, names in fields.items() if name in names and [s] != given]
            lines += [f"  ({name} is set as {f'{s}.{name}' if s else name})" for s in homes]
    return "invalid configuration:\n" + "\n".join(lines)


def config_fields(config_class: type[BaseModel], algorithm: str) -> dict[str, set[str]]:
    """Where a run of ``algorithm`` takes its settings: the config's top-level names (""), and
    the algorithm's section's."""
    fields = {"": set(config_class.model_fields) - set(card_names())}
    section = getattr(config_class.model_fields.get(algorithm), "annotation", None)
    if isinstance(section, type) and issubclass(section, BaseModel):
        fields[algorithm] = set(section.model_fields)
    return fields


def other_algorithms(layers: list[dict[str, Any]], algorithm: str) -> list[str]:
    """Sections the user set for an algorithm this run does not train (the off-policy config
    has one for each: they would be ignored): one line each, for the error."""
    sections = {name for layer in layers for name in layer if name != algorithm}
    return [
        f"  {name}: this run trains {algorithm} (`algorithm`): {name}'s settings would not apply"
        for name in sorted(sections & set(card_names()))
    ]


def preload_malloc() -> None:
    """Train with a faster malloc (services/malloc.py: tcmalloc, else jemalloc, where this
    machine has one; ``PODIUM_POD_MALLOC`` as for the platform's pods, default ``auto``). A
    process gets its allocator when it starts, and this command trains in its own process: so
    it starts its command line anew with the library preloaded (the same pid, once).

    Only when this process is the command (``podium train ...``, ``python -m services.cli
    train ...``): the app invoked in another program's process (a test runner's) must not
    re-execute that program."""
    from services.malloc import AllocatorError, reexec_with_allocator

    args = sys.argv[1:]
    if args[:1] != ["train"] or sys.orig_argv[len(sys.orig_argv) - len(args) :] != args:
        return
    try:
        reexec_with_allocator()
    except AllocatorError as exc:
        raise CliError(str(exc)) from None


def allocator_line() -> str:
    """The allocator this run trains with (it sets the speed of the compiled and off-policy
    updates), and where ``auto`` found none on this machine, how to get one (one it found and
    the dynamic linker refused is named by the running allocator alone)."""
    from services.malloc import AUTO, NONE_FOUND, SYSTEM, find_allocator, running_allocator, setting

    name = running_allocator().name
    if name == SYSTEM and setting() == AUTO and find_allocator() is None:
        return f"malloc: system ({NONE_FOUND})"
    return f"malloc: {name}"


def train(env: str, config: Path | None, sets: list[str], out: Path, quiet: bool) -> None:
    from services.cli.overrides import ConfigError, load_yaml, parse_set
    from services.contracts.algorithms.hyperparameters import HyperparameterError
    from services.contracts.envs import EnvCardError, argument_problem, unreachable_target
    from services.contracts.spec import check_env_name
    from services.registry import PluginError, UnknownNameError

    try:  # before torch is imported (seconds): a misspelt name is answered at once
        check_env_name(env)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        # The user's layers (YAML, then each --set) are read once and merged in order over the
        # preset of the algorithm they name (services/pod/training/presets.py); the algorithm's
        # trainer is a registry lookup (services/pod/training/trainer.py).
        from services.pod.training.presets import train_config

        layers = [load_yaml(config)] if config is not None else []
        layers += [parse_set(assignment) for assignment in sets]
        cfg = train_config(env, layers)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    except ValidationError as exc:
        from services.pod.training.trainer import trainer_class

        algorithm = layered_algorithm(layers)
        fields = config_fields(trainer_class(algorithm).config_class, algorithm)
        wrong = other_algorithms(layers, algorithm)
        raise CliError("\n".join([describe_validation(exc, fields), *wrong])) from None
    except (UnknownNameError, HyperparameterError, PluginError, CardError, EnvCardError) as exc:
        raise CliError(str(exc)) from None
    from services.pod import mkl_dispatch  # imported with the package above, before torch

    if error := mkl_dispatch.setting_error():
        raise CliError(error)
    if cfg.env != env:
        raise CliError(f"the config names env {cfg.env!r} but the command names {env!r}")
    for field in ("env_kwargs", "eval_env_kwargs"):  # as a spec's are checked
        if problem := argument_problem(cfg.env, field, getattr(cfg, field)):
            raise CliError(problem)
    if why := unreachable_target(cfg.env, cfg.target_return):
        raise CliError(f"target_return {why}; target_return=null trains the whole budget")
    if wrong := other_algorithms(layers, cfg.algorithm):
        raise CliError("invalid configuration:\n" + "\n".join(wrong))
    output_dir(out, "--out")

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from services.cli.plots import learning_curve
    from services.pod.training.fit import build
    from services.pod.training.fit import train as run_training
    from services.pod.training.tensorboard import Board

    try:
        trainer = build(cfg)
    except (UnknownNameError, TypeError, ValueError, ImportError) as exc:  # ImportError: an extra
        raise CliError(str(exc)) from None

    console = Console(stderr=True)
    said: list[str] = []

    def say_trainer() -> None:
        """What trains and what runs compiled (the CLI shows no logs, and that is what sets
        its speed): once, and again when ``compile: auto`` has decided."""
        if quiet or (said and said[-1] == trainer.compiled):
            return
        said.append(trainer.compiled)
        line = f"trainer: {type(trainer).__name__}, {trainer.compiled}"
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    if not quiet:
        console.print(allocator_line(), markup=False, highlight=False, soft_wrap=True)
    say_trainer()
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    # Line-buffered and flushed per record: the run can be followed while it trains
    # (`tail -f`), and a killed run keeps every record written so far.
    metrics = (out / "metrics.jsonl").open("w", buffering=1)
    # The same records as TensorBoard curves (`tensorboard --logdir <out>/tensorboard`); a
    # rerun into the same --out replaces them, as it does metrics.jsonl.
    board = Board(out / "tensorboard", replace=True)
    board.hyperparameters(cfg.model_dump(mode="json"))
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
        say_trainer()
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        board.record(record)
        if "eval_return" in record:
            latest_eval["value"] = f"{record['eval_return']:.1f}"
        rate = record["env_steps"] / max(record["train_seconds"], 1e-9)
        progress.update(task, completed=record["env_steps"], rate=rate, eval=latest_eval["value"])

    with progress:
        task = progress.add_task(env, total=cfg.total_env_steps, rate=0.0, eval="–")
        try:
            result = run_training(cfg, out_dir=out, on_progress=on_progress, trainer=trainer)
        except HyperparameterError as exc:  # compile: on refused at the first compile
            raise CliError(str(exc)) from None
        finally:
            metrics.close()
            board.close()
    # A trading env's evaluation may score episodes by their Sharpe ratio, not their return.
    score = {**cfg.env_kwargs, **cfg.eval_env_kwargs}.get("score", "return")
    measure = "eval return" if score == "return" else f"eval {score}"
    png = learning_curve(
        result.history, out / "learning_curve.png", env, cfg.target_return, measure
    )
    best = result.best.mean if result.best else float("nan")
    shown = f"{best:.1f}" if score == "return" else f"{best:.3f}"
    steps = result.history[-1]["env_steps"] if result.history else 0
    if result.solved_at_env_steps is not None:
        console.print(
            f"[green]solved[/green] {env}: {measure} {shown} >= {cfg.target_return:g} "
            f"after {result.solved_at_env_steps:,} env steps, {result.train_seconds:.1f} s training"
        )
    else:
        console.print(f"{env}: best {measure} {shown} after {steps:,} env steps")
    console.print(f"checkpoints: {out / 'checkpoints'}   learning curve: {png}")
