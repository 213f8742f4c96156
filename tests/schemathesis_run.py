"""Run schemathesis (its CLI, as a user would) against a live API and read its JSON report.

Shared by tests/test_schemathesis.py (bounded, in CI) and bench/schemathesis_long.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Every check schemathesis has, less one that cannot hold here: `positive_data_acceptance`
# expects every schema-valid request to succeed, but whether a name is registered, an
# algorithm is in the experiment's ensemble, a spec's name is a DNS label or a run fits the
# server's bounds is decided by code the schema cannot express (answered 422 naming the field).
# `negative_data_rejection` is on: it catches a server accepting what its schema forbids.
EXCLUDED_CHECKS = ("positive_data_acceptance",)
PHASES = "examples,coverage,fuzzing,stateful"


@dataclass
class Result:
    report: dict[str, Any]
    output: str

    @property
    def cases(self) -> int:
        return int(self.report["test_cases"]["generated"])

    @property
    def failures(self) -> list[dict[str, Any]]:
        return list(self.report.get("failures") or [])

    @property
    def errors(self) -> list[Any]:
        return list(self.report.get("errors") or [])

    @property
    def server_errors(self) -> int:
        return sum(f["count"] for f in self.failures if f["type"] == "ServerError")

    def summary(self) -> str:
        """The failures as the CLI printed them (what a reader needs to reproduce each)."""
        start = self.output.find("FAILURES")
        return self.output[start:] if start >= 0 else self.output[-6000:]


def run(
    base_url: str,
    token: str | None,
    out_dir: Path,
    *,
    max_examples: int,
    seed: int,
    exclude_checks: tuple[str, ...] = EXCLUDED_CHECKS,
    workers: int = 1,
    timeout_s: float = 600,
    extra: tuple[str, ...] = (),
) -> Result:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{base_url}/api/v1/openapi.json",
        "--checks",
        "all",
        "--phases",
        PHASES,
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--workers",
        str(workers),
        "--request-timeout",
        "30",
        "--generation-database",
        "none",
        "--no-color",
        "--report",
        "json",
        "--report-json-path",
        str(report),
        *extra,
    ]
    if exclude_checks:
        cmd += ["--exclude-checks", ",".join(exclude_checks)]
    if token:
        cmd += ["--header", f"Authorization: Bearer {token}"]
    proc = subprocess.run(
        cmd, cwd=out_dir, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    output = proc.stdout + proc.stderr
    if not report.exists():
        raise RuntimeError(f"schemathesis wrote no report (exit {proc.returncode}):\n{output}")
    return Result(json.loads(report.read_text()), output)
