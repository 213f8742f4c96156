"""Compiled against eager, for each compiled path and env, on one machine: the rows that set
``compile: auto``'s rule (services/pod/algorithms/compiled.py ``RULES``, docs/compiled-loop.md).

Each case is an algorithm's preset for an env with P agents, trained by the trainer a pod uses
(``build_trainer``), one torch thread, in three fresh processes run one after another:

* ``eager`` (``compile: off``): one warm-up step, then ``--steps`` timed steps;
* ``cold`` (``compile: on``, an empty compile cache): the first two steps (they compile), then
  ``--steps`` timed steps;
* ``warm`` (``compile: on``, the cache the cold process left): the first two steps.

A step is one PPO iteration (rollout, GAE, updates) or one off-policy vector step with its
gradient updates (timed once updates have started). Reported per case: the eager and compiled
seconds per unit (an env step per agent for PPO, a gradient update for off-policy) and their
ratio (``speedup``); the seconds the trainer spent compiling or loading its graphs
(``Trainer.compile_seconds``), cold (``compile_s``) and warm (``warm_s``, a load from the
cache); the probe's seconds in each process
(``machine_factor``'s, so that the rule's reference probe is recorded beside the rows), and the
load. The medians per path are the ``Rule`` rows to put in compiled.py.

    .venv/bin/python bench/compiled_rows.py                       # the CPU cases below
    .venv/bin/python bench/compiled_rows.py --cases ppo:Pendulum-v1:1 sac:Pendulum-v1:1
    .venv/bin/python bench/compiled_rows.py --device cuda --cases ppo:Pendulum-v1:64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    "ppo:CartPole-v1:1",
    "ppo:Acrobot-v1:1",
    "ppo:Pendulum-v1:1",
    "ppo:CartPole-v1:8",
    "sac:Pendulum-v1:1",
    "dqn:CartPole-v1:1",
]


def child(case: str, mode: str, steps: int, device: str) -> dict:
    """In a fresh process: build the case's trainer, time its steps (see the docstring)."""
    # The pod's package before torch: it lets MKL choose its kernels by instruction sets.
    from services.pod import mkl_dispatch

    mkl = mkl_dispatch.state()
    import torch

    from services.pod.algorithms.compiled import _probe_s
    from services.pod.training.presets import train_config
    from services.pod.training.trainer import build_trainer

    torch.set_num_threads(1)
    algorithm, env, agents = case.split(":")
    compile = "off" if mode == "eager" else "on"
    configs = [
        train_config(
            env,
            [
                {
                    "algorithm": algorithm,
                    "device": device,
                    "torch_threads": 1,
                    "seed": i,
                    "target_return": None,
                    # PPO's compile is its own setting; the off-policy loop's is the run's.
                    **(
                        {algorithm: {"compile": compile}}
                        if algorithm == "ppo"
                        else {"compile": compile}
                    ),
                }
            ],
        )
        for i in range(int(agents))
    ]
    trainer = build_trainer(configs)
    offpolicy = algorithm != "ppo"
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def units() -> int:
        return trainer.updates if offpolicy else trainer.env_steps

    if offpolicy:  # the replay fills before any update: eager, uncompiled, not what is timed
        while trainer.updates == 0:
            trainer.step()
    start = time.perf_counter()
    for _ in range(1 if mode == "eager" else 2):
        trainer.step()
    sync()
    first = time.perf_counter() - start
    out = {"case": case, "mode": mode, "first_s": first, "probe_s": _probe_s(), "mkl": mkl}
    if mode != "warm":
        before = units()
        start = time.perf_counter()
        for _ in range(steps):
            trainer.step()
        sync()
        out["s_per_unit"] = (time.perf_counter() - start) / (units() - before)
        out["units_per_step"] = (units() - before) / steps
    out["compiled"] = trainer.compiled
    out["compile_seconds"] = trainer.compile_seconds  # built or loaded, wherever it fell
    out["load"] = os.getloadavg()[0]
    trainer.close()
    return out


def run(case: str, mode: str, steps: int, device: str, cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PODIUM_LOG_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", case, mode, str(steps), device],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{case} {mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from services.malloc import reexec_with_allocator

    # Every process with the allocator the pods run with (services/malloc.py); children
    # inherit it.
    reexec_with_allocator()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=CASES, help="algorithm:env:agents")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per process")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("runs/compiled_rows.json"))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case, mode, steps, device = args.child
        print(json.dumps(child(case, mode, int(steps), device)))
        return
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if "model name" in ln), "?")
    print(f"{cpu}, {os.cpu_count()} cores, device {args.device}", flush=True)
    rows = []
    for case in args.cases:
        with tempfile.TemporaryDirectory(prefix="podium-rows-") as cache:
            eager = run(case, "eager", args.steps, args.device, Path(cache))
            cold = run(case, "cold", args.steps, args.device, Path(cache))
            warm = run(case, "warm", args.steps, args.device, Path(cache))
        row = {
            "case": case,
            "eager_s_per_unit": eager["s_per_unit"],
            "compiled_s_per_unit": cold["s_per_unit"],
            "speedup": eager["s_per_unit"] / cold["s_per_unit"],
            "compile_s": cold["compile_seconds"],
            "warm_s": warm["compile_seconds"],
            "probe_s": [eager["probe_s"], cold["probe_s"], warm["probe_s"]],
            "load": [eager["load"], cold["load"], warm["load"]],
            "compiled": cold["compiled"],
        }
        rows.append(row)
        print(
            f"{case:24} eager {row['eager_s_per_unit'] * 1e6:9.1f} us/unit, compiled "
            f"{row['compiled_s_per_unit'] * 1e6:9.1f} us/unit: {row['speedup']:5.2f}x; compile "
            f"{row['compile_s']:6.1f} s cold, {row['warm_s']:5.1f} s warm; probe "
            f"{statistics.median(row['probe_s']) * 1e3:.1f} ms; load "
            f"{max(row['load']):.1f}",
            flush=True,
        )
    for path in ("onpolicy", "offpolicy"):
        mine = [r for r in rows if (r["case"].startswith("ppo:")) == (path == "onpolicy")]
        if mine:
            print(
                f"Rule for ({path!r}, {args.device.split(':')[0]!r}): speedup "
                f"{statistics.median(r['speedup'] for r in mine):.1f}, compile_s "
                f"{statistics.median(r['compile_s'] for r in mine):.0f}, warm_s "
                f"{statistics.median(r['warm_s'] for r in mine):.0f}; probe "
                f"{statistics.median(p for r in mine for p in r['probe_s']) * 1e3:.1f} ms"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": args.device, "cpu": cpu, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
