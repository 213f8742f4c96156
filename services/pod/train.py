"""Train one agent in one process: worker → learner → evaluator, fused (Anakin-style).

This is the loop ``podium train`` runs and the one a training pod runs per round. Read it top
to bottom: collect a rollout, update, every so often evaluate and checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from services import registry
from services.pod.algorithms.ppo import PPO, PPOConfig
from services.pod.checkpoint import save_training_files
from services.pod.envs.registry import make_env
from services.pod.evaluator import EvalResult, Evaluator
from services.pod.fusion import ParameterAverager, agree, run_group
from services.pod.learner import Learner
from services.pod.worker import Worker

#: Returns at which the reference tasks count as solved (gymnasium's reward thresholds, and
#: -200 for Pendulum, the usual bar since it has none).
SOLVED_AT: dict[str, float] = {
    "CartPole-v1": 475.0,
    "Pendulum-v1": -200.0,
    "Acrobot-v1": -100.0,
    "MountainCarContinuous-v0": 90.0,
}


class RunConfig(BaseModel):
    """What every training run has, whatever its algorithm: env, budget, evaluation, seeds,
    device. ``TrainConfig`` (PPO) and ``OffPolicyConfig`` (services/pod/offpolicy.py) add the
    algorithm's hyperparameters."""

    model_config = ConfigDict(extra="forbid")

    env: str = "CartPole-v1"
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    algorithm: str = "ppo"
    total_env_steps: int = Field(500_000, ge=1, description="Training budget in env steps.")
    eval_every_steps: int = Field(20_000, ge=1)
    eval_episodes: int = Field(10, ge=1)
    target_return: float | None = Field(None, description="Stop once the evaluation reaches it.")
    device: str = "cpu"
    seed: int = 0
    eval_seed: int | None = Field(
        None, description="Seed of the evaluation start states (default: seed + 10,000)."
    )
    torch_threads: int | None = Field(
        1, ge=1, description="Intra-op threads; small networks run fastest on one thread."
    )

    @property
    def evaluation_seed(self) -> int:
        return self.seed + 10_000 if self.eval_seed is None else self.eval_seed

    def make_envs(self, num_envs: int) -> tuple[Any, Any]:
        """The training env (``num_envs`` copies, seeded by ``seed``) and the evaluation env
        (one copy per evaluation episode, seeded by ``evaluation_seed``)."""
        train_env = make_env(
            self.env, num_envs, device=self.device, seed=self.seed, **self.env_kwargs
        )
        eval_env = make_env(
            self.env,
            self.eval_episodes,
            device=self.device,
            seed=self.evaluation_seed,
            **self.env_kwargs,
        )
        return train_env, eval_env


class TrainConfig(RunConfig):
    """One PPO training run. ``ppo`` holds the algorithm's hyperparameters."""

    ppo: PPOConfig = Field(default_factory=PPOConfig)
    learners: int = Field(
        1,
        ge=1,
        le=64,
        description="Learner replicas, each with its own envs, averaged after every epoch.",
    )


#: Tuned starting points per built-in env; a config file or --set overrides any field.
PRESETS: dict[str, dict[str, Any]] = {
    # Few envs and many epochs on whole small batches: CartPole is solved in ~12k env steps
    # and ~400 gradient steps (median of 5 seeds), and gradient steps are what cost time here.
    "CartPole-v1": {
        "total_env_steps": 200_000,
        "eval_every_steps": 4_096,
        "ppo": {
            "num_envs": 16,
            "num_steps": 16,
            "learning_rate": 8e-3,
            "gamma": 0.98,
            "gae_lambda": 0.8,
            "num_minibatches": 1,
            "update_epochs": 8,
            "hidden_sizes": [32, 32],
            "norm_obs": False,
        },
    },
    # gSDE exploration (smooth in time) is what makes the swing-up fast and reliable; with
    # independent per-step noise PPO needs several times the steps and fails some seeds.
    "Pendulum-v1": {
        "total_env_steps": 200_000,
        "eval_every_steps": 8_192,
        "ppo": {
            "num_envs": 128,
            "num_steps": 16,
            "learning_rate": 1e-3,
            "gamma": 0.9,
            "gae_lambda": 0.95,
            "num_minibatches": 8,
            "update_epochs": 10,
            "norm_reward": True,
            "sde_sample_freq": 4,
            "log_std_init": -1.0,
        },
    },
    # FinRL-style trading on the synthetic market (services/pod/envs/stock_trading.py).
    "StockTrading-v0": {
        "total_env_steps": 300_000,
        "eval_every_steps": 32_768,
        "env_kwargs": {"market_seed": 0, "num_stocks": 5, "episode_length": 252},
        "ppo": {
            "num_envs": 32,
            "num_steps": 64,
            "learning_rate": 3e-4,
            "gamma": 0.99,
            "gae_lambda": 0.95,
            "num_minibatches": 8,
            "update_epochs": 5,
            "norm_obs": True,
            "norm_reward": True,
            "log_std_init": -0.5,
        },
    },
}


