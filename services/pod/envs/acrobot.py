"""Acrobot-v1, torch-native: gymnasium's equations, constants, reward and limits, batched.

Same as ``gymnasium.envs.classic_control.AcrobotEnv`` with its defaults: "book" dynamics
integrated by one RK4 step of dt = 0.2 with the torque held constant, joint angles wrapped to
[-pi, pi], velocities clipped to ±4pi / ±9pi, no torque noise, termination when the free end is
above the bar (``-cos(t1) - cos(t1 + t2) > 1``), reward -1 per step and 0 on the terminating
one, initial state uniform in ±0.1, truncation at 500 steps.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import TorchVecEnv
from services.pod.envs.functional import FunctionalEnv


def _wrap(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """gymnasium's ``wrap``: shift by whole periods into [low, high], endpoints kept. gymnasium
    loops ``x -= period`` while ``x > high``; here the count of periods is computed instead,
    which gives the same value for the single shift that occurs in practice."""
    period = high - low
    above = torch.ceil((x - high) / period).clamp_(min=0)
    below = torch.ceil((low - x) / period).clamp_(min=0)
    return x - above * period + below * period


class Acrobot(FunctionalEnv):
    name = "Acrobot-v1"
    state_dim = 4  # theta1, theta2, dtheta1, dtheta2
    reset_uniforms = 4

    dt = 0.2
    LINK_LENGTH_1 = 1.0
    LINK_MASS_1 = 1.0
    LINK_MASS_2 = 1.0
    LINK_COM_POS_1 = 0.5
    LINK_COM_POS_2 = 0.5
    LINK_MOI = 1.0
    MAX_VEL_1 = 4 * math.pi
    MAX_VEL_2 = 9 * math.pi
    AVAIL_TORQUE = (-1.0, 0.0, 1.0)
    GRAVITY = 9.8

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int | None = 500,
    ) -> None:
        super().__init__(device, dtype, max_episode_steps)
        high = np.array([1.0, 1.0, 1.0, 1.0, self.MAX_VEL_1, self.MAX_VEL_2], dtype=np.float32)
        self.single_observation_space = gym.spaces.Box(-high, high, dtype=np.float32)
        self.single_action_space = gym.spaces.Discrete(3)
        self.uniform_start([-0.1] * 4, [0.2] * 4)

    def _dsdt(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Time derivative of the state (gymnasium's ``_dsdt``, "book" variant)."""
        m1, m2 = self.LINK_MASS_1, self.LINK_MASS_2
        l1, lc1, lc2 = self.LINK_LENGTH_1, self.LINK_COM_POS_1, self.LINK_COM_POS_2
        i1 = i2 = self.LINK_MOI
        g = self.GRAVITY
        theta1, theta2, dtheta1, dtheta2 = s.unbind(-1)
        cos2, sin2 = torch.cos(theta2), torch.sin(theta2)
        d1 = m1 * lc1**2 + m2 * (l1**2 + lc2**2 + 2 * l1 * lc2 * cos2) + i1 + i2
        d2 = m2 * (lc2**2 + l1 * lc2 * cos2) + i2
        phi2 = m2 * lc2 * g * torch.cos(theta1 + theta2 - math.pi / 2.0)
        phi1 = (
            -m2 * l1 * lc2 * dtheta2**2 * sin2
            - 2 * m2 * l1 * lc2 * dtheta2 * dtheta1 * sin2
            + (m1 * lc1 + m2 * l1) * g * torch.cos(theta1 - math.pi / 2)
            + phi2
        )
        ddtheta2 = (a + d2 / d1 * phi1 - m2 * l1 * lc2 * dtheta1**2 * sin2 - phi2) / (
            m2 * lc2**2 + i2 - d2**2 / d1
        )
        ddtheta1 = -(d2 * ddtheta2 + phi1) / d1
        return torch.stack((dtheta1, dtheta2, ddtheta1, ddtheta2), dim=-1)

    def step(
        self, state: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The torque of action 0, 1, 2: -1, 0, +1 (``AVAIL_TORQUE``).
        torque = action.to(self.dtype) - 1.0
        s, dt = state, self.dt
        k1 = self._dsdt(s, torque)
        k2 = self._dsdt(s + dt / 2 * k1, torque)
        k3 = self._dsdt(s + dt / 2 * k2, torque)
        k4 = self._dsdt(s + dt * k3, torque)
        ns = s + dt / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
        theta1 = _wrap(ns[..., 0], -math.pi, math.pi)
        theta2 = _wrap(ns[..., 1], -math.pi, math.pi)
        new = torch.stack(
            (
                theta1,
                theta2,
                ns[..., 2].clamp(-self.MAX_VEL_1, self.MAX_VEL_1),
                ns[..., 3].clamp(-self.MAX_VEL_2, self.MAX_VEL_2),
            ),
            -1,
        )
        terminated = -torch.cos(theta1) - torch.cos(theta2 + theta1) > 1.0
        return new, terminated.to(self.dtype) - 1.0, terminated

    def observe(self, state: torch.Tensor) -> torch.Tensor:
        theta1, theta2, dtheta1, dtheta2 = state.unbind(-1)
        obs = torch.stack(
            (
                torch.cos(theta1),
                torch.sin(theta1),
                torch.cos(theta2),
                torch.sin(theta2),
                dtheta1,
                dtheta2,
            ),
            dim=-1,
        )
        return obs.to(torch.float32)


class AcrobotEnv(TorchVecEnv):
    functional = Acrobot
