"""The off-policy algorithms' hyperparameters (SAC, TD3, DDPG, DQN family), importable without
torch.

Like ppo_config.py: the control plane validates an experiment's search space against these
field names, and it must not import torch; the algorithms themselves are in sac.py, td3.py,
ddpg.py and dqn.py. ``ReplayLoopConfig`` holds what every off-policy algorithm shares, the
off-policy loop's own hyperparameters (services/pod/offpolicy.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.pod.algorithms.ppo_config import Activation

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


class _AgentConfig(BaseModel):
    """What every off-policy agent has; a subclass re-declares a field whose default differs."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(1e-3, gt=0)
    gamma: float = Field(0.99, gt=0, le=1)
    tau: float = Field(0.005, gt=0, le=1, description="Soft target update rate.")
    hidden_sizes: list[int] = Field(default_factory=lambda: [256, 256], min_length=1)
    activation: Activation = "relu"


class ContinuousAgentConfig(_AgentConfig):
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


class DDPGConfig(ContinuousAgentConfig):
    gamma: float = Field(0.98, gt=0, le=1)
    exploration_noise: float = Field(0.1, ge=0, description="Std of the Gaussian action noise.")


class TD3Config(DDPGConfig):
    policy_noise: float = Field(0.2, ge=0, description="Std of the target policy smoothing.")
    noise_clip: float = Field(0.5, ge=0)
    policy_delay: int = Field(2, ge=1, description="Critic updates per actor update.")


class SACConfig(ContinuousAgentConfig):
    init_alpha: float = Field(1.0, gt=0, description="Initial entropy temperature.")
    autotune_alpha: bool = Field(True, description="Learn α towards the target entropy.")
    target_entropy: float | None = Field(None, description="Default: −dim(action).")


class DQNConfig(_AgentConfig):
    double: bool = Field(False, description="Double DQN: the online net picks a' for the target.")
    dueling: bool = Field(False, description="Dueling heads: Q = V + A − mean(A).")
    tau: float = Field(0.05, gt=0, le=1, description="Soft target update rate (1 = hard copy).")
    target_update_every: int = Field(1, ge=1, description="Gradient steps between target updates.")
    epsilon_start: float = Field(1.0, ge=0, le=1)
    epsilon_end: float = Field(0.05, ge=0, le=1)
    exploration_steps: int = Field(10_000, ge=1, description="Env steps over which ε decays.")
    max_grad_norm: float | None = Field(10.0, gt=0)


#: Each built-in off-policy algorithm's own hyperparameters (the loop's are
#: ``ReplayLoopConfig``), by registered name, for the torch-free checks of
#: services/pod/algorithms/hyperparameters.py; the pod reads them from the registered class.
AGENT_CONFIGS: dict[str, type[BaseModel]] = {
    "sac": SACConfig,
    "td3": TD3Config,
    "ddpg": DDPGConfig,
    "dqn": DQNConfig,
}
