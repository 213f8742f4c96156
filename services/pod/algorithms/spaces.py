"""Whether an algorithm's card (services/contracts/algorithms/) trains an env's action kind."""

from __future__ import annotations

import gymnasium as gym

from services.contracts.algorithms.card import card
from services.contracts.envs import ActionKind


def action_kind(space: gym.Space) -> ActionKind | None:
    if isinstance(space, gym.spaces.Discrete):
        return "discrete"
    return "continuous" if isinstance(space, gym.spaces.Box) else None


def check_action_space(algorithm: str, space: gym.Space) -> None:
    """Refuse (ValueError) an action space ``algorithm``'s card does not declare."""
    kinds = card(algorithm).action_kinds
    if action_kind(space) not in kinds:
        wanted = " or ".join(
            "a Discrete" if k == "discrete" else "a continuous (Box)" for k in kinds
        )
        raise ValueError(f"{algorithm} needs {wanted} action space, got {space}")
