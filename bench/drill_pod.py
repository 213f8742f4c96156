"""The pod of bench/fault_drills.py: a real process that reports to the leaderboard like a pod
(metadata-only results, with the credential the orchestrator gave it) and records every report
the leaderboard acknowledged, so the drills can look for each one afterwards.

Each acknowledged report is appended, one line, to ``$PODIUM_POD_DIR/<pod>.acks`` after the
200 arrives (a kill between the two loses the line, never a stored report: the drills can only
undercount what was acknowledged). Interval: ``env.kwargs.drill.report_interval_s``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def report_body(submission_id: str, pod_id: str, algorithm: str, score: float) -> dict[str, Any]:
    """A metadata-only SubmissionResult (no files)."""
    return {
        "submission_id": submission_id,
        "pod_id": pod_id,
        "algorithm": algorithm,
        "score": score,
        "eval": {"mean": score, "episodes": 1},
        "env_steps": 100,
    }


def main() -> None:
    exp_id, pod_id = os.environ["PODIUM_EXPERIMENT_ID"], os.environ["PODIUM_POD_ID"]
    spec = json.loads(os.environ["PODIUM_SPEC"])
    interval = spec["env"].get("kwargs", {}).get("drill", {}).get("report_interval_s", 0.2)
    algorithm = next(iter(spec["algorithms"]))
    rng = random.Random(f"{exp_id}/{pod_id}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"drill pod {pod_id} of {exp_id} started", flush=True)
    http = httpx.Client(
        base_url=f"{os.environ['PODIUM_LEADERBOARD_URL']}/api/v1/experiments/{exp_id}",
        headers={"Authorization": f"Bearer {os.environ.get('PODIUM_API_TOKEN', '')}"},
        timeout=10,
    )
    acks_path = Path(os.environ["PODIUM_POD_DIR"], f"{pod_id}.acks")
    with http, acks_path.open("a", buffering=1) as acks:
        for n in range(1, sys.maxsize):
            sid = f"{pod_id}-{n}"
            try:
                r = http.post(
                    "/submissions", json=report_body(sid, pod_id, algorithm, rng.uniform(0, 500))
                )
                r.raise_for_status()
                acks.write(f"{sid} {int(r.json()['accepted'])} {time.time():.3f}\n")
            except (httpx.HTTPError, ValueError) as e:
                print(f"report {n} not acknowledged: {e!r}", flush=True)
            time.sleep(interval)


if __name__ == "__main__":
    main()
