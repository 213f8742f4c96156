"""``podium backtest``: a trading agent's training files run over the held-out period of its
market, beside buy-and-hold and equal weight, with the five metrics FinRL reports and a plot
of the account values. The files are verified and read as safetensors and JSON only."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import typer

from services.cli.errors import CliError

#: The metrics (services/pod/trading/backtest.py) and their column headers.
KEYS = {
    "cumulative_return": "return",
    "annual_return": "annual",
    "annual_volatility": "volatility",
    "max_drawdown": "max drawdown",
    "sharpe": "Sharpe",
}


def backtest(directory: Path, period: str, plot: Path | None, as_json: bool) -> None:
    from pydantic import ValidationError
    from rich.console import Console
    from rich.table import Table

    from services.contracts.algorithms.hyperparameters import HyperparameterError
    from services.contracts.spec import describe_errors
    from services.contracts.training_files import CheckpointError
    from services.pod.trading.backtest import backtest_candidate, metrics

    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        raise CliError(f"{directory}: {what} (an agent's training files)")
    if plot is not None and plot.suffix.lower() != ".png":
        raise CliError(f"--plot {plot}: a .png file")
    try:
        result = backtest_candidate(directory, period)  # type: ignore[arg-type]
    except ValidationError as exc:
        fields = "; ".join(line.strip() for line in describe_errors(exc))
        raise CliError(f"{directory}/hyperparameters.json: {fields}") from None
    # LookupError: an env or algorithm this installation does not register; TypeError: env
    # arguments the env does not take (files from another version).
    except (CheckpointError, HyperparameterError, ValueError, LookupError, TypeError) as exc:
        raise CliError(str(exc).splitlines()[0]) from None
    # A Sharpe ratio is undefined (NaN) for an account that never moves (all cash).
    report = {
        name: {k: v if math.isfinite(v) else None for k, v in asdict(metrics(values)).items()}
        for name, values in result.values.items()
    }
    if plot is not None:
        from services.cli.plots import account_values

        try:
            account_values(result.dates, result.values, plot, f"{period} period")
        except OSError as exc:
            raise CliError(f"--plot {plot}: {exc.strerror or exc}") from None
    first, last = str(result.dates[0]), str(result.dates[-1])
    if as_json:
        out = {"period": period, "first_day": first, "last_day": last, "metrics": report}
        typer.echo(json.dumps(out, indent=2, allow_nan=False))
        return
    table = Table(title=f"{period} period {first} .. {last}")
    table.add_column("strategy", no_wrap=True)
    for header in KEYS.values():
        table.add_column(header, justify="right", no_wrap=True)
    for name, row in report.items():
        cells = [
            "n/a" if row[k] is None else f"{row[k]:.2f}" if k == "sharpe" else f"{row[k]:.1%}"
            for k in KEYS
        ]
        table.add_row(name, *cells)
    console = Console()
    console.print(table)
    if plot is not None:
        console.print(f"plot: {plot}")
