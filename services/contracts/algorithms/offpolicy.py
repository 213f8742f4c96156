"""What the off-policy family shares (SAC, TD3, DDPG, DQN and plugins of the family), torch-free:
the off-policy loop's own hyperparameters (``ReplayLoopConfig``; the loop is
services/pod/training/offpolicy.py) and the agents' common config fields. Each algorithm's own
config is in its folder beside this module (sac/config.py, ...).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.contracts.algorithms.card import OFF_POLICY, AlgorithmCard, PopulationCard
from services.contracts.algorithms.ppo.config import Activation, CompileSwitch
from services.contracts.envs import ActionKind

#: How exploration noise is correlated in time (services/pod/algorithms/noise.py).
NoiseKind = Literal["white", "ou", "pink"]


class ReplayLoopConfig(BaseModel):
    """The off-policy loop's hyperparameters: how data is collected, stored and replayed."""

    model_config = ConfigDict(extra="forbid")

    num_envs: int = Field(32, ge=1, description="Parallel sub-environments of the worker.")
    learning_starts: int = Field(1_000, ge=0, description="Env steps of random actions first.")
    buffer_size: int = Field(100_000, ge=1, description="Replay capacity in transitions.")
    batch_size: int = Field(256, ge=1)
    updates_per_step: float = Field(
        0.25, gt=0, description="Gradient updates per env step (update-to-data ratio)."
    )
    compile: CompileSwitch = Field(
        "auto",
        description="torch.compile the gradient update (SAC, TD3, DDPG, DQN), "
        "updates_per_call updates per call (one CUDA graph per call on a GPU); auto: where the "
        "estimate says it pays over the run's updates (docs/compiled-loop.md); on: refused "
        "where it cannot be honoured (no C++ compiler).",
    )
    updates_per_call: int = Field(
        8,
        ge=1,
        description="Gradient updates per learner call when the update is compiled: the owed "
        "updates are paid in chunks of this many, and the actors read the new weights once "
        "per chunk.",
    )


class AgentConfig(BaseModel):
    """What every off-policy agent has; a subclass re-declares a field whose default differs."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(1e-3, gt=0)
    gamma: float = Field(0.99, gt=0, le=1)
    tau: float = Field(0.005, gt=0, le=1, description="Soft target update rate.")
    hidden_sizes: list[int] = Field(default_factory=lambda: [256, 256], min_length=1)
    activation: Activation = "relu"


class ContinuousAgentConfig(AgentConfig):
    """The continuous agents' exploration noise: its correlation in time."""

    action_noise: NoiseKind = Field(
        "white",
        description="Exploration noise over time: white (independent draws), ou "
        "(Ornstein-Uhlenbeck) or pink (1/f); see services/pod/algorithms/noise.py.",
    )
    noise_correlation: float = Field(
        0.9985, ge=0, lt=1, description="ou: correlation of successive draws (1 - theta dt)."
    )
    noise_horizon: int = Field(
        1000, ge=2, description="pink: steps per drawn sequence (the longest period it holds)."
    )


def off_policy_card(
    name: str,
    label: str,
    config: type[BaseModel],
    action_kinds: tuple[ActionKind, ...],
    package: str,
    summary: str,
    population: PopulationCard | None = None,
) -> AlgorithmCard:
    """The card of an off-policy algorithm: the family's trainer, its loop's hyperparameters
    beside the algorithm's own ``config``, presets in ``package``'s ``presets/``."""
    return AlgorithmCard(
        name=name,
        label=label,
        family=OFF_POLICY,
        config=config,
        loop_config=ReplayLoopConfig,
        action_kinds=action_kinds,
        population=population,
        presets_package=package,
        summary=summary,
    )
