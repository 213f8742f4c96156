"""The DQN family's hyperparameters, torch-free (the agent: services/pod/algorithms/dqn.py)."""

from __future__ import annotations

from pydantic import Field

from services.contracts.algorithms.offpolicy import AgentConfig


class DQNConfig(AgentConfig):
    double: bool = Field(False, description="Double DQN: the online net picks a' for the target.")
    dueling: bool = Field(False, description="Dueling heads: Q = V + A − mean(A).")
    tau: float = Field(0.05, gt=0, le=1, description="Soft target update rate (1 = hard copy).")
    target_update_every: int = Field(1, ge=1, description="Gradient steps between target updates.")
    epsilon_start: float = Field(1.0, ge=0, le=1)
    epsilon_end: float = Field(0.05, ge=0, le=1)
    exploration_steps: int = Field(10_000, ge=1, description="Env steps over which ε decays.")
    max_grad_norm: float | None = Field(10.0, gt=0)
