"""MountainCarContinuous-v0, torch-native: gymnasium's equations, reward and limits, batched.

Same as ``gymnasium.envs.classic_control.Continuous_MountainCarEnv`` with its defaults: force
clipped to ±1, power 0.0015, velocity clipped to ±0.07, position clipped to [-1.2, 0.6] (velocity
zeroed when the car hits the left wall moving left), termination at position >= 0.45 with
velocity >= goal_velocity, reward 100 on reaching the goal minus ``0.1 a**2`` (of the *unclipped*
action, as gymnasium), initial position uniform in [-0.6, -0.4] at rest, truncation at 999 steps.

gymnasium stores this env's state as float32 after each step, so a float64 run of this env
agrees with it to float32 precision, not better.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import TorchVecEnv
from services.pod.envs.functional import FunctionalEnv


class MountainCarContinuous(FunctionalEnv):
    name = "MountainCarContinuous-v0"
    state_dim = 2  # position, velocity
    reset_uniforms = 2

    min_action = -1.0
    max_action = 1.0
    min_position = -1.2
    max_position = 0.6
    max_speed = 0.07
    goal_position = 0.45
    power = 0.0015

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int | None = 999,
        goal_velocity: float = 0.0,
    ) -> None:
        super().__init__(device, dtype, max_episode_steps)
        self.goal_velocity = float(goal_velocity)
        self.single_observation_space = gym.spaces.Box(
            np.array([self.min_position, -self.max_speed], dtype=np.float32),
            np.array([self.max_position, self.max_speed], dtype=np.float32),
            dtype=np.float32,
        )
        self.single_action_space = gym.spaces.Box(
            self.min_action, self.max_action, shape=(1,), dtype=np.float32
        )
        self.uniform_start([-0.6, 0.0], [0.2, 0.0])

    def step(
        self, state: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        position, velocity = state.unbind(-1)
        a = action[..., 0].to(self.dtype)
        force = a.clamp(self.min_action, self.max_action)
        velocity = velocity + force * self.power - 0.0025 * torch.cos(3 * position)
        velocity = velocity.clamp(-self.max_speed, self.max_speed)
        position = (position + velocity).clamp(self.min_position, self.max_position)
        velocity = velocity.masked_fill((position == self.min_position) & (velocity < 0), 0.0)
        terminated = (position >= self.goal_position) & (velocity >= self.goal_velocity)
        reward = terminated * 100.0 - a.square() * 0.1
        return torch.stack((position, velocity), -1), reward.to(self.dtype), terminated


class MountainCarContinuousEnv(TorchVecEnv):
    functional = MountainCarContinuous
