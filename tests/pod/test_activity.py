"""The pod says what it is doing (services/pod/runtime/activity.py), in records the live display
reads back (services/contracts/pod_activity.py): the round loop's phases as it says them, and
compiling whenever the pod's main thread is in a compiler (a real ``torch.compile`` here)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from services.contracts.pod_activity import EVENT, last_activity
from services.logs import configure
from services.pod.runtime.activity import Activity


def _records(log: Path) -> list[dict]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [r for r in lines if r.get("event") == EVENT]


def test_the_phases_are_logged_as_they_change_and_read_back(tmp_path: Path) -> None:
    log = tmp_path / "pod.log"
    configure(file=log)
    try:
        activity = Activity(sample_s=0.05, heartbeat_s=0.3)
        activity.now("loading")
        time.sleep(0.5)  # longer than a heartbeat: said again, with the seconds so far
        activity.now("training")
        time.sleep(0.5)  # training is not repeated
        activity.close()
    finally:
        configure()
    said = [(r["activity"], r["seconds"]) for r in _records(log)]
    assert [a for a, _ in said] == ["starting", "loading", "loading", "training"], said
    assert said[2][1] >= 0.3
    found = last_activity(log.read_text())
    assert found is not None and found[0] == "training"
    assert abs(found[1] - time.time()) < 5  # since when, in epoch seconds


def test_a_compile_in_the_main_thread_is_seen_as_compiling(tmp_path: Path) -> None:
    log = tmp_path / "pod.log"
    configure(file=log)
    torch._dynamo.reset()
    try:
        activity = Activity(sample_s=0.02, heartbeat_s=60)
        activity.now("training")

        @torch.compile(backend="inductor")
        def step(x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x @ x.T).sum(dim=1) * 2 + 1

        step(torch.randn(64, 64))  # dynamo traces, inductor compiles: seconds on a CPU
        time.sleep(0.1)
        activity.now("evaluating")
        activity.close()
    finally:
        configure()
    said = [r["activity"] for r in _records(log)]
    assert "compiling" in said, said
    assert said.index("compiling") > said.index("training")  # seen, not said
    assert said[-1] == "evaluating"
