"""``podium train``'s loop: train one agent until its budget is spent or it is solved.

Read it top to bottom: step the trainer (services/pod/training/trainer.py; a rollout and its update,
or one vector step), every ``eval_every_steps`` env steps evaluate (the clock stops meanwhile) and
save the training files as ``latest`` and, when best so far, ``best``; stop once the evaluation
reaches ``target_return``. One loop for every algorithm: which trainer trains the config's algorithm
is a registry lookup. A trainer with learner replicas (PPO's ``learners: N``) runs N of these loops
in a process group (services/pod/training/fusion.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.pod.roles.evaluator import EvalResult
from services.pod.training.fusion import agree, run_group
from services.pod.training.trainer import RunConfig, Trainer, build_trainer, trainer_class

Callback = Callable[[dict[str, float]], None]


@dataclass
class TrainResult:
    """What a training run gives back."""

    config: RunConfig
    history: list[dict[str, float]] = field(default_factory=list)
    best: EvalResult | None = None
    solved_at_env_steps: int | None = None
    train_seconds: float = 0.0  # wall time excluding evaluation


def build(config: RunConfig) -> Trainer:
    """The trainer for ``config`` (and so its validation: an unknown algorithm, an action
    space the algorithm does not take)."""
    if config.torch_threads:  # small nets on many threads crawl
        torch.set_num_threads(config.torch_threads)
    return build_trainer([config])


def train(
    config: RunConfig,
    out_dir: Path | None = None,
    on_progress: Callback | None = None,
    trainer: Trainer | None = None,
) -> TrainResult:
    """Train until the budget is spent or the evaluation reaches ``target_return``. ``trainer``
    (built from ``config``) lets a caller build it first (and so validate, or resume from loaded
    training files: the run goes on from its ``env_steps``). With learner replicas this returns
    rank 0's result (rank 0 runs here, so ``on_progress`` reports)."""
    world = trainer_class(config.algorithm).replicas(config)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    if world > 1:
        return run_group(
            _replica, world, args=(config, out_dir, None), rank0_args=(config, out_dir, on_progress)
        )
    return fit(config, trainer or build(config), out_dir, on_progress)


def _replica(
    rank: int, world: int, config: RunConfig, out_dir: Path | None, on_progress: Callback | None
) -> TrainResult:
    """One learner replica: its own envs and seed, the group's weights after every epoch;
    rank 0 evaluates, saves, reports, and decides when to stop."""
    trainer = build(config.model_copy(update={"seed": config.seed + 1000 * rank}))
    trainer.join_group(world)
    lead = rank == 0
    return fit(config, trainer, out_dir if lead else None, on_progress, lead=lead, world=world)


def fit(
    config: RunConfig,
    trainer: Trainer,
    out_dir: Path | None = None,
    on_progress: Callback | None = None,
    lead: bool = True,
    world: int = 1,
) -> TrainResult:
    """The loop (see the module's docstring). ``lead``: this replica evaluates; with
    ``world`` > 1 the replicas agree on when to stop."""
    result = TrainResult(config=config)
    every = config.eval_every_steps
    next_eval = (trainer.env_steps // every + 1) * every
    clock = 0.0
    while trainer.env_steps < config.total_env_steps:
        start = time.perf_counter()
        trainer.step()
        clock += time.perf_counter() - start

        last = trainer.env_steps >= config.total_env_steps
        evaluate = lead and (trainer.env_steps >= next_eval or last)
        if trainer.one_update_per_step or evaluate:
            # A device may still be running the steps it was given (they return once
            # launched): the clock counts until they are done, not only their launches.
            start = time.perf_counter()
            trainer.wait()
            clock += time.perf_counter() - start
            record: dict[str, float] = {
                "env_steps": trainer.env_steps,
                "updates": trainer.updates,
                "train_seconds": clock,
                **trainer.progress(),
            }
            if evaluate:
                next_eval += every
                [evaluation] = trainer.evaluate()
                record["eval_return"] = evaluation.mean
                record["eval_std"] = evaluation.std
                improved = result.best is None or evaluation.mean > result.best.mean
                result.best = evaluation if improved else result.best
                if out_dir is not None:
                    trainer.save(0, out_dir / "checkpoints" / "latest")
                    if improved:
                        trainer.save(0, out_dir / "checkpoints" / "best")
                target = config.target_return
                if target is not None and evaluation.mean >= target:
                    result.solved_at_env_steps = result.solved_at_env_steps or trainer.env_steps
            result.history.append(record)
            if on_progress is not None:
                on_progress(record)
        stop = result.solved_at_env_steps is not None
        if world > 1:
            stop = agree(stop)  # replicas must leave the loop together
        if stop:
            break
    result.train_seconds = clock
    return result
