"""``podium backtest``: a trading agent's training files run over the held-out period of its
market, beside buy-and-hold and equal weight, with the five metrics FinRL reports and a plot
of the account values. The files are verified and read as safetensors and JSON only."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from services.cli.errors import CliError

#: The metrics (services/pod/backtest.py) and their column headers.
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

    from services.contracts.training_files import CheckpointError
    from services.pod.algorithms.hyperparameters import HyperparameterError
    from services.pod.backtest import backtest_candidate, metrics

    if not directory.is_dir():
        raise CliError(f"{directory}: no such directory (an agent's training files)")
    try:
        result = backtest_candidate(directory, period)
    except (CheckpointError, HyperparameterError, ValidationError, ValueError) as exc:
        raise CliError(str(exc).splitlines()[0]) from None
    report = {name: metrics(values).as_dict() for name, values in result.values.items()}
    if plot is not None:
        from services.cli.plots import account_values

        account_values(result.dates, result.values, plot, f"{period} period")
    if as_json:
        typer.echo(json.dumps({"period": period, "metrics": report}, indent=2))
        return
    first, last = str(result.dates[0]), str(result.dates[-1])
    table = Table(title=f"{period} period {first} .. {last}")
    table.add_column("strategy", no_wrap=True)
    for header in KEYS.values():
        table.add_column(header, justify="right", no_wrap=True)
    for name, row in report.items():
        cells = [f"{row[k]:.2f}" if k == "sharpe" else f"{row[k]:.1%}" for k in KEYS]
        table.add_row(name, *cells)
    console = Console()
    console.print(table)
    if plot is not None:
        console.print(f"plot: {plot}")
