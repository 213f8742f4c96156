"""DDPG's hyperparameters, torch-free (the agent: services/pod/algorithms/ddpg.py)."""

from __future__ import annotations

from pydantic import Field

from services.contracts.algorithms.offpolicy import ContinuousAgentConfig


class DDPGConfig(ContinuousAgentConfig):
    gamma: float = Field(0.98, gt=0, le=1)
    exploration_noise: float = Field(0.1, ge=0, description="Std of the Gaussian action noise.")
