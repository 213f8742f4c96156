"""Pendulum-v1, torch-native: gymnasium's equations, constants, reward and limits, batched.

Same as ``gymnasium.envs.classic_control.PendulumEnv`` with its defaults: torque clipped to ±2,
angular velocity clipped to ±8, reward ``-(angle_normalize(th)**2 + 0.1 thdot**2 + 0.001 u**2)``
on the state *before* the update, initial angle uniform in [-pi, pi] and velocity in [-1, 1],
never terminates, truncation at 200 steps.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import TorchVecEnv
from services.pod.envs.functional import FunctionalEnv


class Pendulum(FunctionalEnv):
    name = "Pendulum-v1"
    state_dim = 2  # theta, theta_dot
    reset_uniforms = 2

    max_speed = 8.0
    max_torque = 2.0
    dt = 0.05
    m = 1.0
    l = 1.0  # noqa: E741 - gymnasium's name

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int | None = 200,
        g: float = 10.0,
    ) -> None:
        super().__init__(device, dtype, max_episode_steps)
        self.g = float(g)
        high = np.array([1.0, 1.0, self.max_speed], dtype=np.float32)
        self.single_observation_space = gym.spaces.Box(-high, high, dtype=np.float32)
        self.single_action_space = gym.spaces.Box(
            -self.max_torque, self.max_torque, shape=(1,), dtype=np.float32
        )
        self.uniform_start([-math.pi, -1.0], [2 * math.pi, 2.0])
        self._pi = self.const(math.pi)
        self._gravity_term = self.const(3 * self.g / (2 * self.l))

    def observe(self, state: torch.Tensor) -> torch.Tensor:
        th, thdot = state.unbind(-1)
        return torch.stack((torch.cos(th), torch.sin(th), thdot), -1).float()

    def step(
        self, state: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        th, thdot = state.unbind(-1)
        u = action[..., 0].to(self.dtype).clamp(-self.max_torque, self.max_torque)
        # angle_normalize(th) = ((th + pi) % (2 pi)) - pi
        angle = torch.remainder(th + self._pi, 2 * math.pi) - self._pi
        reward = -(angle * angle) - 0.1 * (thdot * thdot) - 0.001 * (u * u)
        # newthdot = thdot + (3 g / (2 l) sin(th) + 3 / (m l**2) u) dt, clipped; newth uses it.
        acc = torch.sin(th) * self._gravity_term + u * (3.0 / (self.m * self.l**2))
        thdot = (thdot + acc * self.dt).clamp(-self.max_speed, self.max_speed)
        new = torch.stack((th + thdot * self.dt, thdot), -1)
        return new, reward, torch.zeros_like(th, dtype=torch.bool)


class PendulumEnv(TorchVecEnv):
    functional = Pendulum
