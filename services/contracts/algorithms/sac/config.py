"""SAC's hyperparameters, torch-free (the agent: services/pod/algorithms/sac.py)."""

from __future__ import annotations

from pydantic import Field

from services.contracts.algorithms.offpolicy import ContinuousAgentConfig


class SACConfig(ContinuousAgentConfig):
    init_alpha: float = Field(1.0, gt=0, description="Initial entropy temperature.")
    autotune_alpha: bool = Field(True, description="Learn α towards the target entropy.")
    target_entropy: float | None = Field(None, description="Default: −dim(action).")
