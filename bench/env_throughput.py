"""Env throughput: Podium's envs against gymnasium's vector env of the same task, side by side.

    python bench/env_throughput.py [--device cpu|cuda] [--seconds S] [--threads T]
    python bench/env_throughput.py --envs envpool:HalfCheetah-v5 envpool:Hopper-v5 \
        --counts 1 8 64 [--gym-mode sync|async] [--envpool-threads K]

For each env and env count, the torch env and ``gymnasium.make_vec(id, n,
vectorization_mode="sync")`` of the same env are stepped with random actions in alternating
windows of ``--seconds``, ``--repeats`` pairs of windows. The table shows each side's median
steps/s (env steps: batch size x batch steps per second) and the median of the per-pair ratios:
pairing adjacent windows keeps bursts of load from other processes on a shared machine from
landing on one side only. Both sides do the same work per step: same-step autoreset with the
final observation kept, episode bookkeeping on ours, action checks on both. Prints a markdown
table.

``envpool:<task>`` names measure the EnvPool adapter (C++ simulation in EnvPool's thread pool,
``--envpool-threads`` threads, torch tensors out) against gymnasium's MuJoCo env of the same
task; ``--gym-mode async`` runs gymnasium's envs in subprocesses (AsyncVectorEnv) instead.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import gymnasium as gym
import numpy as np

# The pod's package before torch: it lets MKL choose its kernels by instruction sets.
import services.pod  # noqa: F401

# isort: split
import torch

from services.contracts.envpool_tasks import ENVPOOL_PREFIX
from services.pod.envs import make_env

ENVS = ("Pendulum-v1", "CartPole-v1")
COUNTS = (1, 64, 1024, 4096, 16384)
POOL = 16  # pre-drawn action batches, cycled, so drawing actions is not what gets timed


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _steps_per_second(
    step: Callable[[int], object], num_envs: int, seconds: float, sync: Callable[[], None]
) -> float:
    for i in range(3):  # warm-up
        step(i)
    sync()
    steps, start = 0, time.perf_counter()
    while True:
        for _ in range(8):
            step(steps)
            steps += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps * num_envs / elapsed


def _torch_side(
    name: str, n: int, device: str, seconds: float, **kwargs: object
) -> Callable[[], float]:
    env = make_env(name, n, device=device, seed=0, **kwargs)
    env.reset()
    g = torch.Generator().manual_seed(0)
    space = env.single_action_space
    if isinstance(space, gym.spaces.Discrete):
        pool = [torch.randint(0, int(space.n), (n,), generator=g) for _ in range(POOL)]
    else:
        low, high = float(space.low[0]), float(space.high[0])
        pool = [low + (high - low) * torch.rand(n, *space.shape, generator=g) for _ in range(POOL)]
    pool = [a.to(device) for a in pool]
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    return lambda: _steps_per_second(lambda i: env.step(pool[i % POOL]), n, seconds, sync)


def _gym_side(name: str, n: int, seconds: float, mode: str = "sync") -> Callable[[], float]:
    env = gym.make_vec(
        name.removeprefix(ENVPOOL_PREFIX),
        n,
        vectorization_mode=mode,
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    env.reset(seed=0)
    env.action_space.seed(0)
    pool = [env.action_space.sample() for _ in range(POOL)]
    return lambda: _steps_per_second(lambda i: env.step(pool[i % POOL]), n, seconds, lambda: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="device of the torch envs (cpu, cuda)")
    parser.add_argument("--seconds", type=float, default=0.25, help="per measurement window")
    parser.add_argument("--repeats", type=int, default=8, help="pairs of alternating windows")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--envs", nargs="+", default=list(ENVS))
    parser.add_argument("--counts", nargs="+", type=int, default=list(COUNTS))
    parser.add_argument("--gym-mode", choices=("sync", "async"), default="sync")
    parser.add_argument(
        "--envpool-threads", type=int, default=None, help="EnvPool's threads (default: cores)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda given but torch sees no CUDA device")

    print(f"- CPU: {_cpu_model()}, {len(os.sched_getaffinity(0))} cores")
    if device.startswith("cuda"):
        print(f"- GPU: {torch.cuda.get_device_name()}")
    print(
        f"- torch {torch.__version__} ({args.threads} intra-op thread(s)), gymnasium "
        f"{gym.__version__}, numpy {np.__version__}, Python {platform.python_version()}"
    )
    print(
        f"- Podium envs on `{device}`; gymnasium {args.gym_mode} vector env on CPU; "
        f"EnvPool threads: {args.envpool_threads or 'one per core'}; medians over "
        f"{args.repeats} pairs of alternating {args.seconds:g} s windows; load average "
        f"at start {os.getloadavg()[0]:.1f}\n"
    )
    print(f"| env | num_envs | Podium (steps/s) | gymnasium {args.gym_mode} (steps/s) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name in args.envs:
        for n in args.counts:
            extra = (
                {"num_threads": args.envpool_threads}
                if name.startswith(ENVPOOL_PREFIX) and args.envpool_threads
                else {}
            )
            ours_run = _torch_side(name, n, device, args.seconds, **extra)
            theirs_run = _gym_side(name, n, args.seconds, args.gym_mode)
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(ours_run())
                theirs.append(theirs_run())
            a, b = statistics.median(ours), statistics.median(theirs)
            ratio = statistics.median(x / y for x, y in zip(ours, theirs, strict=True))
            print(f"| {name} | {n} | {a:,.0f} | {b:,.0f} | {ratio:,.1f}x |", flush=True)


if __name__ == "__main__":
    main()
