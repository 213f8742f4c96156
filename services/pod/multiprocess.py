"""The pod's three roles as three processes: worker and evaluator processes around the learner.

The learner stays in the pod's main process (it is the single writer of the agent's state and
what the round loop checkpoints); the worker and the evaluator run in processes started with
torch.multiprocessing ("spawn": safe with the threads of the HTTP client and metrics server).
Tensors never travel by copy through a pipe:

- a rollout is moved into shared memory by the worker (``Rollout.share_memory_``; on a GPU the
  tensors go through CUDA IPC) and the queue carries only handles;
- the policy weights live in a shared-memory state dict per role, allocated once per build;
  the learner copies its weights into it and tells the role to load them.

Worker and learner alternate (collect with the newest weights, then update), exactly as the
fused loop does, so for the same seed both modes produce the same agent up to floating-point
noise; the evaluator plays deterministic episodes on its own env. Both modes have the same
interface (``build``, ``step``, ``evaluate``, ``publish``, ``close``), see
services/pod/runtime.py for the fused one.
"""

from __future__ import annotations

import os
import queue
import signal
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from services.logs import get_logger
from services.pod.evaluator import EvalResult
from services.pod.learner import Learner
from services.pod.train import TrainConfig, build

log = get_logger(__name__)

POLL_S = 0.5


class RoleError(RuntimeError):
    """A role process failed (its error and traceback are in the message) or died."""


def _role_main(
    role: str, inbox: Any, outbox: Any, threads: int, parent_pid: int
) -> None:  # pragma: no cover - runs in a spawned process (covered by the multiprocess tests)
    """A worker or evaluator process: build on "build", act on "collect" / "evaluate"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pod's main process decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(max(1, threads))
    weights: dict[str, torch.Tensor] = {}
    worker = evaluator = policy = None
    keep: Any = None  # the last rollout stays alive until the learner has read it (CUDA IPC)
    while True:
        try:
            message = inbox.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the pod's main process is gone: so are we
                return
            continue
        kind = message[0]
        try:
            if kind == "stop":
                return
            if kind == "build":
                _, config_json, weights = message
                # The agent built here is only a policy to act with; its weights come from
                # the learner before every rollout or evaluation.
                worker, local, evaluator = build(TrainConfig.model_validate_json(config_json))
                policy = local.policy
                outbox.put(("built",))
            elif kind == "collect":
                policy.load_state_dict(weights)
                keep = worker.collect().share_memory_()
                if keep.rewards.is_cuda:  # finished before the learner's stream reads it
                    torch.cuda.synchronize()
                outbox.put(("rollout", keep))
            elif kind == "evaluate":
                policy.load_state_dict(weights)
                outbox.put(("result", evaluator.evaluate(policy)))
        except Exception as exc:  # reported to the main process, which fails the pod with it
            outbox.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            return


class _Role:
    def __init__(self, ctx: Any, name: str, threads: int) -> None:
        self.name = name
        self.inbox = ctx.Queue()
        self.outbox = ctx.Queue()
        self.process = ctx.Process(
            target=_role_main,
            args=(name, self.inbox, self.outbox, threads, os.getpid()),
            name=f"podium-{name}",
            daemon=True,
        )
        self.weights: dict[str, torch.Tensor] = {}

    def receive(self, expected: str) -> Any:
        while True:
            try:
                message = self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RoleError(
                        f"{self.name} process exited (code {self.process.exitcode})"
                    ) from None
                continue
            if message[0] == "error":
                raise RoleError(f"{self.name} process failed: {message[1]}\n{message[2]}")
            if message[0] != expected:
                raise RoleError(f"{self.name} process answered {message[0]!r}, not {expected!r}")
            return message[1] if len(message) > 1 else None


class ProcessRoles:
    """Worker and evaluator processes, learner here. Start-up costs a torch import per process
    (measured in bench/pod_modes.py), paid once per pod: a restart from a parent rebuilds the
    roles inside the same processes."""

    def __init__(self, threads: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.roles = {name: _Role(ctx, name, threads) for name in ("worker", "evaluator")}
        # Children ignore SIGTERM from their first instruction (the disposition is inherited
        # through exec): the orchestrator signals the whole process group, and only the main
        # process may decide to stop, after its final report.
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            for role in self.roles.values():
                role.process.start()
        finally:
            signal.signal(signal.SIGTERM, previous)
        self.learner: Learner | None = None

    def build(self, config: TrainConfig) -> Learner:
        # Built the same way as in the roles' processes, so every process starts from the
        # same initial weights; this process keeps only the learner.
        worker, self.learner, evaluator = build(config)
        for env in (worker.env, evaluator.env):
            if hasattr(env, "close"):
                env.close()
        state = self.learner.policy_state()
        for role in self.roles.values():
            # One shared copy per role: the evaluator may read while the worker's is rewritten.
            role.weights = {k: v.clone().share_memory_() for k, v in state.items()}
            role.inbox.put(("build", config.model_dump_json(), role.weights))
        for role in self.roles.values():
            role.receive("built")
        return self.learner

    def publish(self, role: str = "worker") -> None:
        """Copy the learner's current policy into ``role``'s shared weights."""
        assert self.learner is not None
        with torch.no_grad():
            for name, value in self.learner.agent.policy.state_dict().items():
                self.roles[role].weights[name].copy_(value)
        if self.learner.agent.return_rms.mean.is_cuda:  # written before another process reads
            torch.cuda.synchronize()

    def step(self) -> tuple[dict[str, float], torch.Tensor]:
        """One rollout (collected with the newest weights) and one update."""
        assert self.learner is not None
        worker = self.roles["worker"]
        self.publish("worker")
        worker.inbox.put(("collect",))
        rollout = worker.receive("rollout")
        stats = self.learner.update(rollout)
        return stats, rollout.episode_returns.clone()

    def evaluate(self) -> EvalResult:
        self.publish("evaluator")
        evaluator = self.roles["evaluator"]
        evaluator.inbox.put(("evaluate",))
        return evaluator.receive("result")

    def close(self) -> None:
        for role in self.roles.values():
            if role.process.is_alive():
                role.inbox.put(("stop",))
        for role in self.roles.values():
            role.process.join(timeout=5)
            if role.process.is_alive():
                role.process.kill()
                role.process.join(timeout=5)
