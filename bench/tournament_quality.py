"""Learning quality of a tournament: P pods under PBT vs P independent pods vs 1 pod.

    python bench/tournament_quality.py [--task pendulum] [--pods 4] [--reps 5] [--cap-s 120]

``--task`` picks the env, the algorithms, the search space, the target and the budgets
(``TASKS`` below); ``--cap-s``, ``--round-steps`` and ``--ready-env-steps`` override the task's.

The same machine for every arm: P pods with ``PODIUM_CPU = cores / P`` each, or one pod alone
on it (``--single-cpu`` torch threads, default 1: a second intra-op thread makes PPO on these
small networks much slower, so one thread is the single pod's best use of the machine).
Hyperparameters come from a wide search space (below), so which ones a pod gets matters:

- ``pbt``: P pods, PBT generator (exploit the top quarter, explore by perturbing), the task's
  one algorithm;
- ``ensemble``: P pods, PBT generator, an ensemble of algorithms (ElegantRL's: pod i trains the
  task's i-th ensemble algorithm, round robin; PBT copies only within an algorithm);
- ``improving``: as ``pbt``, with the generator option ``protect_improving`` (an agent whose
  score rose since its previous report is not replaced);
- ``random``: P independent pods, random generator (each keeps its own draw; best of P);
- ``random-ensemble``: as ``random`` over the ensemble's algorithms (best of P);
- ``single``: 1 pod, random generator, the task's one algorithm;
- ``pop-pbt``: ONE population pod (``population.agents_per_pod = P``: P PPO agents trained
  batched in one process, services/pod/training/onpolicy.py), PBT between its agents;
- ``pop-random``: one population pod, random generator (each agent keeps its draw): the
  batched best of P, which splits ``pop-pbt``'s gain over ``random`` into batching
  (``pop-random`` / ``random``) and selection (``pop-pbt`` / ``pop-random``);
- ``halving``: the ``random`` arm's P pods (the same draws and seeds) under successive halving
  across pods (``population.halving``, ``--rung-env-steps``, eta 2), stopped by the
  orchestrator's own rule (services/orchestrator/scaling.py ``plan_scale`` with the pods'
  last scores, at the rungs of services/contracts/spec.py ``halving_pods``); round-robin
  mode only, where a stopped pod's rounds go to the others.

The population arms start their P agents from the same draws as pods 0..P-1 of the other arms
(the generator's seeded draw depends on the asking id, and the bench asks with those pods'
ids); their torch seeds differ (a population seeds agent i from its pod id).

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
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.cli.platform import ThreadedServer, bind_listener
from services.contracts.algorithms.hyperparameters import hyperparameter_names
from services.leaderboard.app import create_app
from services.leaderboard.settings import LeaderboardSettings

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
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


@dataclass(frozen=True)
class Task:
    """One benchmark task: what the pods train and when a run has reached its target."""

    env: str
    target: float
    algorithm: str  # the pbt, improving, random and single arms
    ensemble: tuple[str, ...]  # the ensemble arms' algorithms, pod i trains ensemble[i % n]
    search_space: dict[str, Any]
    round_steps: int
    ready_env_steps: int
    cap_s: float  # CPU seconds of all pods together (round-robin clock)
    eval_episodes: int = 10
    # protect_improving's margin (score units): a rise smaller than this is evaluation noise.
    improvement: float = 0.0


def pin(value: Any) -> dict[str, Any]:
    """A one-value choice: a run setting every pod shares."""
    return {"type": "choice", "values": [value]}


def offpolicy_space(
    num_envs: int,
    updates_per_step: float,
    learning_starts: int,
    hidden: int,
    lr_high: float,
    noise_high: float,
    alpha_high: float,
) -> dict[str, Any]:
    """Off-policy settings every pod of a task shares (the loop's and the network's), then
    the searched ones. Names only some algorithms of an ensemble take (exploration_noise:
    DDPG/TD3, init_alpha: SAC) are applied by those pods."""
    return {
        "num_envs": pin(num_envs),
        "batch_size": pin(256),
        "updates_per_step": pin(updates_per_step),
        "learning_starts": pin(learning_starts),
        "hidden_sizes": pin([hidden, hidden]),
        "learning_rate": {"type": "log_uniform", "low": 1e-4, "high": lr_high},
        "gamma": {"type": "uniform", "low": 0.95, "high": 0.999},
        "tau": {"type": "log_uniform", "low": 0.002, "high": 0.05},
        "exploration_noise": {"type": "uniform", "low": 0.05, "high": noise_high},
        "init_alpha": {"type": "log_uniform", "low": 0.01, "high": alpha_high},
    }


# MountainCar: many envs and few updates per env step: on two shared cores the env steps are
# what is scarce for an exploration task, and 32 torch-native envs step nearly for free.
# Exploration is what it is about: noise from nearly none to wild, SAC's temperature likewise.
MCC_SPACE = {
    **offpolicy_space(32, 0.0625, 8192, 64, 1e-2, 1.0, 10.0),
    # The kind of exploration noise is searched too: white noise never leaves "do nothing",
    # time-correlated noise usually does (docs/tournaments.md), and a pod cannot know which.
    "action_noise": {"type": "choice", "values": ["white", "ou", "pink"]},
}
# SAC on Pendulum with the preset's loop (32 envs, batch 512, 0.25 updates per env step) and
# its learning values searched as widely as WIDE_SEARCH_SPACE searches PPO's: a short horizon,
# a tiny or huge learning rate or a temperature that drowns the reward never swings up.
SAC_WIDE_SPACE = {
    "learning_rate": {"type": "log_uniform", "low": 1e-5, "high": 5e-2},
    "gamma": {"type": "uniform", "low": 0.5, "high": 0.999},
    "tau": {"type": "log_uniform", "low": 1e-3, "high": 0.5},
    "init_alpha": {"type": "log_uniform", "low": 0.01, "high": 10.0},
}
# HalfCheetah: gymnasium's CPU envs cost far more per step; fewer, and more updates per step.
CHEETAH_SPACE = offpolicy_space(4, 0.25, 4000, 128, 3e-3, 0.5, 1.0)

TASKS: dict[str, Task] = {
    # PPO on Pendulum (docs/benchmarks.md, "Tournament learning quality"): the ensemble adds
    # PPO's off-policy rivals, which learn Pendulum in a tenth of PPO's env steps.
    "pendulum": Task(
        "Pendulum-v1",
        -200.0,
        "ppo",
        ("ppo", "sac"),
        SEARCH_SPACE,
        2048,
        8192,
        60.0,
        improvement=50.0,
    ),
    "pendulum-wide": Task(
        "Pendulum-v1",
        -200.0,
        "ppo",
        ("ppo", "sac"),
        WIDE_SEARCH_SPACE,
        2048,
        16_384,  # the generator's default, as for every PPO wide-space task
        60.0,
        improvement=50.0,
    ),
    # The wide space with gSDE pinned off (population pods have no gSDE; a one-value choice
    # is a setting every agent shares): the arms with and without population pods alike.
    "pendulum-pop": Task(
        "Pendulum-v1",
        -200.0,
        "ppo",
        ("ppo", "sac"),
        {**WIDE_SEARCH_SPACE, "sde_sample_freq": pin(0)},
        2048,
        8192,
        40.0,
        improvement=50.0,
    ),
    # MountainCarContinuous with PPO in the wide space: the flag is ~100 steps of rocking
    # away, so a short horizon (gamma far below 0.99), a tiny learning rate or a policy that
    # narrows before it reaches the flag never leaves "do nothing"; PPO's preset (gamma 0.99,
    # unit initial std) solves it alone. Population pods train PPO, so this is the
    # exploration task they can run.
    "mcc-ppo": Task(
        "MountainCarContinuous-v0",
        90.0,
        "ppo",
        ("ppo",),
        WIDE_SEARCH_SPACE,
        2048,
        16_384,
        60.0,
        improvement=5.0,
    ),
    # Acrobot with PPO's preset (16 envs x 256 steps) in the wide space: unlike Pendulum's,
    # most wide draws still reach -100 (docs/benchmarks.md), a control for the wide tasks.
    "acrobot-wide": Task(
        "Acrobot-v1",
        -100.0,
        "ppo",
        ("ppo",),
        WIDE_SEARCH_SPACE,
        4096,
        16_384,
        120.0,
        improvement=10.0,
    ),
    # CartPole with PPO's preset (16 envs x 16 steps, many epochs) in the wide space: a
    # short horizon or an extreme learning rate never balances the pole for 500 steps.
    "cartpole-wide": Task(
        "CartPole-v1",
        475.0,
        "ppo",
        ("ppo",),
        WIDE_SEARCH_SPACE,
        2048,
        16_384,
        60.0,
        improvement=25.0,
    ),
    "pendulum-sac-wide": Task(
        "Pendulum-v1",
        -200.0,
        "sac",
        ("sac",),
        SAC_WIDE_SPACE,
        2048,
        4096,
        120.0,
        eval_episodes=50,  # the preset's: a return depends on the start angle
        improvement=50.0,
    ),
    # Hard exploration: most off-policy draws never leave "do nothing" (score ~0), and an
    # agent still exploring scores below it (the action cost), so PBT's plain rule copies the
    # idle ones. Target 90: gymnasium's reward threshold.
    "mcc": Task(
        "MountainCarContinuous-v0",
        90.0,
        "td3",
        ("td3", "sac", "ddpg"),
        MCC_SPACE,
        round_steps=8192,
        ready_env_steps=16_384,
        cap_s=40.0,
        improvement=5.0,
    ),
    # MuJoCo locomotion through EnvPool's HalfCheetah-v5 (the same task as gymnasium's, faster
    # from 8 envs): a target far below a solved cheetah, because two shared cores train a
    # few tens of thousands of env steps per pod at most.
    "halfcheetah": Task(
        "envpool:HalfCheetah-v5",
        1500.0,
        "td3",
        ("td3", "sac", "ddpg"),
        CHEETAH_SPACE,
        4096,
        16_384,
        600.0,
        eval_episodes=3,
        improvement=100.0,
    ),
    # PPO on EnvPool's HalfCheetah-v5 (the preset: 8 envs x 256 steps, 10 epochs, normalised
    # observations and rewards), for the population arms: a population of 4 costs ~1.8x one
    # agent's CPU per round here. Single runs split by seed between a fast gait (3,000 within
    # ~350k env steps) and a slow one (~1,700); the search space is around the preset's values.
    "halfcheetah-ppo": Task(
        "envpool:HalfCheetah-v5",
        3000.0,
        "ppo",
        ("ppo",),
        {
            "learning_rate": {"type": "log_uniform", "low": 1e-4, "high": 1e-3},
            "gamma": {"type": "uniform", "low": 0.98, "high": 0.999},
            "gae_lambda": {"type": "uniform", "low": 0.9, "high": 0.98},
            "clip_coef": {"type": "uniform", "low": 0.1, "high": 0.3},
            "ent_coef": {"type": "uniform", "low": 0.0, "high": 0.005},
        },
        round_steps=20_480,
        ready_env_steps=61_440,
        cap_s=300.0,
        eval_episodes=3,
        improvement=100.0,
    ),
}
TOURNAMENT_ARMS = ("pbt", "ensemble", "improving", "pop-pbt", "halving")
POPULATION_ARMS = ("pop-pbt", "pop-random")
ARMS = (*TOURNAMENT_ARMS, "random", "random-ensemble", "single", "pop-random")


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


def arm_algorithms(arm: str, task: Task) -> tuple[str, ...]:
    """The algorithms of an arm's pods: pod i trains the i-th (round robin)."""
    return task.ensemble if arm.endswith("ensemble") else (task.algorithm,)


