"""Torch-native envs against gymnasium's reference envs, step by step from identical states.

Each step, every gymnasium env is put in the torch env's state for that sub-environment and
stepped with the same action; next state, observation, reward and termination must agree. The
torch envs run their own trajectories (with autoreset), so the comparison walks through
termination and reset too. Start states are spread wider than the reset distribution so that
clipping, wrapping and termination branches are all exercised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import pytest
import torch

from services.pod.envs.acrobot import AcrobotEnv
from services.pod.envs.base import TorchVecEnv
from services.pod.envs.cartpole import CartPoleEnv
from services.pod.envs.mountain_car_continuous import MountainCarContinuousEnv
from services.pod.envs.pendulum import PendulumEnv

N = 64
STEPS = 40


@dataclass
class Case:
    cls: type[TorchVecEnv]
    gym_id: str
    wide_low: list[float]  # start states drawn uniformly in [wide_low, wide_high]
    wide_high: list[float]
    actions: Callable[[torch.Generator], torch.Tensor]
    # Distance of a gymnasium state to the termination boundary: float32 runs may disagree
    # with gymnasium on termination only closer than this to it.
    boundary: Callable[[np.ndarray], float]
    # Tolerance on the float64 state: MountainCarContinuous keeps float32 state in gymnasium.
    state_atol64: float = 1e-9


def _quantized_box(low: float, high: float) -> Callable[[torch.Generator], torch.Tensor]:
    """Actions on a 2**-8 grid, beyond the bounds to exercise clipping.

    gymnasium multiplies float32 actions in float32 (numpy scalar promotion); on this grid
    those products are exact, so the float64 comparison can stay tight.
    """

    def draw(g: torch.Generator) -> torch.Tensor:
        u = torch.rand(N, 1, generator=g, dtype=torch.float64) * (high - low) + low
        return (torch.round(u * 256) / 256).float()

    return draw


def _discrete(n: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randint(0, n, (N,), generator=g)


CASES = {
    "CartPole-v1": Case(
        CartPoleEnv,
        "CartPole-v1",
        [-2.3, -2.0, -0.2, -2.0],
        [2.3, 2.0, 0.2, 2.0],
        _discrete(2),
        lambda s: min(abs(abs(s[0]) - 2.4), abs(abs(s[2]) - 12 * 2 * math.pi / 360)),
    ),
    "Pendulum-v1": Case(
        PendulumEnv,
        "Pendulum-v1",
        [-3 * math.pi, -8.0],
        [3 * math.pi, 8.0],
        _quantized_box(-2.5, 2.5),
        lambda s: math.inf,
    ),
    "Acrobot-v1": Case(
        AcrobotEnv,
        "Acrobot-v1",
        [-math.pi, -math.pi, -4 * math.pi, -9 * math.pi],
        [math.pi, math.pi, 4 * math.pi, 9 * math.pi],
        _discrete(3),
        lambda s: abs(-math.cos(s[0]) - math.cos(s[1] + s[0]) - 1.0),
    ),
    "MountainCarContinuous-v0": Case(
        MountainCarContinuousEnv,
        "MountainCarContinuous-v0",
        [-1.2, -0.07],
        [0.6, 0.07],
        _quantized_box(-1.5, 1.5),
        lambda s: min(abs(s[0] - 0.45), abs(s[1])),
        state_atol64=2e-7,
    ),
}


def _reference(gym_id: str) -> list[gym.Env]:
    return [gym.make(gym_id).unwrapped for _ in range(N)]


def _compare(case: Case, dtype: torch.dtype) -> int:
    """Run the comparison; return how many terminations were compared (coverage check)."""
    g = torch.Generator().manual_seed(1234)
    env = case.cls(N, dtype=dtype, seed=7)
    env.reset()
    low = torch.tensor(case.wide_low, dtype=dtype)
    high = torch.tensor(case.wide_high, dtype=dtype)
    env.state.copy_(low + (high - low) * torch.rand(N, len(low), generator=g, dtype=dtype))
    if case.cls is MountainCarContinuousEnv:
        env.state[:4] = torch.tensor([-1.2, -0.05], dtype=dtype)  # at the wall, moving left
    refs = _reference(case.gym_id)
    for ref in refs:
        ref.reset(seed=0)
    float64 = dtype == torch.float64
    value_tol = dict(rel=1e-9, abs=1e-9) if float64 else dict(rel=1e-5, abs=1e-4)
    terminations = 0
    for _ in range(STEPS):
        before = env.state.double().numpy().copy()
        actions = case.actions(g)
        _, reward, terminated, truncated, info = env.step(actions)
        assert not truncated.any()
        after = env.state.double().numpy()
        for i, ref in enumerate(refs):
            ref.reset(seed=0)  # clears CartPole's "stepped after termination" flag
            ref.state = before[i].copy()
            action = actions[i].numpy() if actions.ndim == 2 else int(actions[i])
            ref_obs, ref_reward, ref_term, ref_trunc, _ = ref.step(action)
            assert not ref_trunc
            ref_state = np.asarray(ref.state, dtype=np.float64)
            near_boundary = not float64 and case.boundary(ref_state) < 1e-4
            if not near_boundary:
                assert bool(terminated[i]) == ref_term, (i, before[i], ref_state)
            assert float(reward[i]) == pytest.approx(float(ref_reward), **value_tol)
            # Observations are float32 either way; in float32 runs the error scales with the
            # largest state component (Acrobot's velocities reach ~28).
            obs_atol = 2e-6 if float64 else 1e-5 * max(1.0, float(np.abs(ref_state).max()))
            np.testing.assert_allclose(info["final_obs"][i].numpy(), ref_obs, rtol=0, atol=obs_atol)
            if ref_term:
                terminations += 1
            elif float64:
                np.testing.assert_allclose(after[i], ref_state, rtol=0, atol=case.state_atol64)
            elif not near_boundary:
                np.testing.assert_allclose(after[i], ref_state, rtol=1e-5, atol=obs_atol)
    return terminations


@pytest.mark.parametrize("name", list(CASES))
def test_matches_gymnasium_float64(name: str) -> None:
    terminations = _compare(CASES[name], torch.float64)
    if name != "Pendulum-v1":  # Pendulum never terminates
        assert terminations > 0, "the trajectories must reach termination to test it"


@pytest.mark.parametrize("name", list(CASES))
def test_matches_gymnasium_float32(name: str) -> None:
    _compare(CASES[name], torch.float32)


def test_pendulum_unquantized_actions_agree_to_float32_rounding() -> None:
    """With arbitrary float32 torques the only gap is gymnasium's float32 arithmetic on u."""
    g = torch.Generator().manual_seed(5)
    env = PendulumEnv(N, dtype=torch.float64, seed=3)
    env.reset()
    refs = _reference("Pendulum-v1")
    for ref in refs:
        ref.reset(seed=0)
    for _ in range(10):
        before = env.state.numpy().copy()
        actions = (torch.rand(N, 1, generator=g) * 4 - 2).float()
        _, reward, _, _, _ = env.step(actions)
        for i, ref in enumerate(refs):
            ref.state = before[i].copy()
            _, ref_reward, _, _, _ = ref.step(actions[i].numpy())
            np.testing.assert_allclose(env.state[i].numpy(), ref.state, rtol=0, atol=1e-7)
            assert float(reward[i]) == pytest.approx(ref_reward, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("name", list(CASES))
def test_time_limit_matches_gymnasium_spec(name: str) -> None:
    case = CASES[name]
    assert case.cls(1).max_episode_steps == gym.spec(case.gym_id).max_episode_steps


@pytest.mark.parametrize(
    ("cls", "action"),
    [
        (PendulumEnv, torch.zeros(4, 1)),
        (AcrobotEnv, torch.ones(4, dtype=torch.int64)),  # no torque: never swings up
        (MountainCarContinuousEnv, torch.zeros(4, 1)),  # no force: never reaches the flag
    ],
)
def test_truncates_exactly_at_the_time_limit(cls: type[TorchVecEnv], action: torch.Tensor) -> None:
    env = cls(4, seed=0)
    env.reset()
    limit = env.max_episode_steps
    assert limit is not None
    for t in range(1, limit + 1):
        obs, _, terminated, truncated, info = env.step(action)
        assert not terminated.any()
        if t < limit:
            assert not truncated.any(), t
        else:
            assert truncated.all()
            assert (info["episode_length"] == limit).all()
            # Autoreset: a fresh start, different from the final observation.
            assert not torch.equal(obs, info["final_obs"])


def test_cartpole_truncates_at_500_and_termination_wins_on_the_last_step() -> None:
    env = CartPoleEnv(2, dtype=torch.float64, seed=0)
    env.reset()
    env.state.zero_()
    env.state[1, 0] = 2.399  # sub-env 1 leaves the track on this step
    env.state[1, 1] = 1.0
    env._episode_length.fill_(499)
    _, _, terminated, truncated, info = env.step(torch.tensor([0, 1]))
    assert terminated.tolist() == [False, True]
    assert truncated.tolist() == [True, False]
    assert info["episode_length"].tolist() == [500, 500]


@pytest.mark.parametrize("name", list(CASES))
def test_initial_states_cover_gymnasium_ranges(name: str) -> None:
    case = CASES[name]
    env = case.cls(20_000, seed=0)
    env.reset()
    ours = env.state.double()
    ref = gym.make(case.gym_id).unwrapped
    ref_states = []
    for seed in range(300):
        ref.reset(seed=seed)
        ref_states.append(np.asarray(ref.state, dtype=np.float64))
    ref_arr = torch.tensor(np.array(ref_states))
    # Same support: our samples stay inside gymnasium's range and fill it.
    low, high = ref_arr.min(0).values, ref_arr.max(0).values
    span = (high - low).clamp(min=1e-12)
    assert (ours.min(0).values >= low - 0.05 * span).all()
    assert (ours.max(0).values <= high + 0.05 * span).all()
    assert (ours.min(0).values <= low + 0.05 * span).all()
    assert (ours.max(0).values >= high - 0.05 * span).all()
