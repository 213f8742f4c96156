"""Fault drills an SRE can rerun (results in docs/reliability.md).

The services run as separate processes, as on a cluster: a Debian ``redis-server`` with the
chart's persistence settings (``--appendonly yes --appendfsync everysec --save 60 1``, see
helm/podium/templates/redis.yaml), ``python -m services.leaderboard`` with its blob store on a
small tmpfs (so "disk full" is real), and ``python -m services.orchestrator`` with the local
backend. One experiment runs throughout on 3 pods (bench/drill_pod.py: real processes that
report to the leaderboard every 0.2 s and record every acknowledged report); a second client
(the "hammer") submits metadata reports to another experiment as fast as it can around
the Redis drill. A drill that ends the experiment (a crash-loop verdict) is recorded, and the
next drills run on a new one.

Drills, in order: SIGKILL of one pod; of all pods (twice, back to back); of the orchestrator
(down 2 s); of the leaderboard in the middle of a 32 MB upload; of Redis (down 2 s, the hammer
running); SIGSTOP of the leaderboard for 10 s (a pod killed meanwhile); the blob store filled to
0 bytes free. Before and after each: acknowledged reports, the leaderboard's decided-report log,
board and lineage entries; after each: how long until the platform served again.

Needs root (tmpfs mount) and ``apt-get install -y redis-server``.

    .venv/bin/python bench/fault_drills.py [--out drills.json] [--skip DRILL ...]

Prints one JSON line per drill and a summary; entries lost must be 0.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform as host
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
from drill_pod import report_body
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "drill-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PODS = 3
HAMMER = "hammer"
ENDED = {"succeeded", "failed", "cancelled", "budget_exhausted"}
REDIS_ARGS = ["--appendonly", "yes", "--appendfsync", "everysec", "--save", "60", "1"]


def wait(cond: Callable[[], Any], timeout: float = 120.0, since: float | None = None) -> float:
    """Seconds from ``since`` (a ``time.monotonic()``; default now) until ``cond()`` is truthy,
    rounded to 10 ms; AssertionError after ``timeout`` s of waiting."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s")
        time.sleep(0.05)
    return round(time.monotonic() - (start if since is None else since), 2)


