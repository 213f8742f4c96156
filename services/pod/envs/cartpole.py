"""CartPole-v1, torch-native: gymnasium's equations, constants, reward and limits, batched."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import TorchVecEnv


class CartPoleEnv(TorchVecEnv):
    spec_id = "CartPole-v1"

    gravity = 9.8
    masscart = 1.0
    masspole = 0.1
    total_mass = masspole + masscart
    length = 0.5  # half the pole's length
    polemass_length = masspole * length
    force_mag = 10.0
    tau = 0.02  # seconds between state updates (explicit Euler, as gymnasium's default)
    theta_threshold_radians = 12 * 2 * math.pi / 360
    x_threshold = 2.4

    def __init__(self, num_envs: int = 1, device="cpu", dtype=torch.float32, **kwargs):
        kwargs.setdefault("max_episode_steps", 500)
        super().__init__(num_envs, device, dtype, **kwargs)
        high = np.array(
            [self.x_threshold * 2, np.finfo(np.float32).max, self.theta_threshold_radians * 2,
             np.finfo(np.float32).max],
            dtype=np.float32,
        )
        self.single_observation_space = gym.spaces.Box(-high, high, dtype=np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.state = torch.zeros(self.num_envs, 4, device=self.device, dtype=dtype)

    def _reset_envs(self, mask: torch.Tensor) -> None:
        fresh = self._uniform((self.num_envs, 4), -0.05, 0.05)
        self.state = torch.where(mask[:, None], fresh, self.state)

    def _physics_step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, x_dot, theta, theta_dot = self.state.unbind(1)
        force = (actions.to(self.dtype) * 2 - 1) * self.force_mag
        costheta, sintheta = torch.cos(theta), torch.sin(theta)
        temp = (force + self.polemass_length * theta_dot.square() * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta.square() / self.total_mass)
        )
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x = x + self.tau * x_dot
        x_dot = x_dot + self.tau * xacc
        theta = theta + self.tau * theta_dot
        theta_dot = theta_dot + self.tau * thetaacc
        self.state = torch.stack((x, x_dot, theta, theta_dot), dim=1)
        terminated = (x.abs() > self.x_threshold) | (theta.abs() > self.theta_threshold_radians)
        # Reward 1 on every step including the one that terminates (gymnasium's default).
        reward = torch.ones(self.num_envs, device=self.device, dtype=self.dtype)
        return reward, terminated

    def _observe(self) -> torch.Tensor:
        return self.state.to(torch.float32)
