"""Env steps/s of the Anakin PPO iteration (services/pod/training/anakin.py) against Podium's
existing trainers, on PureJaxRL's CartPole-v1 recipe (issue 33, deliverable 1).

Recipe per agent: 4 envs x 128 steps, 4 epochs x 4 minibatches, 64x64 tanh, lr 2.5e-4
annealed, clipped value loss, ent 0.01, observation normalisation on (Podium's default; the
same config for every side). Measured, for each P:

* ``anakin-iteration``: the whole iteration as one ``torch.compile(fullgraph=True)`` program
  (only when named in ``--sides``: its compile at 128 steps is too long for this bench);
* ``anakin-steps``: two compiled programs (rollout step, minibatch update) looped in Python;
* ``anakin-eager``: the same function uncompiled;
* ``population``: ``PopulationTrainer`` (P agents, hand-written batched forward/backward);
* ``onpolicy``: ``OnPolicyTrainer`` (one agent; P agents would be P times its time, so it
  runs at P = 1 only), with its default ``compile: auto`` (eager on CPU).

Env steps/s are of all P agents together: the median over ``--repeats`` timings of
``--iterations`` iterations each, after one warm-up iteration; the compile time (the first
call, including the warm-up iteration) is reported apart. One thread (``torch.set_num_threads(1)``).

    .venv/bin/python bench/anakin_iteration.py --agents 1 8 64 --repeats 3
    .venv/bin/python bench/anakin_iteration.py --agents 8 --sides anakin-steps population
    .venv/bin/python bench/anakin_iteration.py --recipe cartpole-pod   # a CartPole pod's shape
    .venv/bin/python bench/anakin_iteration.py --evaluation 40   # compiled vs eager evaluation

``--recipe cartpole-pod`` measures the shape a CartPole PPO pod trains instead (the env's preset
with the pod defaults: 16 envs x 16 steps, 8 epochs of one minibatch, 32x32, no observation
normalisation, no annealing): the shape ``compile: auto``'s rules (services/pod/algorithms/
compiled.py ``ANAKIN_AUTO``) are measured on beside the recipe's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# A fresh inductor cache, so that every compile time below is a cold compile (set before
# torch is imported; the on-disk cache would otherwise serve a rerun's kernels).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="anakin-bench-"))

import torch

from services.contracts.algorithms.ppo.config import PPOConfig
from services.pod.config import PPORunConfig
from services.pod.training.anakin import PUREJAXRL_CARTPOLE, AnakinPPO
from services.pod.training.anakin_trainer import AnakinTrainer
from services.pod.training.onpolicy import OnPolicyTrainer
from services.pod.training.population_trainer import PopulationTrainer
from services.pod.training.presets import merge, preset

TOTAL = 500_000
RECIPE = PUREJAXRL_CARTPOLE


def _recipe(name: str) -> PPOConfig:
    if name == "purejaxrl":
        return PUREJAXRL_CARTPOLE
    pod = merge(preset("ppo", "CartPole-v1"), OnPolicyTrainer.pod_defaults)
    return PPOConfig.model_validate(pod["ppo"])


SIDES = ("anakin-iteration", "anakin-steps", "anakin-eager", "population", "onpolicy")
#: anakin-iteration is left out by default: at 128 steps its compile takes far longer than
#: this bench should (docs/benchmarks.md, "Anakin iteration"); name it to include it.
DEFAULT_SIDES = [s for s in SIDES if s != "anakin-iteration"]


def _run_config(seed: int) -> PPORunConfig:
    return PPORunConfig(
        env="CartPole-v1",
        total_env_steps=TOTAL,
        eval_every_steps=TOTAL,
        seed=seed,
        device="cpu",
        torch_threads=1,
        ppo=RECIPE,
    )


def _builder(side: str, agents: int) -> Callable[[], Callable[[], None]]:
    """A function building the side's trainer and returning its one-iteration step."""
    if side.startswith("anakin-"):
        mode = {"anakin-iteration": "iteration", "anakin-steps": "steps"}.get(side, "off")

        def build() -> Callable[[], None]:
            run = AnakinPPO(RECIPE, list(range(agents)), total_env_steps=TOTAL, compile=mode)

            def step() -> None:
                metrics = run.step()
                float(metrics["stats"].sum())  # the host read at an iteration boundary

            return step

        return build
    if side == "population":
        return lambda: PopulationTrainer([_run_config(i) for i in range(agents)]).step
    return lambda: OnPolicyTrainer([_run_config(0)]).step