class Service:
    """One process of the platform: started, killed, stopped, restarted as the drill says."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path):
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as f:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
            )

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Platform:
    def __init__(self, work: Path, blob_mb: int):
        self.work = work
        self.blob_dir = work / "blobs"
        self.blob_dir.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={blob_mb}m", "tmpfs", str(self.blob_dir)],
            check=True,
        )
        self.redis_port, self.lb_port, self.orch_port = free_port(), free_port(), free_port()
        self.lb_url = f"http://127.0.0.1:{self.lb_port}"
        self.orch_url = f"http://127.0.0.1:{self.orch_port}"
        redis_dir = work / "redis"
        redis_dir.mkdir()
        base = {**os.environ, "PODIUM_API_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
        base["PODIUM_REDIS_URL"] = f"redis://127.0.0.1:{self.redis_port}/0"
        redis_argv = ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1"]
        self.redis = Service(
            "redis", [*redis_argv, "--dir", str(redis_dir), *REDIS_ARGS], base, work / "redis.log"
        )
        lb_env = {
            **base,
            "PODIUM_DATA_DIR": str(work / "leaderboard"),
            "PODIUM_BLOB_DIR": str(self.blob_dir),
            "PODIUM_PORT": str(self.lb_port),
        }
        py = sys.executable
        self.leaderboard = Service(
            "leaderboard", [py, "-m", "services.leaderboard"], lb_env, work / "leaderboard.log"
        )
        self.orch_dir = work / "orchestrator"
        orch_env = {
            **base,
            "PODIUM_DATA_DIR": str(self.orch_dir),
            "PODIUM_PORT": str(self.orch_port),
            "PODIUM_BACKEND": "local",
            "PODIUM_LEADERBOARD_URL": self.lb_url,
            "PODIUM_POD_COMMAND": json.dumps([py, str(ROOT / "bench" / "drill_pod.py")]),
            "PODIUM_CAPACITY_CPU": str(PODS),
            "PODIUM_CAPACITY_GPUS": "0",
            "PODIUM_RECONCILE_INTERVAL_S": "0.5",
        }
        self.orchestrator = Service(
            "orchestrator",
            [py, "-m", "services.orchestrator"],
            orch_env,
            work / "orchestrator.log",
        )
        self.http = httpx.Client(headers=AUTH, timeout=30)

    def ready(self, url: str) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
        return False

    def start(self) -> None:
        self.redis.start()
        self.leaderboard.start()
        self.orchestrator.start()
        wait(lambda: self.ready(self.lb_url) and self.ready(self.orch_url), 60)

    def stop(self) -> None:
        for s in (self.orchestrator, self.leaderboard, self.redis):
            s.stop()
        for p in self.live_pods().values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p, signal.SIGKILL)
        subprocess.run(["umount", "-l", str(self.blob_dir)], check=False)

    # -- what the drills look at --------------------------------------------------------------
    def pod_records(self, exp: str) -> dict[str, dict[str, Any]]:
        out = {}
        for rec in (self.orch_dir / "experiments" / exp / "pods").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                out[rec.stem] = json.loads(rec.read_text())
        return out

    def live_pods(self, exp: str = "*") -> dict[str, int]:
        """pod id → pid of every drill pod process alive (observed, not asked)."""
        out = {}
        for rec in (self.orch_dir / "experiments").glob(f"{exp}/pods/*.json"):
            with contextlib.suppress(OSError, ValueError, psutil.Error):
                pid = json.loads(rec.read_text())["pid"]
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE and "drill_pod" in " ".join(p.cmdline()):
                    out[rec.stem] = pid
        return out

    def acks(self, exp: str) -> list[tuple[str, str, float]]:
        """(submission id, pod id, time) of every report a drill pod saw acknowledged."""
        out = []
        for f in (self.orch_dir / "experiments" / exp / "pods").glob("*.acks"):
            for line in f.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3:
                    out.append((parts[0], f.stem, float(parts[2])))
        return out

    def decided(self, exp: str) -> Counter[str]:
        """How often each submission id appears in the leaderboard's decided-report log."""
        seen: Counter[str] = Counter()
        after = None
        while True:
            params = {"limit": 10_000, **({"after": after} if after else {})}
            r = self.http.get(f"{self.lb_url}/api/v1/experiments/{exp}/submissions", params=params)
            r.raise_for_status()
            page = r.json()
            seen.update(s["submission_id"] for s in page["submissions"])
            after = page["next_after"]
            if not after:
                return seen

    def lineage(self, exp: str) -> set[str]:
        r = self.http.get(f"{self.lb_url}/api/v1/experiments/{exp}/lineage")
        r.raise_for_status()
        return {n["candidate_id"] for n in r.json()["nodes"]}

    def board(self, exp: str) -> int:
        r = self.http.get(f"{self.lb_url}/api/v1/experiments/{exp}/leaderboard")
        r.raise_for_status()
        return len(r.json()["candidates"])

    def staging_files(self) -> int:
        return len(list((self.blob_dir / ".staging").glob("*")))


