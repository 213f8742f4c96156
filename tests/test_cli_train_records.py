"""`podium train`'s metrics.jsonl as a user follows it: each record on disk when it happens."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path


def test_metrics_are_on_disk_while_training_and_after_a_kill(tmp_path: Path) -> None:
    """An off-policy run writes a record per evaluation only. Its records can be followed
    while it trains, and a killed run keeps them (the file was 0 bytes after 6 evaluations when
    it was block-buffered)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "services.cli", "train", "Pendulum-v1", "--out", str(out),
            "--quiet", "--set", "algorithm=sac", "--set", "total_env_steps=100000000",
            "--set", "eval_every_steps=640", "--set", "eval_episodes=1",
            "--set", "learning_starts=320", "--set", "target_return=null",  # no early stop
            # The records, not a compile: with a budget of 1e8 env steps `auto` compiles,
            # minutes on a loaded machine with a cold cache.
            "--set", "compile=off",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    metrics, counters = out / "metrics.jsonl", out / "checkpoints" / "latest" / "counters.json"

    def saved_env_steps() -> int:
        # The fit loop saves `latest` at each evaluation, just before it reports the record.
        try:
            return int(json.loads(counters.read_text())["env_steps"])
        except (OSError, ValueError, KeyError):
            return 0  # not written yet, or being replaced

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and saved_env_steps() < 1920:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended early"
        assert saved_env_steps() >= 1920, "no third evaluation within 120 s"
        # The third evaluation was saved, so the first two records were reported before it.
        lines = metrics.read_text().splitlines()
        evaluated = [json.loads(line)["env_steps"] for line in lines if "eval_return" in line]
        assert evaluated[:2] == [640, 1280], lines
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) >= len(lines) >= 2
