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


class PendulumEnv(TorchVecEnv):
    spec_id = "Pendulum-v1"
    state_dim = 2  # theta, theta_dot

    max_speed = 8.0
    max_torque = 2.0
    dt = 0.05
    m = 1.0
    l = 1.0  # noqa: E741 - gymnasium's name

    def __init__(
        self,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int | None = 200,
        seed: int | None = None,
        check_actions: bool = True,
        g: float = 10.0,
    ):
        super().__init__(num_envs, device, dtype, max_episode_steps, seed, check_actions)
        self.g = float(g)
        high = np.array([1.0, 1.0, self.max_speed], dtype=np.float32)
        self.single_observation_space = gym.spaces.Box(-high, high, dtype=np.float32)
        self.single_action_space = gym.spaces.Box(
            -self.max_torque, self.max_torque, shape=(1,), dtype=np.float32
        )
        self._low = self._row([-math.pi, -1.0])
        self._span = self._row([2 * math.pi, 2.0])
        self._pi = self._const(math.pi)
        self._gravity_term = self._const(3 * self.g / (2 * self.l))
        self._zero = self._const(0.0)

    def _initial_state(self, n: int) -> torch.Tensor:
        return self._uniform_state(n, self._low, self._span)

    def _physics_step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        th, thdot = self.columns
        u = actions[:, 0].to(self.dtype).clamp(-self.max_torque, self.max_torque)
        # angle_normalize(th) = ((th + pi) % (2 pi)) - pi
        angle = torch.add(th, self._pi).remainder_(2 * math.pi).sub_(self._pi)
        reward = torch.addcmul(self._zero, angle, angle, value=-1.0)
        reward.addcmul_(thdot, thdot, value=-0.1).addcmul_(u, u, value=-0.001)
        # newthdot = thdot + (3 g / (2 l) sin(th) + 3 / (m l**2) u) dt, clipped; newth uses it.
        acc = torch.sin(th).mul_(self._gravity_term).add_(u, alpha=3.0 / (self.m * self.l**2))
        thdot.add_(acc, alpha=self.dt).clamp_(-self.max_speed, self.max_speed)
        th.add_(thdot, alpha=self.dt)
        return reward, torch.zeros(self.num_envs, device=self.device, dtype=torch.bool)

    def _observe(self, state: torch.Tensor) -> torch.Tensor:
        th = state[:, 0]
        if torch.compiler.is_compiling():  # dynamo takes no strided out=; inductor fuses this
            return torch.stack((torch.cos(th), torch.sin(th), state[:, 1]), 1).float()
        obs = torch.empty(len(state), 3, device=self.device, dtype=torch.float32)
        torch.cos(th, out=obs[:, 0])
        torch.sin(th, out=obs[:, 1])
        obs[:, 2] = state[:, 1]
        return obs
