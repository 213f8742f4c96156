"""The Isaac Lab adapter maps DirectRLEnv's in-step resets and time-outs onto the protocol.

Isaac Lab itself needs Isaac Sim and a GPU; these tests run the adapter on the in-repo
stand-in (tests/pod/envs/isaaclab_example.py), which has DirectRLEnv's interface and timing.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest
import torch

from services.pod.envs import list_envs, make_env
from services.pod.envs.isaaclab_adapter import IsaacLabVecEnv, isaaclab_task, make_isaaclab_env
from tests.pod.envs.isaaclab_example import CartpoleDirectEnv
from tests.pod.plugins import register_plugin

STAND_IN = "Podium-StandIn-Cartpole-Direct-v0"


@pytest.fixture
def registered_stand_in() -> Iterator[str]:
    # As Isaac Lab registers its tasks: an entry point and no env checker (tensor observations).
    gym.register(STAND_IN, entry_point=CartpoleDirectEnv, disable_env_checker=True)
    yield STAND_IN
    del gym.envs.registry[STAND_IN]


def test_reset_starts_every_sub_env_and_seeds_like_isaac_lab() -> None:
    env = IsaacLabVecEnv(CartpoleDirectEnv(16), seed=3)
    obs, _ = env.reset()
    assert obs.shape == (16, 4) and obs.dtype == torch.float32
    # Direct cart-pole: pole angle in ±0.25π, everything else at rest.
    assert (obs[:, 0].abs() <= 0.25 * math.pi).all() and not obs[:, 1:].any()
    again, _ = IsaacLabVecEnv(CartpoleDirectEnv(16), seed=3).reset()
    assert torch.equal(obs, again)


def test_time_out_is_truncation_and_the_same_step_starts_the_next_episode() -> None:
    task = CartpoleDirectEnv(4, episode_length_s=10 / 60)  # 10 env steps of 1/60 s
    env = IsaacLabVecEnv(task, seed=0)
    env.reset()
    assert env.max_episode_steps == 10
    zero = torch.zeros(4, 1)
    total = torch.zeros(4)
    # DirectRLEnv times out once episode_length_buf reaches max_episode_length - 1.
    for _ in range(8):
        _, reward, terminated, truncated, _ = env.step(zero)
        total += reward
        assert not (terminated | truncated).any()
    obs, reward, terminated, truncated, info = env.step(zero)
    total += reward
    assert truncated.all() and not terminated.any()
    assert info["episode_length"].tolist() == [9, 9, 9, 9]
    torch.testing.assert_close(info["episode_return"], total)
    assert not obs[:, 1:].any(), "Isaac Lab reset the sub-environments inside this step"
    assert torch.equal(info["final_obs"], obs)  # the finished episode's last one is not kept
    assert (env._stats.episode_length == 0).all() and not task.episode_length_buf.any()


def test_failure_is_termination_and_handed_out_tensors_are_copies() -> None:
    task = CartpoleDirectEnv(3)
    env = IsaacLabVecEnv(task, seed=1)
    env.reset()
    task.dof_pos[1, 1] = 2.0  # the pole of sub-env 1 is past 90°
    obs, reward, terminated, truncated, info = env.step(torch.zeros(3, 1))
    assert terminated.tolist() == [False, True, False] and not truncated.any()
    assert reward[1] < -2.0 < 0 < reward[0]
    assert info["episode_length"].tolist() == [0, 1, 0]
    assert abs(obs[1, 0]) <= 0.25 * math.pi  # already the next episode
    env.step(torch.zeros(3, 1))
    assert not task.reset_terminated[1], "the env's own buffer was overwritten"
    assert terminated.tolist() == [False, True, False], "the adapter handed out a copy"


def test_terminated_wins_over_a_simultaneous_time_out() -> None:
    task = CartpoleDirectEnv(2, episode_length_s=3 / 60)
    env = IsaacLabVecEnv(task, seed=0)
    env.reset()
    env.step(torch.zeros(2, 1))
    task.dof_pos[0, 0] = 5.0  # sub-env 0 leaves the track on its last allowed step
    _, _, terminated, truncated, _ = env.step(torch.zeros(2, 1))
    assert task.reset_time_outs.all()
    assert terminated.tolist() == [True, False] and truncated.tolist() == [False, True]


def test_not_an_isaac_lab_env_is_refused() -> None:
    with pytest.raises(TypeError, match="not an Isaac Lab RL env"):
        IsaacLabVecEnv(gym.make("CartPole-v1"))


def test_a_registered_task_is_built_by_its_id(registered_stand_in: str) -> None:
    env = isaaclab_task(registered_stand_in)(num_envs=5, device="cpu", seed=0)
    assert isinstance(env, IsaacLabVecEnv) and env.num_envs == 5
    assert env.spec_id == registered_stand_in and env.reset()[0].shape == (5, 4)
    env.close()
    assert env.env.unwrapped.closed


def test_module_syntax_and_unregistered_ids_import_nothing() -> None:
    with pytest.raises(ValueError, match="module:id"):
        make_isaaclab_env("tests.pod.envs.isaaclab_example:CartpoleDirectEnv", 2, "cpu")
    # Not registered and no Isaac Lab here: the error says what to install.
    with pytest.raises(ImportError, match="Isaac Lab is not installed"):
        make_isaaclab_env("Isaac-Not-A-Task-v0", 2, "cpu")


def test_papers_tasks_are_listed_and_say_what_they_need() -> None:
    assert {"Isaac-Ant-Direct-v0", "Isaac-Humanoid-Direct-v0"} <= set(list_envs())
    with pytest.raises(ImportError, match="Isaac Lab is not installed"):
        make_env("Isaac-Ant-Direct-v0", 2, device="cpu")


def test_plugin_names_an_installed_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registered_stand_in: str
) -> None:
    source = textwrap.dedent(
        f"""
            from services.pod.envs.isaaclab_adapter import isaaclab_task
            cartpole = isaaclab_task({registered_stand_in!r})
        """
    )
    envs = {"StandInCartpole-v0": "podium_isaaclab_demo:cartpole"}
    register_plugin(tmp_path, monkeypatch, "podium_isaaclab_demo", source, {"podium.envs": envs})
    env = make_env("StandInCartpole-v0", 3, device="cpu", seed=0)
    assert isinstance(env, IsaacLabVecEnv) and env.reset()[0].shape == (3, 4)
    with pytest.raises(TypeError, match="'episode_length_s'"):
        make_env("StandInCartpole-v0", 3, device="cpu", episode_length_s=1.0)
