"""Which action-space kinds environments have and algorithms train, without importing either.

The control plane refuses at submission an algorithm whose action-space kind does not fit the
env (DQN on Pendulum-v1, SAC on CartPole-v1) instead of accepting it and having every pod exit
with "bad input". Knowing an env's action space otherwise means building it, and an
algorithm's means importing torch: so the kinds of the built-in algorithms and of the envs
known here are declared in this table, the one place the spec validator and the pods read.
An env or algorithm not listed (a plugin) is not checked here; its pods decide (a pod exits 2
on input that can never work, and the experiment fails at once with the pod's message).
"""

from __future__ import annotations

import re
from typing import Literal

from services.contracts.envpool_tasks import ENVPOOL_PREFIX

ActionKind = Literal["discrete", "continuous"]
DISCRETE: ActionKind = "discrete"
CONTINUOUS: ActionKind = "continuous"

#: Registered algorithm name → the action-space kinds it trains. The built-in algorithm classes
#: read their ``action_spaces`` from here (services/pod/algorithms/), so the fact is stated once.
ALGORITHM_ACTION_KINDS: dict[str, tuple[ActionKind, ...]] = {
    "ppo": (DISCRETE, CONTINUOUS),
    "sac": (CONTINUOUS,),
    "td3": (CONTINUOUS,),
    "ddpg": (CONTINUOUS,),
    "dqn": (DISCRETE,),
    "portfolio_gradient": (CONTINUOUS,),
}

#: Registered algorithm name → the only envs (spec ``env.name``) it trains; an algorithm not
#: listed trains any env of its action kinds. The portfolio gradient differentiates a trading
#: account's returns through the market's closes, which only StockTrading-v0 has.
ALGORITHM_ENVS: dict[str, tuple[str, ...]] = {"portfolio_gradient": ("StockTrading-v0",)}

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


def misfits(env: str, algorithms: list[str]) -> list[str]:
    """The algorithms among ``algorithms`` that cannot train on ``env``, each with the reason:
    an algorithm made for other envs (``ALGORITHM_ENVS``), or one whose action kinds do not
    include the env's (not checked where either kind is not known here)."""
    kind = env_action_kind(env)
    out = []
    for name in algorithms:
        kinds = ALGORITHM_ACTION_KINDS.get(name)
        envs = ALGORITHM_ENVS.get(name)
        if envs is not None and env not in envs:
            out.append(f"cannot train {name} on {env}: {name} trains {' or '.join(envs)} only")
        elif kind is not None and kinds is not None and kind not in kinds:
            out.append(
                f"cannot train {name} on {env}: {name} trains {' or '.join(sorted(kinds))} "
                f"actions, {env} has {kind} actions"
            )
    return out
