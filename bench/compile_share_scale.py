"""One compile per experiment at scale, by simulation: N pods of one experiment start together
and settle their compile cache through the real leaderboard (results in docs/deploy.md,
"Compiled pods").

- The real leaderboard (``python -m services.leaderboard``, embedded Redis, filesystem blob
  store) in its own process.
- N pods in this process, one thread each, each running the pods' own code
  (services/pod/runtime/compile_share.py ``CompileShare`` with its own ``LeaderboardClient``) on
  a run config of the experiment, started over ``--spread`` seconds as the orchestrator creates
  them. The pod that is told to compile "compiles" for ``--compile-s`` seconds (it writes
  ``--bundle-mb`` of incompressible files into its cache directory, about what a CPU CartPole
  compile leaves, and sleeps), then publishes at its "first report"; the others wait, fetch,
  verify and unpack, as a pod does.

Measured: pods that compiled (claims answered ``compile``), bundles stored in the blob store,
downloads, the leaderboard's requests by route (its own /metrics), its CPU seconds, every
pod's wait, and how long after the publish the last pod had loaded. Without sharing each pod
compiles: N x ``--compile-s`` compile seconds.

    .venv/bin/python bench/compile_share_scale.py                 # 64 pods
    .venv/bin/python bench/compile_share_scale.py --pods 1000 --spread 30
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402
from cluster_scale import cpu_model, free_port, pct, wait_port  # noqa: E402  (bench/ on path)

from services.api_client import LeaderboardClient  # noqa: E402
from services.contracts.spec import ExperimentSpec  # noqa: E402
from services.pod.runtime.compile_share import CompileShare  # noqa: E402
from services.pod.training.presets import pod_config  # noqa: E402

TOKEN = "compile-share-bench"
EXP = "compiled"


def main() -> None:
    import logging

    from services.logs import configure

    configure(level="WARNING")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=64)
    ap.add_argument("--spread", type=float, default=5.0, help="seconds over which pods start")
    ap.add_argument("--compile-s", type=float, default=20.0)
    ap.add_argument("--bundle-mb", type=float, default=4.0)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="podium-compile-share-"))
    port = free_port()
    env = {
        **os.environ,
        "PODIUM_DATA_DIR": str(work / "lb"),
        "PODIUM_API_TOKEN": TOKEN,
        "PODIUM_PORT": str(port),
        "PODIUM_LOG_LEVEL": "WARNING",
    }
    server = subprocess.Popen([sys.executable, "-m", "services.leaderboard"], cwd=ROOT, env=env)
    try:
        wait_port(port, "leaderboard")
        url = f"http://127.0.0.1:{port}"
        while httpx.get(f"{url}/readyz").status_code != 200:
            time.sleep(0.1)
        result = run(url, work, args, psutil.Process(server.pid))
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps(result, indent=2))


def run(url: str, work: Path, args: argparse.Namespace, server: psutil.Process) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    config = {"top_k": 8, "algorithms": {"ppo": 1.0}, "generator": {"strategy": "pbt"}}
    httpx.put(f"{url}/api/v1/experiments/{EXP}", json=config, headers=headers).raise_for_status()
    spec = ExperimentSpec.model_validate(
        {"name": EXP, "env": {"name": "CartPole-v1"}, "algorithms": {"ppo": 1.0}}
    )
    files = max(1, int(args.bundle_mb))
    outcomes: list[dict[str, Any]] = [{} for _ in range(args.pods)]
    published_at: list[float] = []
    cpu_before = server.cpu_times()
    load_before = os.getloadavg()[0]

    def pod(i: int) -> None:
        time.sleep(args.spread * i / args.pods)
        cache = work / f"cache{i}"
        client = LeaderboardClient(url, EXP, TOKEN)
        share = CompileShare(client, f"p{i}", cache, wait_s=3600)
        begin = time.monotonic()
        share.before_build([pod_config(spec, {"learning_rate": 1e-3 * (1 + i % 7)}, i)])
        if share.pending:  # told to compile: what a compile leaves, then its first report
            time.sleep(args.compile_s)
            for f in range(files):
                (cache / "kernels").mkdir(parents=True, exist_ok=True)
                size = int(args.bundle_mb * 2**20 / files)
                (cache / "kernels" / f"k{f}.so").write_bytes(os.urandom(size))
            share.stepped(args.compile_s)
            share.reported()
            published_at.append(time.monotonic())
        outcomes[i] = {**share.outcome, "settled_at": time.monotonic(), "began": begin}
        client.close()

    start = time.monotonic()
    threads = [threading.Thread(target=pod, args=(i,)) for i in range(args.pods)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    cpu_after = server.cpu_times()
    metrics = httpx.get(f"{url}/metrics").text
    requests: dict[str, int] = {}
    for m in re.finditer(
        r'podium_leaderboard_request_duration_seconds_count\{method="(\w+)",'
        r'route="([^"]+)",status="(\d+)"\} ([0-9.e+]+)',
        metrics,
    ):
        if "compile-caches" in m[2]:
            key = f"{m[1]} {m[2].rsplit('/', 1)[-1]} {m[3]}"
            requests[key] = requests.get(key, 0) + int(float(m[4]))
    states: dict[str, int] = {}
    for o in outcomes:
        states[str(o.get("state"))] = states.get(str(o.get("state")), 0) + 1
    loaded = [o for o in outcomes if o.get("state") == "loaded"]
    waits = [o["waited_s"] for o in loaded]
    stored = [p for p in (work / "lb" / "blobs").rglob("*") if len(p.name) == 64]
    return {
        "pods": args.pods,
        "spread_s": args.spread,
        "compile_s": args.compile_s,
        "bundle_mb": args.bundle_mb,
        "states": states,
        "compiles": sum(1 for o in outcomes if o.get("state") == "published"),
        "compile_seconds_total": args.compile_s * states.get("published", 0),
        "compile_seconds_without_sharing": args.compile_s * args.pods,
        "bundles_stored": len(stored),
        "requests": requests,
        "wait_s_p50": pct(waits, 0.5),
        "wait_s_max": max(waits, default=0.0),
        "last_loaded_after_publish_s": (
            max(o["settled_at"] for o in loaded) - published_at[0]
            if loaded and published_at
            else None
        ),
        "elapsed_s": elapsed,
        "leaderboard_cpu_s": (cpu_after.user + cpu_after.system)
        - (cpu_before.user + cpu_before.system),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, load {load_before:.2f} before",
    }


if __name__ == "__main__":
    main()
