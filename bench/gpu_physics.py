"""The MuJoCo Warp GPU measurements, in one run: MuJoCo Warp's Ant (and Humanoid).

    python bench/gpu_physics.py                       # on a GPU: the full measurement
    python bench/gpu_physics.py --tiny --device cpu   # a smoke run on the CPU (~2-3 min)

Three parts, each written to ``$OUT/gpu_physics.json`` (or ``--out``) as soon as it is done, so
a run cut short by the device's 10-minute limit still leaves the parts it finished:

1. ``physics``: env steps/s (and physics steps/s = env steps/s x frame skip) of
   ``MjWarp-Ant-v0`` and ``MjWarp-Humanoid-v0`` at ``--envs`` sub-environments under random
   actions, through the Podium env protocol (validation off, as a training loop runs it), with
   the first step's seconds (Warp's kernel compile/load and the CUDA graph capture) apart;
2. ``ppo``: PPO's end-to-end env steps/s (rollout + update, no evaluation) on Ant at each of
   ``--ppo-envs`` sub-environments;
3. ``reward_vs_time``: one PPO run on Ant at ``--curve-envs`` sub-environments, evaluated every
   ``--eval-every`` env steps, until the evaluation reaches ``--target`` (Ant's 6,000) or
   ``--curve-seconds`` of training pass: (train seconds, env steps, evaluation return) rows.

Random actions and PPO both draw on the GPU; nothing is read back to the host inside a timed
loop except what the trainer itself reads. Needs the ``mjwarp`` extra (docs/gpu_physics.md says
how to carry its wheels to the device machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

# The pod's package before torch: it lets MKL choose its kernels by instruction sets.
import services.pod  # noqa: F401

# isort: split
import torch

from services.pod.config import PPORunConfig
from services.pod.envs import make_env
from services.pod.training.fit import train

TASKS = ("MjWarp-Ant-v0", "MjWarp-Humanoid-v0")


class OutOfTimeError(Exception):
    """Raised from the progress callback to end the reward-vs-time run at its time budget."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_avg": os.getloadavg()[0],
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import mujoco_warp
        import warp

        info["warp"] = warp.config.version
        info["mujoco_warp"] = getattr(mujoco_warp, "__version__", "?")
    except ImportError:  # the env import below will say what is missing
        pass
    return info


def physics(task: str, num_envs: int, steps: int, device: torch.device) -> dict[str, Any]:
    """Env steps/s of ``task`` at ``num_envs`` under uniform random actions."""
    start = time.perf_counter()
    env = make_env(
        task,
        num_envs,
        device=device,
        seed=0,
        check_actions=False,
        max_episode_steps=MAX_EPISODE_STEPS,
    )
    env.reset()
    low = torch.as_tensor(env.single_action_space.low, device=device)
    span = torch.as_tensor(env.single_action_space.high, device=device) - low
    g = torch.Generator(device=device).manual_seed(0)
    env.step(low + span * torch.rand((num_envs, *low.shape), generator=g, device=device))
    _sync(device)
    first = time.perf_counter() - start
    ended = 0
    _sync(device)
    start = time.perf_counter()
    done_count = torch.zeros((), dtype=torch.int64, device=device)
    for _ in range(steps):
        actions = low + span * torch.rand((num_envs, *low.shape), generator=g, device=device)
        _, _, terminated, truncated, _ = env.step(actions)
        done_count += (terminated | truncated).sum()
    _sync(device)
    seconds = time.perf_counter() - start
    ended = int(done_count)
    frame_skip = env.task.frame_skip  # type: ignore[attr-defined]
    env.close()
    rate = num_envs * steps / seconds
    return {
        "task": task,
        "num_envs": num_envs,
        "steps": steps,
        "seconds": seconds,
        "build_and_first_step_seconds": first,
        "env_steps_per_s": rate,
        "physics_steps_per_s": rate * frame_skip,
        "episodes_ended": ended,
    }


#: ``--max-episode-steps`` (None: the task's 1,000); the CPU smoke run shortens episodes so
#: that its evaluations end in seconds.
MAX_EPISODE_STEPS: int | None = None


def ppo_config(device: torch.device, num_envs: int, num_steps: int, **extra: Any) -> PPORunConfig:
    """PPO for Ant: Isaac Lab's rsl_rl Ant settings in spirit (short rollouts, big batches)."""
    return PPORunConfig.model_validate(
        {
            "env": "MjWarp-Ant-v0",
            "env_kwargs": {"check_actions": False, "max_episode_steps": MAX_EPISODE_STEPS},
            "device": str(device),
            "torch_threads": None,
            "ppo": {
                "num_envs": num_envs,
                "num_steps": num_steps,
                "learning_rate": 3e-4,
                "gamma": 0.99,
                "gae_lambda": 0.95,
                "num_minibatches": 4,
                "update_epochs": 4,
                "hidden_sizes": [256, 128, 64],
                "activation": "elu",
                "norm_reward": True,
            },
            **extra,
        }
    )


