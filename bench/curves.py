"""Learning curves for the benches' PNGs: per arm, the median over repetitions and the
quartiles around it."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_curves(
    path: Path,
    arms: Mapping[str, tuple[Sequence[float], Sequence[Sequence[float]]]],
    target: float,
    title: str,
    xlabel: str,
    ylabel: str,
) -> None:
    """``arms``: arm -> (x values, the repetitions' values at each x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, (xs, values) in arms.items():
        quartiles = [
            statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
            for v in values
        ]
        runs = max((len(v) for v in values), default=0)
        ax.plot(xs, [statistics.median(v) for v in values], label=f"{arm} (median of {runs})")
        ax.fill_between(xs, [q[0] for q in quartiles], [q[2] for q in quartiles], alpha=0.15)
    ax.axhline(target, color="grey", linestyle="--", label="target")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
