"""Time-to-solve: Podium PPO vs Stable-Baselines3 PPO (rl-baselines3-zoo tuned hyperparameters).

    python bench/ppo_time_to_solve.py [--envs CartPole-v1 Pendulum-v1] [--seeds 5]

For each env and seed, runs SB3 then Podium in the same process, alternating, so machine noise
hits both alike. Both are evaluated deterministically on 10 episodes at least every 4,096 env
steps; the clock stops while evaluating (wall time excluding evaluation). "Solved" is the first
evaluation whose mean reaches the threshold. Prints a markdown table with medians and the ratio.
Needs the bench extra: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from sb3_timing import machine, timed_learn

EVAL_EVERY = 4096
EVAL_EPISODES = 10
THRESHOLD = {"CartPole-v1": 475.0, "Pendulum-v1": -200.0}
SB3_BUDGET = {"CartPole-v1": 200_000, "Pendulum-v1": 300_000}

# rl-baselines3-zoo hyperparams/ppo.yml ("Tuned" entries).
ZOO = {
    "CartPole-v1": dict(
        n_envs=8,
        n_steps=32,
        batch_size=256,
        gae_lambda=0.8,
        gamma=0.98,
        n_epochs=20,
        ent_coef=0.0,
        learning_rate="lin_0.001",
        clip_range="lin_0.2",
    ),
    "Pendulum-v1": dict(
        n_envs=4,
        n_steps=1024,
        gae_lambda=0.95,
        gamma=0.9,
        n_epochs=10,
        ent_coef=0.0,
        learning_rate=1e-3,
        clip_range=0.2,
        use_sde=True,
        sde_sample_freq=4,
    ),
}


def run_sb3(env_id: str, seed: int) -> tuple[float, int | None]:
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    def schedule(value):
        if isinstance(value, str) and value.startswith("lin_"):
            start = float(value[4:])
            return lambda progress: progress * start
        return value

    params = dict(ZOO[env_id])
    n_envs = params.pop("n_envs")
    params = {k: schedule(v) for k, v in params.items()}
    env = make_vec_env(env_id, n_envs=n_envs, seed=seed)
    eval_env = make_vec_env(env_id, n_envs=1, seed=seed + 10_000)
    threshold = THRESHOLD[env_id]

    model = PPO("MlpPolicy", env, seed=seed, verbose=0, device="cpu", **params)
    return timed_learn(model, eval_env, SB3_BUDGET[env_id], threshold, EVAL_EVERY, EVAL_EPISODES)


def run_podium(env_id: str, seed: int) -> tuple[float, int | None]:
    from services.pod.train import TrainConfig, preset, train

    cfg = TrainConfig.model_validate(
        {
            **preset(env_id),
            "seed": seed,
            "eval_every_steps": EVAL_EVERY,
            "eval_episodes": EVAL_EPISODES,
            "target_return": THRESHOLD[env_id],
        }
    )
    result = train(cfg)
    return result.train_seconds, result.solved_at_env_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(THRESHOLD))
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    default_threads = torch.get_num_threads()

    print(f"machine: {machine()}\n")
    rows = []
    for env_id in args.envs:
        times: dict[str, list[float]] = {"sb3": [], "podium": []}
        steps: dict[str, list[float]] = {"sb3": [], "podium": []}
        for seed in range(args.seeds):
            for name, fn in (("sb3", run_sb3), ("podium", run_podium)):
                torch.set_num_threads(default_threads)  # each side picks its own threads
                seconds, solved = fn(env_id, seed)
                times[name].append(seconds if solved is not None else float("inf"))
                steps[name].append(solved if solved is not None else float("inf"))
                print(f"{env_id} seed {seed} {name:>6}: {seconds:6.2f} s, solved at {solved}")
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            f"| {env_id} | {med['sb3']:.2f} | {statistics.median(steps['sb3']):,.0f} "
            f"| {med['podium']:.2f} | {statistics.median(steps['podium']):,.0f} "
            f"| {med['sb3'] / med['podium']:.1f}x | "
            f"{sum(np.isfinite(times['sb3']))}/{args.seeds}, "
            f"{sum(np.isfinite(times['podium']))}/{args.seeds} |"
        )
    print(
        "\n| env | SB3 median s | SB3 median steps | Podium median s | Podium median steps "
        "| speed-up | solved (SB3, Podium) |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
