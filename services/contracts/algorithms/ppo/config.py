"""PPO's hyperparameters, importable without torch.

The control plane validates an experiment's search space against these field names (so a
misspelt hyperparameter is a 422 at submission, not a crash-looping pod), and it must not
import torch; the algorithm itself is in ppo.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from services.contracts.search_space import WHOLE_RUN

Activation = Literal["tanh", "relu", "elu"]


def _switch(value: Any) -> Any:
    """YAML 1.1 (PyYAML, so specs, config files and ``--set``) reads a bare ``on`` or ``off``
    as a boolean: take it as the word the user wrote."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


#: ``compile``: ``auto``, ``on`` or ``off`` (a YAML boolean counts as ``on``/``off``).
CompileSwitch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_switch)]


class PPOConfig(BaseModel):
    """PPO hyperparameters. Names follow CleanRL; every field can be set from YAML or --set."""

    model_config = ConfigDict(extra="forbid")

    num_envs: int = Field(64, ge=1, description="Parallel sub-environments of the worker.")
    num_steps: int = Field(32, ge=1, description="Rollout length per sub-environment.")
    learning_rate: float = Field(3e-4, gt=0)
    anneal_lr: bool = Field(
        True,
        description="Linearly anneal the LR to 0 over the budget.",
        json_schema_extra=WHOLE_RUN,
    )
    gamma: float = Field(0.99, gt=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    num_minibatches: int = Field(4, ge=1)
    update_epochs: int = Field(4, ge=1)
    clip_coef: float = Field(0.2, gt=0)
    clip_vloss: bool = False
    ent_coef: float = Field(0.0, ge=0)
    vf_coef: float = Field(0.5, ge=0)
    max_grad_norm: float = Field(0.5, gt=0)
    target_kl: float | None = Field(None, gt=0, description="Stop the epochs early above it.")
    norm_adv: bool = True
    norm_obs: bool = True
    norm_reward: bool = Field(False, description="Scale rewards by the std of the return.")
    hidden_sizes: list[int] = Field(default_factory=lambda: [64, 64], min_length=1)
    activation: Activation = "tanh"
    log_std_init: float = 0.0
    action_bounds: Literal["clip", "squash"] = "clip"
    sde_sample_freq: int = Field(
        0, ge=0, description="gSDE exploration, noise redrawn every N steps; 0 = plain Gaussian."
    )
    compile: CompileSwitch = Field(
        "auto",
        description="torch.compile the whole iteration (rollout, GAE, update, evaluation) for "
        "an env with a functional step, the update after a host rollout otherwise; auto: where "
        "the estimate says it pays over the run (docs/compiled-loop.md); on: refused where it "
        "cannot be honoured (no C++ compiler).",
    )

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return max(1, self.batch_size // self.num_minibatches)
