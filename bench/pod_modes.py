"""The pod's roles fused in one process vs as three processes (worker, learner, evaluator).

    python bench/pod_modes.py [--seeds 3] [--updates 150] [--envs CartPole-v1 Pendulum-v1]
                              [--modes fused processes containers]
                              [--device cuda] [--num-envs N]

Per env and seed, the modes run one after the other in this process (the order rotates by
seed) on the env's preset with one torch thread per process:

- fused: ``LocalRoles`` (services/pod/training/onpolicy.py), all three roles in this process;
- processes: ``ProcessRoles``, worker and evaluator as spawned child processes;
- containers: ``RemoteRoles`` here with ``python -m services.pod --role worker`` and
  ``--role evaluator`` as two separate programs, as the Kubernetes Pod's containers run them
  (processes and containers share one link: a Unix socket and shared-memory files);

measuring

- start-up: building the roles (the other modes start two interpreters that import torch);
- throughput: env steps/s of ``--updates`` rollout+update steps after 5 warm-up steps;
- time to target (CartPole only): wall time to the first evaluation >= 475, evaluating every
  4,096 env steps (evaluation included, as in a pod's round).

Prints a markdown table of medians and the ratios to fused.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.pod.config import PPORunConfig
from services.pod.roles.multiprocess import ProcessRoles, RemoteRoles
from services.pod.training.onpolicy import OnPolicyTrainer
from services.pod.training.presets import preset
from services.pod.training.trainer import Roles

ROOT = Path(__file__).resolve().parents[1]

TARGET = {"CartPole-v1": 475.0}
EVAL_EVERY = 4096
MAX_STEPS = 100_000
MODES = ("fused", "processes", "containers")


def config(env: str, seed: int, device: str = "cpu", num_envs: int | None = None) -> PPORunConfig:
    base = preset("ppo", env)
    base.update(seed=seed, eval_episodes=10, torch_threads=1, device=device)
    if num_envs is not None:
        base["ppo"] = {**base["ppo"], "num_envs": num_envs}
    return PPORunConfig.model_validate(base)


class ContainerRoles(RemoteRoles):
    """The learner here; worker and evaluator as two ``python -m services.pod --role`` programs
    that share only a directory with it, as the three containers of a Kubernetes Pod do."""

    def __init__(self) -> None:
        super().__init__(Path(tempfile.mkdtemp(prefix="podium-bench-", dir="/dev/shm")))
        env = {**os.environ, "PODIUM_TORCH_THREADS": "1"}
        where = ["--roles-dir", str(self.directory)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "services.pod", "--role", role, *where],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for role in ("worker", "evaluator")
        ]

    def alive(self, role: str) -> bool:
        return self.procs[0 if role == "worker" else 1].poll() is None

    def close(self) -> None:
        super().close()
        for proc in self.procs:
            proc.wait(timeout=30)
        shutil.rmtree(self.directory, ignore_errors=True)


def make_roles(mode: str) -> Roles | None:
    if mode == "processes":
        return ProcessRoles(threads=1)
    if mode == "containers":
        return ContainerRoles()
    return None  # fused: the trainer's own LocalRoles


def measure(mode: str, env: str, seed: int, args: argparse.Namespace):
    updates = args.updates
    cfg = config(env, seed, args.device, args.num_envs)
    start = time.perf_counter()
    roles = make_roles(mode)
    trainer = OnPolicyTrainer([cfg], roles)
    startup = time.perf_counter() - start
    for _ in range(5):
        trainer.step()
    steps0 = trainer.env_steps
    start = time.perf_counter()
    for _ in range(updates):
        trainer.step()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    steps_per_s = (trainer.env_steps - steps0) / (time.perf_counter() - start)
    solve_s = None
    if env in TARGET:
        trainer.reset(0, cfg)
        start = time.perf_counter()
        next_eval = EVAL_EVERY
        while trainer.env_steps < MAX_STEPS:
            trainer.step()
            if trainer.env_steps >= next_eval:
                next_eval += EVAL_EVERY
                if trainer.evaluate()[0].mean >= TARGET[env]:
                    solve_s = time.perf_counter() - start
                    break
    trainer.close()
    return startup, steps_per_s, solve_s, roles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "Pendulum-v1"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=150)
    parser.add_argument(
        "--modes", nargs="+", default=["fused", "processes", "containers"], choices=MODES
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-envs", type=int, help="sub-environments (default: the preset's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "no GPU"
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{gpu}, torch {torch.__version__}, python {platform.python_version()}"
    )
    rows = []
    for env in args.envs:
        results: dict[str, dict[str, list[float]]] = {
            m: {"startup": [], "sps": [], "solve": []} for m in args.modes
        }
        for seed in range(args.seeds):
            k = seed % len(args.modes)
            order = args.modes[k:] + args.modes[:k]
            for mode in order:
                # A fresh set of processes each time, so start-up is measured every seed.
                startup, sps, solve, roles = measure(mode, env, seed, args)
                if roles is not None:
                    roles.close()
                results[mode]["startup"].append(startup)
                results[mode]["sps"].append(sps)
                if solve is not None:
                    results[mode]["solve"].append(solve)
                print(
                    f"{env} seed {seed} {mode}: start-up {startup:.2f}s, {sps:,.0f} steps/s, "
                    f"solve {solve if solve is None else round(solve, 2)}s",
                    flush=True,
                )
        med = {
            m: {k: statistics.median(v) if v else None for k, v in r.items()}
            for m, r in results.items()
        }
        rows.append((env, med, {m: len(r["solve"]) for m, r in results.items()}))

    print("\n| env | mode | start-up s | env steps/s | time to 475 s | solved |")
    print("|---|---|---|---|---|---|")
    for env, med, solved in rows:
        for mode in args.modes:
            m = med[mode]
            solve = f"{m['solve']:.2f}" if m["solve"] is not None else "-"
            n = f"{solved[mode]}/{args.seeds}" if env in TARGET else "-"
            print(f"| {env} | {mode} | {m['startup']:.2f} | {m['sps']:,.0f} | {solve} | {n} |")
        if "fused" not in med:
            continue
        for mode in args.modes:
            if mode == "fused":
                continue
            ratio = med[mode]["sps"] / med["fused"]["sps"]
            solve_ratio = (
                f"{med[mode]['solve'] / med['fused']['solve']:.2f}x"
                if med["fused"]["solve"] and med[mode]["solve"]
                else ""
            )
            print(f"| {env} | {mode}/fused | | {ratio:.2f}x | {solve_ratio} | |")


if __name__ == "__main__":
    main()