def run(
    lb: Leaderboard, arm: str, rep: int, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    task: Task = args.task_config
    pods = 1 if arm == "single" or arm in POPULATION_ARMS else args.pods
    strategy = "pbt" if arm in TOURNAMENT_ARMS and arm != "halving" else "random"
    # One generator seed per repetition and the same pod ids in every arm: the arms' pods
    # start from the same draws and torch seeds (a pod seeds torch from its id), so a
    # repetition compares strategies rather than luck; the single pod is the random arm's
    # first pod. The ids carry the repetition, so repetitions differ in training seeds too.
    options: dict[str, Any] = {"seed": rep}
    if strategy == "pbt":
        options["ready_env_steps"] = args.ready_env_steps
        if args.truncation is not None:
            options["truncation"] = args.truncation
        if args.exploit_margin:
            options["exploit_margin"] = args.exploit_margin
        if arm == "improving":
            options["protect_improving"] = task.improvement
    exp = f"{arm}-{rep}"
    algorithms = arm_algorithms(arm, task)
    spec = {
        "name": exp,
        "env": {"name": task.env},
        "algorithms": {a: 1.0 for a in algorithms},
        # The names some algorithm of the arm takes (an ensemble's space holds them all).
        "search_space": {
            k: v
            for k, v in task.search_space.items()
            if any(k in (hyperparameter_names(a) or ()) for a in algorithms)
        }
        | ({"compile": pin(args.compile)} if args.compile else {}),
        "generator": {"strategy": strategy, "options": options},
        "round": {"env_steps": args.round_steps},
        "evaluation": {"episodes": task.eval_episodes, "seed": rep},
        "top_k": 16,
    }
    if arm in POPULATION_ARMS:
        spec["population"] = {"min_pods": 1, "max_pods": 1, "agents_per_pod": args.pods}
    if arm == "halving":
        if args.mode != "round-robin":
            raise SystemExit("the halving arm runs in --mode round-robin only")
        halving = {"rung_env_steps": args.rung_env_steps or args.ready_env_steps}
        spec["population"] = {"min_pods": 1, "max_pods": pods, "halving": halving}
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
    target = task.target
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
        "cap_s": args.cap_s,
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
    from services.contracts.spec import ExperimentSpec, halving_pods
    from services.orchestrator.backends.base import PodInfo
    from services.orchestrator.scaling import plan_scale
    from services.orchestrator.scheduler import Res
    from services.orchestrator.status import ExperimentStatus
    from services.pod.runtime.rounds import PodRuntime, RuntimeSettings

    torch.set_num_threads(1)
    model = ExperimentSpec.model_validate(spec)
    exp, target = spec["name"], args.task_config.target
    algorithms = arm_algorithms(arm, args.task_config)
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
    clock, reached, rounds = 0.0, None, 0
    stopped: list[PodRuntime] = []
    best = -math.inf  # every task's score: higher is better
    curve: list[tuple[int, float]] = []  # (env steps the board counts, best score so far)

    def halve(counted: int) -> None:
        """The orchestrator's rule, between two rounds: at a rung, the worst pods stop."""
        keep = halving_pods(model.population, counted)
        live = [rt for rt in runtimes if rt not in stopped]
        if keep is None or len(live) <= keep:
            return
        pods = [PodInfo(exp, rt.pod_id, "Running", i, Res()) for i, rt in enumerate(live)]
        scores = {rt.pod_id: rt.slots[0].score for rt in live if rt.slots[0].score is not None}
        plan = plan_scale(model, ExperimentStatus(), pods, keep, Res(), Res(), 0.0, scores)
        stopped.extend(rt for rt in live if rt.pod_id in plan.stop)

    try:
        for i, rt in enumerate(runtimes):
            start = time.thread_time()
            # Pod i's algorithm pinned (ElegantRL's ensemble: a fixed share of each), its
            # hyperparameters the generator's. A population's agent j is asked for as pod j
            # of the other arms, so that it starts from that pod's draw.
            rt.start(
                [
                    rt.client.generate(
                        f"r{rep}-p{j}" if rt.size > 1 else slot.pod_id,
                        algorithms[(i + j) % len(algorithms)],
                    )
                    for j, slot in enumerate(rt.slots)
                ]
            )
            clock += time.thread_time() - start
        # At least one round: a warm-up run (cap 0) trains each pod once.
        while reached is None and (clock < args.cap_s or not rounds):
            for rt in runtimes:
                if rt in stopped:
                    continue
                start = time.thread_time()
                rounds += 1
                rt.train_round()
                rt.report()
                scores = [s.score for s in rt.slots if s.score is not None]
                done = bool(scores) and max(scores) >= target
                if not done:
                    rt.maybe_exploit()
                clock += time.thread_time() - start
                # Off the clock: the board's count, read once a round for the curve and the rungs.
                counted = lb.http.get(f"/experiments/{exp}").json()["env_steps"]
                if scores:
                    best = max(best, *scores)
                    curve.append((counted, best))
                if not done and model.population.halving is not None:
                    halve(counted)
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
        "cap_s": args.cap_s,
        "curve": curve,
    }


