"""Write a Prometheus file_sd target list of the local backend's training pods.

With the local backend (docker compose, one machine) every pod is a process that serves its metrics
on an ephemeral port (``PODIUM_METRICS_PORT=0``) and writes the bound port to
``<data_dir>/experiments/<experiment>/pods/<pod>.metrics_port``. Prometheus cannot discover those
ports itself, so this loop turns the files into ``file_sd_configs`` targets (``<host>:<port>``
labelled ``experiment`` and ``pod``) for the pods whose record says they still run, rewriting the
file atomically whenever the set changes. Stdlib only: it runs in the control-plane image.

    python deploy/prometheus/pod_targets.py --data-dir /data --host orchestrator \
        --out /sd/pods.json [--interval 1] [--once]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def _running(record: Path) -> bool:
    """Whether the local backend's record says the pod still runs. The record outlives the
    process until the reconciler's next pass removes it, but the backend marks it `ended` (and
    `exit_code` for its own children) the moment the process exits: a target listed until the
    removal is scraped `down` for those seconds."""
    try:
        rec = json.loads(record.read_text())
    except (OSError, ValueError):
        return False  # gone (the pod was removed); records are replaced atomically
    return rec.get("ended") is None and rec.get("exit_code") is None


def targets(data_dir: Path, host: str) -> list[dict[str, object]]:
    """One file_sd group per live pod metrics endpoint, sorted for stable output."""
    out = []
    for path in sorted((data_dir / "experiments").glob("*/pods/*.metrics_port")):
        try:
            port = int(path.read_text().strip())
        except (OSError, ValueError):
            continue  # being replaced or removed: the next pass sees it
        pod = path.name.removesuffix(".metrics_port")
        if not _running(path.parent / f"{pod}.json"):
            continue
        out.append(
            {
                "targets": [f"{host}:{port}"],
                "labels": {"experiment": path.parent.parent.name, "pod": pod},
            }
        )
    return out


def write(out: Path, groups: list[dict[str, object]]) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(groups, indent=1) + "\n")
    os.replace(tmp, out)  # Prometheus never reads a half-written file


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, required=True, help="The orchestrator's data dir.")
    p.add_argument("--host", default="127.0.0.1", help="Host Prometheus reaches the pods at.")
    p.add_argument("--out", type=Path, required=True, help="file_sd JSON file to write.")
    # A glob and a few small reads per scan: cheap enough to drop an ended pod within a second
    # (Prometheus watches the file, so it applies the change at once).
    p.add_argument("--interval", type=float, default=1.0, help="Seconds between scans.")
    p.add_argument("--once", action="store_true", help="Write once and exit.")
    args = p.parse_args(argv)
    # As a container's PID 1 the process gets no default SIGTERM action: exit on it, or every
    # `docker stop` waits out its timeout and kills.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    last = None
    while True:
        groups = targets(args.data_dir, args.host)
        if groups != last:
            write(args.out, groups)
            last = groups
        if args.once:
            return
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
