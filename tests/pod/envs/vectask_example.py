"""A small task written against IsaacGymEnvs' ``VecTask`` interface, in pure torch.

Isaac Gym cannot be installed everywhere (it needs its own wheel and an NVIDIA driver), so the
Isaac Gym adapter is exercised against this task, which follows the interface and, above all,
the timing of ``isaacgymenvs/tasks/base/vec_task.py`` and ``isaacgymenvs/tasks/cartpole.py``:

* buffers ``obs_buf`` (N, num_obs), ``rew_buf`` (N,), ``reset_buf`` / ``progress_buf`` /
  ``timeout_buf`` (N,) long, ``extras`` dict; ``reset_buf`` starts at 1, so the first step
  resets every sub-environment;
* ``step(actions)`` clamps the actions, runs ``pre_physics_step``, the physics,
  ``post_physics_step``, then sets ``timeout_buf = (progress_buf >= max_episode_length - 1) &
  (reset_buf != 0)`` and returns ``({"obs": obs}, rew_buf, reset_buf, extras)`` with
  ``extras["time_outs"]``. The reward and reset buffers are returned by reference and reused;
* ``post_physics_step`` increments ``progress_buf`` and only then calls ``reset_idx`` for
  sub-environments whose ``reset_buf`` was set by the *previous* step: a finished
  sub-environment is reset one step late, and the action of that step is lost;
* ``reset()`` resets nothing: it returns the current observation buffer;
* random numbers come from torch's global generator (IsaacGymEnvs seeds it with
  ``torch.manual_seed``).

The physics is the classic cart-pole (gymnasium's equations, explicit Euler, dt = 0.02) driven
by a continuous force ``action * max_push_effort``; reward and reset rules are IsaacGymEnvs'
Cartpole task (reward ``1 - angle**2 - 0.01 |cart_vel| - 0.005 |pole_vel|``, -2 and reset when the
cart leaves ``reset_dist`` or the pole falls past 90°, time out after ``max_episode_length``).
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
import torch


class CartpoleVecTask:
    """Cart-pole with IsaacGymEnvs' ``VecTask`` attributes, methods and reset timing."""

    gravity = 9.8
    masscart = 1.0
    masspole = 0.1
    total_mass = masscart + masspole
    length = 0.5  # half the pole's length
    polemass_length = masspole * length
    dt = 0.02

    def __init__(
        self,
        num_envs: int,
        device: str = "cpu",
        max_episode_length: int = 500,
        reset_dist: float = 3.0,
        max_push_effort: float = 10.0,
        clip_actions: float = 1.0,
        clip_observations: float = math.inf,
    ):
        self.num_envs = num_envs
        self.num_obs = 4
        self.num_states = 0
        self.num_actions = 1
        self.device = device
        self.rl_device = device
        self.max_episode_length = max_episode_length
        self.reset_dist = reset_dist
        self.max_push_effort = max_push_effort
        self.clip_actions = clip_actions
        self.clip_obs = clip_observations
        self.control_freq_inv = 1
        self.control_steps = 0
        self.obs_space = gym.spaces.Box(-np.inf, np.inf, shape=(self.num_obs,), dtype=np.float32)
        self.act_space = gym.spaces.Box(-1.0, 1.0, shape=(self.num_actions,), dtype=np.float32)
        # Simulator state: (cart position, pole angle) and their velocities per sub-environment.
        self.dof_pos = torch.zeros(num_envs, 2, device=device)
        self.dof_vel = torch.zeros(num_envs, 2, device=device)
        self.forces = torch.zeros(num_envs, device=device)
        self.allocate_buffers()
        self.obs_dict: dict[str, torch.Tensor] = {}

    @property
    def observation_space(self) -> gym.Space:
        return self.obs_space

    @property
    def action_space(self) -> gym.Space:
        return self.act_space

    def allocate_buffers(self) -> None:
        n, dev = self.num_envs, self.device
        self.obs_buf = torch.zeros((n, self.num_obs), device=dev, dtype=torch.float)
        self.rew_buf = torch.zeros(n, device=dev, dtype=torch.float)
        self.reset_buf = torch.ones(n, device=dev, dtype=torch.long)
        self.timeout_buf = torch.zeros(n, device=dev, dtype=torch.long)
        self.progress_buf = torch.zeros(n, device=dev, dtype=torch.long)
        self.extras: dict[str, Any] = {}

    # -- VecTask.step / reset ------------------------------------------------------------
    def step(
        self, actions: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict[str, Any]]:
        action_tensor = torch.clamp(actions, -self.clip_actions, self.clip_actions)
        self.pre_physics_step(action_tensor)
        for _ in range(self.control_freq_inv):
            self._simulate()
        self.post_physics_step()
        self.control_steps += 1
        self.timeout_buf = (self.progress_buf >= self.max_episode_length - 1) & (
            self.reset_buf != 0
        )
        self.extras["time_outs"] = self.timeout_buf.to(self.rl_device)
        self.obs_dict["obs"] = torch.clamp(self.obs_buf, -self.clip_obs, self.clip_obs).to(
            self.rl_device
        )
        return (
            self.obs_dict,
            self.rew_buf.to(self.rl_device),
            self.reset_buf.to(self.rl_device),
            self.extras,
        )

    def reset(self) -> dict[str, torch.Tensor]:
        self.obs_dict["obs"] = torch.clamp(self.obs_buf, -self.clip_obs, self.clip_obs).to(
            self.rl_device
        )
        return self.obs_dict

    def zero_actions(self) -> torch.Tensor:
        return torch.zeros(
            [self.num_envs, self.num_actions], dtype=torch.float32, device=self.rl_device
        )

    # -- task (IsaacGymEnvs' Cartpole) ---------------------------------------------------
    def reset_idx(self, env_ids: torch.Tensor) -> None:
        n = len(env_ids)
        self.dof_pos[env_ids] = 0.2 * (torch.rand((n, 2), device=self.device) - 0.5)
        self.dof_vel[env_ids] = 0.5 * (torch.rand((n, 2), device=self.device) - 0.5)
        self.reset_buf[env_ids] = 0
        self.progress_buf[env_ids] = 0

    def pre_physics_step(self, actions: torch.Tensor) -> None:
        self.forces = actions.to(self.device).squeeze(-1) * self.max_push_effort

    def post_physics_step(self) -> None:
        self.progress_buf += 1
        env_ids = self.reset_buf.nonzero(as_tuple=False).squeeze(-1)
        if len(env_ids) > 0:
            self.reset_idx(env_ids)
        self.compute_observations()
        self.compute_reward()

    def compute_observations(self) -> torch.Tensor:
        self.obs_buf[:, 0] = self.dof_pos[:, 0]
        self.obs_buf[:, 1] = self.dof_vel[:, 0]
        self.obs_buf[:, 2] = self.dof_pos[:, 1]
        self.obs_buf[:, 3] = self.dof_vel[:, 1]
        return self.obs_buf

    def compute_reward(self) -> None:
        cart_pos, cart_vel, pole_angle, pole_vel = self.obs_buf.unbind(1)
        reward = 1.0 - pole_angle * pole_angle - 0.01 * cart_vel.abs() - 0.005 * pole_vel.abs()
        failed = (cart_pos.abs() > self.reset_dist) | (pole_angle.abs() > math.pi / 2)
        self.rew_buf[:] = torch.where(failed, torch.full_like(reward, -2.0), reward)
        reset = torch.where(failed, torch.ones_like(self.reset_buf), self.reset_buf)
        timed_out = self.progress_buf >= self.max_episode_length - 1
        self.reset_buf[:] = torch.where(timed_out, torch.ones_like(reset), reset)

    def _simulate(self) -> None:
        cartpole_euler_step(self.dof_pos, self.dof_vel, self.forces, self.dt)


def cartpole_euler_step(
    dof_pos: torch.Tensor, dof_vel: torch.Tensor, forces: torch.Tensor, dt: float
) -> None:
    """One explicit-Euler step of the cart-pole equations (stands in for PhysX), in place.

    ``dof_pos`` / ``dof_vel``: (N, 2) cart position and pole angle, and their velocities;
    ``forces``: (N,) force on the cart. Also the physics of the Isaac Lab stand-in.
    """
    c = CartpoleVecTask
    theta, theta_dot = dof_pos[:, 1], dof_vel[:, 1]
    cos, sin = torch.cos(theta), torch.sin(theta)
    temp = (forces + c.polemass_length * theta_dot**2 * sin) / c.total_mass
    thetaacc = (c.gravity * sin - cos * temp) / (
        c.length * (4.0 / 3.0 - c.masspole * cos**2 / c.total_mass)
    )
    xacc = temp - c.polemass_length * thetaacc * cos / c.total_mass
    dof_pos += dt * dof_vel
    dof_vel += dt * torch.stack((xacc, thetaacc), dim=1)
