"""Which hyperparameter names each algorithm a pod trains takes, importable without torch.

A spec's ``search_space`` and a generator's hyperparameters are flat names. For PPO they are
``PPOConfig`` fields; for an off-policy algorithm they are its own config's fields plus the
off-policy loop's (``ReplayLoopConfig``: ``num_envs``, ``batch_size``, ``buffer_size``,
``learning_starts``, ``updates_per_step``). The control plane (services/spec.py) and the pod
(services/pod/runtime.py) check names against this one table.
"""

from __future__ import annotations

from pydantic import BaseModel

from services.pod.algorithms.offpolicy_config import AGENT_CONFIGS, ReplayLoopConfig
from services.pod.algorithms.ppo_config import PPOConfig

#: Registered algorithm name → the config models whose fields are its hyperparameters.
HYPERPARAMETER_MODELS: dict[str, tuple[type[BaseModel], ...]] = {
    "ppo": (PPOConfig,),
    **{name: (config, ReplayLoopConfig) for name, config in AGENT_CONFIGS.items()},
}


def hyperparameter_names(algorithm: str) -> frozenset[str] | None:
    """The hyperparameter names ``algorithm`` takes, or None for an algorithm a pod does not
    know without importing it (a plugin)."""
    models = HYPERPARAMETER_MODELS.get(algorithm)
    if models is None:
        return None
    return frozenset(name for model in models for name in model.model_fields)
