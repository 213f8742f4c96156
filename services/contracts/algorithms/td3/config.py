"""TD3's hyperparameters, torch-free (the agent: services/pod/algorithms/td3.py)."""

from __future__ import annotations

from pydantic import Field

from services.contracts.algorithms.ddpg.config import DDPGConfig


class TD3Config(DDPGConfig):
    policy_noise: float = Field(0.2, ge=0, description="Std of the target policy smoothing.")
    noise_clip: float = Field(0.5, ge=0)
    policy_delay: int = Field(2, ge=1, description="Critic updates per actor update.")
