"""Every env honours the VecEnv protocol: shapes, dtypes, autoreset, bookkeeping, seeding.

The same checks run on the torch-native envs, the gymnasium and EnvPool adapters and the Isaac
Lab adapter (on the in-repo DirectRLEnv cart-pole). The Isaac Lab adapter differs in one
documented way: at the step an episode ends ``obs`` equals ``final_obs`` (Isaac Lab resets
finished sub-environments in the step but does not return the finished episode's last
observation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import pytest
import torch

from services.pod.envs import make_env
from services.pod.envs.base import VecEnv
from services.pod.envs.isaaclab_adapter import IsaacLabVecEnv
from tests.pod.envs.isaaclab_example import CartpoleDirectEnv

N = 8


@dataclass
class Maker:
    make: Callable[[int | None], VecEnv]
    same_step_reset: bool = True
    steps: int = 120  # enough for several episodes to end


def _isaaclab(seed: int | None) -> VecEnv:
    return IsaacLabVecEnv(CartpoleDirectEnv(N, episode_length_s=0.5), seed=seed)


MAKERS = {
    "CartPole-v1": Maker(lambda s: make_env("CartPole-v1", N, seed=s)),
    "Pendulum-v1": Maker(lambda s: make_env("Pendulum-v1", N, seed=s, max_episode_steps=30)),
    "Acrobot-v1": Maker(lambda s: make_env("Acrobot-v1", N, seed=s, max_episode_steps=30)),
    "MountainCarContinuous-v0": Maker(
        lambda s: make_env("MountainCarContinuous-v0", N, seed=s, max_episode_steps=30)
    ),
    "gym:CartPole-v1": Maker(lambda s: make_env("gym:CartPole-v1", N, seed=s)),
    "gym:Pendulum-v1": Maker(
        lambda s: make_env("gym:Pendulum-v1", N, seed=s, max_episode_steps=30)
    ),
    "gym:FrozenLake-v1": Maker(lambda s: make_env("gym:FrozenLake-v1", N, seed=s)),
    "isaaclab:CartpoleDirectEnv": Maker(_isaaclab, same_step_reset=False),
    # EnvPool resets on the step after an episode ends; the adapter turns that into ours.
    "envpool:Hopper-v5": Maker(lambda s: make_env("envpool:Hopper-v5", N, seed=s)),
    "envpool:HalfCheetah-v5": Maker(
        lambda s: make_env("envpool:HalfCheetah-v5", N, seed=s, max_episode_steps=30)
    ),
    "envpool:CartPole-v1": Maker(lambda s: make_env("envpool:CartPole-v1", N, seed=s)),
}


def _random_actions(env: VecEnv, g: torch.Generator) -> torch.Tensor:
    space = env.single_action_space
    if isinstance(space, gym.spaces.Discrete):
        return torch.randint(0, int(space.n), (env.num_envs,), generator=g)
    low = torch.as_tensor(space.low)
    high = torch.as_tensor(space.high)
    return low + (high - low) * torch.rand((env.num_envs, *space.shape), generator=g)


def _rollout(env: VecEnv, seed: int, steps: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    obs, _ = env.reset(seed=seed)
    out = [(obs,)]
    for _ in range(steps):
        obs, reward, terminated, truncated, _ = env.step(_random_actions(env, g))
        out.append((obs, reward, terminated, truncated))
    return out


@pytest.fixture(params=list(MAKERS), ids=list(MAKERS))
def maker(request: pytest.FixtureRequest) -> Maker:
    return MAKERS[request.param]


def test_shapes_dtypes_autoreset_and_bookkeeping(maker: Maker) -> None:
    env = maker.make(0)
    try:
        obs_shape = env.single_observation_space.shape
        obs, info = env.reset()
        assert isinstance(info, dict)
        assert obs.shape == (N, *obs_shape) and obs.dtype == torch.float32
        assert obs.device == env.device
        assert env.observation_space.shape == (N, *obs_shape)
        g = torch.Generator().manual_seed(1)
        ret = torch.zeros(N, dtype=torch.float64)
        length = torch.zeros(N, dtype=torch.int64)
        ended = 0
        for _ in range(maker.steps):
            previous = obs.clone()
            kept = obs
            obs, reward, terminated, truncated, info = env.step(_random_actions(env, g))
            assert torch.equal(kept, previous), "the env wrote into an observation it handed out"
            assert obs.shape == (N, *obs_shape) and obs.dtype == torch.float32
            assert reward.shape == (N,) and reward.dtype.is_floating_point
            assert terminated.shape == truncated.shape == (N,)
            assert terminated.dtype == truncated.dtype == torch.bool
            assert not (terminated & truncated).any()
            assert torch.isfinite(obs).all() and torch.isfinite(reward).all()
            final = info["final_obs"]
            assert final.shape == obs.shape and final.dtype == torch.float32
            done = terminated | truncated
            # Bookkeeping: the env's episode return/length equal our own sums since the last end.
            ret += reward.double()
            length += 1
            assert torch.equal(info["episode_length"], torch.where(done, length, 0))
            torch.testing.assert_close(
                info["episode_return"].double(),
                torch.where(done, ret, 0.0),
                rtol=1e-5,
                atol=1e-4,
            )
            ret[done] = 0
            length[done] = 0
            # Where nothing ended the final observation is the observation.
            assert torch.equal(final[~done], obs[~done])
            if maker.same_step_reset and done.any():
                # Autoreset in the same step: a fresh observation, not the final one.
                assert not torch.equal(final[done], obs[done])
            ended += int(done.sum())
            if env.max_episode_steps is not None:
                assert (info["episode_length"] <= env.max_episode_steps).all()
        assert ended > 0, "episodes must end within the test horizon"
    finally:
        env.close()


def test_same_seed_same_trajectory_other_seed_differs(maker: Maker) -> None:
    runs = []
    for seed in (3, 3, 4):
        env = maker.make(None)
        runs.append(_rollout(env, seed, 40))
        env.close()
    a, b, c = runs
    for step_a, step_b in zip(a, b, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            assert torch.equal(x, y)
    assert not all(
        torch.equal(x, y) for sa, sc in zip(a, c, strict=True) for x, y in zip(sa, sc, strict=True)
    )


def test_constructor_seed_is_used_by_the_first_reset(maker: Maker) -> None:
    first = maker.make(11)
    second = maker.make(11)
    try:
        assert torch.equal(first.reset()[0], second.reset()[0])
    finally:
        first.close()
        second.close()


#: Envs whose every episode starts in one state (nothing to tell groups apart by).
FIXED_START = {"gym:FrozenLake-v1"}


@pytest.mark.parametrize(
    "name",
    [n for n in MAKERS if not n.startswith("isaaclab:") and n not in FIXED_START]
    + ["MjWarp-Ant-v0"],
)
def test_groups_start_alike_and_run_alike_under_the_same_actions(name: str) -> None:
    """``reset(seed, groups)``: each of the equal slices starts as the first does (a population's
    agents are evaluated on the same episodes), and the same actions give the same steps there
    until an episode ends; within a slice the sub-environments start apart. (Isaac Lab draws
    every scene's start from one generator: its groups start apart, as its adapter says.)"""
    groups, n = 4, N // 4
    env = MAKERS[name].make(1) if name in MAKERS else make_env(name, N, seed=1)
    try:
        obs, _ = env.reset(seed=5, groups=groups)
        slices = obs.view(groups, n, -1)
        assert all(torch.equal(slices[0], slices[g]) for g in range(groups)), name
        assert not torch.equal(slices[0, 0], slices[0, 1]), name
        g = torch.Generator().manual_seed(0)
        for _ in range(10):
            obs, reward, terminated, truncated, _ = env.step(
                torch.cat([_random_actions(env, g)[:n]] * groups)
            )
            if bool((terminated | truncated).any()):
                break
            for x in (obs.view(groups, n, -1), reward.view(groups, n)):
                assert all(torch.equal(x[0], x[h]) for h in range(groups)), name
        # Reset without groups, the slices start apart again; with groups and no seed, alike.
        obs, _ = env.reset(seed=5)
        assert not torch.equal(obs.view(groups, n, -1)[0], obs.view(groups, n, -1)[1]), name
        slices = env.reset(groups=groups)[0].view(groups, n, -1)
        assert all(torch.equal(slices[0], slices[g]) for g in range(groups)), name
    finally:
        env.close()


@pytest.mark.parametrize("name", ["CartPole-v1", "Pendulum-v1"])
def test_masked_reset_path_matches_protocol(name: str) -> None:
    """The sync-free reset used on accelerators, exercised on CPU."""
    env = make_env(name, N, seed=0, max_episode_steps=5)
    env._host_reads_free = False
    env.reset()
    g = torch.Generator().manual_seed(0)
    for t in range(1, 11):
        obs, _, terminated, truncated, info = env.step(_random_actions(env, g))
        done = terminated | truncated
        if t % 5 == 0:
            assert done.all()
        assert not torch.equal(obs[done], info["final_obs"][done]) or not done.any()
        assert (env._episode_length[done] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["CartPole-v1", "Pendulum-v1", "Acrobot-v1"])
def test_cuda_env_steps_on_device(name: str) -> None:
    env = make_env(name, 256, device="cuda", seed=0, max_episode_steps=20)
    obs, _ = env.reset()
    assert obs.is_cuda
    g = torch.Generator().manual_seed(0)
    ended = torch.zeros(256, dtype=torch.bool, device="cuda")
    for _ in range(20):
        obs, reward, terminated, truncated, info = env.step(_random_actions(env, g).cuda())
        ended |= terminated | truncated
    assert obs.is_cuda and reward.is_cuda and info["final_obs"].is_cuda
    assert ended.all(), "every episode ends by the 20-step limit"
    assert (env._episode_length < 20).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float64_matches_cpu_physics() -> None:
    cpu = make_env("Pendulum-v1", 64, seed=0, dtype=torch.float64)
    gpu = make_env("Pendulum-v1", 64, device="cuda", seed=0, dtype=torch.float64)
    cpu.reset()
    gpu.reset()
    gpu.state.copy_(cpu.state)
    actions = torch.linspace(-2, 2, 64).unsqueeze(1)
    for _ in range(10):
        cpu_obs, *_ = cpu.step(actions)
        gpu_obs, *_ = gpu.step(actions.cuda())
    np.testing.assert_allclose(gpu.state.cpu().numpy(), cpu.state.numpy(), atol=1e-9)
    np.testing.assert_allclose(gpu_obs.cpu().numpy(), cpu_obs.numpy(), atol=1e-6)
