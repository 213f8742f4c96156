"""Does PBT inside a population pod beat the best of the same P agents trained apart?

    python bench/pod_pbt.py --task cartpole [--agents 8] [--reps 10] [--every 8192]
                            [--budget N] [--target R] [--by train_return] [--compile on]
                            [--pbt '{"quantile": 0.125}'] [--png docs/pod_pbt_cartpole.png]

For each repetition r, both arms start from the same P hyperparameter draws (the task's search
space, sampled with seed r: random search's draws) and the same agent seeds, in one population
trainer of the pod (services/pod/training/; eager, or compiled with ``--compile on``: the
exploits change values, never the programs), and train ``--budget`` env steps per agent:

- ``pbt``: the pod's own PBT (services/pod/runtime/in_pod_pbt.py, the spec's
  ``population.exploit`` with ``every_env_steps = --every`` and the in-pod defaults: the worst
  quarter copies a top-quarter agent and explores its hyperparameters);
  with ``--halving``, successive halving in the pod instead (intervals doubling from
  ``--every``; at each rung the worse half becomes unexplored copies of the better half);
- ``apart``: no selection: each agent keeps its draw (best of P, which is also random search
  over P draws).

Every ``--eval-every`` env steps both arms evaluate every agent on the same evaluation episodes
(the bench's clock, not PBT's input unless ``--by evaluation``); a run has reached the target
when its best agent's evaluation does. Reported per task: medians over repetitions of env steps
(per agent) to the target, the fraction of repetitions that reach it, the paired ratio
pbt / apart (repetitions where one arm never reaches count at the budget), the final best and
median agent, and wall seconds. Arms are interleaved per repetition on the same core; one PNG
of the median best return against env steps per task.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The pod's package before torch: it lets MKL choose its kernels by instruction sets.
import services.pod  # noqa: F401

# isort: split
import torch

from services.contracts.search_space import sample_space
from services.contracts.spec import ExperimentSpec
from services.contracts.strategies import PopulationExploit
from services.pod.runtime.in_pod_pbt import InPodPBT
from services.pod.training.presets import pod_config
from services.pod.training.trainer import build_trainer


@dataclass(frozen=True)
class Task:
    env: str
    algorithm: str
    target: float
    budget: int  # env steps per agent
    space: dict[str, Any]


# Wide spaces: a user who does not know the algorithm's good values for the task; many draws
# learn slowly or not at all within the budget.
PPO_SPACE = {
    "learning_rate": {"type": "log_uniform", "low": 1e-5, "high": 5e-2},
    "ent_coef": {"type": "uniform", "low": 0.0, "high": 0.05},
    "gamma": {"type": "uniform", "low": 0.8, "high": 0.999},
    "clip_coef": {"type": "uniform", "low": 0.02, "high": 0.5},
}
SAC_SPACE = {
    "learning_rate": {"type": "log_uniform", "low": 3e-5, "high": 3e-2},
    "gamma": {"type": "uniform", "low": 0.8, "high": 0.999},
    "tau": {"type": "log_uniform", "low": 0.001, "high": 0.1},
}
TASKS = {
    "cartpole": Task("CartPole-v1", "ppo", 475.0, 32_768, PPO_SPACE),
    # Acrobot's solve threshold (-100) is reached early by the best of a few wide draws; -80 is
    # near the best an agent does, where the hyperparameters of the last stretch matter.
    "acrobot": Task("Acrobot-v1", "ppo", -80.0, 61_440, PPO_SPACE),
    # 32 envs per agent and 200-step episodes: an agent ends its first episodes at 6,400 env
    # steps, so decisions by training return need a budget of several times that.
    # The preset's PPO (gSDE, 128 envs x 16) in the wide space: most draws never swing up.
    "pendulum": Task("Pendulum-v1", "ppo", -200.0, 131_072, PPO_SPACE),
    "pendulum-sac": Task("Pendulum-v1", "sac", -200.0, 40_960, SAC_SPACE),
    # EnvPool's HalfCheetah-v5 with the SAC preset (256x256, 0.25 updates per env step): its
    # seeds reach 3,000 at 51-72k env steps; in the wide space most draws do not.
    "halfcheetah-sac": Task("envpool:HalfCheetah-v5", "sac", 3000.0, 61_440, SAC_SPACE),
}


def run(
    task: Task,
    rep: int,
    agents: int,
    rule: PopulationExploit | None,
    eval_every: int,
    compile_mode: str = "off",
) -> dict:
    spec = ExperimentSpec.model_validate(
        {
            "name": "bench",
            "env": {"name": task.env},
            "algorithms": {task.algorithm: 1.0},
            "search_space": task.space,
            "population": {"agents_per_pod": agents},
        }
    )
    draws = random.Random(rep)
    hyperparameters = [sample_space(spec.search_space, draws) for _ in range(agents)]

    def config(values: dict[str, Any], seed: int) -> Any:
        return pod_config(spec, {**values, "compile": compile_mode}, seed, "cpu", 1)

    seeds = [1000 * rep + i for i in range(agents)]
    torch.manual_seed(rep)
    trainer = build_trainer([config(h, s) for h, s in zip(hyperparameters, seeds, strict=True)])
    pbt = InPodPBT(rule, spec.search_space, agents, f"rep{rep}") if rule is not None else None
    built_at = [0] * agents
    curve: list[tuple[int, float, float]] = []  # (env steps per agent, best, median agent)
    reached: int | None = None
    copies = 0
    select_s = 0.0  # the decisions' time: ranking, copies and explores
    next_eval = eval_every
    start = time.perf_counter()
    while trainer.env_steps < task.budget:
        trainer.step()
        if pbt is not None and pbt.due(trainer.env_steps):
            trainer.wait()
            begin = time.perf_counter()
            done = pbt.select(
                trainer,
                hyperparameters,
                built_at,
                lambda h, src, dst: config(h, seeds[dst]),
            )
            for c in done:
                hyperparameters[c.dst], built_at[c.dst] = c.hyperparameters, trainer.env_steps
            copies += len(done)
            trainer.wait()
            select_s += time.perf_counter() - begin
        if trainer.env_steps >= next_eval:
            next_eval += eval_every
            means = [r.mean for r in trainer.evaluate()]
            curve.append((trainer.env_steps, max(means), statistics.median(means)))
            if reached is None and max(means) >= task.target:
                reached = trainer.env_steps
    seconds = time.perf_counter() - start
    trainer.close()
    return {
        "reached": reached,
        "curve": curve,
        "copies": copies,
        "seconds": seconds,
        "select_s": select_s,
    }


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def plot(path: Path, task: str, results: dict[str, list[dict]], target: float) -> None:
    from curves import plot_curves  # bench/curves.py, beside this script

    arms = {}
    for arm, runs in results.items():
        n = min(len(r["curve"]) for r in runs)
        steps = [x for x, _, _ in runs[0]["curve"][:n]]
        arms[f"{arm}"] = (steps, [[r["curve"][k][1] for r in runs] for k in range(n)])
    title = f"{task}: PBT in the pod vs the best of P apart"
    plot_curves(path, arms, target, title, "env steps per agent", "best agent's evaluation return")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="cartpole")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--first-rep", type=int, default=0)
    parser.add_argument("--every", type=int, default=8192, help="env steps between decisions")
    parser.add_argument("--eval-every", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=None, help="env steps per agent")
    parser.add_argument("--target", type=float, default=None, help="instead of the task's")
    parser.add_argument("--by", choices=("train_return", "evaluation"), default="train_return")
    parser.add_argument(
        "--halving",
        action="store_true",
        help="successive halving in the pod: intervals doubling from --every, the worse half "
        "replaced by unexplored copies of the better half",
    )
    parser.add_argument(
        "--pbt",
        type=json.loads,
        default=None,
        help="the in-pod PBT options as JSON (the spec's population.exploit.pbt), e.g. "
        '\'{"truncation": 0.5, "quantile": 0.125}\': half the agents become explored copies of '
        "the best",
    )
    parser.add_argument("--arms", nargs="+", choices=("pbt", "apart"), default=["pbt", "apart"])
    parser.add_argument(
        "--compile",
        choices=("off", "on"),
        default="off",
        help="the population trainer compiled (PBT changes values, never the programs)",
    )
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--jsonl", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = TASKS[args.task]
    if args.budget or args.target is not None:
        task = Task(
            task.env,
            task.algorithm,
            task.target if args.target is None else args.target,
            args.budget or task.budget,
            task.space,
        )
    halving = {"truncation": 0.5, "quantile": 0.5, "explore": False}
    options = {**(halving if args.halving else {}), **(args.pbt or {})}
    rule = PopulationExploit(
        every_env_steps=args.every,
        by=args.by,
        **({"growth": 2.0} if args.halving else {}),
        **({"pbt": options} if options else {}),
    )
    results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    print(f"# {args.task}: {task.env} {task.algorithm}, P = {args.agents}, budget {task.budget:,}")
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    for rep in range(args.first_rep, args.first_rep + args.reps):
        for arm in args.arms:
            rule_here = rule if arm == "pbt" else None
            out = run(task, rep, args.agents, rule_here, args.eval_every, args.compile)
            results[arm].append(out)
            last = out["curve"][-1]
            print(
                f"rep {rep} {arm}: reached {out['reached']}, final best {last[1]:.1f}, "
                f"median agent {last[2]:.1f}, copies {out['copies']}, {out['seconds']:.0f} s "
                f"({out['select_s']:.3f} s deciding)",
                flush=True,
            )
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps({"task": args.task, "rep": rep, "arm": arm, **out}) + "\n")
    budget = task.budget
    ratios = [
        (p["reached"] or budget) / (a["reached"] or budget)
        for p, a in zip(results.get("pbt", []), results.get("apart", []), strict=False)
    ]
    print()
    print(
        "| arm | reached | median env steps to target | at the budget: best >= target "
        "| final best | final median agent | s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for arm, runs in results.items():
        hits = [r["reached"] for r in runs if r["reached"] is not None]
        steps = sorted((r["reached"] or float("inf")) for r in runs)
        mid = (
            steps[len(steps) // 2] if len(steps) % 2 else sum(steps[len(steps) // 2 - 1 :][:2]) / 2
        )
        print(
            f"| {arm} | {len(hits)}/{len(runs)} | "
            f"{'never' if mid == float('inf') else f'{mid:,.0f}'} | "
            f"{sum(r['curve'][-1][1] >= task.target for r in runs)}/{len(runs)} | "
            f"{median([r['curve'][-1][1] for r in runs]):.1f} | "
            f"{median([r['curve'][-1][2] for r in runs]):.1f} | "
            f"{median([r['seconds'] for r in runs]):.0f} |"
        )
    print(f"\npaired ratio pbt / apart of env steps to target (unreached = budget): median "
          f"{median(ratios):.2f} over {len(ratios)} repetitions")  # fmt: skip
    if args.png:
        plot(args.png, args.task, results, task.target)
        print(f"curves: {args.png}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