def ppo_throughput(device: torch.device, num_envs: int, num_steps: int, updates: int) -> dict:
    """End-to-end PPO env steps/s: ``updates`` rollouts and updates after one warm-up."""
    budget = num_envs * num_steps * (updates + 1)
    cfg = ppo_config(
        device,
        num_envs,
        num_steps,
        total_env_steps=budget,
        eval_every_steps=budget,  # one evaluation, at the end, outside the clock
        eval_episodes=2,
    )
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    result = train(cfg, on_progress=history.append)
    wall = time.perf_counter() - start
    return {
        "num_envs": num_envs,
        "num_steps": num_steps,
        "env_steps": budget,
        "train_seconds": result.train_seconds,
        "wall_seconds_with_build_and_eval": wall,
        "env_steps_per_s": budget / result.train_seconds,
    }


def reward_vs_time(
    device: torch.device,
    num_envs: int,
    num_steps: int,
    eval_every: int,
    target: float,
    seconds: float,
) -> dict[str, Any]:
    rows: list[dict[str, float]] = []

    def record(row: dict[str, float]) -> None:
        if "eval_return" in row:
            rows.append({k: row[k] for k in ("train_seconds", "env_steps", "eval_return")})
            print(
                f"  {row['train_seconds']:8.1f} s {row['env_steps']:>12,.0f} steps "
                f"return {row['eval_return']:9.1f}",
                flush=True,
            )
        if row["train_seconds"] > seconds:
            raise OutOfTimeError

    cfg = ppo_config(
        device,
        num_envs,
        num_steps,
        total_env_steps=10**12,
        eval_every_steps=eval_every,
        eval_episodes=16,
        target_return=target,
    )
    reached = None
    try:
        result = train(cfg, on_progress=record)
        reached = result.solved_at_env_steps
    except OutOfTimeError:
        pass
    return {"num_envs": num_envs, "target": target, "solved_at_env_steps": reached, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="smoke sizes (CPU)")
    p.add_argument("--envs", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--steps", type=int, default=200, help="timed env steps per size")
    p.add_argument("--ppo-envs", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--ppo-steps", type=int, default=16, help="rollout length")
    p.add_argument("--ppo-updates", type=int, default=10)
    p.add_argument("--curve-envs", type=int, default=4096)
    p.add_argument("--eval-every", type=int, default=2_000_000)
    p.add_argument("--target", type=float, default=6000.0)
    p.add_argument("--curve-seconds", type=float, default=300.0)
    p.add_argument("--max-episode-steps", type=int, default=None)
    p.add_argument("--parts", nargs="+", default=["physics", "ppo", "reward_vs_time"])
    p.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_physics.json"
    )
    a = p.parse_args()
    if a.tiny:
        a.envs, a.steps, a.ppo_envs, a.ppo_steps, a.ppo_updates = [2, 8], 3, [4], 4, 1
        a.curve_envs, a.eval_every, a.curve_seconds, a.max_episode_steps = 4, 32, 5.0, 8
    global MAX_EPISODE_STEPS
    MAX_EPISODE_STEPS = a.max_episode_steps
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    report: dict[str, Any] = {
        "machine": machine(device),
        "args": {k: str(v) for k, v in vars(a).items()},
    }

    def save() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))

    if "physics" in a.parts:
        report["physics"] = []
        for task in TASKS:
            for n in a.envs:
                row = physics(task, n, a.steps, device)
                report["physics"].append(row)
                save()
                print(
                    f"{task:20} {n:>7} envs: {row['env_steps_per_s']:14,.0f} env steps/s "
                    f"{row['physics_steps_per_s']:14,.0f} physics steps/s "
                    f"(first step {row['build_and_first_step_seconds']:.1f} s)",
                    flush=True,
                )
    if "ppo" in a.parts:
        report["ppo"] = []
        for n in a.ppo_envs:
            row = ppo_throughput(device, n, a.ppo_steps, a.ppo_updates)
            report["ppo"].append(row)
            save()
            print(f"PPO Ant {n:>7} envs: {row['env_steps_per_s']:14,.0f} env steps/s", flush=True)
    if "reward_vs_time" in a.parts:
        print(f"PPO Ant {a.curve_envs} envs, reward vs time:", flush=True)
        report["reward_vs_time"] = reward_vs_time(
            device, a.curve_envs, a.ppo_steps, a.eval_every, a.target, a.curve_seconds
        )
        save()
    report["machine"]["load_avg_end"] = os.getloadavg()[0]
    save()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
