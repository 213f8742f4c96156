"""Population update step: P PPO agents batched in one population vs a Python loop over them.

One "update step" is a full PPO update of every agent on its own rollout (per agent: 16 envs x
16 steps = 256 samples, 4 epochs x 4 minibatches of 64 = 16 gradient steps; tanh MLPs). The
population (services/pod/training/population.py: modules stacked with torch.func, networks as
batched matmuls over the agent axis, one flat Adam) and P separate ``PPO`` agents
(services/pod/algorithms/ppo.py, fused Adam) update on the same CartPole rollouts, alternating
in the same process. Per seed the median of ``--repeats`` timings; printed: medians over seeds
of those times, their ratio, and the median over seeds of the per-seed ratios.

    python bench/population_vmap.py                       # P = 1 8 32 64, 64x64 and 256x256
    python bench/population_vmap.py --sizes 8 --hidden 64 --seeds 1   # quick look
    python bench/population_vmap.py --device cuda

SAC rows (``--algorithm sac``; ``td3`` and ``ddpg`` alike, with their own population
class): one update step = ``--offpolicy-updates`` SAC gradient steps of every
agent (twin critics, actor and temperature, targets' Polyak) on its own minibatch of 256 from
its own replay buffer: ``PopulationSAC.update`` (services/pod/training/offpolicy_population.py:
torch.func over the agent axis, one BatchedAdam over the stacked weights, per-agent learning
rate, gamma and tau) against a loop over P ``SAC`` agents (services/pod/algorithms/sac.py,
fused Adam) on the same minibatches, alternating in the same process.

    python bench/population_vmap.py --algorithm sac --sizes 1 8 32 --hidden 64 256

DQN rows (``--algorithm dqn``): the same with ``PopulationDQN.update`` (double, dueling: the
CartPole preset's D3QN; gradient clipping, per-agent target timing) against a loop of P ``DQN``
agents (services/pod/algorithms/dqn.py), on CartPole-shaped transitions (4 observations, 2
actions).

K-step rows (``--kstep``, SAC, TD3, DDPG or DQN): one timing = ``--offpolicy-updates``
updates of every agent, each drawing its own minibatch of 256 from a replay buffer of 10,000
random transitions: eager, as a pod with ``compile: off`` runs them (P = 1: ``SAC.update`` /
``TD3.update`` / ``DQN.update`` on ``ReplayBuffer.sample``; P > 1: the population's ``update``
on ``StackedReplay.sample``), against one call of the compiled K-step update
(services/pod/algorithms/kstep.py ``KStep``: one compiled program per update, the K of a call
one CUDA graph on a GPU) on the same stack. Printed per update (all P agents); "first call" is
the compiled side's first call of K updates, its compile included (cold: the bench points
inductor at an empty cache unless ``--warm-cache``).

    python bench/population_vmap.py --kstep --algorithm sac --sizes 1 8 32 --hidden 64 256
    python bench/population_vmap.py --kstep --algorithm td3 --device cuda
    python bench/population_vmap.py --kstep --algorithm dqn --sizes 1 8 --hidden 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.pod.algorithms.ppo import PPO, PPOConfig
from services.pod.training.population import build_population


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(p: int, hidden: int, seed: int, device: str, repeats: int) -> tuple[float, float]:
    cfg = PPOConfig(
        num_envs=16,
        num_steps=16,
        num_minibatches=4,
        update_epochs=4,
        hidden_sizes=[hidden, hidden],
        anneal_lr=False,
    )
    hps = [{"learning_rate": 3e-4 * (1 + i % 4), "ent_coef": 0.01 * (i % 3)} for i in range(p)]
    pop = build_population("CartPole-v1", cfg, hps, seed=seed, eval_episodes=1, device=device)
    loop = []
    for i, hp in enumerate(hps):
        torch.manual_seed(seed + i)
        space = pop.env.single_observation_space, pop.env.single_action_space
        agent = PPO(*space, cfg.model_copy(update=hp))
        loop.append(agent.to(device))
    rollout = pop.collect()
    parts = [rollout.agent(i) for i in range(p)]
    # Warm-up (allocator, first calls), then alternate the two so drift hits both.
    pop.update(rollout)
    for agent, part in zip(loop, parts, strict=True):
        agent.update(part)
    t_pop, t_loop = [], []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        pop.update(rollout)
        sync(device)
        t_pop.append(time.perf_counter() - start)
        start = time.perf_counter()
        for agent, part in zip(loop, parts, strict=True):
            agent.update(part)
        sync(device)
        t_loop.append(time.perf_counter() - start)
    return statistics.median(t_pop), statistics.median(t_loop)


def _transitions(
    algorithm: str, p: int, n: int, g: torch.Generator, device: str
) -> tuple[torch.Tensor, ...]:
    """``n`` random transitions per agent, (P, n, ...) each field: Pendulum's shapes, or
    CartPole's (4 observations, 2 discrete actions) for DQN."""
    obs = 4 if algorithm == "dqn" else 3
    action = (
        torch.randint(0, 2, (p, n), generator=g, device=device)
        if algorithm == "dqn"
        else torch.rand(p, n, 1, generator=g, device=device) * 2 - 1
    )
    return (
        torch.randn(p, n, obs, generator=g, device=device),
        action,
        torch.randn(p, n, generator=g, device=device),
        torch.randn(p, n, obs, generator=g, device=device),
        (torch.rand(p, n, generator=g, device=device) < 0.01).float(),
    )


