"""Tournament plots: the series behind them, checked by value, from the real leaderboard's
answers (submission log, flat lineage); and the PNGs they draw."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pytest
from fastapi.testclient import TestClient

from services.cli import plots
from services.leaderboard.app import create_app
from tests.leaderboard.conftest import AUTH, experiment, result, settings_for

API = "/api/v1/experiments"


def read_png(path: Path) -> np.ndarray:
    assert path.read_bytes().startswith(b"\x89PNG")
    return matplotlib.image.imread(path)


def drawn(img: np.ndarray) -> float:
    """Fraction of pixels that are not white: a blank canvas is ~0."""
    return float((img[..., :3] < 0.95).any(axis=-1).mean())


@pytest.fixture
def lb(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(settings_for(tmp_path / "data")), headers=AUTH) as c:
        yield c


def report(sid: str, pod: str, score: float, steps: int) -> dict[str, Any]:
    return {
        "submission_id": sid,
        "pod_id": pod,
        "algorithm": "ppo",
        "score": score,
        "env_steps": steps,
        "accepted": True,
        "decided_at": 0.0,
    }


# -- best score so far ---------------------------------------------------------------------------


def test_best_so_far_from_the_real_submission_log(lb: TestClient, tmp_path: Path) -> None:
    """Two pods report to a top-2 board; a report that does not make the board still counts
    (its env steps, its time), and the best never goes down."""
    lb.put(f"{API}/e", json=experiment(top_k=2))
    start = time.time()
    reports = [
        ("p0", 10.0, 1000),
        ("p1", 30.0, 2000),
        ("p0", 20.0, 1500),
        ("p1", 15.0, 500),
        ("p0", 500.0, 4000),
    ]
    for i, (pod, score, steps) in enumerate(reports):
        r = lb.post(
            f"{API}/e/submissions", json=result(f"s{i}", score, pod_id=pod, env_steps=steps)
        )
        assert r.status_code == 200, r.text
    log = lb.get(f"{API}/e/submissions").json()
    assert log["next_after"] is None
    subs = log["submissions"]
    assert [s["accepted"] for s in subs] == [True, True, True, False, True]
    assert [s["env_steps"] for s in subs] == [1000, 2000, 1500, 500, 4000]  # rejects too

    series = plots.best_so_far(subs, start)
    assert series["best"] == [10.0, 30.0, 30.0, 30.0, 500.0]
    assert series["env_steps"] == [1000, 3000, 4500, 5000, 9000]
    assert series["t"] == [s["decided_at"] - start for s in subs]
    assert all(0 <= a <= b for a, b in itertools.pairwise(series["t"]))
    assert series["t"][-1] <= time.time() - start

    pods = plots.pod_series(subs, start)
    assert pods["p0"]["score"] == [10.0, 20.0, 500.0]
    assert pods["p1"]["score"] == [30.0, 15.0] and pods["p1"]["accepted"] == [True, False]
    assert pods["p1"]["t"] == [subs[1]["decided_at"] - start, subs[3]["decided_at"] - start]

    full = read_png(plots.tournament_progress(series, tmp_path / "b.png", "e", target=475))
    empty = read_png(plots.tournament_progress(plots.best_so_far([], start), tmp_path / "x.png"))
    assert full.shape == empty.shape and full.shape[1] > full.shape[0]  # two panels
    assert drawn(full) > drawn(empty)
    curves = read_png(plots.pod_curves(subs, tmp_path / "c.png", "e", target=475, start=start))
    assert drawn(curves) > drawn(read_png(plots.pod_curves([], tmp_path / "n.png")))


def test_a_run_solved_in_seconds_still_shows_the_climb() -> None:
    """CartPole solved 4 s in: every report is on the curve, not a flat line at 500, and the
    curve runs on to the experiment's end."""
    subs = [
        {**report(f"s{i}", f"p{i % 2}", score, 2048), "decided_at": 1000.0 + t}
        for i, (t, score) in enumerate([(1.5, 22.0), (2.1, 9.0), (2.9, 180.0), (3.6, 500.0)])
    ]
    subs.reverse()  # the order of the log does not matter, the decision times do
    series = plots.best_so_far(subs, start=1000.0, end=1006.0)
    assert series["t"] == pytest.approx([1.5, 2.1, 2.9, 3.6, 6.0])
    assert series["best"] == [22.0, 22.0, 180.0, 500.0, 500.0]
    assert series["env_steps"] == [2048, 4096, 6144, 8192, 8192]


def test_lower_is_better_keeps_the_lowest() -> None:
    subs = [
        {**report(f"s{i}", "p", score, 10), "decided_at": float(i)}
        for i, score in enumerate([5.0, 7.0, 2.0, 3.0])
    ]
    assert plots.best_so_far(subs, 0.0, higher_is_better=False)["best"] == [5.0, 5.0, 2.0, 2.0]
    assert plots.best_so_far(subs, 0.0)["best"] == [5.0, 7.0, 7.0, 7.0]


