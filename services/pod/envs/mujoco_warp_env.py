"""Ant and Humanoid on MuJoCo Warp (``mujoco-warp``): thousands of MuJoCo worlds on one device.

Gymnasium's ``Ant-v5`` and ``Humanoid-v5`` (same XML, frame skip, rewards, healthy ranges, reset
noise and limit) with positions-and-velocities observations and no contact cost, over zero-copy
torch views of the simulator's arrays; on CUDA one env step's physics is a CUDA graph on torch's
stream. Names: ``MjWarp-Ant-v0``, ``MjWarp-Humanoid-v0``; install: ``pip install
'podium[mjwarp]'``. Why this engine, the differences from gymnasium and what was measured:
docs/gpu_physics.md.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from services.pod.envs.base import EpisodeStats, Info, StepResult, VecEnv, check_num_envs

ASSETS = os.path.join(os.path.dirname(gym.__file__), "envs", "mujoco", "assets")


@dataclass(frozen=True)
class Task:
    """One locomotion task: gymnasium v5's constants for it."""

    xml: str
    forward_reward_weight: float
    ctrl_cost_weight: float
    healthy_reward: float
    healthy_z: tuple[float, float]
    #: Ant's healthy range includes its ends, Humanoid's excludes them (as gymnasium's).
    healthy_z_inclusive: bool
    #: Ant: ``qpos0 + U(-s, s)``, ``s * N(0, 1)``; Humanoid: ``U(-s, s)`` for both.
    reset_noise_scale: float
    qvel_noise_normal: bool
    #: Forward progress: x of the torso body (Ant) or of the centre of mass (Humanoid).
    forward_from_mass_center: bool
    frame_skip: int = 5
    max_episode_steps: int = 1000


ANT = Task(
    xml="ant.xml",
    forward_reward_weight=1.0,
    ctrl_cost_weight=0.5,
    healthy_reward=1.0,
    healthy_z=(0.2, 1.0),
    healthy_z_inclusive=True,
    reset_noise_scale=0.1,
    qvel_noise_normal=True,
    forward_from_mass_center=False,
)
HUMANOID = Task(
    xml="humanoid.xml",
    forward_reward_weight=1.25,
    ctrl_cost_weight=0.1,
    healthy_reward=5.0,
    healthy_z=(1.0, 2.0),
    healthy_z_inclusive=False,
    reset_noise_scale=1e-2,
    qvel_noise_normal=False,
    forward_from_mass_center=True,
)


def _engine() -> tuple[Any, Any, Any]:
    """``(mujoco, warp, mujoco_warp)``, or an ImportError that says what to install."""
    try:
        mujoco = importlib.import_module("mujoco")
        wp = importlib.import_module("warp")
        mjw = importlib.import_module("mujoco_warp")
    except ImportError as e:
        raise ImportError(
            f"the MjWarp envs need MuJoCo Warp: pip install 'podium[mjwarp]' ({e})"
        ) from e
    # Not its per-module "Module ... load took" lines: quiet before warp 1.19, log_level since.
    vars(wp.config).update(quiet=True, log_level=getattr(wp, "LOG_WARNING", 30))
    return mujoco, wp, mjw


