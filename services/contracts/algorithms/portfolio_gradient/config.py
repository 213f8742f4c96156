"""The portfolio gradient's hyperparameters, importable without torch (the control plane
checks a search space's names against them; the algorithm is in portfolio_gradient.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PortfolioGradientConfig(BaseModel):
    """One agent of the portfolio gradient: its Adam step size and the L2 penalty on its
    stock scorer's weights (the invested fraction's are not penalised)."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(0.05, gt=0)
    l2: float = Field(1e-3, ge=0)
