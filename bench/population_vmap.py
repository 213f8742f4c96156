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


def measure_offpolicy(
    algorithm: str, p: int, hidden: int, seed: int, device: str, repeats: int, updates: int
):
    from services.pod.algorithms.replay_buffer import Batch
    from services.pod.envs.registry import make_env
    from services.pod.training.offpolicy_population import POPULATIONS
    from services.pod.training.trainer import algorithm_card, algorithm_class

    env = make_env("Pendulum-v1", 1)
    spaces = env.single_observation_space, env.single_action_space
    env.close()
    agent_class, config_class = algorithm_class(algorithm), algorithm_card(algorithm).config

    def agents() -> list:
        out = []
        for i in range(p):
            torch.manual_seed(seed + i)
            cfg = config_class(
                hidden_sizes=[hidden, hidden],
                learning_rate=3e-4 * (1 + i % 4),
                gamma=0.99 - 0.01 * (i % 3),
                tau=0.005 * (1 + i % 2),
            )
            out.append(agent_class(*spaces, cfg).to(device))
        return out

    pop, loop = POPULATIONS[algorithm](agents()), agents()
    g = torch.Generator(device=device).manual_seed(seed)
    b = 256
    batches = [
        Batch(
            torch.randn(p, b, 3, generator=g, device=device),
            torch.rand(p, b, 1, generator=g, device=device) * 2 - 1,
            torch.randn(p, b, generator=g, device=device),
            torch.randn(p, b, 3, generator=g, device=device),
            (torch.rand(p, b, generator=g, device=device) < 0.01).float(),
        )
        for _ in range(updates)
    ]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--algorithm", choices=["ppo", "sac", "td3", "ddpg"], default="ppo")
    parser.add_argument(
        "--offpolicy-updates", type=int, default=10, help="SAC/TD3/DDPG steps per timing"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, device {args.device}, threads {args.threads}, {args.algorithm}"
    )
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
