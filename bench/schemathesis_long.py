"""A long schemathesis run against both services (results in docs/benchmarks.md, section
"API fuzzing").

The services are `podium up`'s embedded platform (real HTTP on 127.0.0.1, an embedded Redis)
with the stand-in pod as the local backend's pod command, exactly as tests/test_schemathesis.py
runs them, with many more examples: every phase (stateful included), every check but
``positive_data_acceptance`` (see tests/schemathesis_run.py), seeded.

    .venv/bin/python bench/schemathesis_long.py [--max-examples 400] [--seed 1] [--out DIR]
        [--api orchestrator|leaderboard ...] [--continue-on-failure]

Prints one JSON line per API (cases generated, failures by check, 5xx, time) and writes each
API's schemathesis JSON report and CLI output under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import schemathesis_run  # noqa: E402
from tests.platform_servers import standin_platform  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-examples", type=int, default=400, help="per operation and phase")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="reports (default: a temp dir)")
    ap.add_argument("--api", choices=["orchestrator", "leaderboard"], nargs="*", default=None)
    ap.add_argument(
        "--continue-on-failure",
        action="store_true",
        help="keep generating for an operation after its first failure (more cases)",
    )
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="schemathesis-long-"))
    print(f"# {host.node()} {host.processor() or host.machine()} cpus={os.cpu_count()}")
    with tempfile.TemporaryDirectory() as data, standin_platform(Path(data)) as p:
        for service, url in (
            ("orchestrator", p.orchestrator_url),
            ("leaderboard", p.leaderboard_url),
        ):
            if args.api and service not in args.api:
                continue
            start = time.monotonic()
            result = schemathesis_run.run(
                url,
                p.token,
                out / service,
                max_examples=args.max_examples,
                seed=args.seed,
                workers=args.workers,
                timeout_s=6 * 3600,
                extra=("--continue-on-failure",) if args.continue_on_failure else (),
            )
            (out / service / "output.txt").write_text(result.output)
            by_code = {f"{f['code']} {f['title']}": f["count"] for f in result.failures}
            print(
                json.dumps(
                    {
                        "api": service,
                        "cases": result.cases,
                        "failures": sum(by_code.values()),
                        "server_errors_5xx": result.server_errors,
                        "by_code": by_code,
                        "errors": len(result.errors),
                        "phases": {k: v["status"] for k, v in result.report["phases"].items()},
                        "seconds": round(time.monotonic() - start, 1),
                        "services_alive": p.healthy(),
                        "report": str(out / service),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