class Hammer:
    """Metadata reports to its own experiment as fast as one connection allows; every
    acknowledged one is remembered."""

    def __init__(self, lb_url: str):
        self.url = f"{lb_url}/api/v1/experiments/{HAMMER}"
        self.acked: list[tuple[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        n = 0
        with httpx.Client(headers=AUTH, timeout=10) as c:
            while not self._stop.is_set():
                n += 1
                sid = f"h-{n}"
                body = report_body(sid, "hammer", "ppo", (n * 7919) % 1000 / 2)
                try:
                    if c.post(f"{self.url}/submissions", json=body).status_code == 200:
                        self.acked.append((sid, time.time()))
                except httpx.HTTPError:
                    time.sleep(0.05)


class Drills:
    def __init__(self, p: Platform, hammer: Hammer):
        self.p, self.hammer = p, hammer
        self.experiments: list[str] = []
        self.results: list[dict[str, Any]] = []

    @property
    def exp(self) -> str:
        return self.experiments[-1]

    def start_experiment(self) -> None:
        """A new experiment on PODS drill pods (also when a drill ended the previous one)."""
        spec = {
            "name": "drill",
            "env": {"name": "CartPole-v1", "kwargs": {"drill": {"report_interval_s": 0.2}}},
            "algorithms": {"ppo": 1.0},
            "population": {"min_pods": PODS, "max_pods": PODS},
            "resources": {"cpu": 1, "gpus": 0, "memory": "256Mi"},
        }
        r = self.p.http.post(f"{self.p.orch_url}/api/v1/experiments", json=spec)
        r.raise_for_status()
        self.experiments.append(r.json()["id"])
        wait(lambda: len(self.p.live_pods(self.exp)) == PODS, 120)
        wait(lambda: len(self.p.acks(self.exp)) > 20, 60)

    def snapshot(self) -> dict[str, Any]:
        """Everything acknowledged and stored, over every experiment of the run (ids are
        prefixed with their experiment)."""
        for _ in range(30):
            try:
                return self._snapshot()
            except httpx.HTTPError as e:
                print(f"# snapshot retried: {e!r}", file=sys.stderr)
                time.sleep(1)
        return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        p = self.p
        wait(lambda: p.ready(p.lb_url), 120)
        acked = {f"{HAMMER}/{s}" for s, _ in self.hammer.acked}
        decided: Counter[str] = Counter()
        lineage: set[str] = set()
        board = 0
        for exp in [*self.experiments, HAMMER]:
            acked |= {f"{exp}/{s}" for s, _, _ in p.acks(exp)}
            decided.update({f"{exp}/{s}": n for s, n in p.decided(exp).items()})
            lineage |= {f"{exp}/{c}" for c in p.lineage(exp)}
            board += p.board(exp)
        return {"acked": acked, "decided": decided, "lineage": lineage, "board": board}

    def first_ack_after(self, t0: float, pods: set[str] | None = None) -> bool:
        return any(
            t > t0 and (pods is None or pod not in pods) for _, pod, t in self.p.acks(self.exp)
        )

    def state(self) -> dict[str, Any]:
        return self.p.http.get(f"{self.p.orch_url}/api/v1/experiments/{self.exp}").json()

    def running(self) -> bool:
        """Not ended (pending while it backs off after pod failures is still running)."""
        return self.state()["state"] not in ENDED

    def new_pods(self, old: dict[str, int], n: int) -> bool:
        """``n`` pods not in ``old`` are running; AssertionError if the experiment ended."""
        if len(set(self.p.live_pods(self.exp)) - set(old)) >= n:
            return True
        state = self.state()
        if state["state"] in ENDED:
            raise AssertionError(f"experiment ended: {state['state']}: {state.get('reason')}")
        return False

    @contextlib.contextmanager
    def drill(self, name: str) -> Iterator[dict[str, Any]]:
        before = self.snapshot()
        out: dict[str, Any] = {"drill": name, "experiment": self.exp}
        start = time.monotonic()
        try:
            yield out
        except AssertionError as e:  # recorded; the next drill runs anyway
            out["error"] = f"{e} (after {sorted(out)})"
        time.sleep(2)  # let in-flight reports land before counting
        after = self.snapshot()
        lost_reports = before["acked"] - set(after["decided"])
        lost_lineage = before["lineage"] - after["lineage"]
        # Reports acknowledged during the drill must be there too.
        lost_during = after["acked"] - set(after["decided"])
        out.update(
            acked_before=len(before["acked"]),
            acked_after=len(after["acked"]),
            decided_before=sum(before["decided"].values()),
            decided_after=sum(after["decided"].values()),
            duplicates=sum(c - 1 for c in after["decided"].values() if c > 1),
            board_before=before["board"],
            board_after=after["board"],
            lineage_before=len(before["lineage"]),
            lineage_after=len(after["lineage"]),
            entries_lost=len(lost_reports | lost_during) + len(lost_lineage),
            experiment_running=self.running(),
            seconds=round(time.monotonic() - start, 1),
        )
        print(json.dumps(out), flush=True)
        self.results.append(out)

    # -- the drills ---------------------------------------------------------------------------
    def pod(self) -> None:
        with self.drill("SIGKILL one pod") as out:
            old = self.p.live_pods(self.exp)
            victim = next(iter(old))
            t0, m0 = time.time(), time.monotonic()
            os.killpg(old[victim], signal.SIGKILL)
            out["replacement_running_s"] = wait(lambda: self.new_pods(old, 1), since=m0)
            out["replacement_reporting_s"] = wait(
                lambda: self.first_ack_after(t0, set(old)), since=m0
            )

    def all_pods(self, times: int = 2) -> None:
        with self.drill(f"SIGKILL all pods x{times}") as out:
            for i in range(times):
                old = self.p.live_pods(self.exp)
                t0, m0 = time.time(), time.monotonic()
                for pid in old.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                out[f"round{i + 1}_all_running_s"] = wait(
                    lambda old=old: self.new_pods(old, PODS), since=m0
                )
                out[f"round{i + 1}_reporting_s"] = wait(
                    lambda t0=t0, old=old: self.first_ack_after(t0, set(old)), since=m0
                )

    def orchestrator(self, down_s: float = 2.0) -> None:
        with self.drill(f"SIGKILL orchestrator, down {down_s:g}s") as out:
            t0 = time.time()
            self.p.orchestrator.signal(signal.SIGKILL)
            time.sleep(down_s)
            out["reports_while_down"] = self.first_ack_after(t0)
            restart = time.monotonic()
            self.p.orchestrator.start()
            out["ready_s"] = wait(lambda: self.p.ready(self.p.orch_url))
            time.sleep(3)  # a few passes: it must adopt the pods, not start more
            out["pods_after"] = len(self.p.live_pods(self.exp))
            out["since_restart_s"] = round(time.monotonic() - restart, 2)

    def leaderboard_mid_upload(self, mb: int = 32) -> None:
        with self.drill(f"SIGKILL leaderboard mid-upload ({mb} MB)") as out:
            sent = threading.Event()
            status: dict[str, Any] = {}
            data = os.urandom(1 << 20)

            def body() -> Iterator[bytes]:
                boundary = b"--drillboundary"
                result = {
                    "submission_id": "upload-1",
                    "pod_id": "uploader",
                    "algorithm": "ppo",
                    "score": 1.0,
                    "eval": {"mean": 1.0, "episodes": 1},
                    "files": {"model.safetensors": "0" * 64},
                }
                yield (
                    boundary
                    + b'\r\nContent-Disposition: form-data; name="result"\r\n\r\n'
                    + json.dumps(result).encode()
                    + b"\r\n"
                    + boundary
                    + b'\r\nContent-Disposition: form-data; name="model.safetensors"; '
                    b'filename="model.safetensors"\r\n\r\n'
                )
                for i in range(mb):
                    if i == mb // 2:
                        sent.set()
                        time.sleep(0.5)  # the leaderboard is killed here
                    yield data
                yield b"\r\n" + boundary + b"--\r\n"

            def upload() -> None:
                try:
                    r = self.p.http.post(
                        f"{self.p.lb_url}/api/v1/experiments/{self.exp}/submissions",
                        content=body(),
                        headers={"Content-Type": "multipart/form-data; boundary=drillboundary"},
                    )
                    status["code"] = r.status_code
                except httpx.HTTPError as e:
                    status["error"] = type(e).__name__

            t = threading.Thread(target=upload)
            t.start()
            sent.wait(60)
            time.sleep(0.2)
            t0 = time.time()
            self.p.leaderboard.signal(signal.SIGKILL)
            t.join(30)
            out["upload_outcome"] = status
            out["staging_files_after_kill"] = self.p.staging_files()
            m0 = time.monotonic()
            self.p.leaderboard.start()
            out["ready_s"] = wait(lambda: self.p.ready(self.p.lb_url))
            out["reporting_s"] = wait(lambda: self.first_ack_after(t0), since=m0)
            out["staging_files_after_restart"] = self.p.staging_files()

    def redis(self, down_s: float = 2.0) -> None:
        with self.drill(f"SIGKILL Redis, down {down_s:g}s, hammer running") as out:
            self.hammer.start()
            time.sleep(3)
            before = len(self.hammer.acked)
            self.p.redis.signal(signal.SIGKILL)
            time.sleep(down_s)
            m0, t1 = time.monotonic(), time.time()
            self.p.redis.start()
            out["ready_s"] = wait(
                lambda: self.p.ready(self.p.lb_url) and self.p.ready(self.p.orch_url)
            )
            out["hammer_acking_s"] = wait(
                lambda: any(t > t1 for _, t in self.hammer.acked[before:]), since=m0
            )
            out["pods_reporting_s"] = wait(lambda: self.first_ack_after(t1), since=m0)
            time.sleep(3)
            self.hammer.stop()
            out["hammer_acked"] = len(self.hammer.acked)

    def leaderboard_stopped(self, stop_s: float = 10.0) -> None:
        with self.drill(f"SIGSTOP leaderboard {stop_s:g}s, a pod killed meanwhile") as out:
            self.p.leaderboard.signal(signal.SIGSTOP)
            try:
                time.sleep(1)
                old = self.p.live_pods(self.exp)
                m0 = time.monotonic()
                os.killpg(next(iter(old.values())), signal.SIGKILL)
                out["replacement_running_s"] = wait(lambda: self.new_pods(old, 1), stop_s, since=m0)
            except AssertionError:
                out["replacement_running_s"] = None  # not while the leaderboard was stopped
            finally:
                time.sleep(max(0.0, stop_s - 1))
                t0 = time.time()
                self.p.leaderboard.signal(signal.SIGCONT)
            out["reporting_after_cont_s"] = wait(lambda: self.first_ack_after(t0))
            out["pods_after"] = len(self.p.live_pods(self.exp))

    def blob_store_full(self) -> None:
        with self.drill("blob store full (tmpfs at 0 bytes free)") as out:
            filler = self.p.blob_dir / "filler"
            with filler.open("wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            with contextlib.suppress(OSError), filler.open("ab") as f:
                while True:  # the last partial MiB
                    f.write(b"\0" * 4096)
                    f.flush()
            out["free_bytes"] = shutil.disk_usage(self.p.blob_dir).free
            out["upload_when_full"] = self.upload(1 << 20, "full-1")
            r = httpx.get(f"{self.p.lb_url}/readyz")
            out["readyz_when_full"] = r.status_code
            t0 = time.time()
            try:
                wait(lambda: self.first_ack_after(t0), 10)
                out["metadata_reports_acked_when_full"] = True
            except AssertionError:
                out["metadata_reports_acked_when_full"] = False
            out["staging_files_when_full"] = self.p.staging_files()
            filler.unlink()
            out["upload_after_freeing"] = self.upload(1 << 20, "full-2")
            out["staging_files_after"] = self.p.staging_files()

    def upload(self, size: int, sid: str) -> int:
        data = os.urandom(size)
        result = {
            "submission_id": sid,
            "pod_id": "uploader",
            "algorithm": "ppo",
            "score": 1.0,
            "eval": {"mean": 1.0, "episodes": 1},
            "files": {"model.safetensors": hashlib.sha256(data).hexdigest()},
        }
        r = self.p.http.post(
            f"{self.p.lb_url}/api/v1/experiments/{self.exp}/submissions",
            files={
                "result": (None, json.dumps(result), "application/json"),
                "model.safetensors": ("model.safetensors", data, "application/octet-stream"),
            },
        )
        return r.status_code


DRILLS = ["pod", "all_pods", "orchestrator", "leaderboard_mid_upload", "redis",
          "leaderboard_stopped", "blob_store_full"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--skip", nargs="*", default=[], choices=DRILLS)
    ap.add_argument("--blob-mb", type=int, default=64, help="size of the blob store tmpfs")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    args = ap.parse_args()
    # A stopped run still stops its services and pods and unmounts the tmpfs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if shutil.which("redis-server") is None:
        sys.exit("needs redis-server: apt-get install -y redis-server")
    print(f"# {host.node()} {host.machine()} cpus={os.cpu_count()} redis-server {REDIS_ARGS}")
    work = Path(tempfile.mkdtemp(prefix="podium-drills-"))
    p = Platform(work, args.blob_mb)
    hammer = Hammer(p.lb_url)
    try:
        p.start()
        p.http.put(
            f"{p.lb_url}/api/v1/experiments/{HAMMER}", json={"algorithms": {"ppo": 1.0}}
        ).raise_for_status()
        drills = Drills(p, hammer)
        drills.start_experiment()
        for name in DRILLS:
            if name in args.skip:
                continue
            getattr(drills, name)()
            if not drills.running():
                note = f"experiment {drills.exp} ended; a new one runs the next drills"
                print(json.dumps({"note": note}), flush=True)
                drills.start_experiment()
        summary = {
            "drills": len(drills.results),
            "experiments": len(drills.experiments),
            "acknowledged_reports": len(drills.snapshot()["acked"]),
            "entries_lost": sum(d["entries_lost"] for d in drills.results),
            "duplicates": max((d["duplicates"] for d in drills.results), default=0),
        }
        print(json.dumps({"summary": summary}), flush=True)
        if args.out:
            args.out.write_text(
                json.dumps({"summary": summary, "drills": drills.results}, indent=1)
            )
    finally:
        with contextlib.suppress(Exception):
            hammer.stop()
        p.stop()
        if args.keep:
            print(f"# logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
