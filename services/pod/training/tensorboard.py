"""TensorBoard event files for a training run: its curves against env steps and its
hyperparameters, written by torch's ``SummaryWriter`` (the ``tensorboard`` package, in the
``pod`` extra) through one ``Board`` for both users: ``podium train`` (services/cli/train.py,
through fit's records) and the pod's round loop (services/pod/runtime/rounds.py).

Tags: ``eval/return`` (and ``eval/return_std``), ``train/return``, ``losses/<name>`` (every
statistic of the trainer's record whose name holds "loss"), ``train/<name>`` (its other
statistics: entropy, KL, updates...), ``perf/env_steps_per_s``; the hyperparameters as a text
table (``hyperparameters``) and for the HParams dashboard.

A board never stops training: when the writer cannot be made or fails (no ``tensorboard``
package, a full or read-only disk), it logs once and drops every later call."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from services.logs import get_logger

log = get_logger(__name__)

#: Record keys that are not curves: the x axis and the clocks (the rate is derived from them).
NOT_CURVES = frozenset({"env_steps", "train_seconds"})
#: Record keys with tags of their own.
TAGS = {
    "eval_return": "eval/return",
    "eval_std": "eval/return_std",
    "train_return": "train/return",
}
#: The metric the HParams dashboard shows beside each run's hyperparameters.
HPARAM_METRIC = "eval/return"


def tag(name: str) -> str | None:
    """The TensorBoard tag of a record key (None: not a curve)."""
    if name in NOT_CURVES:
        return None
    if name in TAGS:
        return TAGS[name]
    return f"losses/{name}" if "loss" in name else f"train/{name}"


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as ``a.b`` names (a run config's algorithm section, say)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def hparam_value(value: Any) -> bool | int | float | str:
    """What the HParams dashboard takes: numbers, booleans and strings (the rest as text)."""
    return value if isinstance(value, bool | int | float | str) else str(value)


class Board:
    """One run's event files in ``log_dir`` (None: a board that writes nothing).
    ``min_interval_s``: training records (those without an evaluation) closer together than
    this are not written one by one, so that a trainer that reports every vector step (the
    off-policy ones) does not spend its time serialising summaries; the latest value of each of
    their curves is written with the next record written (or at ``flush``), so a statistic that
    only some records hold (``train/return``: only those where episodes ended) is never lost.
    Evaluations are always written."""

    def __init__(
        self, log_dir: Path | None, min_interval_s: float = 0.5, replace: bool = False
    ) -> None:
        self.log_dir = log_dir
        self.replace = replace  # remove an earlier run's event files there when first writing
        self.min_interval_s = min_interval_s
        self._writer: Any = None  # torch.utils.tensorboard.SummaryWriter, made on first use
        self._dead = log_dir is None
        self._last_write = -math.inf
        self._rate_from: tuple[float, float] | None = None  # (env steps, train seconds)
        self._hparams_written = False
        #: The latest value of each curve of the records not written yet, and their step.
        self._held: dict[str, float] = {}
        self._held_step = 0

    @property
    def enabled(self) -> bool:
        return not self._dead

    # -- failure-proofing --------------------------------------------------------------------
    def _call(self, what: Callable[[Any], None]) -> None:
        """Run ``what(writer)``; the first failure is logged and turns the board off."""
        if self._dead:
            return
        try:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                if self.replace and self.log_dir is not None and self.log_dir.is_dir():
                    # An earlier run's files here would merge with this run's into one zigzag curve.
                    for old in self.log_dir.glob("events.out.tfevents.*"):
                        old.unlink()
                # Flushed every few seconds: a run is watched while it trains.
                self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)
            what(self._writer)
        except Exception as exc:  # a writer must never stop training
            self._dead = True
            log.warning(
                "tensorboard writer failed; training goes on without it",
                dir=str(self.log_dir),
                error=f"{type(exc).__name__}: {exc}",
            )
            writer, self._writer = self._writer, None
            if writer is not None:
                with contextlib.suppress(Exception):  # already reported once above
                    writer.close()

    # -- writing -----------------------------------------------------------------------------
    def record(self, record: Mapping[str, float], step: int | None = None) -> None:
        """A training record (fit's: ``env_steps``, ``train_seconds``, the trainer's statistics,
        ``eval_return`` after an evaluation) at ``step`` (default: its ``env_steps``)."""
        if self._dead:
            return
        evaluated = "eval_return" in record
        now = time.monotonic()
        x = int(record["env_steps"] if step is None else step)
        scalars = {t: float(v) for k, v in record.items() if (t := tag(k)) is not None}
        if not evaluated and now - self._last_write < self.min_interval_s:
            self._held.update(scalars)
            self._held_step = x
            return
        self._last_write = now
        scalars = {**self._held, **scalars}
        self._held.clear()
        if "env_steps" in record and "train_seconds" in record:
            steps, seconds = float(record["env_steps"]), float(record["train_seconds"])
            if self._rate_from is not None:
                # Since the last written record: shows slow-downs a running average would hide.
                d_steps, d_seconds = steps - self._rate_from[0], seconds - self._rate_from[1]
                if d_steps > 0 and d_seconds > 0:
                    scalars["perf/env_steps_per_s"] = d_steps / d_seconds
            elif steps > 0 and seconds > 0:
                scalars["perf/env_steps_per_s"] = steps / seconds
            self._rate_from = (steps, seconds)
        self.scalars(scalars, x)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Scalars by tag at ``step``."""

        def write(writer: Any) -> None:
            for name, value in values.items():
                writer.add_scalar(name, float(value), global_step=int(step))

        self._call(write)

    def hyperparameters(self, values: Mapping[str, Any], step: int = 0) -> None:
        """The run's hyperparameters: a text table at ``step`` (PBT changes them: each change is
        a new step of the table), and, the first time, the HParams dashboard's entry for this
        run (with ``eval/return`` as its metric)."""
        flat = {k: hparam_value(v) for k, v in flatten(values).items()}
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(flat.items()))
        table = "| name | value |\n| --- | --- |\n" + rows

        def write(writer: Any) -> None:
            writer.add_text("hyperparameters", table, global_step=int(step))
            if not self._hparams_written:
                from torch.utils.tensorboard.summary import hparams

                # In this run's own directory: SummaryWriter.add_hparams would start another.
                experiment, start, end = hparams(flat, {HPARAM_METRIC: math.nan})
                file_writer = writer._get_file_writer()
                for summary in (experiment, start, end):
                    file_writer.add_summary(summary)
                self._hparams_written = True

        self._call(write)

    def _write_held(self) -> None:
        if self._held and not self._dead:
            held, self._held = self._held, {}
            self.scalars(held, self._held_step)

    def flush(self) -> None:
        self._write_held()
        if self._writer is not None:
            self._call(lambda writer: writer.flush())

    def close(self) -> None:
        self._write_held()
        if self._writer is not None:
            self._call(lambda writer: writer.close())
        self._writer = None
        self._dead = True
