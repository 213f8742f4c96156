"""The run config every way of training shares: env, budget, evaluation, seeds, device.

It sits under the pod's layers (services/pod/__init__.py): the roles build their envs and agents
from it, the trainers extend it with an algorithm's hyperparameters (``PPORunConfig`` here,
services/pod/training/offpolicy.py's ``OffPolicyConfig``), the runtime writes it from a spec.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from services.contracts.algorithms.card import card
from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.algorithms.ppo.config import PPOConfig
from services.pod.envs.base import VecEnv
from services.pod.envs.registry import make_env


class RunConfig(BaseModel):
    """Every run's fields; a trainer's config adds the algorithm's hyperparameters, by its name."""

    model_config = ConfigDict(extra="forbid")

    env: str = "CartPole-v1"
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    algorithm: str = "ppo"
    total_env_steps: int = Field(500_000, ge=1, description="Training budget in env steps.")
    eval_every_steps: int = Field(20_000, ge=1)
    eval_episodes: int = Field(10, ge=1)
    eval_env_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="The evaluation env's arguments on top of env_kwargs (e.g. a held-out "
        "period to score on).",
    )
    target_return: float | None = Field(None, description="Stop once the evaluation reaches it.")
    expected_env_steps: int | None = Field(
        None,
        ge=1,
        description="Env steps a run of this config takes to reach its target (the preset's "
        "measurement): compile: auto weighs a compile against them, not the whole budget.",
    )
    device: str = "cpu"
    seed: int = 0
    eval_seed: int | None = Field(
        None, description="Seed of the evaluation start states (default: seed + 10,000)."
    )
    torch_threads: int | None = Field(
        1, ge=1, description="Intra-op threads; small networks run fastest on one thread."
    )

    @field_validator("device")
    @classmethod
    def _device_here(cls, value: str) -> str:
        # Refused at validation, so `podium train --set device=cuda` on a machine without a GPU
        # is a named-field error, not a traceback from the first tensor put there.
        try:
            device = torch.device(value)
        except RuntimeError:
            raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:N)") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"{value!r}: torch sees no CUDA device on this machine")
            if (device.index or 0) >= torch.cuda.device_count():
                raise ValueError(f"{value!r}: this machine has {torch.cuda.device_count()} GPU(s)")
        return value

    @property
    def agent_config(self) -> BaseModel:
        """The algorithm's hyperparameters (the field named after the algorithm)."""
        return getattr(self, self.algorithm)

    @property
    def evaluation_seed(self) -> int:
        return self.seed + 10_000 if self.eval_seed is None else self.eval_seed

    def make_envs(self, num_envs: int, slots: int = 1) -> tuple[VecEnv, VecEnv]:
        """The training env (``slots * num_envs`` copies, seeded by ``seed``) and the evaluation
        env (one copy per evaluation episode and slot, seeded by ``evaluation_seed``)."""
        train_env = make_env(
            self.env, slots * num_envs, device=self.device, seed=self.seed, **self.env_kwargs
        )
        eval_env = make_env(
            self.env,
            slots * self.eval_episodes,
            device=self.device,
            seed=self.evaluation_seed,
            **{**self.env_kwargs, **self.eval_env_kwargs},
        )
        return train_env, same_spaces(train_env, eval_env)


def same_spaces(train: Any, evaluation: Any) -> Any:
    """``evaluation`` (an env or functional env) if it has ``train``'s observation shape and
    action space: the policy reads and acts in it as in training. ValueError otherwise."""
    shapes = [
        (e.single_observation_space.shape, e.single_action_space) for e in (train, evaluation)
    ]
    if shapes[0] != shapes[1]:
        why = "training's {0[0]} and {0[1]}, evaluation's {1[0]} and {1[1]}".format(*shapes)
        raise ValueError(f"eval_env_kwargs change the env's observations or actions: {why}")
    return evaluation


class PPORunConfig(RunConfig):
    """One PPO training run. ``ppo`` holds the algorithm's hyperparameters."""

    ppo: PPOConfig = Field(default_factory=PPOConfig)
    learners: int = Field(
        1,
        ge=1,
        le=64,
        description="Learner replicas, each with its own envs, averaged after every epoch.",
    )


@cache
def on_policy_config(algorithm: str) -> type[PPORunConfig]:
    """The run config of on-policy ``algorithm``: ``PPORunConfig``, with a field of the
    algorithm's own config (its card's, which extends ``PPOConfig``: the rollout, GAE and
    network settings every on-policy algorithm here shares) under its name for another."""
    if algorithm == "ppo":
        return PPORunConfig
    agent = card(algorithm).config
    if not (isinstance(agent, type) and issubclass(agent, PPOConfig)):
        raise HyperparameterError(
            f"the on-policy trainer trains algorithms whose config extends PPOConfig; "
            f"{algorithm}'s is {agent.__name__}"
        )
    return create_model(  # type: ignore[call-overload, no-any-return]
        f"{agent.__name__}RunConfig",
        __base__=PPORunConfig,
        algorithm=(str, algorithm),
        **{algorithm: (agent, Field(default_factory=agent))},
    )
