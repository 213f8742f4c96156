"""Do the large-batch presets solve every built-in env at accelerator-sized batches? PPO with
``--num-envs N`` on each built-in torch-native env with a solve threshold, its config built as
``podium train ENV --set ppo.num_envs=N`` builds it (services/pod/training/presets.py
``train_config``: from the preset's ``large_batch.min_num_envs`` on, its large-batch section;
docs/presets.md), trained with ``podium train``'s loop (services/pod/training/fit.py) until it
reaches the target, spends its budget or passes ``--cap-seconds`` of wall time (evaluations
included). Prints one JSON line per run and a table: env steps and seconds to the target, best
evaluation return.

    python bench/large_batch_presets.py --device cuda --num-envs 4096        # a GPU, ~3 min
    python bench/large_batch_presets.py --device cpu --num-envs 1024 --cap-seconds 120

``--cpu-preset`` trains each env with its CPU preset's fields instead (the large-batch section
left out, the budget per env kept): the shape that failed on an H200. ``--set
key=value`` goes on top of every run (e.g. ``--set ppo.compile=on``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The pod's package before torch: it lets MKL choose its kernels by instruction sets.
import services.pod  # noqa: F401

# isort: split
import torch

from services.cli.overrides import parse_set
from services.contracts.algorithms.card import card, merge
from services.pod.training.fit import build, fit
from services.pod.training.presets import preset, train_config

#: The built-in torch-native envs PPO has presets and a solve threshold for (StockTrading-v0 is
#: judged by a backtest, not a threshold).
ENVS = ("CartPole-v1", "Acrobot-v1", "Pendulum-v1", "MountainCarContinuous-v0")


class CapReachedError(Exception):
    """The run's wall-clock cap passed: stop it where it is."""


def run(
    env: str,
    num_envs: int,
    device: str,
    seed: int,
    cap: float,
    layers: list[dict],
    cpu_preset: bool,
) -> dict:
    user = [{"seed": seed, "device": device, "ppo": {"num_envs": num_envs}}, *layers]
    config = train_config(env, user)
    if cpu_preset:
        # The file's own fields (no large-batch section) at this env count and the large
        # preset's budget and cadence, so that only the hyperparameters differ.
        small = merge(preset("ppo", env), *user)
        small |= {k: getattr(config, k) for k in ("total_env_steps", "eval_every_steps")}
        config = type(config).model_validate(merge(small, *layers))
    seen: dict = {"best": None, "solved_at": None, "solved_s": None, "evals": 0}
    start = time.perf_counter()

    def progress(record: dict[str, float]) -> None:
        elapsed = time.perf_counter() - start
        if "eval_return" in record:
            seen["evals"] += 1
            value = record["eval_return"]
            seen["best"] = value if seen["best"] is None else max(seen["best"], value)
            target = config.target_return
            if seen["solved_at"] is None and target is not None and value >= target:
                seen["solved_at"], seen["solved_s"] = int(record["env_steps"]), elapsed
            print(
                f"  {env}: {record['env_steps']:,.0f} env steps, {elapsed:.1f} s, eval {value:.1f}",
                file=sys.stderr,
                flush=True,
            )
        seen["env_steps"], seen["train_seconds"] = record["env_steps"], record["train_seconds"]
        if elapsed > cap and seen["solved_at"] is None:
            raise CapReachedError

    trainer = build(config)
    capped = False
    try:
        fit(config, trainer, on_progress=progress)
    except CapReachedError:
        capped = True
    finally:
        trainer.close()
    ppo = config.ppo
    threshold = card("ppo").large_batch_from(env)
    return {
        "env": env,
        "preset": "cpu" if cpu_preset else "chosen",
        "trainer": type(trainer).__name__,
        "large_batch": threshold is not None and num_envs >= threshold,
        "device": device,
        "seed": seed,
        "num_envs": ppo.num_envs,
        "num_steps": ppo.num_steps,
        "num_minibatches": ppo.num_minibatches,
        "update_epochs": ppo.update_epochs,
        "learning_rate": ppo.learning_rate,
        "budget": config.total_env_steps,
        "target": config.target_return,
        "env_steps_to_target": seen["solved_at"],
        "seconds_to_target": None if seen["solved_s"] is None else round(seen["solved_s"], 1),
        "best": None if seen["best"] is None else round(seen["best"], 1),
        "env_steps": int(seen.get("env_steps", 0)),
        "train_seconds": round(seen.get("train_seconds", 0.0), 1),
        "wall_seconds": round(time.perf_counter() - start, 1),
        "capped": capped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-envs", type=int, default=4096)
    parser.add_argument("--cap-seconds", type=float, default=40.0, help="wall-clock cap per env")
    parser.add_argument("--envs", nargs="*", default=list(ENVS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0])
    parser.add_argument(
        "--cpu-preset",
        action="store_true",
        help="train the CPU presets' fields at this env count (the baseline)",
    )
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers = [parse_set(s) for s in args.sets]
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
    print(
        f"# torch {torch.__version__}, {args.device} ({where or platform.machine()}), "
        f"load {os.getloadavg()[0]:.2f}, cap {args.cap_seconds:g} s per env",
        flush=True,
    )
    rows = []
    for env in args.envs:
        for seed in args.seeds:
            record = run(
                env, args.num_envs, args.device, seed, args.cap_seconds, layers, args.cpu_preset
            )
            print(json.dumps(record), flush=True)
            rows.append(record)
    print(
        "\n| env | preset | seed | envs x steps | minibatches x epochs | target "
        "| env steps to target | s to target | best | env steps run | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = "large batch" if r["large_batch"] and r["preset"] == "chosen" else r["preset"]
        steps = "—" if r["env_steps_to_target"] is None else f"{r['env_steps_to_target']:,}"
        secs = "—" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:g}"
        print(
            f"| {r['env']} | {name} | {r['seed']} | {r['num_envs']:,} x {r['num_steps']} "
            f"| {r['num_minibatches']} x {r['update_epochs']} | {r['target']:g} | {steps} "
            f"| {secs} | {r['best']} | {r['env_steps']:,} | {r['wall_seconds']:g} |"
        )


if __name__ == "__main__":
    main()
