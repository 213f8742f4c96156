"""Plots users look at: one agent's learning curve, and a tournament's progress, pods and
lineage. matplotlib (headless), no torch; inputs are plain dicts as the APIs return them (the
leaderboard's submission log and flat lineage). The series behind each plot come from small
functions (``best_so_far``, ``pod_series``, ``_layout``) that tests check by value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.collections import LineCollection

# Figures without pyplot (matplotlib's way for servers and scripts): no GUI backend to pick
# (pods and CI have no display), and no pyplot import, a third of a second of every command
# that draws (`podium train`'s learning curve).
from matplotlib.figure import Figure


def learning_curve(
    history: Sequence[dict[str, float]],
    path: Path,
    title: str = "",
    target: float | None = None,
    measure: str = "eval return",
) -> Path:
    """Evaluation return (mean ± std) and training episode return against env steps; where
    the evaluation scores by another ``measure`` (a Sharpe ratio), that alone: the training
    returns are in other units."""
    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.subplots()
    train = [(h["env_steps"], h["train_return"]) for h in history if "train_return" in h]
    if train and measure == "eval return":
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
    ax.set_ylabel("episode return" if measure == "eval return" else measure.removeprefix("eval "))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def account_values(
    dates: Sequence[Any], values: Mapping[str, Sequence[float]], path: Path, title: str = ""
) -> Path:
    """Account value per day of each strategy (``podium backtest``)."""
    import numpy as np

    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.subplots()
    days = np.asarray(dates, dtype="datetime64[D]")
    for name, series in values.items():
        ax.plot(days, np.asarray(series) / 1e6, lw=1.2, label=name)
    ax.set_ylabel("account value ($M)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.autofmt_xdate()
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _better(higher_is_better: bool) -> Any:
    return (lambda a, b: a > b) if higher_is_better else (lambda a, b: a < b)


def best_so_far(
    submissions: Sequence[Mapping[str, Any]],
    start: float,
    higher_is_better: bool = True,
    end: float | None = None,
) -> dict[str, list[float]]:
    """The best score reported so far after each report, in the order they were decided.

    ``submissions``: the leaderboard's submission log (``decided_at`` epoch seconds, ``score``,
    ``env_steps`` trained since the pod's previous report), kept or not. Returns parallel lists
    ``t`` (seconds since ``start``), ``env_steps`` (the running sum over every pod) and ``best``;
    with ``end`` (the experiment's end), a last point carries the final best to it.
    """
    better = _better(higher_is_better)
    out: dict[str, list[float]] = {"t": [], "env_steps": [], "best": []}
    steps, best = 0, None
    for s in sorted(submissions, key=lambda s: s["decided_at"]):
        steps += int(s.get("env_steps") or 0)
        if best is None or better(s["score"], best):
            best = s["score"]
        out["t"].append(s["decided_at"] - start)
        out["env_steps"].append(steps)
        out["best"].append(best)
    if end is not None and out["t"] and end - start > out["t"][-1]:
        out["t"].append(end - start)
        out["env_steps"].append(steps)
        out["best"].append(out["best"][-1])
    return out


def best_from_polls(samples: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """The same series from the CLI's progress polls (``t``, ``env_steps``, ``best``): only
    when the leaderboard's log could not be read; polls miss everything between two of them."""
    kept = [s for s in samples if s.get("best") is not None]
    return {
        "t": [s["t"] for s in kept],
        "env_steps": [s.get("env_steps") or 0 for s in kept],
        "best": [s["best"] for s in kept],
    }


def tournament_progress(
    series: Mapping[str, Sequence[float]],
    path: Path,
    title: str = "",
    target: float | None = None,
) -> Path:
    """Best score so far against wall time and against env steps (all pods), as
    ``best_so_far`` computes them; a dot where the best improved."""
    fig = Figure(figsize=(11, 4), dpi=110)
    ax_t, ax_s = fig.subplots(1, 2, sharey=True)
    best = list(series.get("best", []))
    improved = [i for i, b in enumerate(best) if i == 0 or b != best[i - 1]]
    for ax, xs, label in (
        (ax_t, list(series.get("t", [])), "wall time since submission (s)"),
        (ax_s, list(series.get("env_steps", [])), "env steps (all pods)"),
    ):
        if best:
            ax.step(xs, best, where="post", color="tab:blue", lw=2, label="best so far")
            ax.plot(
                [xs[i] for i in improved], [best[i] for i in improved], "o", color="tab:blue", ms=4
            )
        if target is not None:
            ax.axhline(target, color="tab:green", ls="--", lw=1, label=f"target {target:g}")
        if best or target is not None:
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    ax_t.set_ylabel("best score")
    fig.suptitle(title)
    return _save(fig, path)


def pod_series(
    submissions: Sequence[Mapping[str, Any]], start: float
) -> dict[str, dict[str, list[Any]]]:
    """Each pod's own reports in time order: ``t`` (seconds since ``start``), ``score``,
    ``accepted``."""
    pods: dict[str, dict[str, list[Any]]] = {}
    for s in sorted(submissions, key=lambda s: s["decided_at"]):
        pod = pods.setdefault(str(s["pod_id"]), {"t": [], "score": [], "accepted": []})
        pod["t"].append(s["decided_at"] - start)
        pod["score"].append(s["score"])
        pod["accepted"].append(bool(s.get("accepted")))
    return pods


def pod_curves(
    submissions: Sequence[Mapping[str, Any]],
    path: Path,
    title: str = "",
    target: float | None = None,
    start: float | None = None,
) -> Path:
    """Each pod's curve: the score of every report it made, over wall time; filled markers were
    kept on the leaderboard, hollow ones were not.

    ``submissions``: the leaderboard's submission log; ``start`` (epoch seconds) is time zero,
    the first report's time by default.
    """
    fig = Figure(figsize=(8, 4.5), dpi=110)
    ax = fig.subplots()
    if submissions:
        t0 = start if start is not None else min(s["decided_at"] for s in submissions)
        pods = pod_series(submissions, t0)
        cmap = matplotlib.colormaps["tab20"]
        legend = len(pods) <= 12
        for i, (pod, series) in enumerate(pods.items()):
            colour = cmap(i % 20)
            ax.plot(
                series["t"],
                series["score"],
                "-",
                lw=1.2,
                color=colour,
                label=pod if legend else None,
            )
            for kept in (True, False):
                pts = [
                    (t, y)
                    for t, y, a in zip(
                        series["t"], series["score"], series["accepted"], strict=True
                    )
                    if a == kept
                ]
                if pts:
                    ax.scatter(
                        *zip(*pts, strict=True),
                        s=12,
                        zorder=2,
                        edgecolors=colour,
                        facecolors=colour if kept else "none",
                        linewidths=1,
                    )
        if legend:
            ax.legend(title="pod (hollow: not kept)", fontsize=7, loc="lower right", ncols=2)
    if target is not None:
        ax.axhline(target, color="tab:green", ls="--", lw=1)
    ax.set_xlabel("wall time since submission (s)")
    ax.set_ylabel("score (every report)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _layout(
    nodes: Sequence[Mapping[str, Any]],
) -> tuple[list[tuple[Mapping[str, Any], float]], list[tuple[str, str]]]:
    """(node, y) for every node, and the (parent id, child id) edges, from the flat lineage:
    leaves take consecutive rows, a parent sits at the middle of its children (a tidy tree read
    left to right by generation). Iterative, so a chain thousands of generations deep is fine.
    A node whose parent is not in the list is a root."""
    by_id = {n["candidate_id"]: n for n in nodes}
    children: dict[str, list[Mapping[str, Any]]] = {}
    roots = []
    for n in nodes:
        parent = n.get("parent_id")
        if parent and parent in by_id and parent != n["candidate_id"]:
            children.setdefault(parent, []).append(n)
        else:
            roots.append(n)

    def when(n: Mapping[str, Any]) -> float:
        return n.get("created_at", 0.0)

    out: list[tuple[Mapping[str, Any], float]] = []
    edges: list[tuple[str, str]] = []
    ys: dict[str, float] = {}
    seen: set[str] = set()
    row = 0.0
    for root in sorted(roots, key=when):
        stack: list[tuple[Mapping[str, Any], bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            cid = node["candidate_id"]
            kids = sorted(children.get(cid, []), key=when)
            if not done:
                if cid in seen:
                    continue
                seen.add(cid)
                stack.append((node, True))
                stack.extend((k, False) for k in reversed(kids))
                continue
            placed = [ys[k["candidate_id"]] for k in kids if k["candidate_id"] in ys]
            if placed:
                y = (min(placed) + max(placed)) / 2
            else:
                y = row
                row += 1
            ys[cid] = y
            out.append((node, y))
            edges.extend((cid, k["candidate_id"]) for k in kids)
    return out, edges


def _node_positions(nodes: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """(generation, row) of each node as the lineage plot draws it."""
    return [(n.get("generation", 0), y) for n, y in _layout(nodes)[0]]


def lineage_tree(
    nodes: Sequence[Mapping[str, Any]],
    path: Path,
    title: str = "",
) -> Path:
    """The lineage: every candidate ever inserted, parent -> child edges, by generation.

    ``nodes``: the leaderboard's flat lineage ``nodes`` (``candidate_id``, ``parent_id``,
    ``generation``, ``score``, ``status``, ``created_at``). Colour is the score; hollow markers
    are candidates since evicted from the board.
    """
    return _save(lineage_figure(nodes, title), path)


def lineage_figure(nodes: Sequence[Mapping[str, Any]], title: str = "") -> Any:
    """The figure ``lineage_tree`` saves."""
    placed, edges = _layout(nodes)
    where = {n["candidate_id"]: (n.get("generation", 0), y) for n, y in placed}
    height = min(max(4.0, 0.18 * (1 + max((y for _, y in placed), default=0))), 30.0)
    fig = Figure(figsize=(9, height), dpi=110)
    ax = fig.subplots()
    if edges:
        segments = [[where[p], where[c]] for p, c in edges]
        ax.add_collection(LineCollection(segments, colors="0.6", lw=0.8, zorder=1))
    if placed:
        scores = [n["score"] for n, _ in placed]
        lo, hi = min(scores), max(scores)
        norm = matplotlib.colors.Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1)
        cmap = matplotlib.colormaps["viridis"]
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
        # Above the axes, beside the title: inside them it covered the top lineage's first
        # node and its label (every corner of the axes can hold a node).
        legend = ax.legend(
            loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=2, fontsize=7, frameon=False
        )
        # Grey markers: a marker's colour means a score.
        for handle, text in zip(legend.legend_handles, legend.get_texts(), strict=True):
            handle.set_edgecolor("0.35")  # type: ignore[union-attr]
            if text.get_text() == "on the board":
                handle.set_facecolor("0.35")  # type: ignore[union-attr]
    gens = [n.get("generation", 0) for n, _ in placed] or [0]
    ax.set_xlim(min(gens) - 0.5, max(gens) + 0.5)
    ax.set_xlabel("generation")
    # Rows carry no quantity: each leaf (a line of descent's latest candidate) takes a row,
    # oldest root lowest, and a parent sits between its children.
    ax.set_ylabel("lineages: one row per leaf, oldest at the bottom", fontsize=8)
    ax.set_yticks([])
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title or "lineage", loc="left")
    return fig
