"""What ``podium run`` leaves in OUT: the experiment, its leaderboard, lineage, submission log
and candidates as JSON, the best agent's training files (OUT/best), and the plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from services.cli.client import ApiError
from services.cli.pod_logs import local_pods_dir
from services.contracts.pod_activity import eager_for_a_cold_compile

if TYPE_CHECKING:
    from rich.console import Console

    from services.cli.client import PodiumClient

_JSON = TypeAdapter(Any)


def collect(
    client: PodiumClient, exp_id: str, exp: dict[str, Any], out: Path, console: Console
) -> dict[str, Any]:
    """Everything the run's results need, read while the platform is still up."""
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, Any] = {
        "experiment": exp,
        "board": None,
        "lineage": None,
        "submissions": None,
        "candidates": [],
    }
    (out / "experiment.json").write_text(json.dumps(exp, indent=2))
    try:
        got["board"] = client.board(exp_id)
        got["submissions"] = client.submissions(exp_id)
        got["lineage"] = client.lineage(exp_id)
        nodes = sorted(got["lineage"].nodes, key=lambda n: n.created_at)
        # The newest few hundred, with their hyperparameters, for candidates.json.
        got["candidates"] = [client.candidate(exp_id, n.candidate_id) for n in nodes[-500:]]
    except ApiError as exc:
        console.print(f"[yellow]leaderboard not read[/]: {exc.message}")
    for name, file in (
        ("board", "leaderboard"),
        ("lineage", "lineage"),
        ("submissions", "submissions"),
        ("candidates", "candidates"),
    ):
        if got[name] is not None:
            data = _JSON.dump_python(got[name], mode="json")
            (out / f"{file}.json").write_text(json.dumps(data, indent=2))
    if got["board"] and got["board"].candidates:
        try:
            cand = client.export(exp_id, out / "best")
            console.print(
                f"best agent {cand.candidate_id} (score {cand.score:.4g}) exported to "
                f"{out / 'best'}"
            )
        except ApiError as exc:
            console.print(f"[yellow]best agent not exported[/]: {exc.message}")
    return got


def write_plots(
    samples: list[dict[str, Any]],
    got: dict[str, Any],
    out: Path,
    name: str,
    target: float | None,
    console: Console,
    higher_is_better: bool = True,
) -> None:
    """best_score.png and candidates.png from the leaderboard's log of every report (the CLI's
    polls only when it could not be read: they miss what happens between two polls),
    lineage.png from the lineage."""
    from services.cli import plots

    with (out / "progress.jsonl").open("w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    exp = got["experiment"]
    start = exp.get("created_at")
    submissions = got.get("submissions")
    records = [s.model_dump() for s in submissions or []]
    if submissions is not None and start is not None:
        series = plots.best_so_far(records, start, higher_is_better, exp.get("finished_at"))
    else:
        series = plots.best_from_polls(samples)
    written = [plots.tournament_progress(series, out / "best_score.png", name, target)]
    written.append(plots.pod_curves(records, out / "candidates.png", name, target, start))
    if got.get("lineage") is not None:
        nodes = [n.model_dump() for n in got["lineage"].nodes]
        written.append(plots.lineage_tree(nodes, out / "lineage.png", name))
    console.print("plots: " + "  ".join(str(p) for p in written))


def cold_compile_reason(data_dir: Path, exp_id: str) -> str | None:
    """Why the experiment's pods trained eager where a compile would have been a cold one (the
    first pod's log that says so, of the embedded platform's pods under ``data_dir``), or None:
    a run too short to pay for compiling, whose later runs load what ``podium compile`` puts
    in the cache (docs/tournaments.md)."""
    for path in sorted(local_pods_dir(data_dir, exp_id).glob("*.log")):
        try:
            with path.open(encoding="utf-8", errors="replace") as f:
                head = f.read(1 << 16)  # the decision is made in a pod's first updates
        except OSError:  # advice only: a log that cannot be read gives none
            continue
        if reason := eager_for_a_cold_compile(head):
            return reason
    return None
