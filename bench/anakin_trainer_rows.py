"""The Anakin trainer (services/pod/training/anakin_trainer.py) against the eager PPO trainers, as
``compile: auto``'s rules (services/pod/algorithms/compiled.py ``ANAKIN_AUTO``) need them on a
device: env steps/s of both, the trainer's compile seconds (iteration and evaluation programs,
cold inductor cache), and its compiled evaluation against the eager trainer's ``Evaluator`` on
the same weights (the slots' files loaded into the eager trainer), for PureJaxRL's CartPole recipe
(4 x 128 env steps per iteration) and a CartPole pod's shape (16 x 16), P = 1 and 64.

    python3 bench/anakin_trainer_rows.py --device cuda     # one JSON line per row

On a CPU bench/anakin_iteration.py gives the same rows with repeats (``--recipe``,
``--evaluation``). Both sides run in this process; the eager side is ``OnPolicyTrainer`` at
P = 1 and ``PopulationTrainer`` above.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# A fresh inductor cache: every compile below is cold (set before torch is imported).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="anakin-rows-"))

import torch

from services.contracts.algorithms.ppo.config import PPOConfig
from services.pod.config import PPORunConfig
from services.pod.training.anakin import PUREJAXRL_CARTPOLE
from services.pod.training.onpolicy import OnPolicyTrainer
from services.pod.training.population_trainer import PopulationTrainer
from services.pod.training.presets import merge, preset
from services.pod.training.trainer import build_trainer

POD = PPOConfig.model_validate(
    merge(preset("ppo", "CartPole-v1"), OnPolicyTrainer.pod_defaults)["ppo"]
)
RECIPES = {"purejaxrl": PUREJAXRL_CARTPOLE, "cartpole-pod": POD}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rate(step: Callable[[], None], env_steps: int, iterations: int, device: str) -> int:
    """Env steps/s over ``iterations`` steps after one untimed."""
    step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    _sync(device)
    return round(env_steps * iterations / (time.perf_counter() - start))


def row(recipe: str, agents: int, device: str, iterations: int) -> dict:
    torch._dynamo.reset()
    ppo = RECIPES[recipe].model_copy(update={"compile": "on"})
    configs = [
        PPORunConfig(
            env="CartPole-v1",
            total_env_steps=500_000,
            seed=i,
            device=device,
            eval_episodes=10,
            eval_seed=7,
            ppo=ppo,
        )
        for i in range(agents)
    ]
    out: dict = {"recipe": recipe, "agents": agents, "batch": ppo.batch_size, "device": device}
    trainer = build_trainer(configs)
    out["trainer"] = type(trainer).__name__
    start = time.perf_counter()
    trainer.step()
    _sync(device)
    out["first_iteration_s"] = round(time.perf_counter() - start, 2)
    out["anakin"] = rate(trainer.step, agents * ppo.batch_size, iterations, device)
    start = time.perf_counter()
    trainer.evaluate()
    _sync(device)
    out["first_evaluation_s"] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    compiled = trainer.evaluate()
    _sync(device)
    out["evaluation_s"] = round(time.perf_counter() - start, 4)
    eager_configs = [
        c.model_copy(update={"ppo": c.ppo.model_copy(update={"compile": "off"})}) for c in configs
    ]
    eager = (PopulationTrainer if agents > 1 else OnPolicyTrainer)(eager_configs)
    with tempfile.TemporaryDirectory() as directory:
        for i in range(agents):
            trainer.save(i, Path(directory) / str(i))
            eager.load(i, Path(directory) / str(i), eager.config(i))
    start = time.perf_counter()
    evaluated = eager.evaluate()
    _sync(device)
    out["eager_evaluation_s"] = round(time.perf_counter() - start, 4)
    out["mean_return"] = [
        round(sum(r.mean for r in results) / agents, 1) for results in (compiled, evaluated)
    ]
    out["eager"] = rate(eager.step, agents * ppo.batch_size, max(2, iterations // 2), device)
    out["compile_s"] = round(trainer.compile_seconds, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    for recipe in args.recipes:
        for agents in args.agents:
            print(json.dumps(row(recipe, agents, args.device, args.iterations)), flush=True)


if __name__ == "__main__":
    main()
