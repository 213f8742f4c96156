"""Time-to-solve: Podium PPO vs Stable-Baselines3 PPO (rl-baselines3-zoo tuned hyperparameters).

    python bench/ppo_time_to_solve.py [--envs CartPole-v1 Pendulum-v1 HalfCheetah-v5]
                                      [--seeds 5] [--first-seed 0]
                                      [--compile auto|on|off] [--baseline sb3|eager]

HalfCheetah-v5 isolates the implementations rather than racing tuned settings: both sides
train Podium's preset as a tournament's pod does (constant learning rate; SB3 gets it mapped by
bench/tournament_vs_raytune.py's ``sb3_ppo_kwargs``, ``VecNormalize`` included), Podium on
EnvPool's HalfCheetah-v5 and SB3 on gymnasium's (the same transitions), 5 evaluation episodes
every 20,480 env steps.

``--compile`` sets Podium's ``ppo.compile`` (services/pod/algorithms/compiled.py); ``--baseline
eager`` compares Podium compiled (``--compile``, default on) against Podium eager instead of SB3;
the compiled arm starts from a reset dynamo cache every seed, so its time includes compiling
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

# The pod's package before torch: it lets MKL choose its kernels by instruction sets.
import services.pod  # noqa: F401

# isort: split
import torch
from sb3_timing import compare, machine, timed_learn, timed_podium

EVAL_EVERY = {"CartPole-v1": 4096, "Pendulum-v1": 4096, "HalfCheetah-v5": 20_480}
EVAL_EPISODES = {"CartPole-v1": 10, "Pendulum-v1": 10, "HalfCheetah-v5": 5}
THRESHOLD = {"CartPole-v1": 475.0, "Pendulum-v1": -200.0, "HalfCheetah-v5": 3000.0}
SB3_BUDGET = {"CartPole-v1": 200_000, "Pendulum-v1": 300_000, "HalfCheetah-v5": 1_000_000}
#: Envs whose SB3 side trains Podium's preset (no zoo entry), and the env Podium trains.
SAME_SETTINGS = {"HalfCheetah-v5": "envpool:HalfCheetah-v5"}

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

    eval_env = make_vec_env(env_id, n_envs=1, seed=seed + 10_000)
    if env_id in SAME_SETTINGS:
        from stable_baselines3.common.vec_env import VecNormalize
        from tournament_vs_raytune import sb3_model

        model, env = sb3_model("ppo", SAME_SETTINGS[env_id], {}, seed)
        if isinstance(env, VecNormalize):  # timed_learn syncs its statistics before each eval
            eval_env = VecNormalize(eval_env, training=False, norm_reward=False)
    else:
        params = dict(ZOO[env_id])
        n_envs = params.pop("n_envs")
        params = {k: schedule(v) for k, v in params.items()}
        env = make_vec_env(env_id, n_envs=n_envs, seed=seed)
        model = PPO("MlpPolicy", env, seed=seed, verbose=0, device="cpu", **params)
    return timed_learn(
        model,
        eval_env,
        SB3_BUDGET[env_id],
        THRESHOLD[env_id],
        EVAL_EVERY[env_id],
        EVAL_EPISODES[env_id],
    )


def run_podium(env_id: str, seed: int, compile: str = "auto") -> tuple[float, int | None]:
    from services.pod.config import PPORunConfig
    from services.pod.roles import learner
    from services.pod.training.fit import train
    from services.pod.training.presets import preset

    for program in (learner._CHUNK, learner._BATCH, learner._UPDATE, learner._EVALUATE):
        program._graphs.clear()  # as in a new process: compile (or load) time counts every run
    settings = preset("ppo", SAME_SETTINGS.get(env_id, env_id))
    settings["ppo"] = {**settings["ppo"], "compile": compile}
    if env_id in SAME_SETTINGS:  # as a pod trains it (and sb3_ppo_kwargs maps it)
        settings["ppo"]["anneal_lr"] = False
    return timed_podium(
        PPORunConfig,
        train,
        settings,
        seed,
        EVAL_EVERY[env_id],
        EVAL_EPISODES[env_id],
        THRESHOLD[env_id],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "Pendulum-v1"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
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
        cells = compare(
            env_id,
            sb3,
            podium,
            range(args.first_seed, args.first_seed + args.seeds),
            default_threads,
            load=True,
            names=names,
        )
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
