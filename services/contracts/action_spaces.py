"""Which action-space kinds environments have, without building them.

The control plane refuses at submission an algorithm whose action-space kind does not fit the env
(DQN on Pendulum-v1, SAC on CartPole-v1) instead of accepting it and having every pod exit with "bad
input". Knowing an env's action space otherwise means building it: so the kinds of the envs known
here are declared in this table; an algorithm's kinds are on its card
(services/contracts/algorithms/). An env not listed (a plugin) is not checked here; its pods decide
(a pod exits 2 on input that can never work, and the experiment fails at once with the pod's
message)."""

from __future__ import annotations

import re
from typing import Literal

from services.contracts.envpool_tasks import ENVPOOL_PREFIX

ActionKind = Literal["discrete", "continuous"]
DISCRETE: ActionKind = "discrete"
CONTINUOUS: ActionKind = "continuous"

#: Env family (the id without ``gym:``/``envpool:`` and ``-v<N>``) → its action-space kind: Podium's
#: registered envs and gymnasium's own (classic control, Box2D, toy text, MuJoCo).
ENV_ACTION_KINDS: dict[str, ActionKind] = {
    "CartPole": DISCRETE,
    "Acrobot": DISCRETE,
    "MountainCar": DISCRETE,
    "MountainCarContinuous": CONTINUOUS,
    "Pendulum": CONTINUOUS,
    "StockTrading": CONTINUOUS,
    "LunarLander": DISCRETE,
    "LunarLanderContinuous": CONTINUOUS,
    "BipedalWalker": CONTINUOUS,
    "BipedalWalkerHardcore": CONTINUOUS,
    "CarRacing": CONTINUOUS,
    "FrozenLake": DISCRETE,
    "FrozenLake8x8": DISCRETE,
    "CliffWalking": DISCRETE,
    "CliffWalkingSlippery": DISCRETE,
    "Taxi": DISCRETE,
    "Blackjack": DISCRETE,
    **dict.fromkeys(
        (
            "Reacher",
            "Pusher",
            "InvertedPendulum",
            "InvertedDoublePendulum",
            "HalfCheetah",
            "Hopper",
            "Swimmer",
            "Walker2d",
            "Ant",
            "Humanoid",
            "HumanoidStandup",
            # GPU-native locomotion (MuJoCo Warp, Isaac Lab; docs/gpu_physics.md).
            "MjWarp-Ant",
            "MjWarp-Humanoid",
            "Isaac-Ant",
            "Isaac-Humanoid",
            "Isaac-Ant-Direct",
            "Isaac-Humanoid-Direct",
        ),
        CONTINUOUS,
    ),
}

_VERSION = re.compile(r"-v\d+$")


def env_action_kind(env: str) -> ActionKind | None:
    """The action-space kind of env ``env`` (a spec's ``env.name``), None when not known."""
    family = _VERSION.sub("", env.removeprefix("gym:").removeprefix(ENVPOOL_PREFIX))
    return ENV_ACTION_KINDS.get(family)