class MjWarpLocomotionEnv(VecEnv):
    """``num_envs`` MuJoCo worlds of one locomotion task behind the Podium protocol."""

    def __init__(
        self,
        task: Task,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int | None = None,
        max_episode_steps: int | None = None,
        check_actions: bool = True,
        cuda_graph: bool | None = None,
        nconmax: int | None = None,
        njmax: int | None = None,
    ):
        mujoco, wp, mjw = _engine()
        self._mjw = mjw
        self.task = task
        self.num_envs = n = check_num_envs(num_envs)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.spec_id = f"MjWarp-{task.xml.removesuffix('.xml').capitalize()}-v0"
        self.check_actions = check_actions
        self.max_episode_steps = (
            task.max_episode_steps if max_episode_steps is None else int(max_episode_steps)
        )
        if self.max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps!r}")
        self.mj_model = mujoco.MjModel.from_xml_path(os.path.join(ASSETS, task.xml))
        if self.mj_model.opt.solver == mujoco.mjtSolver.mjSOL_PGS:
            # humanoid.xml asks for PGS, which MuJoCo Warp does not implement.
            self.mj_model.opt.solver = mujoco.mjtSolver.mjSOL_NEWTON
        self.dt = float(self.mj_model.opt.timestep) * task.frame_skip
        self._wp_device = wp.get_device(str(self.device))
        with wp.ScopedDevice(self._wp_device):
            self.model = mjw.put_model(self.mj_model)
            self.data = mjw.make_data(self.mj_model, nworld=n, nconmax=nconmax, njmax=njmax)
        # Zero-copy views of the simulator's arrays: reading and writing them is torch work.
        self._qpos = wp.to_torch(self.data.qpos)
        self._qvel = wp.to_torch(self.data.qvel)
        self._ctrl = wp.to_torch(self.data.ctrl)
        self._xpos = wp.to_torch(self.data.xpos)
        self._xipos = wp.to_torch(self.data.xipos)
        self._reset_mask = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._reset_mask_wp = wp.from_torch(self._reset_mask, dtype=wp.int32)
        dev, f32 = self.device, torch.float32
        self._qpos0 = torch.as_tensor(self.mj_model.qpos0, dtype=f32, device=dev)
        mass = torch.as_tensor(self.mj_model.body_mass, dtype=f32, device=dev)
        self._mass_fraction = mass / mass.sum()
        nq, nv, nu = self.mj_model.nq, self.mj_model.nv, self.mj_model.nu
        self.single_observation_space = gym.spaces.Box(
            -np.inf, np.inf, shape=(nq - 2 + nv,), dtype=np.float32
        )
        ctrlrange = self.mj_model.actuator_ctrlrange.astype(np.float32)
        self.single_action_space = gym.spaces.Box(
            ctrlrange[:, 0], ctrlrange[:, 1], shape=(nu,), dtype=np.float32
        )
        self._stream = (
            wp.stream_from_torch(torch.cuda.current_stream(dev)) if dev.type == "cuda" else None
        )
        use_graph = (dev.type == "cuda") if cuda_graph is None else bool(cuda_graph)
        if use_graph and dev.type != "cuda":
            raise ValueError("cuda_graph=True needs a CUDA device")
        self._graph = self._capture() if use_graph else None
        self._host_reads_free = dev.type == "cpu"
        self.generator = torch.Generator(device=dev)
        self.generator.manual_seed(
            seed if seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        )
        self._forward_before = torch.zeros(n, dtype=f32, device=dev)
        self._stats = EpisodeStats(n, dev)
        self._healthy_low = torch.tensor(task.healthy_z[0], dtype=f32, device=dev)
        self._healthy_high = torch.tensor(task.healthy_z[1], dtype=f32, device=dev)

    # -- simulator calls -------------------------------------------------------------------
    def _run(self, fn: Any, *args: Any) -> None:
        """Run Warp work on this env's device and, on CUDA, on torch's current stream."""
        wp = importlib.import_module("warp")
        with wp.ScopedDevice(self._wp_device):
            if self._stream is None:
                fn(*args)
            else:
                with wp.ScopedStream(self._stream, sync_enter=False):
                    fn(*args)

    def _physics(self) -> None:
        for _ in range(self.task.frame_skip):
            self._mjw.step(self.model, self.data)

    def _capture(self) -> Any:
        """The ``frame_skip`` MuJoCo steps of one env step as a CUDA graph. Capture needs every
        kernel loaded, so the steps run once first (on the fresh data; ``reset`` overwrites the
        state afterwards). The capture runs on a Warp stream of its own: CUDA cannot capture
        torch's default (legacy) stream; the graph is launched on torch's."""
        wp = importlib.import_module("warp")
        self._run(self._physics)
        with wp.ScopedDevice(self._wp_device):
            stream = wp.Stream(self._wp_device)
            with (
                wp.ScopedStream(stream, sync_enter=True),
                wp.ScopedCapture(device=self._wp_device, stream=stream) as capture,
            ):
                self._physics()
        return capture.graph

    def _simulate(self) -> None:
        if self._graph is None:
            self._run(self._physics)
        else:
            wp = importlib.import_module("warp")
            wp.capture_launch(self._graph, stream=self._stream)

    # -- task ------------------------------------------------------------------------------
    def _forward_position(self) -> torch.Tensor:
        """x of the torso (Ant) or of the centre of mass (Humanoid), as gymnasium reads it."""
        if self.task.forward_from_mass_center:
            return self._xipos[:, :, 0] @ self._mass_fraction
        return self._xpos[:, 1, 0].clone()

    def _observe(self) -> torch.Tensor:
        return torch.cat((self._qpos[:, 2:], self._qvel), dim=1)

    def _healthy(self) -> torch.Tensor:
        z = self._qpos[:, 2]
        if self.task.healthy_z_inclusive:
            inside = (z >= self._healthy_low) & (z <= self._healthy_high)
        else:
            inside = (z > self._healthy_low) & (z < self._healthy_high)
        return inside & torch.isfinite(self._qpos).all(1) & torch.isfinite(self._qvel).all(1)

    def _reset_worlds(self, mask: torch.Tensor, groups: int = 1) -> None:
        """Reset the worlds where ``mask``: MuJoCo's reset, then gymnasium's noisy start (the
        same in each of ``groups`` equal slices)."""
        self._reset_mask.copy_(mask)
        self._run(self._mjw.reset_data, self.model, self.data, self._reset_mask_wp)
        n, s, g = self.num_envs // groups, self.task.reset_noise_scale, self.generator
        dev, f32 = self.device, torch.float32
        noise = torch.rand((n, self._qpos.shape[1]), generator=g, device=dev, dtype=f32)
        qpos = self._qpos0 + (2 * noise - 1) * s
        if self.task.qvel_noise_normal:
            qvel = s * torch.randn((n, self._qvel.shape[1]), generator=g, device=dev, dtype=f32)
        else:
            u = torch.rand((n, self._qvel.shape[1]), generator=g, device=dev, dtype=f32)
            qvel = (2 * u - 1) * s
        column, qpos, qvel = mask.unsqueeze(1), qpos.repeat(groups, 1), qvel.repeat(groups, 1)
        torch.where(column, qpos, self._qpos, out=self._qpos)
        torch.where(column, qvel, self._qvel, out=self._qvel)
        # gymnasium's set_state runs mj_forward; the reward only needs the positions.
        self._run(self._mjw.kinematics, self.model, self.data)

    # -- protocol --------------------------------------------------------------------------
    def reset(self, seed: int | None = None, groups: int = 1) -> tuple[torch.Tensor, Info]:
        if seed is not None:
            self.generator.manual_seed(int(seed))
        everything = torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
        self._reset_worlds(everything, groups)
        self._forward_before = self._forward_position()
        self._stats.reset()
        return self._observe(), {}

    def step(self, actions: torch.Tensor) -> StepResult:
        actions = self.validate_actions(actions) if self.check_actions else actions.detach()
        actions = actions.to(self.device, torch.float32)
        self._ctrl.copy_(actions)
        self._simulate()
        after = self._forward_position()
        velocity = (after - self._forward_before) / self.dt
        healthy = self._healthy()
        ctrl_cost = self.task.ctrl_cost_weight * actions.square().sum(1)
        reward = (
            self.task.forward_reward_weight * velocity
            + self.task.healthy_reward * healthy
            - ctrl_cost
        )
        terminated = ~healthy
        # The step that reaches the limit truncates (EpisodeStats counts it below).
        done = terminated | (self._stats.episode_length + 1 >= self.max_episode_steps)
        truncated = done & healthy
        final_obs = self._observe()
        info = self._stats.step(reward, done, final_obs)
        self._forward_before = after
        if self._host_reads_free and not bool(done.any()):
            return final_obs, reward, terminated, truncated, info
        # Masked reset (no host sync on CUDA): every world draws noise, done ones take it.
        self._reset_worlds(done)
        self._forward_before = torch.where(done, self._forward_position(), after)
        return self._observe(), reward, terminated, truncated, info


def ant(
    num_envs: int = 1, device: str | torch.device = "cpu", seed: int | None = None, **kwargs: Any
) -> MjWarpLocomotionEnv:
    """Gymnasium's Ant-v5 on MuJoCo Warp (the differences: docs/gpu_physics.md)."""
    return MjWarpLocomotionEnv(ANT, num_envs, device=device, seed=seed, **kwargs)


def humanoid(
    num_envs: int = 1, device: str | torch.device = "cpu", seed: int | None = None, **kwargs: Any
) -> MjWarpLocomotionEnv:
    """Gymnasium's Humanoid-v5 on MuJoCo Warp (the differences: docs/gpu_physics.md)."""
    return MjWarpLocomotionEnv(HUMANOID, num_envs, device=device, seed=seed, **kwargs)
