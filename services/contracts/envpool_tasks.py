"""The EnvPool tasks Podium adapts, named ``envpool:<task id>`` in specs and on the CLI.

Stated here, torch- and EnvPool-free, so the control plane can check a spec's env name without
importing EnvPool (which loads every simulator it ships). The list is EnvPool's gymnasium-API
tasks with vector observations and Box or Discrete actions — MuJoCo locomotion and control, and
classic control — since Podium's policies read flat float vectors; image tasks (Atari, Procgen)
are left out. ``tests/pod/envs/test_envpool_adapter.py`` checks that every id is in EnvPool's
registry, so the list cannot drift from the installed package.

Which simulator an id is (``envpool_simulator``): EnvPool builds its MuJoCo tasks on its *own*
copy of MuJoCo, linked into its C++ library (``ENVPOOL_MUJOCO_VERSION``), not on the ``mujoco``
package that gymnasium's MuJoCo envs (``gym:<id>``) and MuJoCo Warp run on. The task code and
models are gymnasium's, so on the same MuJoCo one step agrees to 1e-9; across versions it need
not: with MuJoCo 4.0 installed, ``envpool:Ant-v5`` and ``envpool:Humanoid-v5`` differ from
gymnasium's ``Ant-v5`` / ``Humanoid-v5`` on most states (the numbers, and the tasks that stay
equal, are in docs/gpu_physics.md, "EnvPool's MuJoCo is not gymnasium's"). The classic-control
ids are EnvPool's C++ ports of gymnasium's tasks, no MuJoCo involved.
"""

from __future__ import annotations

ENVPOOL_PREFIX = "envpool:"

#: The MuJoCo inside EnvPool 1.2.5 (``strings`` on envpool/mujoco/mujoco_gym_envpool.so); the
#: installed ``mujoco`` package does not change it.
ENVPOOL_MUJOCO_VERSION = "3.6.0"

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


def envpool_simulator(task_id: str) -> str:
    """What simulates ``envpool:<task_id>`` (one of ``ENVPOOL_TASKS``), in words."""
    if task_id not in ENVPOOL_TASKS:
        raise ValueError(f"{task_id!r} is not an EnvPool task Podium adapts")
    if task_id.rsplit("-v", 1)[0] in _MUJOCO:
        return f"MuJoCo {ENVPOOL_MUJOCO_VERSION} built into EnvPool (not the installed mujoco)"
    return "EnvPool's C++ port of gymnasium's classic-control task"