def preset(env: str) -> dict[str, Any]:
    """The preset for ``env`` with its solve threshold as the default target."""
    base = {"env": env, "target_return": SOLVED_AT.get(env)}
    overrides = PRESETS.get(env, {})
    merged = {**base, **{k: v for k, v in overrides.items() if k != "ppo"}}
    merged["ppo"] = dict(overrides.get("ppo", {}))
    return merged


@dataclass
class TrainResult:
    """What a training run gives back (on-policy and off-policy loops alike)."""

    config: RunConfig
    history: list[dict[str, float]] = field(default_factory=list)
    best: EvalResult | None = None
    solved_at_env_steps: int | None = None
    train_seconds: float = 0.0  # wall time excluding evaluation


Callback = Callable[[dict[str, float]], None]


def build(config: TrainConfig) -> tuple[Worker, Learner, Evaluator]:
    """Construct the three roles for ``config`` (fused: they share one policy object)."""
    # Looked up by registered name: a config can name an algorithm, never a module.
    algorithm = registry.load(registry.ALGORITHMS, config.algorithm, kind="algorithm")
    if algorithm is not PPO:
        raise ValueError(f"algorithm {config.algorithm!r} is not trainable by `podium train` yet")
    torch.manual_seed(config.seed)
    cfg = config.ppo
    eval_seed = config.evaluation_seed
    env, eval_env = config.make_envs(cfg.num_envs)
    agent = PPO(env.single_observation_space, env.single_action_space, cfg).to(config.device)
    worker = Worker(env, agent.policy, cfg.num_steps, gamma=cfg.gamma, seed=config.seed)
    learner = Learner(agent, config.total_env_steps)
    evaluator = Evaluator(eval_env, seed=eval_seed)
    return worker, learner, evaluator


def train(
    config: TrainConfig,
    out_dir: Path | None = None,
    on_progress: Callback | None = None,
    roles: tuple[Worker, Learner, Evaluator] | None = None,
) -> TrainResult:
    """Train until the budget is spent or the evaluation reaches ``target_return``.

    ``roles`` lets a caller build (and so validate) the worker, learner and evaluator first.
    With ``config.learners > 1`` the replicas run in a process group and this returns rank 0's
    result (rank 0 runs here, so ``on_progress`` still reports).
    """
    if config.learners > 1:
        return run_group(
            _replica,
            config.learners,
            args=(config, out_dir, None),
            rank0_args=(config, out_dir, on_progress),
        )
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    worker, learner, evaluator = roles or build(config)
    return _loop(config, worker, learner, evaluator, out_dir, on_progress)


def _replica(
    rank: int, world: int, config: TrainConfig, out_dir: Path | None, on_progress: Callback | None
) -> TrainResult:
    """One fused learner: its own envs and seed, the group's weights after every epoch."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    worker, learner, evaluator = build(
        config.model_copy(update={"seed": config.seed + 1000 * rank})
    )
    learner.world = world
    averager = ParameterAverager(learner.agent, learner.agent.optimizer)
    averager.broadcast(0)  # one starting point for all replicas
    learner.after_epoch = averager
    lead = rank == 0  # evaluates, checkpoints, reports, and decides when to stop
    return _loop(
        config,
        worker,
        learner,
        evaluator if lead else None,
        out_dir if lead else None,
        on_progress if lead else None,
        fused=True,
    )


def _loop(
    config: TrainConfig,
    worker: Worker,
    learner: Learner,
    evaluator: Evaluator | None,
    out_dir: Path | None,
    on_progress: Callback | None,
    fused: bool = False,
) -> TrainResult:
    result = TrainResult(config=config)
    next_eval = config.eval_every_steps
    clock = 0.0
    while learner.env_steps < config.total_env_steps:
        start = time.perf_counter()
        rollout = worker.collect()
        stats = learner.update(rollout)
        clock += time.perf_counter() - start

        record: dict[str, float] = {
            "env_steps": learner.env_steps,
            "train_seconds": clock,
            **stats,
        }
        if rollout.episode_returns.numel():
            record["train_return"] = float(rollout.episode_returns.mean())
        last = learner.env_steps >= config.total_env_steps
        if evaluator is not None and (learner.env_steps >= next_eval or last):
            next_eval += config.eval_every_steps
            evaluation = evaluator.evaluate(learner.policy)
            record["eval_return"] = evaluation.mean
            record["eval_std"] = evaluation.std
            if out_dir is not None:
                save_training_files(out_dir / "checkpoints" / "latest", learner, config)
                if evaluator.best is evaluation:
                    save_training_files(out_dir / "checkpoints" / "best", learner, config)
            if (
                config.target_return is not None
                and evaluation.mean >= config.target_return
                and result.solved_at_env_steps is None
            ):
                result.solved_at_env_steps = learner.env_steps
        result.history.append(record)
        if on_progress is not None:
            on_progress(record)
        stop = result.solved_at_env_steps is not None
        if fused:
            stop = agree(stop)  # replicas must leave the loop together
        if stop:
            break
    result.best = evaluator.best if evaluator is not None else None
    result.train_seconds = clock
    return result
