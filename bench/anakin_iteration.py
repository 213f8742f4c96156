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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

# A fresh inductor cache, so that every compile time below is a cold compile (set before
# torch is imported; the on-disk cache would otherwise serve a rerun's kernels).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="anakin-bench-"))

import torch

from services.pod.config import PPORunConfig
from services.pod.training.anakin import PUREJAXRL_CARTPOLE, AnakinPPO
from services.pod.training.onpolicy import OnPolicyTrainer
from services.pod.training.population_trainer import PopulationTrainer

TOTAL = 500_000
RECIPE = PUREJAXRL_CARTPOLE
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
        "build_s": round(built - start, 2),
        "first_iteration_s": round(first - built, 2),
        "env_steps_per_s": round(statistics.median(rates)),
        "spread": [round(r) for r in rates],
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for agents in args.agents:
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
