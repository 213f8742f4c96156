"""Plots users look at: one agent's learning curve, and a tournament's progress, candidates and
lineage. matplotlib (headless), no torch; inputs are plain dicts as the APIs return them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def tournament_progress(
    samples: Sequence[Mapping[str, Any]],
    path: Path,
    title: str = "",
    target: float | None = None,
) -> Path:
    """The best score on the leaderboard against wall time and against env steps.

    ``samples``: ``{"t": seconds since submission, "env_steps": int | None, "best": float |
    None}`` as the CLI polls them; samples without a best score yet are skipped.
    """
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4), dpi=110, sharey=True)
    with_best = [s for s in samples if s.get("best") is not None]
    xs = [s["t"] for s in with_best]
    ys = [s["best"] for s in with_best]
    ax_t.step(xs, ys, where="post", color="tab:blue", lw=2)
    by_steps = [(s["env_steps"], s["best"]) for s in with_best if s.get("env_steps") is not None]
    if by_steps:
        ax_s.step(*zip(*by_steps, strict=True), where="post", color="tab:blue", lw=2)
    for ax, label in ((ax_t, "wall time (s)"), (ax_s, "env steps (all pods)")):
        if target is not None:
            ax.axhline(target, color="tab:green", ls="--", lw=1, label=f"target {target:g}")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    ax_t.set_ylabel("best score")
    fig.suptitle(title)
    return _save(fig, path)


def candidate_curves(
    candidates: Sequence[Mapping[str, Any]],
    path: Path,
    title: str = "",
    target: float | None = None,
    start: float | None = None,
) -> Path:
    """Each pod's curve: the scores of the agents it put on the leaderboard, over wall time.

    ``candidates``: leaderboard candidates (``pod_id``, ``score``, ``created_at``); ``start``
    (epoch seconds) is time zero, the first candidate's time by default.
    """
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    if candidates:
        t0 = start if start is not None else min(c["created_at"] for c in candidates)
        pods: dict[str, list[tuple[float, float]]] = {}
        for c in sorted(candidates, key=lambda c: c["created_at"]):
            pods.setdefault(str(c["pod_id"]), []).append((c["created_at"] - t0, c["score"]))
        cmap = plt.get_cmap("tab20")
        for i, (pod, points) in enumerate(pods.items()):
            ax.plot(
                *zip(*points, strict=True),
                "o-",
                ms=3,
                lw=1.2,
                color=cmap(i % 20),
                label=pod if len(pods) <= 12 else None,
            )
        if len(pods) <= 12:
            ax.legend(title="pod", fontsize=7, loc="lower right", ncols=2)
    if target is not None:
        ax.axhline(target, color="tab:green", ls="--", lw=1)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("score (accepted submissions)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _layout(roots: Sequence[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], float]]:
    """(node, y) for every node: leaves take consecutive rows, a parent sits at the middle of
    its children (a tidy tree read left to right by generation)."""
    out: list[tuple[Mapping[str, Any], float]] = []
    row = 0.0

    def visit(node: Mapping[str, Any]) -> float:
        nonlocal row
        children = sorted(node.get("children") or [], key=lambda c: c.get("created_at", 0.0))
        if children:
            ys = [visit(c) for c in children]
            y = (min(ys) + max(ys)) / 2
        else:
            y = row
            row += 1
        out.append((node, y))
        return y

    # Iterative depth would be safer for absurdly deep trees; lineages are a few hundred deep
    # at most (one level per generation).
    for root in sorted(roots, key=lambda r: r.get("created_at", 0.0)):
        visit(root)
    return out


def lineage_tree(
    roots: Sequence[Mapping[str, Any]],
    path: Path,
    title: str = "",
) -> Path:
    """The lineage: every candidate ever inserted, parent -> child edges, by generation.

    ``roots``: the leaderboard's lineage ``roots`` (nodes with ``candidate_id``,
    ``generation``, ``score``, ``status``, ``children``). Colour is the score; hollow markers
    are candidates since evicted from the board.
    """
    placed = _layout(roots)
    where = {n["candidate_id"]: (n.get("generation", 0), y) for n, y in placed}
    height = min(max(4.0, 0.18 * (1 + max((y for _, y in placed), default=0))), 30.0)
    fig, ax = plt.subplots(figsize=(9, height), dpi=110)
    for node, y in placed:
        x = node.get("generation", 0)
        for child in node.get("children") or []:
            cx, cy = where[child["candidate_id"]]
            ax.plot([x, cx], [y, cy], color="0.6", lw=0.8, zorder=1)
    if placed:
        scores = [n["score"] for n, _ in placed]
        lo, hi = min(scores), max(scores)
        norm = matplotlib.colors.Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1)
        cmap = plt.get_cmap("viridis")
        for evicted in (False, True):
            pts = [(n, y) for n, y in placed if (n.get("status") == "evicted") == evicted]
            if not pts:
                continue
            colours = [cmap(norm(n["score"])) for n, _ in pts]
            ax.scatter(
                [n.get("generation", 0) for n, _ in pts],
                [y for _, y in pts],
                s=36,
                zorder=2,
                facecolors="none" if evicted else colours,
                edgecolors=colours,
                linewidths=1.2,
                label="evicted" if evicted else "on the board",
            )
        if len(placed) <= 40:
            for n, y in placed:
                ax.annotate(
                    f"{n['score']:.4g}",
                    (n.get("generation", 0), y),
                    xytext=(5, 2),
                    textcoords="offset points",
                    fontsize=6,
                )
        fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="score")
        ax.legend(loc="upper left", fontsize=7)
    gens = [n.get("generation", 0) for n, _ in placed] or [0]
    ax.set_xlim(min(gens) - 0.5, max(gens) + 0.5)
    ax.set_xlabel("generation")
    ax.set_yticks([])
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title or "lineage")
    return _save(fig, path)
