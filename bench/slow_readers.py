"""Clients that never read their answers, against both services of ``podium up`` at their default
client limits (results in docs/benchmarks.md, "Clients that misbehave").

    .venv/bin/python bench/slow_readers.py [--attackers 300] [--requests 67] [--nofile 1024]

``podium up`` starts on ephemeral ports under an open-file limit of ``--nofile`` (the
connection limit is a quarter of it). Against each service in turn, ``--attackers``
connections each pipeline ``--pipelined`` GETs of ``/api/v1/openapi.json`` (41 KB answers)
with a 4 KiB receive buffer and never read; meanwhile ``--requests`` normal GETs, each on a new
connection, are timed (answered: a 200 within 1 s). The service's RSS is read before and after.
Without a deadline on writes nothing else was answered for 60 s, and each connection held every
request it had pipelined.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]


def start_up(data_dir: Path, nofile: int) -> tuple[subprocess.Popen, str, str, str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    env = {k: v for k, v in os.environ.items() if not k.startswith("PODIUM_")}
    env.update(PODIUM_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--data-dir", str(data_dir), "--port", "0",
         "--leaderboard-port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=limit,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        session = data_dir / "platform.json"
        with contextlib.suppress(OSError, ValueError):
            s = json.loads(session.read_text())
            urls = (s["orchestrator_url"], s["leaderboard_url"])
            if all(httpx.get(f"{u}/readyz", timeout=2).status_code == 200 for u in urls):
                return proc, *urls, s.get("token") or ""
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("podium up did not become ready")


def never_reading(url: str, pipelined: int) -> socket.socket:
    parts = urlsplit(url)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    s.connect((parts.hostname, parts.port))
    s.setblocking(False)
    request = f"GET /api/v1/openapi.json HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode()
    with contextlib.suppress(BlockingIOError):
        s.send(request * pipelined)
    return s


def attack(url: str, path: str, token: str, pid: int, args: argparse.Namespace) -> dict:
    proc = psutil.Process(pid)
    rss_before = proc.memory_info().rss
    socks = []
    for _ in range(args.attackers):
        with contextlib.suppress(OSError):
            socks.append(never_reading(url, args.pipelined))
    time.sleep(0.5)
    times, missed = [], []
    for i in range(args.requests):
        start = time.monotonic()
        try:
            r = httpx.get(url + path, timeout=1.0, headers={"Authorization": f"Bearer {token}"})
            took = time.monotonic() - start
            ok = r.status_code == 200 and took <= 1.0
            times.append(took if ok else None)
            if not ok:
                missed.append(f"#{i}: {r.status_code} in {took:.2f} s")
        except httpx.HTTPError as exc:
            times.append(None)
            missed.append(f"#{i}: {type(exc).__name__}")
        time.sleep(0.02)
    rss_after = proc.memory_info().rss
    for s in socks:
        s.close()
    answered = sorted(t for t in times if t is not None)
    return {
        "attackers": len(socks),
        "answered_within_1s": f"{len(answered)}/{len(times)}",
        "p50_ms": round(1000 * answered[len(answered) // 2], 1) if answered else None,
        "rss_mb": f"{rss_before >> 20} -> {rss_after >> 20}",
        "missed": missed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attackers", type=int, default=300)
    parser.add_argument("--pipelined", type=int, default=1500)
    parser.add_argument("--requests", type=int, default=67)
    parser.add_argument("--nofile", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, orch, lb, token = start_up(Path(tmp) / "data", args.nofile)
        try:
            for name, url, path in (
                ("orchestrator", orch, "/api/v1/experiments"),
                ("leaderboard", lb, "/livez"),
            ):
                print(json.dumps({"service": name, **attack(url, path, token, proc.pid, args)}))
                time.sleep(2)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
