"""A small task with the interface and timing of Isaac Lab's ``DirectRLEnv``, in pure torch.

Isaac Lab needs Isaac Sim (an NVIDIA-licensed, multi-GB install with a GPU), so the Isaac Lab
adapter is exercised against this stand-in, which follows ``isaaclab/envs/direct_rl_env.py``
(Isaac Lab 2.3) and the ``Isaac-Cartpole-Direct-v0`` task:

* a ``gymnasium.Env`` over a batch: ``num_envs``, ``device``, ``single_observation_space`` a
  ``Dict`` with a ``"policy"`` Box, ``single_action_space`` a Box, ``max_episode_length`` =
  ``ceil(episode_length_s / (sim_dt * decimation))``, ``episode_length_buf``;
* ``reset(seed=None, options=None) -> (obs, extras)`` seeds torch's global generator (Isaac Lab's
  ``configure_seed``), resets every sub-environment and returns ``{"policy": tensor}``;
* ``step(action) -> (obs, reward, terminated, truncated, extras)``: ``decimation`` physics
  steps, ``episode_length_buf += 1``, dones (``time_out = episode_length_buf >=
  max_episode_length - 1``, terminated when the cart leaves ±3 m or the pole falls past 90°),
  rewards, then ``_reset_idx`` of the finished sub-environments *inside the same step*, then
  the observations: the returned observation of a finished sub-environment is already the
  first of its next episode, and the last one of the finished episode is not returned.
  ``terminated`` and ``truncated`` are the env's own buffers, overwritten on the next step.

Rewards are the Direct cart-pole's (alive 1, termination -2, pole angle², cart and pole
velocity penalties); the physics is the classic cart-pole (gymnasium's equations, explicit
Euler) driven by a continuous force, standing in for PhysX.
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
import torch


def cartpole_euler_step(
    dof_pos: torch.Tensor, dof_vel: torch.Tensor, forces: torch.Tensor, dt: float
) -> None:
    """One explicit-Euler step of the cart-pole, in place. ``dof_pos`` / ``dof_vel``: (N, 2)
    cart position and pole angle, and their velocities; ``forces``: (N,) force on the cart."""
    gravity, masscart, masspole, length = 9.8, 1.0, 0.1, 0.5  # length: half the pole's
    total_mass, polemass_length = masscart + masspole, masspole * length
    theta, theta_dot = dof_pos[:, 1], dof_vel[:, 1]
    cos, sin = torch.cos(theta), torch.sin(theta)
    temp = (forces + polemass_length * theta_dot**2 * sin) / total_mass
    thetaacc = (gravity * sin - cos * temp) / (
        length * (4.0 / 3.0 - masspole * cos**2 / total_mass)
    )
    xacc = temp - polemass_length * thetaacc * cos / total_mass
    dof_pos += dt * dof_vel
    dof_vel += dt * torch.stack((xacc, thetaacc), dim=1)


class CartpoleDirectEnv(gym.Env):
    """Cart-pole with ``DirectRLEnv``'s attributes, methods and reset timing."""

    is_vector_env = True
    metadata: dict[str, Any] = {"render_modes": [None]}  # noqa: RUF012 - gymnasium's API

    def __init__(
        self,
        num_envs: int = 16,
        device: str = "cpu",
        episode_length_s: float = 5.0,
        sim_dt: float = 1 / 120,
        decimation: int = 2,
        action_scale: float = 10.0,
        max_cart_pos: float = 3.0,
        initial_pole_angle_range: tuple[float, float] = (-0.25, 0.25),
    ):
        self._num_envs = num_envs
        self._device = device
        self.sim_dt = sim_dt
        self.decimation = decimation
        self.max_episode_length_s = episode_length_s
        self.action_scale = action_scale
        self.max_cart_pos = max_cart_pos
        self.initial_pole_angle_range = initial_pole_angle_range
        self.single_observation_space = gym.spaces.Dict(
            {"policy": gym.spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float32)}
        )
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self.observation_space = gym.vector.utils.batch_space(
            self.single_observation_space["policy"], num_envs
        )
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.dof_pos = torch.zeros(num_envs, 2, device=device)  # cart position, pole angle
        self.dof_vel = torch.zeros(num_envs, 2, device=device)
        self.forces = torch.zeros(num_envs, device=device)
        self.episode_length_buf = torch.zeros(num_envs, device=device, dtype=torch.long)
        self.reset_terminated = torch.zeros(num_envs, device=device, dtype=torch.bool)
        self.reset_time_outs = torch.zeros_like(self.reset_terminated)
        self.reset_buf = torch.zeros_like(self.reset_terminated)
        self.extras: dict[str, Any] = {}
        self.closed = False

    @property
    def num_envs(self) -> int:
        return self._num_envs

    @property
    def device(self) -> str:
        return self._device

    @property
    def max_episode_length(self) -> int:
        return math.ceil(self.max_episode_length_s / (self.sim_dt * self.decimation))

    # -- DirectRLEnv.reset / step ----------------------------------------------------------
    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if seed is not None:
            torch.manual_seed(seed)
        self._reset_idx(torch.arange(self.num_envs, device=self.device))
        return self._get_observations(), self.extras

    def step(
        self, action: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        action = action.to(self.device)
        self._pre_physics_step(action)
        for _ in range(self.decimation):
            cartpole_euler_step(self.dof_pos, self.dof_vel, self.forces, self.sim_dt)
        self.episode_length_buf += 1
        self.reset_terminated[:], self.reset_time_outs[:] = self._get_dones()
        self.reset_buf = self.reset_terminated | self.reset_time_outs
        self.reward_buf = self._get_rewards()
        reset_env_ids = self.reset_buf.nonzero(as_tuple=False).squeeze(-1)
        if len(reset_env_ids) > 0:
            self._reset_idx(reset_env_ids)
        self.obs_buf = self._get_observations()
        terminated, time_outs = self.reset_terminated, self.reset_time_outs
        return self.obs_buf, self.reward_buf, terminated, time_outs, self.extras

    def close(self) -> None:
        self.closed = True

    # -- task (Isaac Lab's Direct cart-pole) -----------------------------------------------
    def _pre_physics_step(self, actions: torch.Tensor) -> None:
        self.forces = self.action_scale * actions.squeeze(-1)

    def _get_observations(self) -> dict[str, torch.Tensor]:
        obs = torch.stack(
            (self.dof_pos[:, 1], self.dof_vel[:, 1], self.dof_pos[:, 0], self.dof_vel[:, 0]),
            dim=-1,
        )
        return {"policy": obs}

    def _get_dones(self) -> tuple[torch.Tensor, torch.Tensor]:
        time_out = self.episode_length_buf >= self.max_episode_length - 1
        out_of_bounds = (self.dof_pos[:, 0].abs() > self.max_cart_pos) | (
            self.dof_pos[:, 1].abs() > math.pi / 2
        )
        return out_of_bounds, time_out

    def _get_rewards(self) -> torch.Tensor:
        terminated = self.reset_terminated.float()
        return (
            1.0 * (1.0 - terminated)
            - 2.0 * terminated
            - self.dof_pos[:, 1] ** 2
            - 0.01 * self.dof_vel[:, 0].abs()
            - 0.005 * self.dof_vel[:, 1].abs()
        )

    def _reset_idx(self, env_ids: torch.Tensor) -> None:
        low, high = self.initial_pole_angle_range
        angle = (low + (high - low) * torch.rand(len(env_ids), device=self.device)) * math.pi
        self.dof_pos[env_ids] = 0.0
        self.dof_pos[env_ids, 1] = angle
        self.dof_vel[env_ids] = 0.0
        self.episode_length_buf[env_ids] = 0
