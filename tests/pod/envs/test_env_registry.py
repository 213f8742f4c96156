"""Env lookup by name, plugins through entry points, and clear errors on bad input."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import pytest
import torch

from services.pod.envs import UnknownEnvError, list_envs, make_env
from services.pod.envs.cartpole import CartPoleEnv
from services.pod.envs.gymnasium_adapter import GymnasiumVecEnv
from services.pod.envs.isaaclab_adapter import IsaacLabVecEnv
from services.pod.envs.pendulum import PendulumEnv
from services.registry import UnknownNameError
from tests.pod.plugins import register_plugin

BUILT_INS = ["Acrobot-v1", "CartPole-v1", "MountainCarContinuous-v0", "Pendulum-v1"]


def test_built_ins_are_listed_and_preferred_over_gymnasium() -> None:
    assert set(BUILT_INS) <= set(list_envs())
    env = make_env("CartPole-v1", 4, seed=0)
    assert isinstance(env, CartPoleEnv) and env.num_envs == 4


def test_gymnasium_ids_go_through_the_adapter() -> None:
    prefixed = make_env("gym:CartPole-v1", 2, seed=0)
    bare = make_env("MountainCar-v0", 2, seed=0)  # registered in gymnasium, not a built-in
    try:
        assert isinstance(prefixed, GymnasiumVecEnv) and prefixed.spec_id == "gym:CartPole-v1"
        assert isinstance(bare, GymnasiumVecEnv)
    finally:
        prefixed.close()
        bare.close()


def test_env_kwargs_reach_the_env() -> None:
    env = make_env("Pendulum-v1", 2, seed=0, g=9.81, dtype=torch.float64, max_episode_steps=7)
    assert isinstance(env, PendulumEnv)
    assert env.g == 9.81 and env.dtype == torch.float64 and env.max_episode_steps == 7
    gym_env = make_env("gym:Pendulum-v1", 2, seed=0, g=9.81, max_episode_steps=7)
    try:
        assert gym_env.env.get_attr("g") == (9.81, 9.81)
        assert gym_env.max_episode_steps == 7
    finally:
        gym_env.close()


def test_unknown_name_lists_known_names_and_mentions_gymnasium() -> None:
    with pytest.raises(UnknownNameError) as err:
        make_env("CartPole-v9", 2)
    message = str(err.value)
    assert "CartPole-v9" in message
    for name in BUILT_INS:
        assert name in message
    assert "gym:<id>" in message


def test_module_syntax_is_refused_without_importing(tmp_path: Path, monkeypatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "podium_evil_module.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "import gymnasium\n"
        "gymnasium.register('Evil-v0', entry_point='gymnasium.envs.classic_control:CartPoleEnv')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("gym:podium_evil_module:Evil-v0", "podium_evil_module:Evil-v0"):
        with pytest.raises(UnknownEnvError, match="module:id syntax is not allowed"):
            make_env(name, 1)
    assert not marker.exists() and "podium_evil_module" not in sys.modules
    with pytest.raises(ValueError, match="module:id"):
        GymnasiumVecEnv("podium_evil_module:Evil-v0", 1)
    assert not marker.exists()


def test_unknown_kwargs_are_named() -> None:
    with pytest.raises(TypeError, match="'gravity'"):
        make_env("CartPole-v1", 2, gravity=3.0)
    with pytest.raises(TypeError, match="Pendulum-v1.*bogus"):
        make_env("gym:Pendulum-v1", 2, bogus=1)
    with pytest.raises(TypeError, match="wrappers"):
        make_env("gym:Pendulum-v1", 2, wrappers=[])


@pytest.mark.parametrize("num_envs", [0, -3, 2.5, True])
def test_bad_num_envs(num_envs: object) -> None:
    with pytest.raises(ValueError, match="num_envs"):
        make_env("CartPole-v1", num_envs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_envs"):
        make_env("gym:CartPole-v1", num_envs)  # type: ignore[arg-type]


def test_unsupported_gymnasium_space_is_a_clear_error() -> None:
    # Blackjack observes a Tuple of Discrete spaces.
    with pytest.raises(ValueError, match="only Box and Discrete"):
        make_env("gym:Blackjack-v1", 2)


def test_plugin_entry_point_is_found_by_name(tmp_path: Path, monkeypatch) -> None:
    """A package registering an Isaac task factory in `podium.envs` is usable by name."""
    source = textwrap.dedent(
        """
            from services.pod.envs.isaaclab_adapter import IsaacLabVecEnv
            from tests.pod.envs.isaaclab_example import CartpoleDirectEnv

            def cartpole(num_envs, device="cpu", seed=None, episode_length_s=5.0):
                task = CartpoleDirectEnv(num_envs, str(device), episode_length_s)
                return IsaacLabVecEnv(task, seed=seed)
            """
    )
    envs = {"DirectCartpole-v0": "podium_plugin_demo:cartpole"}
    register_plugin(tmp_path, monkeypatch, "podium_plugin_demo", source, {"podium.envs": envs})
    assert "DirectCartpole-v0" in list_envs()
    env = make_env("DirectCartpole-v0", 3, seed=0, episode_length_s=0.15)
    assert isinstance(env, IsaacLabVecEnv) and env.max_episode_steps == 9
    obs, _ = env.reset()
    assert obs.shape == (3, 4)
    with pytest.raises(TypeError, match="'reset_dist'"):
        make_env("DirectCartpole-v0", 3, reset_dist=1.0)


BAD_ACTIONS = {
    "CartPole-v1": [
        (torch.zeros(3, dtype=torch.int64), "shape"),
        (torch.zeros(4, 1, dtype=torch.int64), "shape"),
        (torch.zeros(4), "integers"),
        (torch.tensor([0, 1, 2, 0]), r"\[0, 1\]"),
        (torch.tensor([0, -1, 0, 0]), r"\[0, 1\]"),
        ([0, 1, 0, 1], "torch.Tensor"),
    ],
    "Pendulum-v1": [
        (torch.zeros(4), "shape"),
        (torch.zeros(4, 2), "shape"),
        (torch.zeros(4, 1, dtype=torch.int64), "floating point"),
        (torch.tensor([[0.0], [float("nan")], [0.0], [0.0]]), "NaN"),
        (torch.tensor([[0.0], [float("inf")], [0.0], [0.0]]), "NaN or inf"),
    ],
}


@pytest.mark.parametrize("prefix", ["", "gym:"])
@pytest.mark.parametrize("name", list(BAD_ACTIONS))
def test_bad_actions_are_rejected_and_leave_the_state_intact(prefix: str, name: str) -> None:
    env = make_env(prefix + name, 4, seed=0)
    try:
        obs, _ = env.reset()
        for actions, message in BAD_ACTIONS[name]:
            with pytest.raises(ValueError, match=message):
                env.step(actions)
        if isinstance(env, PendulumEnv | CartPoleEnv):
            assert torch.equal(env.observe(env.state), obs)
    finally:
        env.close()


# Every discrete env: Podium's own, and one per adapter (each takes its own path to the step).
DISCRETE_ENVS = [
    "CartPole-v1",
    "Acrobot-v1",
    "gym:CartPole-v1",
    "gym:FrozenLake-v1",
    "envpool:CartPole-v1",
    "envpool:MountainCar-v0",
]


@pytest.mark.parametrize("name", DISCRETE_ENVS)
def test_discrete_actions_of_a_narrow_integer_dtype_get_a_value_error(name: str) -> None:
    """int32/int64 index a discrete action everywhere; a smaller integer type made the
    torch-native envs fail deep in their physics (``index_select``'s RuntimeError) while the
    adapters took it, so the protocol's check names it instead, for every env alike."""
    env = make_env(name, 4, seed=0)
    try:
        assert isinstance(env.single_action_space, gym.spaces.Discrete)
        env.reset()
        for dtype in (torch.uint8, torch.int8, torch.int16):
            with pytest.raises(ValueError, match=f"int32 or int64\\), got {dtype}"):
                env.step(torch.zeros(4, dtype=dtype))
        for dtype in (torch.int32, torch.int64):
            obs, *_ = env.step(torch.ones(4, dtype=dtype))
            assert obs.shape[0] == 4
    finally:
        env.close()


def test_huge_finite_actions_are_not_mistaken_for_inf() -> None:
    env = make_env("Pendulum-v1", 4, seed=0)
    env.reset()
    obs, *_ = env.step(torch.full((4, 1), 3e38))  # the sum overflows, the values do not
    assert torch.isfinite(obs).all()


def test_gymnasium_async_mode_matches_sync() -> None:
    """Subprocess vectorization gives the same trajectories as in-process for one seed."""
    actions = torch.randint(0, 2, (30, 3), generator=torch.Generator().manual_seed(0))
    results = []
    for mode in ("sync", "async"):
        env = make_env("gym:CartPole-v1", 3, seed=5, vectorization_mode=mode)
        try:
            trajectory = [env.reset()[0]]
            for a in actions:
                obs, reward, terminated, truncated, info = env.step(a)
                trajectory += [obs, reward, terminated, truncated, info["final_obs"]]
            results.append(trajectory)
        finally:
            env.close()
    for x, y in zip(*results, strict=True):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="vectorization_mode"):
        make_env("gym:CartPole-v1", 2, vectorization_mode="threads")