def measure_offpolicy(
    algorithm: str, p: int, hidden: int, seed: int, device: str, repeats: int, updates: int
):
    from services.pod.algorithms.replay_buffer import Batch
    from services.pod.training.offpolicy_population import POPULATIONS

    def agents() -> list:
        return _offpolicy_agents(algorithm, p, hidden, seed, device)

    pop, loop = POPULATIONS[algorithm](agents()), agents()
    g = torch.Generator(device=device).manual_seed(seed)
    b = 256
    batches = [Batch(*_transitions(algorithm, p, b, g, device)) for _ in range(updates)]
    parts = [[Batch(*(f[i] for f in batch)) for i in range(p)] for batch in batches]

    def run_pop() -> None:
        for step, batch in enumerate(batches):
            pop.update(batch, g, step + 1)

    def run_loop() -> None:
        for step, per_agent in enumerate(parts):
            for agent, part in zip(loop, per_agent, strict=True):
                agent.update(part, g, step + 1)

    run_pop()  # warm-up (allocator, first calls), then alternate the two so drift hits both
    run_loop()
    t_pop, t_loop = [], []
    for _ in range(repeats):
        for fn, times in ((run_pop, t_pop), (run_loop, t_loop)):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(t_pop), statistics.median(t_loop)


def _offpolicy_agents(algorithm: str, p: int, hidden: int, seed: int, device: str) -> list:
    from services.pod.envs.registry import make_env
    from services.pod.training.trainer import algorithm_card, algorithm_class

    env = make_env("CartPole-v1" if algorithm == "dqn" else "Pendulum-v1", 1)
    spaces = env.single_observation_space, env.single_action_space
    env.close()
    agent_class, config_class = algorithm_class(algorithm), algorithm_card(algorithm).config
    out = []
    for i in range(p):
        torch.manual_seed(seed + i)
        # DQN: the CartPole preset's D3QN, each agent its own target period.
        dqn = {"double": True, "dueling": True, "target_update_every": 1 + i % 3}
        cfg = config_class(
            hidden_sizes=[hidden, hidden],
            learning_rate=3e-4 * (1 + i % 4),
            gamma=0.99 - 0.01 * (i % 3),
            tau=0.005 * (1 + i % 2),
            **(dqn if algorithm == "dqn" else {}),
        )
        out.append(agent_class(*spaces, cfg).to(device))
    return out


