"""The compiled on-device loop against eager: env steps/s, fused rollout steps/s, compile cost.

    python bench/compiled_loop.py [--envs CartPole-v1 Pendulum-v1] [--counts 1 64 4096 65536]
                                  [--seconds 0.5] [--repeats 5] [--pod-start] [--device cuda]

For each env and env count, two arms, stepped in alternating windows of ``--seconds``
(``--repeats`` pairs, medians and the median of the per-pair ratios, so load from other
processes lands on both arms alike):

* env: ``env.step`` (eager; on CPU the finished sub-environments reset by index) against
  ``torch.compile`` of ``env.step_masked`` (the compiled loop's env step: masked reset with the
  fresh initial states drawn eagerly outside the graph, as services/pod/roles/worker.py does);
* rollout: services/pod/roles/worker.py ``FusedRolloutWorker.collect`` eager (``RolloutWorker``) and
  compiled (act + env step + storage write as one compiled function per vector step), PPO's
  preset networks, env steps per second of collection.

The compile time (first call, with this process's warm inductor caches after the first size)
is printed separately; ``--pod-start`` also times, in fresh subprocesses with an empty inductor
cache, what a pod pays to compile its loop at start, and what a PBT restart (a new agent from
new weights and hyperparameters) pays after it: nothing, as the graphs are reused. Prints
markdown tables; runs with one intra-op thread.
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
from collections.abc import Callable

import torch

from services.pod.config import PPORunConfig
from services.pod.envs import make_env
from services.pod.roles.rollout_roles import build_agent
from services.pod.roles.worker import FusedRolloutWorker, RolloutWorker
from services.pod.training.presets import preset

POOL = 16  # pre-drawn action batches, cycled


def _sync() -> None:
    # CUDA kernels run asynchronously: a window ends when the device has done its work.
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _rate(step: Callable[[], object], per_call: int, seconds: float) -> float:
    _sync()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or calls < 2:
        step()
        calls += 1
    _sync()
    return calls * per_call / (time.perf_counter() - start)


def _paired(
    eager: Callable[[], object], compiled: Callable[[], object], per_call: int, args
) -> tuple[float, float, float]:
    """Median eager and compiled steps/s and the median per-pair ratio."""
    e, c = [], []
    for _ in range(args.repeats):
        e.append(_rate(eager, per_call, args.seconds))
        c.append(_rate(compiled, per_call, args.seconds))
    ratio = statistics.median(ci / ei for ei, ci in zip(e, c, strict=True))
    return statistics.median(e), statistics.median(c), ratio


def _timed_first(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def bench_env(env_id: str, n: int, args) -> tuple[float, float, float, float]:
    eager_env = make_env(env_id, n, device=args.device, seed=0, check_actions=False)
    comp_env = make_env(env_id, n, device=args.device, seed=0, check_actions=False)
    eager_env.reset(seed=0)
    comp_env.reset(seed=0)
    pool = [eager_env.action_space.sample() for _ in range(POOL)]
    actions = [torch.as_tensor(a, device=args.device) for a in pool]
    # On CUDA as services/pod/algorithms/compiled.py compiles it: CUDA graphs replay the step's
    # kernels.
    cuda = comp_env.device.type == "cuda"
    step_masked = torch.compile(
        type(comp_env).step_masked, fullgraph=True, mode="reduce-overhead" if cuda else None
    )
    i = [0]

    def eager() -> None:
        i[0] += 1
        eager_env.step(actions[i[0] % POOL])

    def compiled() -> None:
        i[0] += 1
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()
        step_masked(comp_env, actions[i[0] % POOL], comp_env._initial_state(n))

    compile_s = _timed_first(compiled)
    return (*_paired(eager, compiled, n, args), compile_s)


def _workers(env_id: str, n: int, device: str) -> tuple[RolloutWorker, FusedRolloutWorker]:
    settings = preset("ppo", env_id)
    settings["ppo"] = {**settings["ppo"], "num_envs": n, "num_steps": 8, "compile": "off"}
    cfg = PPORunConfig.model_validate({**settings, "env": env_id, "seed": 0, "device": device})
    env, _, agent = build_agent(cfg)
    eager = RolloutWorker(env, agent.policy, 8, cfg.ppo.gamma, 0)
    env2, _, agent2 = build_agent(cfg)
    fused = FusedRolloutWorker(env2, agent2.policy, 8, cfg.ppo.gamma, 0, compile=True)
    return eager, fused


def bench_rollout(env_id: str, n: int, args) -> tuple[float, float, float, float]:
    eager, fused = _workers(env_id, n, args.device)
    compile_s = _timed_first(fused.collect)
    return (*_paired(eager.collect, fused.collect, 8 * n, args), compile_s)


def pod_start_child(env_id: str) -> None:
    """Run in a fresh process with an empty inductor cache: what a pod pays at start."""
    from services.pod.algorithms.compiled import compile_counters
    from services.pod.training.fit import train

    settings = preset("ppo", env_id)
    base = {**settings, "env": env_id, "total_env_steps": 1, "eval_every_steps": 10**9}
    out = {}
    for label, mode in (("eager", "off"), ("compiled", "on"), ("restart", "on")):
        cfg = PPORunConfig.model_validate(
            {**base, "ppo": {**settings["ppo"], "compile": mode, "learning_rate": 1e-3}}
        )
        if label == "restart":  # a PBT restart: new agent, new hyperparameters
            cfg = cfg.model_copy(update={"seed": 1})
            cfg.ppo.ent_coef, cfg.ppo.clip_coef = 0.01, 0.3
        start = time.perf_counter()
        train(cfg)  # build the agent, one rollout and one update
        out[label] = time.perf_counter() - start
        out[f"{label}_graphs"] = compile_counters()["frames"]
    print(json.dumps(out))


def bench_pod_start(env_id: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, __file__, "--child", env_id],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "Pendulum-v1"])
    parser.add_argument("--counts", nargs="+", type=int, default=[1, 64, 4096, 65536])
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pod-start", action="store_true")
    parser.add_argument("--device", default="cpu", help="device of the envs and the policy")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        pod_start_child(args.child)
        return
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "no GPU"
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {gpu}, load {os.getloadavg()}")
    print(
        "\n| env | envs | what | eager steps/s | compiled steps/s | compiled/eager "
        "| compile s |\n|---|---|---|---|---|---|---|"
    )
    for env_id in args.envs:
        for n in args.counts:
            for what, fn in (("env step", bench_env), ("rollout step", bench_rollout)):
                torch._dynamo.reset()  # each size compiles afresh (static shapes)
                e, c, ratio, compile_s = fn(env_id, n, args)
                print(
                    f"| {env_id} | {n:,} | {what} | {e:,.0f} | {c:,.0f} | {ratio:.2f} "
                    f"| {compile_s:.1f} |",
                    flush=True,
                )
    print(f"load after: {os.getloadavg()}")
    if args.pod_start:
        print(
            "\n| env | pod start eager s | pod start compiled s | PBT restart s "
            "| graphs after start | graphs after restart |\n|---|---|---|---|---|---|"
        )
        for env_id in args.envs:
            r = bench_pod_start(env_id)
            print(
                f"| {env_id} | {r['eager']:.1f} | {r['compiled']:.1f} | {r['restart']:.1f} "
                f"| {r['compiled_graphs']} | {r['restart_graphs']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
