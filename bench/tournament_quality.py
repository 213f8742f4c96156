"""Learning quality of a tournament: P pods under PBT vs P independent pods vs 1 pod.

    python bench/tournament_quality.py [--env Pendulum-v1] [--pods 4] [--reps 5] [--cap-s 120]

The same machine for every arm: P pods with ``PODIUM_CPU = cores / P`` each, or one pod alone
on it (``--single-cpu`` torch threads, default 1: a second intra-op thread makes PPO on these
small networks much slower, so one thread is the single pod's best use of the machine).
Hyperparameters come from a wide search space (below), so which ones a pod gets matters:

- ``pbt``: P pods, PBT generator (exploit the top quarter, explore by perturbing);
- ``random``: P independent pods, random generator (each keeps its own draw; best of P);
- ``single``: 1 pod, random generator.

Each run is real: the leaderboard app (uvicorn thread, embedded Redis) and real pod processes
(``python -m services.pod``). Time to target = from launching the pods to the first moment the
leaderboard's best score reaches the target (polled every 0.25 s; pod start-up included); runs
stop there or at ``--cap-s``. Final score = the best score on the board after the pods' final
reports. Arms are interleaved per repetition. Prints a markdown table of medians.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from services.cli.platform import ThreadedServer, bind_listener
from services.leaderboard.app import create_app
from services.leaderboard.settings import LeaderboardSettings

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
TARGET = {"Pendulum-v1": -200.0, "MountainCarContinuous-v0": 90.0, "CartPole-v1": 475.0}
# Wide ranges: most draws learn slowly or not at all under the budget.
SEARCH_SPACE = {
    "learning_rate": {"type": "log_uniform", "low": 5e-5, "high": 1e-2},
    "gamma": {"type": "uniform", "low": 0.8, "high": 0.99},
    "gae_lambda": {"type": "uniform", "low": 0.8, "high": 0.99},
    "clip_coef": {"type": "uniform", "low": 0.05, "high": 0.4},
    "ent_coef": {"type": "uniform", "low": 0.0, "high": 0.02},
}


# Wider still: a user who does not know PPO's good values for the task. Few draws learn within
# the cap, so which ones a pod gets (and whether the population can move to better ones) matters
# more than in SEARCH_SPACE.
WIDE_SEARCH_SPACE = {
    "learning_rate": {"type": "log_uniform", "low": 1e-5, "high": 5e-2},
    "gamma": {"type": "uniform", "low": 0.5, "high": 0.999},
    "gae_lambda": {"type": "uniform", "low": 0.5, "high": 0.999},
    "clip_coef": {"type": "uniform", "low": 0.02, "high": 0.5},
    "ent_coef": {"type": "uniform", "low": 0.0, "high": 0.05},
}


class Leaderboard:
    """The leaderboard app served in a thread of this process, plus an authorized client."""

    def __init__(self, data_dir: Path) -> None:
        settings = LeaderboardSettings(data_dir=data_dir, api_token=TOKEN, redis_url=None)
        self.server = ThreadedServer(
            "leaderboard", create_app(settings), bind_listener("127.0.0.1", 0), "127.0.0.1"
        )
        self.server.start()
        self.url = self.server.url
        self.http = httpx.Client(
            base_url=f"{self.url}/api/v1", headers={"Authorization": f"Bearer {TOKEN}"}
        )

    def close(self) -> None:
        self.http.close()
        self.server.stop(30)


def run(
    lb: Leaderboard, arm: str, rep: int, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    pods = 1 if arm == "single" else args.pods
    strategy = "pbt" if arm == "pbt" else "random"
    # One generator seed per repetition and the same pod ids in every arm: the arms' pods
    # start from the same draws and torch seeds (a pod seeds torch from its id), so a
    # repetition compares strategies rather than luck; the single pod is the random arm's
    # first pod. The ids carry the repetition, so repetitions differ in training seeds too.
    options: dict[str, Any] = {"seed": rep}
    if arm == "pbt" and args.ready_env_steps is not None:
        options["ready_env_steps"] = args.ready_env_steps
    if arm == "pbt" and args.truncation is not None:
        options["truncation"] = args.truncation
    exp = f"{arm}-{rep}"
    spec = {
        "name": exp,
        "env": {"name": args.env},
        "algorithms": {"ppo": 1.0},
        "search_space": WIDE_SEARCH_SPACE if args.space == "wide" else SEARCH_SPACE,
        "generator": {"strategy": strategy, "options": options},
        "round": {"env_steps": args.round_steps},
        "evaluation": {"episodes": 10, "seed": rep},
        "top_k": 16,
    }
    config = {k: spec[k] for k in ("search_space", "generator", "algorithms", "top_k")}
    lb.http.put(f"/experiments/{exp}", json=config).raise_for_status()
    if args.mode == "round-robin":
        return run_round_robin(lb, arm, rep, args, work, spec, pods)
    cores = args.cores or os.cpu_count() or 1
    procs = []
    start = time.monotonic()
    for i in range(pods):
        env = {
            **os.environ,
            "PODIUM_EXPERIMENT_ID": exp,
            "PODIUM_POD_ID": f"r{rep}-p{i}",
            "PODIUM_SPEC": json.dumps(spec),
            "PODIUM_POD_DIR": str(work),
            "PODIUM_CPU": f"{args.single_cpu if arm == 'single' else cores / pods:g}",
            "PODIUM_LEADERBOARD_URL": lb.url,
            "PODIUM_API_TOKEN": TOKEN,
            "PODIUM_LOG_JSON": "1",
        }
        log = (work / f"{exp}-{i}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "services.pod"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    reached = first = None
    target = TARGET[args.env]
    while time.monotonic() - start < args.cap_s:
        r = lb.http.get(f"/experiments/{exp}/best")
        if r.status_code == 200:
            if first is None:  # the first report: the pods are up and have trained a round
                first = time.monotonic() - start
            if r.json()["score"] >= target:
                reached = time.monotonic() - start
                break
        time.sleep(0.25)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(60)
    best = lb.http.get(f"/experiments/{exp}/best")
    final = best.json()["score"] if best.status_code == 200 else None
    summary = lb.http.get(f"/experiments/{exp}").json()
    return {
        "arm": arm,
        "rep": rep,
        "time_to_target_s": reached,
        "first_report_s": first,
        "final": final,
        "env_steps": summary["env_steps"],
        "exit_codes": [p.returncode for p in procs],
    }


def run_round_robin(
    lb: Leaderboard,
    arm: str,
    rep: int,
    args: argparse.Namespace,
    work: Path,
    spec: dict[str, Any],
    pods: int,
) -> dict[str, Any]:
    """The same pods' code (PodRuntime: generator, rounds, reports, PBT exploit) in this one
    process, one round of one pod at a time on one thread. The clock is the CPU time of that
    thread (``time.thread_time``: other jobs on a shared machine do not move it; the leaderboard's
    own thread is not counted), so every arm gets exactly the same total CPU and no arm pays
    for interpreters starting."""
    import torch

    from services.api_client import LeaderboardClient
    from services.contracts.spec import ExperimentSpec
    from services.pod.runtime import PodRuntime, RuntimeSettings

    torch.set_num_threads(1)
    model = ExperimentSpec.model_validate(spec)
    exp, target = spec["name"], TARGET[args.env]
    runtimes = [
        PodRuntime(
            exp,
            f"r{rep}-p{i}",
            model,
            LeaderboardClient(lb.url, exp, TOKEN),
            RuntimeSettings(work_dir=work / str(i)),
        )
        for i in range(pods)
    ]
    clock, reached = 0.0, None
    try:
        for rt in runtimes:
            start = time.thread_time()
            rt.start()
            clock += time.thread_time() - start
        while reached is None and clock < args.cap_s:
            for rt in runtimes:
                start = time.thread_time()
                rt.train_round()
                rt.report()
                score = rt.slots[0].score
                done = score is not None and score >= target
                if not done:
                    rt.maybe_exploit()
                clock += time.thread_time() - start
                if done:
                    reached = clock
                    break
    finally:
        for rt in runtimes:
            rt.close()
    best = lb.http.get(f"/experiments/{exp}/best")
    summary = lb.http.get(f"/experiments/{exp}").json()
    return {
        "arm": arm,
        "rep": rep,
        "time_to_target_s": reached,
        "first_report_s": 0.0,
        "final": best.json()["score"] if best.status_code == 200 else None,
        "env_steps": summary["env_steps"],
        "exit_codes": [],
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--env", default="Pendulum-v1", choices=sorted(TARGET))
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--first-rep",
        type=int,
        default=0,
        help="number of the first repetition (seeds the pods): split reps over processes",
    )
    parser.add_argument("--cap-s", type=float, default=120.0)
    parser.add_argument("--round-steps", type=int, default=8192)
    parser.add_argument("--cores", type=float, default=None, help="total CPU; default: all")
    parser.add_argument(
        "--single-cpu",
        type=float,
        default=1.0,
        help="PODIUM_CPU of the single pod (torch threads); small nets run fastest on one",
    )
    parser.add_argument(
        "--ready-env-steps",
        type=int,
        default=None,
        help="pbt: env steps an agent trains before it may be replaced (generator option)",
    )
    parser.add_argument(
        "--truncation",
        type=float,
        default=None,
        help="pbt: share of the pods replaced (generator option); default: all but the best",
    )
    parser.add_argument("--space", choices=["default", "wide"], default="default")
    parser.add_argument(
        "--mode",
        choices=["processes", "round-robin"],
        default="processes",
        help="processes: real pod processes sharing the machine (wall time); round-robin: "
        "the pods' code in this process, one round at a time (CPU time, no start-up)",
    )
    parser.add_argument("--arms", nargs="+", default=["pbt", "random", "single"])
    parser.add_argument(
        "--summarize",
        nargs="+",
        type=Path,
        default=None,
        help="print the table of earlier runs' output files (reps split over processes)",
    )
    args = parser.parse_args()
    if args.summarize:
        lines = [ln for f in args.summarize for ln in f.read_text().splitlines()]
        summarize([json.loads(ln) for ln in lines if ln.startswith('{"arm"')], args)
        return
    logging.getLogger("httpx").setLevel(logging.WARNING)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; {args.env}, {args.pods} pods, cap {args.cap_s:g}s, "
        f"{args.mode}, {args.space} search space, ready {args.ready_env_steps}, "
        f"truncation {args.truncation}",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="podium-bench-") as tmp:
        lb = Leaderboard(Path(tmp) / "lb")
        try:
            for rep in range(args.first_rep, args.first_rep + args.reps):
                arms = args.arms[rep % len(args.arms) :] + args.arms[: rep % len(args.arms)]
                for arm in arms:
                    work = Path(tmp) / f"{arm}-{rep}"
                    work.mkdir()
                    out = run(lb, arm, rep, args, work)
                    results.append(out)
                    print(json.dumps(out), flush=True)
        finally:
            lb.close()
    summarize(results, args)


def summarize(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """A markdown table of medians per arm (an unsolved run counts as the cap), then the
    paired comparison: the arms of one repetition start from the same draws."""
    seen: set[tuple[str, int]] = set()
    for r in results:
        if (r["arm"], r["rep"]) in seen:
            raise SystemExit(f"arm {r['arm']} rep {r['rep']} appears twice: one run per file set")
        seen.add((r["arm"], r["rep"]))
    results = sorted(results, key=lambda r: r["rep"])
    arms = [a for a in ("pbt", "random", "single") if any(r["arm"] == a for r in results)]
    target = TARGET[args.env]
    print(
        f"\n| arm | pods | time to {target:g}: median s | from first report: median s | "
        "env steps to target: median | solved within cap | per run s | final best: median | "
        "per run |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    medians: dict[str, float | None] = {}
    trained: dict[str, float | None] = {}
    capped: dict[str, dict[int, float]] = {}
    for arm in arms:
        runs = [r for r in results if r["arm"] == arm]
        times = [r["time_to_target_s"] for r in runs]
        # An unsolved run counts as the cap: the median is then a lower bound.
        capped[arm] = {
            r["rep"]: t if t is not None else args.cap_s for r, t in zip(runs, times, strict=True)
        }
        medians[arm] = median(list(capped[arm].values()))
        # Start-up (interpreters importing torch, the first round) is paid alike by every
        # arm with the same number of pods; this column is the time spent learning after it.
        after = [capped[arm][r["rep"]] - (r["first_report_s"] or 0.0) for r in runs]
        trained[arm] = median(after)
        finals = [r["final"] for r in runs if r["final"] is not None]
        per_run = ", ".join(f"{t:.1f}" if t is not None else f">{args.cap_s:g}" for t in times)
        # All pods' env steps when the target was reached: the CPU clock's noise-free twin
        # (every arm runs the same code per step); an unsolved run counts as endless.
        steps = median(
            [r["env_steps"] if r["time_to_target_s"] is not None else float("inf") for r in runs]
        )
        print(
            f"| {arm} | {1 if arm == 'single' else args.pods} | {medians[arm]:.1f} | "
            f"{trained[arm]:.1f} | {'unsolved' if steps == float('inf') else f'{steps:,.0f}'} | "
            f"{sum(t is not None for t in times)}/{len(runs)} | "
            f"{per_run} | {median(finals):.1f} | {', '.join(f'{f:.1f}' for f in finals)} |"
        )
    if "pbt" not in medians:
        return
    for arm in arms:
        if arm == "pbt":
            continue
        reps = sorted(set(capped["pbt"]) & set(capped[arm]))
        ratios = [capped["pbt"][r] / capped[arm][r] for r in reps]
        faster = sum(x < 1 for x in ratios)
        print(
            f"pbt / {arm} time to target: {medians['pbt'] / medians[arm]:.2f}x from launch, "
            f"{trained['pbt'] / trained[arm]:.2f}x from the first report; paired over "
            f"{len(reps)} reps: median ratio {median(ratios) or float('nan'):.2f}x, pbt "
            f"faster in {faster}, at most 0.5x in {sum(x <= 0.5 for x in ratios)}"
        )


if __name__ == "__main__":
    main()
