"""The EnvPool tasks Podium adapts, named ``envpool:<task id>`` in specs and on the CLI.

Stated here, torch- and EnvPool-free, so the control plane can check a spec's env name without
importing EnvPool (which loads every simulator it ships). The list is EnvPool's gymnasium-API
tasks with vector observations and Box or Discrete actions — MuJoCo locomotion and control, and
classic control — since Podium's policies read flat float vectors; image tasks (Atari, Procgen)
are left out. ``tests/pod/envs/test_envpool_adapter.py`` checks that every id is in EnvPool's
registry, so the list cannot drift from the installed package.
"""

from __future__ import annotations

ENVPOOL_PREFIX = "envpool:"

_MUJOCO = (
    "Ant",
    "HalfCheetah",
    "Hopper",
    "Humanoid",
    "HumanoidStandup",
    "InvertedDoublePendulum",
    "InvertedPendulum",
    "Pusher",
    "Reacher",
    "Swimmer",
    "Walker2d",
)

ENVPOOL_TASKS: tuple[str, ...] = (
    *(f"{name}-v{version}" for name in _MUJOCO for version in (4, 5)),
    "CartPole-v1",
    "Pendulum-v1",
    "Acrobot-v1",
    "MountainCar-v0",
    "MountainCarContinuous-v0",
)
