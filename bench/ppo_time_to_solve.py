"""Time-to-solve: Podium PPO vs Stable-Baselines3 PPO (rl-baselines3-zoo tuned hyperparameters).

    python bench/ppo_time_to_solve.py [--envs CartPole-v1 Pendulum-v1] [--seeds 5]
                                      [--compile auto|on|off] [--baseline sb3|eager]

``--compile`` sets Podium's ``ppo.compile`` (services/pod/compiled.py); ``--baseline eager``
compares Podium compiled (``--compile``, default on) against Podium eager instead of SB3; the
compiled arm starts from a reset dynamo cache every seed, so its time includes compiling
(with this process's warm inductor caches after the first seed; a cold pod start is
bench/compiled_loop.py --pod-start).

For each env and seed, runs SB3 then Podium in the same process, alternating, so machine noise
hits both alike. Both are evaluated deterministically on 10 episodes at least every 4,096 env
steps; the clock stops while evaluating (wall time excluding evaluation). "Solved" is the first
evaluation whose mean reaches the threshold. Prints a markdown table with medians and the ratio.
Needs the bench extra: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import functools

import torch
from sb3_timing import compare, machine, timed_learn, timed_podium

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


def run_podium(env_id: str, seed: int, compile: str = "auto") -> tuple[float, int | None]:
    from services.pod.fit import train
    from services.pod.onpolicy import PPORunConfig
    from services.pod.presets import preset

    torch._dynamo.reset()  # compile time counts in every run
    settings = preset("ppo", env_id)
    settings["ppo"] = {**settings["ppo"], "compile": compile}
    return timed_podium(
        PPORunConfig, train, settings, seed, EVAL_EVERY, EVAL_EPISODES, THRESHOLD[env_id]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(THRESHOLD))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--compile", choices=("auto", "on", "off"), default=None)
    parser.add_argument("--baseline", choices=("sb3", "eager"), default="sb3")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()

    print(f"machine: {machine()}\n")
    rows = []
    for env_id in args.envs:
        # Each side picks its own threads from torch's default.
        if args.baseline == "eager":
            sb3 = functools.partial(run_podium, env_id, compile="off")
            podium = functools.partial(run_podium, env_id, compile=args.compile or "on")
        else:
            sb3 = functools.partial(run_sb3, env_id)
            podium = functools.partial(run_podium, env_id, compile=args.compile or "auto")
        names = ("eager", "compiled") if args.baseline == "eager" else ("sb3", "podium")
        cells = compare(env_id, sb3, podium, args.seeds, default_threads, load=True, names=names)
        rows.append(f"| {env_id} {cells}")
    if args.baseline == "eager":
        print("\n(baseline: Podium eager; Podium: compiled, compile time included)")
    print(
        "\n| env | SB3 median s | SB3 median steps | Podium median s | Podium median steps "
        "| speed-up | solved (SB3, Podium) |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
