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
from services.pod.envs.functional import FunctionalEnv


class CartPole(FunctionalEnv):
    name = "CartPole-v1"
    state_dim = 4  # x, x_dot, theta, theta_dot
    reset_uniforms = 4

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
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int | None = 500,
    ) -> None:
        super().__init__(device, dtype, max_episode_steps)
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
        self.uniform_start([-0.05] * 4, [0.1] * 4)
        # gymnasium's physics regrouped into fewer tensor ops (same values up to rounding): the
        # force enters through F / total_mass, picked by the action.
        self._force_over_mass = self.const(self.force_mag / self.total_mass)
        self._neg_gravity = self.const(-self.gravity)
        self._neg_4l_3 = self.const(-self.length * 4.0 / 3.0)

    def step(
        self, state: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, x_dot, theta, theta_dot = state.unbind(-1)
        costheta, sintheta = torch.cos(theta), torch.sin(theta)
        force = torch.where(action.bool(), self._force_over_mass, -self._force_over_mass)
        # temp = (force + polemass_length * theta_dot**2 * sin) / total_mass
        temp = torch.addcmul(
            force, theta_dot * theta_dot, sintheta, value=self.polemass_length / self.total_mass
        )
        # thetaacc = (g sin - cos temp) / (length (4/3 - masspole cos**2 / total_mass)),
        # numerator and denominator both negated.
        thetaacc = torch.addcmul(sintheta * self._neg_gravity, costheta, temp)
        thetaacc = thetaacc / torch.addcmul(
            self._neg_4l_3, costheta, costheta, value=self.length * self.masspole / self.total_mass
        )
        xacc = torch.addcmul(
            temp, thetaacc, costheta, value=-self.polemass_length / self.total_mass
        )
        # Explicit Euler: positions advance with the old velocities.
        new = torch.stack(
            (
                x.add(x_dot, alpha=self.tau),
                x_dot.add(xacc, alpha=self.tau),
                theta.add(theta_dot, alpha=self.tau),
                theta_dot.add(thetaacc, alpha=self.tau),
            ),
            -1,
        )
        terminated = (new[..., 0].abs() > self.x_threshold) | (
            new[..., 2].abs() > self.theta_threshold_radians
        )
        # Reward 1 on every step including the one that terminates (gymnasium's default).
        return new, torch.ones_like(x), terminated


class CartPoleEnv(TorchVecEnv):
    functional = CartPole
