"""A worker or evaluator process of a pod whose roles run apart: it serves the learner.

The learner (services/pod/roles/multiprocess.py ``RemoteRoles``) listens on a Unix socket in a
directory both see (services/pod/roles/transport.py); ``serve_role`` connects, introduces itself,
builds its env and an agent's state from the ``PPORunConfig`` the learner sends and then acts on the
learner's requests: collect a rollout into a shared-memory file (the worker) or evaluate (the
evaluator), each time with the learner's newest weights from the shared weights file. It exits
0 when the learner says stop or goes away, 1 when its own work fails (the learner gets the
error first)."""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services import registry
from services.logs import get_logger
from services.pod.config import PPORunConfig, on_policy_config
from services.pod.roles.learner import PPOEnvs, PPOLearner, per_agent
from services.pod.roles.transport import (
    POLL_S,
    PROTOCOL,
    SOCKET,
    Channel,
    ClosedError,
    SharedTensors,
    TransportError,
    connect,
    layout_of,
    retired,
)

log = get_logger(__name__)

ROLES = ("worker", "evaluator")


class RoleError(RuntimeError):
    """A role failed (its error and traceback are in the message), exited or went silent."""


class _Role:
    """What a worker or evaluator process holds between messages: a learner of one agent
    (services/pod/roles/learner.py ``PPOLearner``) that only acts, with the learner's weights
    copied into its state before every rollout or evaluation, and its env."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name, self.directory = name, directory
        self.learner: PPOLearner | None = None
        self.envs: PPOEnvs | None = None
        self.config: PPORunConfig | None = None
        self.weights: SharedTensors | None = None
        self.loaded = -1  # the weights version the state holds
        self.rollout: SharedTensors | None = None
        self.files = 0

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message["op"]
        if op == "build":
            return self.build(message)
        if op == "collect":
            return self.collect(message)
        if op == "evaluate":
            return self.evaluate(message)
        raise TransportError(f"unknown message {op!r}")

    def build(self, message: dict[str, Any]) -> dict[str, Any]:
        raw = message["config"]
        config = on_policy_config(str(raw.get("algorithm", "ppo"))).model_validate(raw)
        torch.set_num_threads(config.torch_threads or 1)
        self.close()  # a restart from a parent replaces the env
        self.config = config
        worker = self.name == "worker"
        # The env the trainer in one process would step (the functional one where the env has
        # one): for the same seed, the same rollouts and scores as fused.
        self.envs = PPOEnvs.build(config, 1, worker=worker, evaluator=not worker)
        obs_space, action_space = self.envs.spaces(config)
        # The agent built here only acts; its weights come from the learner before every
        # rollout or evaluation.
        torch.manual_seed(config.seed)
        agent_class = registry.load(registry.ALGORITHMS, config.algorithm, kind="algorithm")
        agent = agent_class(obs_space, action_space, config.agent_config)
        train = self.envs.train
        self.learner = PPOLearner(
            train,
            config.agent_config,
            [agent.to(config.device)],
            [per_agent(config.agent_config)],
            [config.seed],
            config.total_env_steps,
            torch.device(config.device),
            getattr(train, "max_episode_steps", None),
            reset_seed=config.seed,
        )
        weights = message["weights"]
        self.weights = SharedTensors(self._path(weights["file"]), weights["layout"])
        self.loaded = -1
        log.info("role built", role=self.name, env=config.env, device=config.device)
        return {"op": "built"}

    def _path(self, name: Any) -> Path:
        if not isinstance(name, str) or not name or Path(name).name != name:
            raise TransportError(f"bad shared file name {name!r}")
        return self.directory / name

    def _load(self, message: dict[str, Any]) -> None:
        version = int(message["weights_version"])
        if version != self.loaded:
            assert self.weights is not None and self.learner is not None
            with torch.no_grad():
                for name, value in self.weights.tensors.items():
                    self.learner.state[name].copy_(value)
            self.loaded = version

    def collect(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.name != "worker" or self.learner is None:
            raise TransportError(f"the {self.name} cannot collect (not built as a worker)")
        self._load(message)
        tensors = self.learner.collect()
        reply: dict[str, Any] = {"op": "rollout"}
        if self.rollout is None or not self.rollout.fits(tensors):
            if self.rollout is not None:
                self.rollout.unlink()  # gone already once the learner mapped it
            self.files += 1
            path = self.directory / f"{os.getpid()}-rollout-{self.files}.shm"
            self.rollout = SharedTensors(path, layout_of(tensors), create=True)
            reply["layout"] = self.rollout.layout
        self.rollout.write(tensors)
        reply["file"] = self.rollout.path.name
        return reply

    def evaluate(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.name != "evaluator" or self.learner is None:
            raise TransportError(f"the {self.name} cannot evaluate (not built as an evaluator)")
        self._load(message)
        assert self.envs is not None and self.config is not None
        envs = self.envs
        assert envs.evaluation is not None
        [result] = self.learner.evaluate(
            envs.evaluation, envs.start, self.config.evaluation_seed, False
        )
        return {
            "op": "result",
            "mean": result.mean,
            "std": result.std,
            "episodes": result.episodes,
            "env_steps": result.env_steps,
        }

    def close(self) -> None:
        if self.envs is not None:
            self.envs.close()
        self.envs = self.learner = None
        if self.rollout is not None:
            self.rollout.unlink()
            self.rollout = None


def _reach_learner(
    role: str, directory: Path, timeout_s: float, give_up: Callable[[], bool]
) -> Channel | None:
    """Connect and introduce ourselves; None if asked to give up before the learner came."""
    deadline = time.monotonic() + timeout_s
    why = f"no learner listening at {directory / SOCKET}"
    while not give_up():
        if retired(directory):
            return None
        if time.monotonic() > deadline:
            raise RoleError(f"{why} after {timeout_s:g}s")
        link = connect(directory)
        if link is None:
            time.sleep(POLL_S)
            continue
        channel, token = link
        try:
            channel.send(
                {
                    "op": "hello",
                    "role": role,
                    "token": token,
                    "protocol": PROTOCOL,
                    "pid": os.getpid(),
                }
            )
            answer = channel.receive(timeout=30)
        except (ClosedError, TimeoutError) as exc:  # a learner shutting down, or a stale socket
            channel.close()
            why = f"the learner at {directory / SOCKET} did not answer ({exc})"
            time.sleep(POLL_S)
            continue
        if answer["op"] == "welcome":
            return channel
        channel.close()
        why = f"the learner refused the {role}: {answer.get('error')}"
        if not answer.get("retry"):
            raise RoleError(why)
        time.sleep(POLL_S)  # the token was rewritten by a new learner: read it again
    return None


def serve_role(
    role: str,
    directory: Path,
    timeout_s: float = 300.0,
    give_up: Callable[[], bool] = lambda: False,
) -> int:
    """Run the worker or evaluator ``role`` for the learner listening in ``directory``.

    Returns 0 when the learner says stop or goes away (its own exit code tells how the pod
    ended), or when ``give_up()`` turns true before the learner came; 1 when this role failed
    (the learner got the error first). Once connected only the learner decides when to stop:
    it still needs the evaluator for its final report after a SIGTERM.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    channel = _reach_learner(role, directory, timeout_s, give_up)
    if channel is None:
        log.info("not needed: stopped, or the learner retired before it came", role=role)
        return 0
    log.info("connected to the learner", role=role, directory=str(directory))
    state = _Role(role, directory)
    try:
        while True:
            try:
                message = channel.receive()
            except ClosedError:
                log.info("the learner went away; role exiting", role=role)
                return 0
            if message["op"] == "stop":
                log.info("role stopped", role=role)
                return 0
            try:
                reply = state.handle(message)
            except Exception as exc:  # the learner fails the pod with it
                error = f"{type(exc).__name__}: {exc}"
                log.error("role failed", role=role, error=error, exc_info=True)
                with contextlib.suppress(ClosedError):
                    channel.send(
                        {"op": "error", "error": error, "traceback": traceback.format_exc()}
                    )
                return 1
            try:
                channel.send(reply)
            except ClosedError:
                log.info("the learner went away; role exiting", role=role)
                return 0
    finally:
        state.close()
        channel.close()