def measure(side: str, agents: int, iterations: int, repeats: int) -> dict[str, float]:
    torch._dynamo.reset()  # each P compiles anew (no shapes made dynamic by an earlier P)
    start = time.perf_counter()
    step = _builder(side, agents)()
    built = time.perf_counter()
    step()  # compile (where it compiles) and warm up
    first = time.perf_counter()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iterations):
            step()
        rates.append(agents * RECIPE.batch_size * iterations / (time.perf_counter() - t0))
    return {
        "side": side,
        "agents": agents,
        "batch": RECIPE.batch_size,
        "build_s": round(built - start, 2),
        "first_iteration_s": round(first - built, 2),
        "env_steps_per_s": round(statistics.median(rates)),
        "spread": [round(r) for r in rates],
    }


def measure_evaluation(agents: int, repeats: int, train_iterations: int) -> dict[str, float]:
    """The Anakin trainer's compiled evaluation (services/pod/training/anakin_eval.py) against
    the eager trainer's on the same weights: agents trained ``train_iterations`` iterations by
    the Anakin trainer, then loaded into ``PopulationTrainer`` (``OnPolicyTrainer`` at P = 1);
    10 episodes per agent. The first compiled call (its compile) is reported apart."""
    torch._dynamo.reset()
    configs = [_run_config(i) for i in range(agents)]
    anakin = AnakinTrainer(configs)  # compile: auto (the recipes' default) compiles here
    for _ in range(train_iterations):
        anakin.step()
    t0 = time.perf_counter()
    anakin.evaluate()
    first = time.perf_counter() - t0

    def timed(evaluate: Callable[[], list]) -> tuple[float, float]:
        times, means = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            results = evaluate()
            times.append(time.perf_counter() - t)
            means = [r.mean for r in results]
        return statistics.median(times), sum(means) / len(means)

    compiled_s, compiled_mean = timed(anakin.evaluate)
    eager = (PopulationTrainer if agents > 1 else OnPolicyTrainer)(configs)
    with tempfile.TemporaryDirectory() as directory:
        for i in range(agents):
            anakin.save(i, Path(directory) / str(i))
            eager.load(i, Path(directory) / str(i), configs[i])
    eager_s, eager_mean = timed(eager.evaluate)
    return {
        "side": "evaluation",
        "agents": agents,
        "first_evaluation_s": round(first, 2),
        "compiled_s": round(compiled_s, 4),
        "eager_s": round(eager_s, 4),
        "compiled_mean_return": round(compiled_mean, 1),
        "eager_mean_return": round(eager_mean, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=DEFAULT_SIDES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--env-steps", type=int, default=20_000, help="env steps (all agents) per timing"
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--recipe", choices=["purejaxrl", "cartpole-pod"], default="purejaxrl")
    parser.add_argument(
        "--evaluation",
        type=int,
        metavar="ITERATIONS",
        help="instead: time the compiled evaluation against the eager trainer's, on agents "
        "trained this many iterations (the first call, its compile, apart)",
    )
    args = parser.parse_args()
    global RECIPE  # what every side trains (one config per run)
    RECIPE = _recipe(args.recipe)
    torch.set_num_threads(1)
    results = []
    for agents in args.agents if args.evaluation else ():
        row = measure_evaluation(agents, args.repeats, args.evaluation)
        results.append(row)
        print(json.dumps(row), flush=True)
    for agents in args.agents if not args.evaluation else ():
        iterations = max(2, args.env_steps // (agents * RECIPE.batch_size))
        for side in args.sides:
            if side == "onpolicy" and agents != 1:
                continue
            row = measure(side, agents, iterations, args.repeats)
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
