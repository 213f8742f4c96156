"""CartPole-v1, torch-native: gymnasium's equations, constants, reward and limits, batched.

Same as ``gymnasium.envs.classic_control.CartPoleEnv`` with its defaults: explicit Euler
integration, reward 1 on every step including the terminating one, termination when the cart
leaves ±2.4 or the pole leaves ±12°, initial state uniform in ±0.05, truncation at 500 steps.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import TorchVecEnv


class CartPoleEnv(TorchVecEnv):
    spec_id = "CartPole-v1"
    state_dim = 4  # x, x_dot, theta, theta_dot

    gravity = 9.8
    masscart = 1.0
    masspole = 0.1
    total_mass = masspole + masscart
    length = 0.5  # half the pole's length
    polemass_length = masspole * length
    force_mag = 10.0
    tau = 0.02  # seconds between state updates
    theta_threshold_radians = 12 * 2 * math.pi / 360
    x_threshold = 2.4

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int | None = 500,
        seed: int | None = None,
        check_actions: bool = True,
    ):
        super().__init__(num_envs, device, dtype, max_episode_steps, seed, check_actions)
        high = np.array(
            [
                self.x_threshold * 2,
                np.finfo(np.float32).max,
                self.theta_threshold_radians * 2,
                np.finfo(np.float32).max,
            ],
            dtype=np.float32,
        )
        self.single_observation_space = gym.spaces.Box(-high, high, dtype=np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self._low = self._row([-0.05] * 4)
        self._span = self._row([0.1] * 4)
        # The physics is gymnasium's, regrouped into fewer tensor ops (same values up to
        # rounding): the force enters through F / total_mass, looked up from the action.
        self._force_over_mass = self._row([-self.force_mag, self.force_mag]) / self.total_mass
        self._neg_gravity = self._const(-self.gravity)
        self._neg_4l_3 = self._const(-self.length * 4.0 / 3.0)
        self._x_threshold = self._const(self.x_threshold)
        self._theta_threshold = self._const(self.theta_threshold_radians)

    def _initial_state(self, n: int) -> torch.Tensor:
        return self._uniform_state(n, self._low, self._span)

    def _physics_step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, x_dot, theta, theta_dot = self.columns
        costheta, sintheta = torch.cos(theta), torch.sin(theta)
        # temp = (force + polemass_length * theta_dot**2 * sin) / total_mass
        temp = torch.addcmul(
            self._force_over_mass.index_select(0, actions),
            theta_dot * theta_dot,
            sintheta,
            value=self.polemass_length / self.total_mass,
        )
        # thetaacc = (g sin - cos temp) / (length (4/3 - masspole cos**2 / total_mass)),
        # numerator and denominator both negated.
        thetaacc = torch.addcmul(sintheta * self._neg_gravity, costheta, temp)
        thetaacc /= torch.addcmul(
            self._neg_4l_3, costheta, costheta, value=self.length * self.masspole / self.total_mass
        )
        xacc = torch.addcmul(
            temp, thetaacc, costheta, value=-self.polemass_length / self.total_mass
        )
        # Explicit Euler: positions advance with the old velocities (in place, column by column).
        x.add_(x_dot, alpha=self.tau)
        x_dot.add_(xacc, alpha=self.tau)
        theta.add_(theta_dot, alpha=self.tau)
        theta_dot.add_(thetaacc, alpha=self.tau)
        terminated = x.abs() > self._x_threshold
        terminated |= theta.abs() > self._theta_threshold
        # Reward 1 on every step including the one that terminates (gymnasium's default).
        return torch.ones(self.num_envs, device=self.device, dtype=self.dtype), terminated

    def _observe(self, state: torch.Tensor) -> torch.Tensor:
        return state.to(torch.float32, copy=True)