#: The warm-up's repetition number: its own experiments, pod ids and seeds.
WARM_UP_REP = 1_000_000


def warm_up(lb: Leaderboard, args: argparse.Namespace, tmp: Path) -> None:
    """One untimed round of every arm's pods: this process compiles (or loads) the programs
    of each shape here, not in the clock of whichever arm happens to run first."""
    warm = argparse.Namespace(**{**vars(args), "cap_s": 0.0})
    for arm in args.arms:
        work = tmp / f"warm-{arm}"
        work.mkdir()
        run(lb, arm, WARM_UP_REP, warm, work)


def plot(path: Path, results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Best score so far against the env steps all pods took, per arm: the median over the
    repetitions (a run's curve holds its last value past its end), and the quartiles."""
    from curves import plot_curves  # bench/curves.py, beside this script

    runs = [r for r in results if r.get("curve")]
    # To the last solved run's end (past it the capped runs only hold their last value).
    solved = [r["curve"][-1][0] for r in runs if r["time_to_target_s"] is not None]
    end = 1.1 * max(solved) if solved else max(r["curve"][-1][0] for r in runs)
    grid = [end * k / 200 for k in range(201)]

    def at(curve: list[list[float]], x: float) -> float | None:
        seen = [y for s, y in curve if s <= x]
        return seen[-1] if seen else None

    arms: dict[str, tuple[list[float], list[list[float]]]] = {}
    for arm in ARMS:
        curves = [r["curve"] for r in runs if r["arm"] == arm]
        if curves:
            # From the first x where every run has reported.
            points = [(x, [at(c, x) for c in curves]) for x in grid]
            kept = [(x, ys) for x, ys in points if None not in ys]
            arms[arm] = ([x for x, _ in kept], [ys for _, ys in kept])  # type: ignore[misc]
    title = f"{args.task}: {args.pods} pods, cap {args.cap_s:g} CPU s"
    ylabel = "best evaluation score so far"
    plot_curves(path, arms, args.task_config.target, title, "env steps, all pods", ylabel)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="pendulum", choices=sorted(TASKS))
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--first-rep",
        type=int,
        default=0,
        help="number of the first repetition (seeds the pods): split reps over processes",
    )
    parser.add_argument("--cap-s", type=float, default=None, help="default: the task's")
    parser.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default=None,
        help="pin every pod's compile setting (default: the platform's auto, which decides "
        "per pod by its measured eager speed: the machine's load moves it, and an eager pod's "
        "round costs several times a compiled one's CPU); round-robin's warm-up compiles",
    )
    parser.add_argument("--round-steps", type=int, default=None, help="default: the task's")
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
        help="pbt: env steps an agent trains before it may be replaced (generator option); "
        "default: the task's",
    )
    parser.add_argument(
        "--truncation",
        type=float,
        default=None,
        help="pbt: share of the pods replaced (generator option); default: the algorithm card's "
        "(PPO 0.25; the others: every pod below the best)",
    )
    parser.add_argument(
        "--exploit-margin",
        type=float,
        default=0.0,
        help="pbt arms: the generator option exploit_margin (a parent must beat a pod by more)",
    )
    parser.add_argument(
        "--space",
        choices=["default", "wide"],
        default="default",
        help="wide: --task pendulum-wide (the earlier spelling)",
    )
    parser.add_argument(
        "--mode",
        choices=["processes", "round-robin"],
        default="processes",
        help="processes: real pod processes sharing the machine (wall time); round-robin: "
        "the pods' code in this process, one round at a time (CPU time, no start-up)",
    )
    parser.add_argument(
        "--rung-env-steps",
        type=int,
        default=None,
        help="halving: env steps per pod before the first rung; default: --ready-env-steps",
    )
    parser.add_argument("--arms", nargs="+", default=["pbt", "random", "single"], choices=ARMS)
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="round-robin: a PNG of the best score so far against env steps, per arm",
    )
    parser.add_argument(
        "--summarize",
        nargs="+",
        type=Path,
        default=None,
        help="print the table of earlier runs' output files (reps split over processes)",
    )
    args = parser.parse_args()
    if args.space == "wide" and args.task == "pendulum":
        args.task = "pendulum-wide"
    task = args.task_config = TASKS[args.task]
    args.cap_s = task.cap_s if args.cap_s is None else args.cap_s
    args.round_steps = task.round_steps if args.round_steps is None else args.round_steps
    if args.ready_env_steps is None:
        args.ready_env_steps = task.ready_env_steps
    if args.summarize:
        lines = [ln for f in args.summarize for ln in f.read_text().splitlines()]
        results = [json.loads(ln) for ln in lines if ln.startswith('{"arm"')]
        summarize(results, args)
        if args.plot is not None:
            plot(args.plot, results, args)
        return
    logging.getLogger("httpx").setLevel(logging.WARNING)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; task {args.task} ({task.env}), {args.pods} pods, cap "
        f"{args.cap_s:g}s, {args.mode}, rounds {args.round_steps}, ready {args.ready_env_steps}, "
        f"truncation {args.truncation}, exploit margin {args.exploit_margin:g}, compile "
        f"{args.compile or 'auto'}",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="podium-bench-") as tmp:
        lb = Leaderboard(Path(tmp) / "lb")
        try:
            if args.mode == "round-robin":
                warm_up(lb, args, Path(tmp))
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
    arms = [a for a in ARMS if any(r["arm"] == a for r in results)]
    target = args.task_config.target
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
        # An unsolved run counts as its cap (runs summarized from files keep their own; files
        # written before the field, --cap-s): the median is then a lower bound.
        caps = [r.get("cap_s", args.cap_s) for r in runs]
        capped[arm] = {
            r["rep"]: t if t is not None else cap
            for r, t, cap in zip(runs, times, caps, strict=True)
        }
        medians[arm] = median(list(capped[arm].values()))
        # Start-up (interpreters importing torch, the first round) is paid alike by every
        # arm with the same number of pods; this column is the time spent learning after it.
        after = [capped[arm][r["rep"]] - (r["first_report_s"] or 0.0) for r in runs]
        trained[arm] = median(after)
        finals = [r["final"] for r in runs if r["final"] is not None]
        per_run = ", ".join(
            f"{t:.1f}" if t is not None else f">{cap:g}" for t, cap in zip(times, caps, strict=True)
        )
        # All pods' env steps when the target was reached: the CPU clock's noise-free twin
        # (every arm runs the same code per step); an unsolved run counts as endless.
        steps = median(
            [r["env_steps"] if r["time_to_target_s"] is not None else float("inf") for r in runs]
        )
        agents = 1 if arm == "single" else args.pods
        print(
            f"| {arm} | {f'1 ({agents} agents)' if arm in POPULATION_ARMS else agents} | "
            f"{medians[arm]:.1f} | "
            f"{trained[arm]:.1f} | {'unsolved' if steps == float('inf') else f'{steps:,.0f}'} | "
            f"{sum(t is not None for t in times)}/{len(runs)} | "
            f"{per_run} | {fmt(median(finals))} | {', '.join(f'{f:.1f}' for f in finals)} |"
        )
    if args.plot is not None:
        plot(args.plot, results, args)
    for tournament in (a for a in arms if a in TOURNAMENT_ARMS):
        for arm in arms:
            if arm in TOURNAMENT_ARMS:
                continue
            reps = sorted(set(capped[tournament]) & set(capped[arm]))
            ratios = [capped[tournament][r] / capped[arm][r] for r in reps]
            faster = sum(x < 1 for x in ratios)
            steps = [paired_steps(results, tournament, arm, r) for r in reps]
            halves, fewer = sum(x <= 0.5 for x in ratios), sum(x < 1 for x in steps)
            print(
                f"{tournament} / {arm} time to target: "
                f"{medians[tournament] / medians[arm]:.2f}x from launch, "  # type: ignore[operator]
                f"{trained[tournament] / trained[arm]:.2f}x from the first report; "  # type: ignore[operator]
                f"paired over {len(reps)} reps: median ratio "
                f"{median(ratios) or float('nan'):.2f}x, "
                f"{tournament} faster in {faster}, at most 0.5x in {halves}; env steps to "
                f"target, paired: median ratio {median(steps) or float('nan'):.2f}x, fewer in "
                f"{fewer}, at most 0.6x in {sum(x <= 0.6 for x in steps)}"
            )


def paired_steps(results: list[dict[str, Any]], a: str, b: str, rep: int) -> float:
    """Arm ``a``'s env steps to the target over arm ``b``'s in one repetition: an unsolved
    run counts its env steps at the cap (so the ratio is a bound), both unsolved count 1."""
    run = {r["arm"]: r for r in results if r["rep"] == rep and r["arm"] in (a, b)}
    if run[a]["time_to_target_s"] is None and run[b]["time_to_target_s"] is None:
        return 1.0
    return run[a]["env_steps"] / run[b]["env_steps"]


if __name__ == "__main__":
    main()
