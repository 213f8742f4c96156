"""Plots users look at: learning curves now, tournament plots later. matplotlib, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: pods and CI have no display
import matplotlib.pyplot as plt


def learning_curve(
    history: Sequence[dict[str, float]],
    path: Path,
    title: str = "",
    target: float | None = None,
) -> Path:
    """Evaluation return (mean ± std) and training episode return against env steps."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    train = [(h["env_steps"], h["train_return"]) for h in history if "train_return" in h]
    if train:
        ax.plot(*zip(*train, strict=True), color="0.65", lw=1, label="training episodes")
    evals = [h for h in history if "eval_return" in h]
    if evals:
        xs = [h["env_steps"] for h in evals]
        ys = [h["eval_return"] for h in evals]
        sd = [h.get("eval_std", 0.0) for h in evals]
        ax.plot(xs, ys, "o-", color="tab:blue", lw=2, ms=3, label="evaluation (deterministic)")
        ax.fill_between(
            xs,
            [y - s for y, s in zip(ys, sd, strict=True)],
            [y + s for y, s in zip(ys, sd, strict=True)],
            color="tab:blue",
            alpha=0.15,
        )
    if target is not None:
        ax.axhline(target, color="tab:green", ls="--", lw=1, label=f"target {target:g}")
    ax.set_xlabel("env steps")
    ax.set_ylabel("episode return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
