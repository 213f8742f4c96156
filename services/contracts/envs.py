"""The env card: one torch-free description per environment, beside the algorithm cards
(services/contracts/algorithms/): what the control plane, the CLI and a pod's trunk know of an
env before anything of it is built.

* ``action_kind``: discrete or continuous actions. The spec check refuses at submission an
  algorithm whose card's kinds do not fit (DQN on Pendulum-v1, SAC on CartPole-v1) instead of
  accepting it and having every pod exit "bad input".
* ``target_return``: the return at which the env counts as solved: a preset's default target
  (gymnasium's reward thresholds; -200 for Pendulum, the usual bar since it has none).
* ``functional``: whether its physics is a functional env (services/pod/envs/functional.py):
  then a pod's whole training iteration and evaluation compile into programs (and, on a GPU,
  one CUDA graph); otherwise the env steps on the host and only the update compiles.
* ``best_return``: the highest return an episode can have, whatever its arguments and length
  (Pendulum's rewards are never positive: 0), where there is one. A target above it is
  refused at submission: the experiment would never stop at it. None: unbounded or set by its
  arguments (CartPole's grows with its time limit; a trading env scores by Sharpe ratio).
* ``kwargs``: the arguments a spec's ``env.kwargs`` and ``evaluation.env_kwargs`` may give it
  (its constructor's, but those the pod sets: ``num_envs``, ``device``, ``seed``); another is
  refused at submission, instead of every pod exiting on it. None: not checked (its pods
  decide).

Podium's own envs register their cards under the entry-point group ``podium.env_cards``, as a
plugin env registers its own (beside its ``podium.envs`` entry); gymnasium's and EnvPool's envs,
which steps on the host, have the cards of ``HOSTED`` by family (the id without ``gym:`` /
``envpool:`` and ``-v<N>``). An env with no card (a plugin without one) is not checked at
submission; its pods decide.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from services import registry
from services.contracts.envpool_tasks import ENVPOOL_PREFIX

ActionKind = Literal["discrete", "continuous"]
DISCRETE: ActionKind = "discrete"
CONTINUOUS: ActionKind = "continuous"


@dataclass(frozen=True)
class EnvCard:
    """What one env is, torch-free (see the module docstring)."""

    name: str
    action_kind: ActionKind
    target_return: float | None = None
    functional: bool = False
    summary: str = ""
    kwargs: frozenset[str] | None = None
    best_return: float | None = None


# -- Podium's own envs (registered under podium.env_cards) ----------------------------------------
_BATCHED = "gymnasium's, batched"
_VECTOR = frozenset({"check_actions", "dtype", "max_episode_steps"})  # every TorchVecEnv's
CARTPOLE = EnvCard("CartPole-v1", DISCRETE, 475.0, True, _BATCHED, _VECTOR)
# Rewards: Acrobot's -1 or 0 a step, Pendulum's a negative cost, MountainCarContinuous's 100 at
# the goal less the actions' squares.
ACROBOT = EnvCard("Acrobot-v1", DISCRETE, -100.0, True, _BATCHED, _VECTOR, best_return=0.0)
PENDULUM = EnvCard(
    "Pendulum-v1", CONTINUOUS, -200.0, True, "gymnasium's", _VECTOR | {"g"}, best_return=0.0
)
MOUNTAIN_CAR_CONTINUOUS = EnvCard(
    "MountainCarContinuous-v0",
    CONTINUOUS,
    90.0,
    True,
    _BATCHED,
    _VECTOR | {"goal_velocity"},
    best_return=100.0,
)
STOCK_TRADING = EnvCard(
    "StockTrading-v0",
    CONTINUOUS,
    functional=True,
    summary="FinRL-style trading accounts",
    kwargs=_VECTOR
    | {
        "action_mode", "csv_path", "data", "episode_length", "hmax", "initial_amount",
        "market_seed", "mode", "momentum", "num_days", "num_stocks", "random_start",
        "rebalance_band", "regime", "reward_scaling", "risk_aversion", "score",
        "shuffle_stocks", "simulated_markets", "split_date", "transaction_cost", "turbulence",
        "validation_date", "validation_fraction",
    },
)  # fmt: skip
# GPU-native locomotion (docs/gpu_physics.md): simulators of their own, stepped from the host.
MJWARP_ANT = EnvCard("MjWarp-Ant-v0", CONTINUOUS, summary="MuJoCo Warp (GPU)")
MJWARP_HUMANOID = EnvCard("MjWarp-Humanoid-v0", CONTINUOUS, summary="MuJoCo Warp (GPU)")
_ISAAC = frozenset({"check_actions"})
ISAAC_ANT = EnvCard("Isaac-Ant-v0", CONTINUOUS, summary="Isaac Lab (GPU)", kwargs=_ISAAC)
ISAAC_HUMANOID = EnvCard("Isaac-Humanoid-v0", CONTINUOUS, summary="Isaac Lab (GPU)", kwargs=_ISAAC)
ISAAC_ANT_DIRECT = EnvCard(
    "Isaac-Ant-Direct-v0", CONTINUOUS, summary="Isaac Lab (GPU)", kwargs=_ISAAC
)
ISAAC_HUMANOID_DIRECT = EnvCard(
    "Isaac-Humanoid-Direct-v0", CONTINUOUS, summary="Isaac Lab (GPU)", kwargs=_ISAAC
)

# -- gymnasium's and EnvPool's envs, stepped on the host, by family --------------------------------
_HOST = "stepped on the host"
_DISCRETE_FAMILIES = (
    "CartPole", "LunarLander", "FrozenLake", "FrozenLake8x8",
    "CliffWalking", "CliffWalkingSlippery", "Taxi", "Blackjack",
)  # fmt: skip
_CONTINUOUS_FAMILIES = (
    "LunarLanderContinuous", "BipedalWalker",
    "BipedalWalkerHardcore", "CarRacing", "Reacher", "Pusher", "InvertedPendulum",
    "InvertedDoublePendulum", "Hopper", "Swimmer", "Walker2d", "Ant", "Humanoid",
    "HumanoidStandup",
)  # fmt: skip
HOSTED: dict[str, EnvCard] = {
    card.name: card
    for card in (
        *(EnvCard(family, DISCRETE, summary=_HOST) for family in _DISCRETE_FAMILIES),
        *(EnvCard(family, CONTINUOUS, summary=_HOST) for family in _CONTINUOUS_FAMILIES),
        EnvCard("Acrobot", DISCRETE, summary=_HOST, best_return=0.0),
        EnvCard("MountainCar", DISCRETE, summary=_HOST, best_return=0.0),
        EnvCard("Pendulum", CONTINUOUS, summary=_HOST, best_return=0.0),
        EnvCard("MountainCarContinuous", CONTINUOUS, summary=_HOST, best_return=100.0),
        # Not gymnasium's 4,800 (beyond PPO's reach in its 1M-step budget): a score good PPO runs
        # pass within that budget and stuck ones never do (docs/tournaments.md).
        EnvCard("HalfCheetah", CONTINUOUS, 3000.0, summary=_HOST),
    )
}

_VERSION = re.compile(r"-v\d+$")


class EnvCardError(ValueError):
    """A name registered as an env card whose object is not an ``EnvCard`` of that name."""


def env_card(name: str) -> EnvCard | None:
    """The card of env ``name`` (a spec's ``env.name``): its registered card, else its
    family's in ``HOSTED`` (named as asked); None where nothing is known of it."""
    if name in registry.names(registry.ENV_CARDS):
        found = registry.load(registry.ENV_CARDS, name, kind="env card")
        if not isinstance(found, EnvCard) or found.name != name:
            what = f"named {found.name!r}" if isinstance(found, EnvCard) else type(found).__name__
            raise EnvCardError(
                f"the env card registered as {name!r} is not an EnvCard named {name!r} ({what})"
            )
        return found
    family = _VERSION.sub("", name.removeprefix("gym:").removeprefix(ENVPOOL_PREFIX))
    hosted = HOSTED.get(family)
    if hosted is None:
        return None
    # A family's card holds for every version but the target, which is a version's.
    target = hosted.target_return if name.endswith("-v5") or family != "HalfCheetah" else None
    return replace(hosted, name=name, target_return=target)


def env_action_kind(env: str) -> ActionKind | None:
    """The action-space kind of env ``env``, None when not known."""
    card = env_card(env)
    return card.action_kind if card else None


def target_return(env: str) -> float | None:
    """Env ``env``'s solve threshold, None if it has none."""
    card = env_card(env)
    return card.target_return if card else None


def unreachable_target(env: str, target: float | None) -> str | None:
    """Why no episode of ``env`` can reach return ``target`` (a higher-is-better target above
    its card's ``best_return``), or None."""
    card = env_card(env)
    best = card.best_return if card else None
    if target is None or best is None or target <= best:
        return None
    hint = f" (did you mean {-target:g}?)" if best <= 0 < target else ""  # a lost minus
    return (
        f"{target:g} is above the best return an episode of {env} can have ({best:g}), so it "
        f"would never be reached{hint}"
    )


#: An env's arguments the pod (and ``podium train``) set themselves: the run's ``num_envs`` and
#: ``seed``, and its ``device``.
RUN_ARGUMENTS = frozenset({"num_envs", "device", "seed"})


#: What the vector envs' own arguments (``_VECTOR``) take, where a card lists them: a wrong type
#: or bound would pass the constructor and fail at the first step, in every pod.
_VECTOR_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_episode_steps": (
        lambda v: v is None or (type(v) is int and v >= 1),
        "a whole number of steps >= 1, or null for no time limit",
    ),
    "check_actions": (lambda v: type(v) is bool, "true or false"),
}


def argument_problem(env: str, field: str, given: Mapping[str, Any]) -> str | None:
    """Why arguments ``given`` (of ``field``) cannot go to ``env``: one the run sets, one its
    card does not list (with a did-you-mean), or a vector env's own argument of a wrong value;
    None if they can, or nothing is known of them."""
    card = env_card(env)
    accepted = card.kwargs if card is not None else None
    if owned := sorted(set(given) & RUN_ARGUMENTS):
        return f"{field}: {', '.join(owned)} is set by the run, not by env arguments"
    if accepted is None:
        return None
    if unknown := sorted(set(given) - accepted):
        close = difflib.get_close_matches(unknown[0], accepted, n=1, cutoff=0.6)
        return (
            f"{field}: {env} does not take {', '.join(repr(k[:64]) for k in unknown[:3])}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; it takes {', '.join(sorted(accepted)) or 'none'}"
        )
    for name, value in given.items():
        if name in _VECTOR_VALUES and not (check := _VECTOR_VALUES[name])[0](value):
            return f"{field}.{name}: {value!r} is not {check[1]}"
    return None
