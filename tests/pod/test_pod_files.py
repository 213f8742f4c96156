"""A pod process keeps what a user reads beyond its life and says what its start-up cost:
its TensorBoard files and its last log lines reach the leaderboard's blob store before it exits
(services/pod/runtime/pod_files.py), and its seconds to the first env step and the first report
are in its log and its /metrics."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx

from services.contracts.artifacts import TENSORBOARD_KIND
from services.contracts.bundles import unpack
from tests.pod.harness import (
    Leaderboard,
    eval_returns,
    make_spec,
    register,
    sigterm_pod_when,
    start_pod,
)


def test_a_stopped_pod_keeps_its_files_and_says_its_start_up(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    spec = make_spec()
    register(leaderboard, "exp", spec)
    pod_dir, log = tmp_path / "pods", tmp_path / "pod.log"
    pod_dir.mkdir()
    proc = start_pod(
        leaderboard, "exp", "p0", spec, pod_dir, log, PODIUM_TENSORBOARD_DIR=str(tmp_path / "tb")
    )
    scraped: dict[str, str] = {}

    def reported_and_scraped() -> bool:
        if '"pod.first_report"' not in log.read_text():
            return False
        port = (pod_dir / "p0.metrics_port").read_text().strip()
        scraped["metrics"] = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        return True

    lines = sigterm_pod_when(proc, log, reported_and_scraped)
    events = {x["event"]: x for x in lines}
    step, report = events["pod.first_env_step"], events["pod.first_report"]
    assert 0 < step["seconds"] <= report["seconds"], (step, report)
    assert events["pod stopped"]["startup_s"] == {
        "first_env_step": step["seconds"],
        "first_report": report["seconds"],
    }
    for milestone in ("first_env_step", "first_report"):
        assert f'milestone="{milestone}",pod="p0"' in scraped["metrics"], scraped["metrics"]

    with leaderboard.api() as api:
        kept = {f["name"]: f for f in api.get("/experiments/exp/pod-files").json()}
        assert set(kept) == {"log", "tensorboard"}
        text = api.get("/experiments/exp/pods/p0/files/log").text
        bundle = api.get("/experiments/exp/pods/p0/files/tensorboard").content
    # Its own last lines: its last report (the final one; or, when the stop came as a report
    # ended, that one, with nothing trained since) and the line it stopped with, as logged.
    last = [json.loads(line) for line in text.splitlines()]
    assert last[-1]["event"] == "pod stopped", last[-3:]
    assert any(x["event"] == "reported" for x in last), last
    assert text.splitlines() == log.read_text().splitlines()[-len(text.splitlines()) :]
    unpack(io.BytesIO(bundle), tmp_path / "boards", expect={"kind": TENSORBOARD_KIND})
    assert eval_returns(tmp_path / "boards")