def test_polls_are_the_fallback_series() -> None:
    samples = [
        {"t": 0.5, "env_steps": None, "best": None},
        {"t": 1.0, "env_steps": 10, "best": 3.0},
        {"t": 1.5, "env_steps": None, "best": 4.0},
    ]
    assert plots.best_from_polls(samples) == {
        "t": [1.0, 1.5],
        "env_steps": [10, 0],
        "best": [3.0, 4.0],
    }


# -- lineage -------------------------------------------------------------------------------------


def node(
    cid: str, parent: str | None, gen: int, score: float, t: float = 0.0, status: str = "active"
) -> dict[str, Any]:
    return {
        "candidate_id": cid,
        "parent_id": parent,
        "algorithm": "ppo",
        "generation": gen,
        "pod_id": "p",
        "submission_id": f"s-{cid}",
        "env_steps": 100,
        "score": score,
        "status": status,
        "created_at": t,
        "evicted_at": None,
    }


def test_lineage_layout_from_flat_nodes_puts_parents_between_their_children() -> None:
    nodes = [
        node("root", None, 0, 1.0, t=0),
        node("a", "root", 1, 2.0, t=1),
        node("b", "root", 1, 2.5, t=2),
        node("a1", "a", 2, 3.0, t=3),
        node("a2", "a", 2, 4.0, t=4),
        node("b1", "b", 2, 5.0, t=5),
        node("other", None, 0, 0.5, t=9),
        node("orphan", "gone-from-the-log", 3, 0.1, t=10),  # its parent is not listed: a root
    ]
    placed_list, edges = plots._layout(list(reversed(nodes)))  # any order in
    placed = {n["candidate_id"]: y for n, y in placed_list}
    assert set(placed) == {n["candidate_id"] for n in nodes}
    leaves = [placed[c] for c in ("a1", "a2", "b1", "other", "orphan")]
    assert leaves == sorted(leaves) and len(set(leaves)) == 5  # one row per leaf, time order
    assert placed["a"] == (placed["a1"] + placed["a2"]) / 2
    assert placed["b"] == placed["b1"]
    assert min(placed["a"], placed["b"]) < placed["root"] < max(placed["a"], placed["b"])
    assert sorted(edges) == sorted(
        [("root", "a"), ("root", "b"), ("a", "a1"), ("a", "a2"), ("b", "b1")]
    )


def test_lineage_of_a_very_long_chain_and_a_wide_board(tmp_path: Path) -> None:
    small = [node("r", None, 0, 1.0), node("c", "r", 1, 2.0, status="evicted")]
    img = read_png(plots.lineage_tree(small, tmp_path / "s.png", "small"))
    assert drawn(img) > 0.01
    # Far deeper than any recursion limit: the layout is iterative.
    depth = 5000
    chain = [node(f"g{g}", f"g{g - 1}" if g else None, g, float(g), t=g) for g in range(depth)]
    placed, edges = plots._layout(chain)
    assert len(placed) == depth and len(edges) == depth - 1
    assert {y for _, y in placed} == {0.0}  # one row: a chain has one leaf
    wide = [node(f"w{i}", None, 0, float(i), t=depth + i) for i in range(200)]
    big = read_png(plots.lineage_tree(chain + wide, tmp_path / "b.png", "big"))
    assert big.shape[0] > img.shape[0]  # taller for more rows
    assert read_png(plots.lineage_tree([], tmp_path / "e.png")).size > 0


def test_lineage_legend_covers_no_node_and_the_y_axis_says_what_it_is() -> None:
    """The legend (upper left, inside the axes) covered the top lineage's first node
    and its label, and the y axis had no label."""
    nodes = [node("r0", None, 0, 1.0, t=0)]
    nodes += [node(f"c{g}", f"c{g - 1}" if g else "r0", g + 1, 2.0 + g, t=g + 1) for g in range(3)]
    nodes += [node(f"top{i}", None, 0, 0.5 + i, t=10 + i) for i in range(4)]  # later roots: on top
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(plots.lineage_figure(nodes, "t"))  # the canvas savefig draws on
    canvas.draw()
    renderer = canvas.get_renderer()
    (ax,) = [a for a in canvas.figure.axes if a.get_legend() is not None]
    legend = ax.get_legend().get_window_extent(renderer)
    points = [ax.transData.transform((x, y)) for x, y in plots._node_positions(nodes)]
    assert points and not [p for p in points if legend.contains(*p)]
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(labels) == len(nodes) and not [b for b in labels if b.overlaps(legend)]
    assert "row" in ax.get_ylabel() and "leaf" in ax.get_ylabel()
