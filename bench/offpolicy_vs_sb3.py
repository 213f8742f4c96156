"""Time-to-solve: Podium off-policy agents vs Stable-Baselines3 (rl-baselines3-zoo settings).

    python bench/offpolicy_vs_sb3.py [--runs sac:Pendulum-v1 td3:Pendulum-v1 dqn:CartPole-v1]
                                     [--seeds 5]

Same procedure as bench/ppo_time_to_solve.py: for each (algorithm, env) and seed, SB3 then
Podium run in the same process, alternating, so machine noise hits both alike. Both are
evaluated deterministically on 10 episodes at least every ``EVAL_EVERY[env]`` env steps; the
clock stops while evaluating (wall time excluding evaluation). "Solved" is the first
evaluation whose mean reaches the threshold. Prints per-seed lines and a markdown table with
medians and the ratio. Needs the bench extra: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import functools
import os

import numpy as np

# The pod's package before torch: it lets MKL choose its kernels by instruction sets.
import services.pod  # noqa: F401

# isort: split
import torch
from sb3_timing import compare, machine, timed_learn, timed_podium

EVAL_EPISODES = 10
EVAL_EVERY = {"Pendulum-v1": 1_024, "CartPole-v1": 2_048}
THRESHOLD = {"CartPole-v1": 475.0, "Pendulum-v1": -200.0}

# rl-baselines3-zoo hyperparams/{sac,td3,dqn}.yml; n_timesteps is SB3's budget. Unlisted
# settings are SB3's defaults (SAC: 256x256 nets, batch 256, buffer 1e6, learning_starts 100,
# tau 0.005, gamma 0.99, train_freq 1, gradient_steps 1, ent_coef "auto").
ZOO = {
    ("sac", "Pendulum-v1"): dict(n_timesteps=20_000, learning_rate=1e-3),
    # td3.yml's Pendulum entry (the zoo's tuned TD3 settings for the env).
    ("td3", "Pendulum-v1"): dict(
        n_timesteps=20_000,
        gamma=0.98,
        buffer_size=200_000,
        learning_starts=10_000,
        noise_std=0.1,
        gradient_steps=-1,
        train_freq=(1, "episode"),
        learning_rate=1e-3,
        policy_kwargs=dict(net_arch=[400, 300]),
    ),
    ("dqn", "CartPole-v1"): dict(
        n_timesteps=50_000,
        learning_rate=2.3e-3,
        batch_size=64,
        buffer_size=100_000,
        learning_starts=1_000,
        gamma=0.99,
        target_update_interval=10,
        train_freq=256,
        gradient_steps=128,
        exploration_fraction=0.16,
        exploration_final_eps=0.04,
        policy_kwargs=dict(net_arch=[256, 256]),
    ),
}


def run_sb3(algorithm: str, env_id: str, seed: int) -> tuple[float, int | None]:
    import stable_baselines3 as sb3
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.noise import NormalActionNoise

    params = dict(ZOO[(algorithm, env_id)])
    budget = params.pop("n_timesteps")
    env = make_vec_env(env_id, n_envs=1, seed=seed)
    eval_env = make_vec_env(env_id, n_envs=1, seed=seed + 10_000)
    if "noise_std" in params:
        dim = env.action_space.shape[0]
        params["action_noise"] = NormalActionNoise(
            np.zeros(dim), params.pop("noise_std") * np.ones(dim)
        )
    threshold, every = THRESHOLD[env_id], EVAL_EVERY[env_id]

    model_class = {"sac": sb3.SAC, "td3": sb3.TD3, "dqn": sb3.DQN}[algorithm]
    model = model_class("MlpPolicy", env, seed=seed, verbose=0, device="cpu", **params)
    return timed_learn(model, eval_env, budget, threshold, every, EVAL_EPISODES)


def run_podium(algorithm: str, env_id: str, seed: int) -> tuple[float, int | None]:
    from services.pod.training.fit import train
    from services.pod.training.offpolicy import OffPolicyConfig
    from services.pod.training.presets import preset

    return timed_podium(
        OffPolicyConfig,
        train,
        preset(algorithm, env_id),
        seed,
        EVAL_EVERY[env_id],
        EVAL_EPISODES,
        THRESHOLD[env_id],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=[f"{a}:{e}" for a, e in ZOO])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--sb3-threads",
        type=int,
        default=torch.get_num_threads(),
        help="SB3's intra-op threads (default: torch's default, as a new user gets it).",
    )
    args = parser.parse_args()

    print(
        f"machine: {machine()}; SB3 threads: {args.sb3_threads}; "
        f"load average at start: {os.getloadavg()}\n",
        flush=True,
    )
    rows = []
    for run in args.runs:
        algorithm, env_id = run.split(":", 1)
        cells = compare(
            f"{algorithm} {env_id}",
            functools.partial(run_sb3, algorithm, env_id),
            functools.partial(run_podium, algorithm, env_id),
            range(args.seeds),
            args.sb3_threads,
            load=True,
        )
        rows.append(f"| {algorithm} | {env_id} {cells}")
        print(rows[-1], flush=True)
    print(
        "\n| algorithm | env | SB3 median s | SB3 median steps | Podium median s "
        "| Podium median steps | speed-up | solved (SB3, Podium) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
