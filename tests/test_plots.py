"""Tournament plots: real PNGs from data shaped as the APIs return it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np

from services import plots


def read_png(path: Path) -> np.ndarray:
    assert path.read_bytes().startswith(b"\x89PNG")
    return matplotlib.image.imread(path)


def drawn(img: np.ndarray) -> float:
    """Fraction of pixels that are not white: a blank canvas is ~0."""
    return float((img[..., :3] < 0.95).any(axis=-1).mean())


def node(cid: str, gen: int, score: float, children: list[dict[str, Any]] | None = None,
         status: str = "active", t: float = 0.0) -> dict[str, Any]:  # fmt: skip
    return {
        "candidate_id": cid,
        "parent_id": None,
        "algorithm": "ppo",
        "generation": gen,
        "score": score,
        "status": status,
        "created_at": t,
        "children": children or [],
    }


def test_tournament_progress_draws_both_axes(tmp_path: Path) -> None:
    samples = [{"t": 0.5, "env_steps": 0, "best": None}] + [
        {"t": 1.0 + i, "env_steps": 1000 * i, "best": 10.0 * i} for i in range(1, 20)
    ]
    full = read_png(plots.tournament_progress(samples, tmp_path / "p.png", "x", target=100))
    empty = read_png(plots.tournament_progress([], tmp_path / "e.png", "x", target=100))
    assert full.shape == empty.shape and full.shape[1] > full.shape[0]  # two panels side by side
    assert drawn(full) > drawn(empty)  # the curves add ink to the same axes


def test_candidate_curves_one_line_per_pod(tmp_path: Path) -> None:
    cands = [
        {"pod_id": f"pod{p}", "score": 10.0 * i + p, "created_at": 1000.0 + i + p / 10}
        for p in range(3)
        for i in range(8)
    ]
    img = read_png(plots.candidate_curves(cands, tmp_path / "c.png", "x", target=80, start=999))
    none = read_png(plots.candidate_curves([], tmp_path / "n.png", "x"))
    assert drawn(img) > drawn(none)


def test_lineage_layout_puts_parents_between_their_children() -> None:
    tree = node(
        "root",
        0,
        1.0,
        [
            node("a", 1, 2.0, [node("a1", 2, 3.0, t=3), node("a2", 2, 4.0, t=4)], t=1),
            node("b", 1, 2.5, [node("b1", 2, 5.0, t=5)], t=2),
        ],
    )
    placed = {n["candidate_id"]: y for n, y in plots._layout([tree, node("other", 0, 0.5, t=9)])}
    leaves = [placed[c] for c in ("a1", "a2", "b1", "other")]
    assert leaves == sorted(leaves) and len(set(leaves)) == 4  # one row per leaf, in time order
    assert placed["a"] == (placed["a1"] + placed["a2"]) / 2
    assert placed["b"] == placed["b1"]
    assert min(placed["a"], placed["b"]) < placed["root"] < max(placed["a"], placed["b"])


def test_lineage_tree_png_small_and_large(tmp_path: Path) -> None:
    small = node("r", 0, 1.0, [node("c", 1, 2.0, status="evicted")])
    img = read_png(plots.lineage_tree([small], tmp_path / "s.png", "small"))
    assert drawn(img) > 0.01
    # A long chain (hundreds of generations) and a wide board still render.
    chain = node("g0", 0, 0.0)
    tip = chain
    for g in range(1, 300):
        child = node(f"g{g}", g, float(g))
        tip["children"] = [child]
        tip = child
    wide = [node(f"w{i}", 0, float(i)) for i in range(200)]
    big = read_png(plots.lineage_tree([chain, *wide], tmp_path / "b.png", "big"))
    assert big.shape[0] > img.shape[0]  # taller for more rows
    assert read_png(plots.lineage_tree([], tmp_path / "e.png")).size > 0