def measure_kstep(
    algorithm: str, p: int, hidden: int, seed: int, device: str, repeats: int, k: int
) -> tuple[float, float, float]:
    """Seconds per update of all P agents, eager and compiled (medians of ``repeats`` calls of
    ``k`` updates), and the compiled side's first call in seconds."""
    from services.pod.algorithms.kstep import KStep
    from services.pod.algorithms.replay_buffer import FIELDS, ReplayBuffer
    from services.pod.algorithms.stacked import POPULATIONS, StackedReplay

    b, capacity = 256, 10_000
    g = torch.Generator(device=device).manual_seed(seed)
    if algorithm == "dqn":
        buffer = ReplayBuffer(capacity, (4,), (), torch.int64, device=device)
    else:
        buffer = ReplayBuffer(capacity, (3,), (1,), device=device)
    replay = StackedReplay(p, buffer)
    replay.add(*_transitions(algorithm, p, capacity, g, device))
    replay.get(0, buffer)
    eager_agents = _offpolicy_agents(algorithm, p, hidden, seed, device)
    stack = POPULATIONS[algorithm](_offpolicy_agents(algorithm, p, hidden, seed, device))
    if p == 1:  # a single agent: its own update on its own buffer; compiled, a stack of one
        [agent] = eager_agents
        fields = tuple(getattr(buffer, name).unsqueeze(0) for name in FIELDS)
        run = KStep(stack, fields, buffer.filled.view(1), b, seed, compile=True)
    else:
        pop = POPULATIONS[algorithm](eager_agents)
        run = KStep(stack, replay.fields, replay.filled, b, seed, compile=True)
    done = {"eager": 0, "compiled": 0}

    def eager() -> None:
        for _ in range(k):
            done["eager"] += 1
            if p == 1:
                agent.update(buffer.sample(b, g), g, done["eager"])
            else:
                pop.update(replay.sample(b, g), g, done["eager"])

    def compiled() -> None:
        run(k, done["compiled"] + 1)
        done["compiled"] += k

    sync(device)
    start = time.perf_counter()
    compiled()  # compiles
    sync(device)
    first = time.perf_counter() - start
    for _ in range(2):  # warm-up: allocator; on CUDA the graph's warm-up and capture
        compiled()
        eager()
    t_eager, t_compiled = [], []
    for _ in range(repeats):
        for fn, times in ((eager, t_eager), (compiled, t_compiled)):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times.append((time.perf_counter() - start) / k)
    return statistics.median(t_eager), statistics.median(t_compiled), first


def main_kstep(args: argparse.Namespace) -> None:
    print(
        "| algorithm | MLP | P | eager (ms/update) | compiled (ms/update) | eager / compiled "
        "| median ratio | per seed | first call (s) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    for hidden in args.hidden:
        for p in args.sizes:
            runs = [
                measure_kstep(
                    args.algorithm,
                    p,
                    hidden,
                    s,
                    args.device,
                    args.repeats,
                    args.offpolicy_updates,
                )
                for s in range(args.seeds)
            ]
            e = statistics.median(r[0] for r in runs)
            c = statistics.median(r[1] for r in runs)
            ratios = [r[0] / r[1] for r in runs]
            listed = " / ".join(f"{r:.2f}" for r in ratios)
            print(
                f"| {args.algorithm} | {hidden}x{hidden} | {p} | {e * 1e3:.2f} | {c * 1e3:.2f} | "
                f"{e / c:.2f}x | **{statistics.median(ratios):.2f}x** | {listed} | "
                f"{runs[0][2]:.0f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--algorithm", choices=["ppo", "sac", "td3", "ddpg", "dqn"], default="ppo")
    parser.add_argument(
        "--offpolicy-updates", type=int, default=10, help="SAC/TD3/DDPG/DQN steps per timing"
    )
    parser.add_argument(
        "--kstep", action="store_true", help="compiled K-step update against eager updates"
    )
    parser.add_argument(
        "--warm-cache", action="store_true", help="--kstep: keep inductor's cache (default: cold)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, device {args.device}, threads {args.threads}, {args.algorithm}"
    )
    if args.kstep:
        if args.algorithm not in ("sac", "td3", "ddpg", "dqn"):
            parser.error("--kstep times an off-policy algorithm: --algorithm sac, td3, ddpg or dqn")
        # One process times every size: more programs of one function than a pod compiles
        # (dynamo's default limit, 8, would turn the later rows eager).
        torch._dynamo.config.recompile_limit = 64
        if not args.warm_cache:  # the first call's compile as a new pod's: nothing cached
            import os
            import tempfile

            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kstep-bench-")
        main_kstep(args)
        return
    print("| MLP | P | population (ms) | loop (ms) | loop / pop. | median ratio | per seed |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for hidden in args.hidden:
        for p in args.sizes:
            if args.algorithm != "ppo":
                runs = [
                    measure_offpolicy(
                        args.algorithm,
                        p,
                        hidden,
                        s,
                        args.device,
                        args.repeats,
                        args.offpolicy_updates,
                    )
                    for s in range(args.seeds)
                ]
            else:
                runs = [measure(p, hidden, s, args.device, args.repeats) for s in range(args.seeds)]
            v = statistics.median(r[0] for r in runs)
            lo = statistics.median(r[1] for r in runs)
            ratios = [r[1] / r[0] for r in runs]
            listed = " / ".join(f"{r:.1f}" for r in ratios)
            print(
                f"| {hidden}x{hidden} | {p} | {v * 1e3:.1f} | {lo * 1e3:.1f} | {lo / v:.1f}x | "
                f"**{statistics.median(ratios):.1f}x** | {listed} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
