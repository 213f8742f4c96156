"""The training pod's round loop.

A pod asks the generator where to start (hyperparameters, maybe a parent's training files),
builds its agent, then trains round after round: a round is ``spec.round`` env steps (or
seconds) of worker → learner; every ``evaluation.every_rounds`` rounds the evaluator scores the
agent and the result goes to the updater with the training files. After each report the pod
asks the generator again; when it proposes a parent that scored better than this pod's agent
(PBT's exploit), the pod restarts from that parent with the proposed hyperparameters (explore),
otherwise it keeps training its own agent. On SIGTERM it finishes the update in flight,
evaluates, makes a final report and returns.

Hyperparameters are PPOConfig field names; every pod starts from the env's preset
(services/pod/train.py) with the generator's hyperparameters on top.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import ValidationError

from services.logs import get_logger
from services.pod.algorithms.ppo import PPOConfig
from services.pod.checkpoint import (
    MANIFEST,
    CheckpointError,
    load_training_files,
    read_files,
    save_training_files,
    write_files,
)
from services.pod.evaluator import EvalResult, Evaluator
from services.pod.leaderboard_client import LeaderboardClient
from services.pod.learner import Learner
from services.pod.metrics import PodMetrics
from services.pod.train import TrainConfig, build, preset
from services.pod.worker import Worker
from services.spec import ExperimentSpec

log = get_logger(__name__)

# Pods train open-ended rounds and the generator tunes the learning rate (PBT), so the LR is
# not annealed toward a budget unless the hyperparameters ask for it.
POD_DEFAULTS: dict[str, Any] = {"anneal_lr": False}


class HyperparameterError(ValueError):
    """Hyperparameters that are not PPOConfig fields or not valid values for them."""


def check_hyperparameter_names(names: list[str] | set[str]) -> None:
    unknown = sorted(set(names) - set(PPOConfig.model_fields))
    if unknown:
        raise HyperparameterError(
            f"unknown hyperparameter(s) {', '.join(map(repr, unknown))}; hyperparameters are "
            f"PPOConfig fields: {', '.join(sorted(PPOConfig.model_fields))}"
        )


def pod_config(
    spec: ExperimentSpec,
    hyperparameters: dict[str, Any],
    seed: int,
    device: str = "cpu",
    threads: int = 1,
) -> TrainConfig:
    """The env's preset, the pod defaults, then the generator's hyperparameters on top."""
    check_hyperparameter_names(list(hyperparameters))
    base = preset(spec.env.name)
    ppo = {**POD_DEFAULTS, **base.pop("ppo"), **hyperparameters}
    base.pop("target_return", None)  # the orchestrator ends the experiment, not the pod
    if spec.budget.total_env_steps:
        base["total_env_steps"] = spec.budget.total_env_steps
    try:
        return TrainConfig.model_validate(
            {
                **base,
                "env_kwargs": {**base.get("env_kwargs", {}), **spec.env.kwargs},
                "ppo": ppo,
                "eval_episodes": spec.evaluation.episodes,
                "device": device,
                "seed": seed,
                "eval_seed": eval_seed(spec),
                "torch_threads": threads,
            }
        )
    except ValidationError as exc:
        fields = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise HyperparameterError(f"invalid hyperparameters: {fields}") from exc


def eval_seed(spec: ExperimentSpec) -> int:
    """Every pod of an experiment evaluates on the same start states, so that scores compare
    agents rather than luck of the draw (Pendulum's start angle alone moves a return by ~100)."""
    if spec.evaluation.seed is not None:
        return spec.evaluation.seed
    return zlib.crc32(f"eval:{spec.name}".encode()) % (2**31)


class Roles(Protocol):
    """Worker, learner and evaluator, fused or as processes (services/pod/multiprocess.py)."""

    learner: Learner | None

    def build(self, config: TrainConfig) -> Learner: ...
    def publish(self, role: str = "worker") -> None: ...
    def step(self) -> tuple[dict[str, float], torch.Tensor]: ...
    def evaluate(self) -> EvalResult: ...
    def close(self) -> None: ...


class FusedRoles:
    """All three roles in this process, sharing one policy object (Anakin-style)."""

    def __init__(self) -> None:
        self.learner: Learner | None = None
        self.worker: Worker | None = None
        self.evaluator: Evaluator | None = None

    def build(self, config: TrainConfig) -> Learner:
        self.close()  # a restart from a parent replaces the envs too
        self.worker, self.learner, self.evaluator = build(config)
        return self.learner

    def publish(self, role: str = "worker") -> None:
        """Nothing to copy: the worker and the evaluator hold the learner's own policy."""

    def step(self) -> tuple[dict[str, float], torch.Tensor]:
        assert self.worker is not None and self.learner is not None
        rollout = self.worker.collect()
        return self.learner.update(rollout), rollout.episode_returns

    def evaluate(self) -> EvalResult:
        assert self.evaluator is not None and self.learner is not None
        return self.evaluator.evaluate(self.learner.policy)

    def close(self) -> None:
        for env in (getattr(self.worker, "env", None), getattr(self.evaluator, "env", None)):
            if env is not None and hasattr(env, "close"):
                env.close()


@dataclass
class Agent:
    """Who the pod's agent is on the leaderboard: lineage and last result."""

    algorithm: str = "ppo"
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    parent_id: str | None = None
    generation: int = 0
    candidate_id: str | None = None  # its last accepted submission
    score: float | None = None  # its last evaluation
    rank: int | None = None
    reports: int = 0  # since it was built
    env_steps_at_start: int = 0  # the learner's env steps when it was built


class PodRuntime:
    #: PBT's "ready" (the generator's ``ready_reports`` / ``ready_env_steps`` options): an
    #: agent is judged, and may be replaced by a better parent, only after this many reports
    #: and env steps since it was built. Judged earlier, scores are evaluation noise: with
    #: 2,048-step rounds (one Pendulum update) and no such rule, bench/tournament_quality.py
    #: saw whole populations copy each other in circles around -1,000 while independent pods
    #: solved the task.
    ready_after_reports = 2
    ready_after_env_steps = 32_768

    def __init__(
        self,
        experiment_id: str,
        pod_id: str,
        spec: ExperimentSpec,
        client: LeaderboardClient,
        roles: Roles,
        work_dir: Path | None = None,
        metrics: PodMetrics | None = None,
        device: str = "cpu",
        threads: int = 1,
        grace_s: float = 30.0,
    ) -> None:
        self.experiment_id, self.pod_id, self.spec = experiment_id, pod_id, spec
        self.client, self.roles = client, roles
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix=f"podium-{pod_id}-"))
        self.metrics = metrics or PodMetrics(experiment_id, pod_id)
        self.device, self.threads, self.grace_s = device, threads, grace_s
        self.seed = zlib.crc32(pod_id.encode()) % (2**31)
        options = spec.generator.options
        self.ready_after_reports = int(options.get("ready_reports", self.ready_after_reports))
        self.ready_after_env_steps = int(options.get("ready_env_steps", self.ready_after_env_steps))
        self.agent = Agent()
        self.config: TrainConfig | None = None
        self.stopping = False
        self.rounds = 0
        self.unreported_steps = 0
        self.submissions: list[dict[str, Any]] = []  # answers of this pod's reports

    # -- signals ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler): report, then return."""
        self.stopping = True
        # Leave time for the final evaluation inside the orchestrator's grace period.
        self.client.deadline = time.monotonic() + 0.7 * self.grace_s

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        self.start(self.client.generate(self.pod_id))
        while not self.stopping:
            self.train_round()
            if self.rounds % self.spec.evaluation.every_rounds == 0:
                self.report()
                if not self.stopping:
                    self.maybe_exploit()
        if self.unreported_steps or not self.submissions:
            self.report(final=True)
        else:  # the last report already holds this agent: a copy would only crowd the board
            log.info("nothing trained since the last report; no final report needed")

    def start(self, manifest: dict[str, Any]) -> None:
        """Build the agent the manifest describes: fresh, or the parent's files + new
        hyperparameters. The parent's lease is released once its files are loaded."""
        hyperparameters = dict(manifest["hyperparameters"])
        self.seed += 1  # a restart explores with its own random stream
        config = pod_config(self.spec, hyperparameters, self.seed, self.device, self.threads)
        if manifest["algorithm"] != config.algorithm:
            raise HyperparameterError(f"algorithm {manifest['algorithm']!r} is not trainable")
        learner = self.roles.build(config)
        parent_id, generation = None, 0
        checkpoint = manifest["checkpoint"]
        try:
            if checkpoint != "fresh":
                try:
                    self.load_parent(learner, config, checkpoint)
                    parent_id, generation = manifest["parent_id"], manifest["generation"]
                except CheckpointError as exc:
                    # Hyperparameters that change the network's shape cannot take the
                    # parent's weights: train the proposed hyperparameters from scratch.
                    log.warning("parent does not fit; starting fresh", error=str(exc))
                    learner = self.roles.build(config)
        finally:
            if manifest.get("lease_id"):
                self.client.release(manifest["lease_id"])
        self.roles.publish("worker")
        self.config = config
        self.agent = Agent(
            algorithm=manifest["algorithm"],
            hyperparameters=hyperparameters,
            parent_id=parent_id,
            generation=generation,
            env_steps_at_start=learner.env_steps,
        )
        log.info(
            "agent built",
            decision=manifest["decision"],
            parent=parent_id,
            generation=generation,
            hyperparameters=hyperparameters,
        )

    def load_parent(self, learner: Learner, config: TrainConfig, checkpoint: dict) -> None:
        files = self.client.download(checkpoint)
        if MANIFEST not in files:
            raise CheckpointError(f"candidate {checkpoint['candidate_id']} has no {MANIFEST}")
        try:
            original = json.loads(files.pop(MANIFEST))
        except ValueError as exc:
            raise CheckpointError(f"the parent's {MANIFEST} is not JSON: {exc}") from exc
        meta = {k: v for k, v in original.items() if k not in ("files", "format")}
        directory = self.work_dir / "parent"
        write_files(directory, files, meta)
        if read_files(directory).manifest["files"] != original.get("files"):
            raise CheckpointError("the parent's files do not match its manifest")
        load_training_files(directory, learner)
        # The optimiser state came with the parent's learning rate; use the proposed one.
        for group in learner.agent.optimizer.param_groups:
            group["lr"] = config.ppo.learning_rate

    def train_round(self) -> None:
        assert self.config is not None
        learner = self.roles.learner
        assert learner is not None
        start_steps, start_updates = learner.env_steps, learner.updates
        start = time.monotonic()
        round_steps, round_seconds = self.spec.round.env_steps, self.spec.round.seconds
        while not self.stopping:
            self.roles.step()
            steps = learner.env_steps - start_steps
            if round_steps is not None and steps >= round_steps:
                break
            if round_seconds is not None and time.monotonic() - start >= round_seconds:
                break
        steps = learner.env_steps - start_steps
        self.rounds += 1
        self.unreported_steps += steps
        self.metrics.round_done(steps, learner.updates - start_updates, time.monotonic() - start)

    def report(self, final: bool = False) -> None:
        """Evaluate and send the score and training files to the updater."""
        assert self.config is not None and self.roles.learner is not None
        evaluation = self.roles.evaluate()
        if not math.isfinite(evaluation.mean):
            raise RuntimeError(f"the evaluation returned a non-finite mean ({evaluation.mean})")
        self.metrics.evaluated(evaluation.mean)
        directory = self.work_dir / "latest"
        save_training_files(directory, self.roles.learner, self.config)
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir())}
        agent = self.agent
        result = {
            "submission_id": uuid.uuid4().hex,  # the same for every retry of this report
            "pod_id": self.pod_id,
            "algorithm": agent.algorithm,
            "hyperparameters": agent.hyperparameters,
            "parent_id": agent.parent_id,
            "generation": agent.generation,
            "env_steps": self.unreported_steps,
            "score": evaluation.mean,
            "eval": {
                "mean": evaluation.mean,
                "std": evaluation.std,
                "episodes": len(evaluation.episodes),
            },
        }
        answer = self.client.submit(result, files)
        self.unreported_steps = 0
        self.metrics.submissions.inc()
        self.submissions.append(
            {**answer, "submission_id": result["submission_id"], "env_steps": result["env_steps"]}
        )
        agent.score, agent.rank = evaluation.mean, answer.get("rank")
        agent.reports += 1
        if answer.get("accepted"):
            # The next report of this agent descends from the one just kept.
            agent.candidate_id = answer["candidate_id"]
            agent.parent_id, agent.generation = agent.candidate_id, agent.generation + 1
        log.info(
            "reported",
            final=final,
            submission=result["submission_id"],
            score=evaluation.mean,
            env_steps=result["env_steps"],
            accepted=answer.get("accepted"),
            candidate=answer.get("candidate_id"),
            rank=answer.get("rank"),
            duplicate=answer.get("duplicate", False),
        )

    def maybe_exploit(self) -> None:
        """Ask the generator; restart from its parent when that one scored better."""
        learner = self.roles.learner
        assert learner is not None
        trained = learner.env_steps - self.agent.env_steps_at_start
        if (
            self.agent.rank == 1
            or self.agent.reports < self.ready_after_reports
            or trained < self.ready_after_env_steps
        ):
            return  # the best there is, or not trained long enough to be judged
        manifest = self.client.generate(self.pod_id, algorithm=self.agent.algorithm)
        parent_id = manifest.get("parent_id")
        better = False
        if parent_id is not None and parent_id != self.agent.candidate_id:
            parent_score = float(self.client.candidate(parent_id)["score"])
            higher = self.spec.evaluation.higher_is_better
            own = self.agent.score
            if own is None:
                own = -math.inf if higher else math.inf
            better = parent_score > own if higher else parent_score < own
        if not better:
            if manifest.get("lease_id"):
                self.client.release(manifest["lease_id"])
            return
        log.info("restarting from a better parent", parent=parent_id, own_score=self.agent.score)
        self.start(manifest)

    def close(self) -> None:
        self.roles.close()
        self.client.close()
        self.metrics.close()
