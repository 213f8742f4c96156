"""The GPU rows of the Anakin and off-policy benches in one prepared call (a lent GPU has
minutes, not hours).

Rows, each printed as a JSON line as it finishes and appended to ``$OUT/gpu_rows.jsonl``:

* ``check``: the CUDA-graph iteration (``AnakinPPO(cuda_graph=True)``) against the same
  iteration launched op by op: same weights after 3 iterations; an agent whose learning rate is
  set to 0 after the capture keeps its weights (a PBT explore reaches the captured graph);
* ``peer``: PureJaxRL's ``make_train`` (bench/purejaxrl_peer.py's transcription, one
  ``jit(vmap(train))`` call) against Podium's compiled iteration, on PureJaxRL's CartPole recipe
  (observations raw, as PureJaxRL's), P = 1, 64, 1,024, 5e5 env steps per agent: compile/build
  seconds, training seconds, env steps/s of all agents, greedy returns (fraction >= 475);
* ``mode``: env steps/s of each way to run the iteration (eager, two compiled programs, a CUDA
  graph over eager ops, a CUDA graph over the compiled programs) at P = 1, 64, 1,024;
* ``large``: one agent at 2**20 envs x 16 steps (the large-batch row: PPO >= 40M env steps/s);
* ``sac``: bench/population_vmap.py's SAC rows (P = 32, 256x256: the population's batched
  update against a loop of 32 agents).

    python bench/gpu_rows.py                      # all rows, on cuda
    python bench/gpu_rows.py --rows check mode    # some
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/podium-inductor-gpu-rows")
# JAX would take 75% of the GPU's memory at start; torch shares the card in this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from services.pod.training import anakin, anakin_eval
from services.pod.training.anakin import PUREJAXRL_CARTPOLE, AnakinPPO

OUT = Path(os.environ.get("OUT", "runs"))
RECIPE_RAW = PUREJAXRL_CARTPOLE.model_copy(update={"norm_obs": False})  # PureJaxRL's own
STEPS_PER_AGENT = 500_000
MODES = {  # name: (compile, cuda_graph)
    "eager": ("off", False),
    "steps": ("steps", False),
    "graph-eager": ("off", True),
    "graph-steps": ("steps", True),
}


def emit(row: dict) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    with (OUT / "gpu_rows.jsonl").open("a") as f:
        f.write(line + "\n")


DEVICE = "cuda"  # --device cpu: a dry run of the script's own code (graph rows fail there)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def greedy_returns(run: AnakinPPO, episodes: int = 10) -> list[float]:
    """Each agent's mean return over ``episodes`` greedy episodes (anakin_eval's, run eagerly),
    from start states of their own counter-based draw."""
    shape, state = run.shape, run.state
    _, initial = anakin.FUNCTIONAL_ENVS[shape.env]
    counter = torch.tensor(12_345, device=state["seed"].device)
    start = initial(anakin.uniform(state["seed"], counter, 0, (episodes, shape.state_dim)))
    returns, _ = anakin_eval.greedy_returns(
        shape, state["params"], state["obs_mean"], state["obs_var"], start
    )
    return returns.mean(1).tolist()


def row_check() -> None:
    cfg = PUREJAXRL_CARTPOLE
    plain = AnakinPPO(cfg, range(4), total_env_steps=10**6, device=DEVICE)
    graphed = AnakinPPO(cfg, range(4), total_env_steps=10**6, device=DEVICE, cuda_graph=True)
    for _ in range(3):
        plain.step()
        graphed.step()
    sync()
    diff = (plain.state["params"] - graphed.state["params"]).abs().max().item()
    env_equal = bool(torch.equal(plain.state["env"], graphed.state["env"]))
    before = graphed.state["params"].clone()
    graphed.set_hyperparameters(0, {"learning_rate": 0.0})
    graphed.step()
    sync()
    frozen = bool(torch.equal(before[0], graphed.state["params"][0]))
    moved = not torch.equal(before[1], graphed.state["params"][1])
    emit(
        {
            "row": "check",
            "max_abs_param_diff_after_3": diff,
            "env_state_equal": env_equal,
            "lr0_agent_frozen": frozen,
            "other_agent_moved": moved,
            "iteration_counter": int(graphed.state["iteration"].item()),
        }
    )


def row_peer(agents: int, steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import purejaxrl_peer  # jax is imported for this row only

    jx = purejaxrl_peer.run_purejaxrl(agents, 0, steps, DEVICE)
    emit(
        {
            "row": "peer",
            "side": "purejaxrl",
            "agents": agents,
            "env_steps_per_agent": jx.env_steps,
            "startup_s": round(jx.startup_s, 2),
            "train_s": round(jx.train_s, 3),
            "steps_per_s": round(jx.steps_per_s),
            "solved": jx.solved,
            "mean_return": round(jx.mean_return, 1),
        }
    )
    start = time.perf_counter()
    run = AnakinPPO(
        RECIPE_RAW,
        [i for i in range(agents)],
        total_env_steps=steps,
        compile="steps",
        device=DEVICE,
        cuda_graph=DEVICE == "cuda",
    )
    run.step()  # compile, warm up, capture: counted as start-up, as PureJaxRL's compile
    sync()
    startup = time.perf_counter() - start
    iterations = run.state["total_iterations"].item()
    start = time.perf_counter()
    while run.iterations < iterations:
        run.step()
    sync()
    train = time.perf_counter() - start
    returns = greedy_returns(run)
    steps_done = run.env_steps
    emit(
        {
            "row": "peer",
            "side": "podium-graph-steps",
            "agents": agents,
            "env_steps_per_agent": steps_done,
            "startup_s": round(startup, 2),
            "train_s": round(train, 3),
            # the first iteration is in startup_s: its steps are not in the rate
            "steps_per_s": round(agents * (steps_done - run.shape.batch) / train),
            "solved": sum(r >= 475 for r in returns) / len(returns),
            "mean_return": round(sum(returns) / len(returns), 1),
        }
    )


def rate(run: AnakinPPO, seconds: float = 1.5, repeats: int = 3) -> tuple[float, list[float]]:
    """Median env steps/s (all agents) over ``repeats`` timings of about ``seconds`` each."""
    t0 = time.perf_counter()
    run.step()
    sync()
    per = max(time.perf_counter() - t0, 1e-4)
    n = max(2, int(seconds / per))
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            run.step()
        sync()
        rates.append(run.shape.agents * run.shape.batch * n / (time.perf_counter() - t0))
    rates.sort()
    return rates[len(rates) // 2], rates


def row_mode(agents: int, mode: str, config=RECIPE_RAW, label: str = "mode") -> None:
    compile_mode, graph = MODES[mode]
    start = time.perf_counter()
    run = AnakinPPO(
        config,
        range(agents),
        total_env_steps=10**9,
        compile=compile_mode,
        device=DEVICE,
        cuda_graph=graph,
    )
    run.step()
    sync()
    first = time.perf_counter() - start
    median, rates = rate(run, seconds=1.0 if mode != "eager" else 0.5)
    emit(
        {
            "row": label,
            "mode": mode,
            "agents": agents,
            "num_envs": config.num_envs,
            "num_steps": config.num_steps,
            "first_iteration_s": round(first, 2),
            "steps_per_s": round(median),
            "spread": [round(r) for r in rates],
        }
    )


def row_large() -> None:
    config = RECIPE_RAW.model_copy(update={"num_envs": 2**20, "num_steps": 16})
    for mode in ("graph-eager", "graph-steps"):
        row_mode(1, mode, config, label="large")


def row_sac() -> None:
    script = Path(__file__).parent / "population_vmap.py"
    cmd = [sys.executable, str(script), "--algorithm", "sac", "--sizes", "1", "32"]
    cmd += ["--hidden", "256", "--seeds", "1", "--repeats", "3", "--device", DEVICE]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False)
    emit(
        {
            "row": "sac",
            "rc": done.returncode,
            "stdout": done.stdout[-3000:],
            "stderr": done.stderr[-1500:],
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["check", "peer", "mode", "sac", "large"])
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 64, 1024])
    parser.add_argument("--steps", type=int, default=STEPS_PER_AGENT)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        torch.set_num_threads(1)  # as PureJaxRL's XLA gets one thread (purejaxrl_peer.py)
    OUT.mkdir(parents=True, exist_ok=True)
    on_gpu = DEVICE == "cuda"
    props = torch.cuda.get_device_properties(0) if on_gpu else None
    emit(
        {
            "row": "machine",
            "gpu": props.name if props else "none",
            "sms": props.multi_processor_count if props else 0,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load": os.getloadavg()[0],
        }
    )
    plan = []
    for name in args.rows:
        if name == "peer":
            plan += [(f"peer P={p}", lambda p=p: row_peer(p, args.steps)) for p in args.agents]
        elif name == "mode":
            plan += [
                (f"mode {m} P={p}", lambda p=p, m=m: row_mode(p, m))
                for p in args.agents
                for m in MODES
            ]
        else:
            plan.append((name, globals()[f"row_{name}"]))
    for name, fn in plan:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # a row that fails must not cost the rows after it
            emit({"row": name, "error": repr(exc), "trace": traceback.format_exc()[-2000:]})
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
