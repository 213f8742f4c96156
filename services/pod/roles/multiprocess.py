"""The pod's roles apart: worker and evaluator in their own processes, the learner here.

The learner stays in the pod's main process (it is the single writer of the agent's state and
what the round loop checkpoints). The worker and the evaluator run ``serve_role``
(services/pod/roles/role_process.py), either as
child processes of the pod (``ProcessRoles``, ``--mode processes``) or as the worker and
evaluator containers of a Kubernetes Pod (``RemoteRoles``, ``--role learner`` beside
``--role worker`` and ``--role evaluator``). Both use one link (services/pod/roles/transport.py): a
Unix socket in a shared directory for JSON control messages, shared-memory files for tensors:

- the policy weights live in a shared file per role, allocated once per build; ``publish``
  copies the learner's policy into it and the role loads it before it next acts;
- a rollout is written by the worker into its shared file (allocated on the first rollout of a
  build) and the learner updates from the mapped tensors in place.

PPO's trainer (services/pod/training/onpolicy.py) collects and evaluates through ``RemoteRoles``
as through the roles in its own process. Each role builds its env and an agent's state from the
``PPORunConfig`` the learner sends (JSON), and takes the learner's weights before every rollout
or evaluation. Worker and learner alternate (collect with the newest
weights, then update), exactly as in one process, so for the same seed every mode trains the
same agent up to floating-point noise. A role exits when the learner says stop or goes away;
the learner fails with a ``RoleError`` naming the role when one fails, exits or stops
answering.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from hmac import compare_digest
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from services.logs import get_logger
from services.pod.config import PPORunConfig
from services.pod.roles.evaluator import EvalResult
from services.pod.roles.role_process import ROLES, RoleError, serve_role
from services.pod.roles.transport import (
    POLL_S,
    PROTOCOL,
    SOCKET,
    TOKEN,
    Channel,
    ClosedError,
    SharedTensors,
    TransportError,
    listen,
    retire,
)

log = get_logger(__name__)

#: Where the roles meet unless told otherwise: the pod's shared, memory-backed /dev/shm.
DEFAULT_ROLES_DIR = Path("/dev/shm/podium-roles")


# -- the learner side --------------------------------------------------------------------------
@dataclass
class _Peer:
    name: str
    channel: Channel
    pid: int
    weights: SharedTensors | None = None
    version: int = 0
    rollout: SharedTensors | None = None


class RemoteRoles:
    """The learner here; the worker and the evaluator are whoever connects to ``directory``
    (their own containers, or the children ``ProcessRoles`` starts). ``timeout_s`` bounds the
    wait for a role to connect and for any answer."""

    in_process = False

    def __init__(self, directory: Path = DEFAULT_ROLES_DIR, timeout_s: float = 300.0) -> None:
        self.directory, self.timeout_s = Path(directory), timeout_s
        self.server, self.token = listen(self.directory)
        self.peers: dict[str, _Peer] = {}
        self._builds = 0
        self._device = "cpu"
        self._cancel = threading.Event()
        log.info("waiting for the roles", directory=str(self.directory))

    # -- hooks for ProcessRoles --------------------------------------------------------------
    def alive(self, role: str) -> bool:
        """Whether ``role`` can still answer (a container's exit shows as end of stream)."""
        return True

    def cancel(self) -> None:
        """Stop waiting for roles to connect (safe from a signal handler)."""
        self._cancel.set()

    # -- connection ----------------------------------------------------------------------------
    def _connect_roles(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        self.server.settimeout(POLL_S)
        while missing := [r for r in ROLES if r not in self.peers]:
            if self._cancel.is_set():
                raise RoleError(f"stopped while waiting for the {' and '.join(missing)} to connect")
            for role in missing:
                if not self.alive(role):
                    raise RoleError(f"the {role} exited before it connected")
            if time.monotonic() > deadline:
                raise RoleError(
                    f"the {' and '.join(missing)} did not connect to "
                    f"{self.directory / SOCKET} within {self.timeout_s:g}s"
                )
            try:
                sock, _ = self.server.accept()
            except TimeoutError:
                continue
            self._greet(Channel(sock))

    def _greet(self, channel: Channel) -> None:
        try:
            hello = channel.receive(timeout=10)
        except (TransportError, TimeoutError) as exc:
            log.warning("a connection did not introduce itself", error=str(exc))
            channel.close()
            return
        role, error, retry = hello.get("role"), None, False
        if hello.get("op") != "hello" or hello.get("protocol") != PROTOCOL:
            error = f"expected a hello of protocol {PROTOCOL}, got {hello}"
        elif not compare_digest(str(hello.get("token", "")), self.token):
            error, retry = "wrong token (from an earlier learner?)", True
        elif role not in ROLES:
            error = f"unknown role {role!r}"
        elif role in self.peers:
            error = f"a {role} is already connected"
        if error is not None:
            log.warning("role refused", role=role, error=error)
            with contextlib.suppress(ClosedError):
                channel.send({"op": "refused", "error": error, "retry": retry})
            channel.close()
            return
        channel.send({"op": "welcome"})
        pid = hello.get("pid")
        self.peers[role] = _Peer(role, channel, pid if isinstance(pid, int) else 0)
        log.info("role connected", role=role, pid=pid)

    def _receive(self, peer: _Peer, expected: str) -> dict[str, Any]:
        try:
            message = peer.channel.receive(self.timeout_s, alive=lambda: self.alive(peer.name))
        except ClosedError as exc:
            raise RoleError(
                f"the {peer.name} went away ({exc}): its process or container exited"
            ) from None
        except TimeoutError:
            raise RoleError(f"the {peer.name} did not answer within {self.timeout_s:g}s") from None
        if message["op"] == "error":
            raise RoleError(
                f"the {peer.name} failed: {message.get('error')}\n{message.get('traceback', '')}"
            )
        if message["op"] != expected:
            raise RoleError(f"the {peer.name} answered {message['op']!r}, not {expected!r}")
        return message

    def _send(self, peer: _Peer, message: dict[str, Any]) -> None:
        try:
            peer.channel.send(message)
        except ClosedError as exc:
            raise RoleError(
                f"the {peer.name} went away ({exc}): its process or container exited"
            ) from None

    # -- what the on-policy trainer asks ------------------------------------------------------
    def build(self, config: PPORunConfig, weights: dict[str, torch.Tensor]) -> None:
        """Have the roles build their env and agent for ``config``, with ``weights`` (the
        agent's ``params``, ``obs_mean``, ``obs_var``, one row: what acting needs)."""
        self._connect_roles()
        self._device = config.device
        self._builds += 1
        for peer in self.peers.values():
            # One copy per role: publishing to the worker leaves what the evaluator sees alone.
            path = self.directory / f"{os.getpid()}-weights-{peer.name}-{self._builds}.shm"
            peer.weights = SharedTensors.create(path, weights)
            peer.version += 1
            message = {"file": path.name, "layout": peer.weights.layout}
            self._send(
                peer, {"op": "build", "config": config.model_dump(mode="json"), "weights": message}
            )
        for peer in self.peers.values():  # both build at once
            self._receive(peer, "built")
            # Both sides have it mapped now, and a mapping outlives the file's name: nothing
            # is left behind in the shared directory if a process is killed.
            peer.weights.unlink()

    def publish(self, role: str, weights: dict[str, torch.Tensor]) -> None:
        """Copy the learner's current weights into ``role``'s shared weights."""
        peer = self.peers[role]
        assert peer.weights is not None
        peer.weights.write(weights)
        peer.version += 1

    def collect(
        self, weights: dict[str, torch.Tensor], device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """One rollout (services/pod/roles/worker.py's buffers, (T, 1, N, ...)), collected
        with ``weights``, mapped from shared memory."""
        peer = self.peers["worker"]
        self.publish("worker", weights)
        self._send(peer, {"op": "collect", "weights_version": peer.version})
        reply = self._receive(peer, "rollout")
        if "layout" in reply:  # a new file (first rollout of a build): map it
            peer.rollout = SharedTensors(self.directory / Path(reply["file"]).name, reply["layout"])
            peer.rollout.unlink()  # mapped on both sides (see build)
        assert peer.rollout is not None and peer.rollout.path.name == reply["file"]
        return {k: v.to(device) for k, v in peer.rollout.tensors.items()}

    def evaluate(self, weights: dict[str, torch.Tensor]) -> EvalResult:
        self.publish("evaluator", weights)
        peer = self.peers["evaluator"]
        self._send(peer, {"op": "evaluate", "weights_version": peer.version})
        reply = self._receive(peer, "result")
        return EvalResult(
            mean=float(reply["mean"]),
            std=float(reply["std"]),
            episodes=[float(x) for x in reply["episodes"]],
            env_steps=int(reply["env_steps"]),
        )

    def close(self) -> None:
        for peer in self.peers.values():
            with contextlib.suppress(ClosedError):
                peer.channel.send({"op": "stop"})
            peer.channel.close()
            for shared in (peer.weights, peer.rollout):
                if shared is not None:  # a build that failed before both sides mapped it
                    shared.unlink()
        self.peers = {}
        self.server.close()
        for name in (SOCKET, TOKEN):
            (self.directory / name).unlink(missing_ok=True)
        retire(self.directory)  # roles still waiting to connect need not wait any longer


# -- worker and evaluator as child processes ---------------------------------------------------
def _child_main(
    role: str, directory: str, threads: int, timeout_s: float, parent: int
) -> None:  # pragma: no cover - runs in a spawned process (covered by the multiprocess tests)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pod's main process decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(max(1, threads))
    code = serve_role(role, Path(directory), timeout_s, give_up=lambda: os.getppid() != parent)
    raise SystemExit(code)


def _shared_tmp() -> str | None:
    """/dev/shm where there is one (memory-backed on Linux), else the default temp dir."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class ProcessRoles(RemoteRoles):
    """Worker and evaluator as child processes, learner here. Start-up costs a torch import per
    process (measured in bench/pod_modes.py), paid once per pod: a restart from a parent
    rebuilds the roles inside the same processes."""

    def __init__(self, threads: int = 1, timeout_s: float = 300.0) -> None:
        directory = Path(tempfile.mkdtemp(prefix="podium-roles-", dir=_shared_tmp()))
        super().__init__(directory, timeout_s)
        ctx = mp.get_context("spawn")  # safe with the threads of the HTTP client and metrics
        self.processes = {
            role: ctx.Process(
                target=_child_main,
                args=(role, str(directory), threads, timeout_s, os.getpid()),
                name=f"podium-{role}",
                daemon=True,
            )
            for role in ROLES
        }
        # Children ignore SIGTERM from their first instruction (the disposition is inherited
        # through exec): the orchestrator signals the whole process group, and only the main
        # process may decide to stop, after its final report.
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            for process in self.processes.values():
                process.start()
        finally:
            signal.signal(signal.SIGTERM, previous)

    def alive(self, role: str) -> bool:
        return self.processes[role].is_alive()

    def close(self) -> None:
        super().close()
        for process in self.processes.values():
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        shutil.rmtree(self.directory, ignore_errors=True)
