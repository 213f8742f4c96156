"""The training pod's round loop.

A pod asks the generator where to start (algorithm, hyperparameters, maybe a parent's training
files), builds its agent, then trains round after round: a round is ``spec.round`` env steps
(or seconds) of worker → learner; every ``evaluation.every_rounds`` rounds the evaluator scores
the agent and the result goes to the updater with the training files. After each report the pod
asks the generator again; when it proposes a parent (of the same algorithm) that scored better
than this pod's agent (PBT's exploit), the pod restarts from that parent with the proposed
hyperparameters (explore), otherwise it keeps training its own agent. On SIGTERM it finishes
the update in flight, evaluates, makes a final report and returns.

The loop is the same for every algorithm; what differs sits behind ``Family``: PPO (on-policy,
services/pod/train.py, fused or as processes) and SAC, TD3, DDPG and the DQN family (off-policy,
services/pod/offpolicy.py, fused, the replay buffer in the training files). Hyperparameters are
the algorithm's own names (services/pod/algorithms/hyperparameters.py); every pod starts from
the preset for its algorithm and env with the generator's hyperparameters on top. In an
algorithm mix, a search-space name only some of the algorithms take is applied by those
algorithms' pods and ignored by the others (it still travels with the candidate, so the
generator's strategies see every name of the search space).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypedDict

import torch
from pydantic import ValidationError
from typing_extensions import Unpack  # typing.Unpack from Python 3.12

from services.api_client import LeaderboardClient
from services.contracts.leaderboard import Manifest, ManifestCheckpoint, SubmissionResponse
from services.contracts.spec import ExperimentSpec, describe_errors
from services.contracts.strategies import is_ready, parent_is_better, ready_rule
from services.logs import get_logger
from services.pod import offpolicy
from services.pod.algorithms.hyperparameters import (  # torch-free, shared with the spec
    HyperparameterError,
    check_hyperparameter_names,
    hyperparameter_names,
)
from services.pod.algorithms.offpolicy_config import AGENT_CONFIGS, OFF_POLICY_ALGORITHMS
from services.pod.checkpoint import (
    MANIFEST,
    CheckpointError,
    load_training_files,
    save_training_files,
    write_files,
)
from services.pod.evaluator import EvalResult, Evaluator
from services.pod.learner import Learner
from services.pod.metrics import PodMetrics
from services.pod.offpolicy import OffPolicyConfig, OffPolicyRoles
from services.pod.train import RunConfig, TrainConfig, build, preset
from services.pod.worker import Worker

log = get_logger(__name__)

# Pods train open-ended rounds and the generator tunes the learning rate (PBT), so PPO's LR is
# not annealed toward a budget unless the hyperparameters ask for it.
POD_DEFAULTS: dict[str, Any] = {"anneal_lr": False}


class Trainee(Protocol):
    """What the round loop reads of a built agent (PPO's Learner, an OffPolicyRoles)."""

    env_steps: int
    updates: int


class Roles(Protocol):
    """Worker, learner and evaluator, fused or as processes (services/pod/multiprocess.py)."""

    learner: Any  # a Trainee once built

    def build(self, config: Any) -> Any: ...
    def publish(self, role: str = "worker") -> None: ...
    def step(self) -> object: ...
    def evaluate(self) -> EvalResult: ...
    def close(self) -> None: ...


class FusedRoles:
    """PPO's three roles in this process, sharing one policy object (Anakin-style)."""

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


class FusedOffPolicyRoles:
    """An off-policy agent's roles in this process. One OffPolicyRoles holds the worker's env,
    the learner's state, the replay buffer and the evaluator; a step is one vector step."""

    def __init__(self) -> None:
        self.learner: OffPolicyRoles | None = None

    def build(self, config: OffPolicyConfig) -> OffPolicyRoles:
        self.close()
        self.learner = offpolicy.build(config)
        return self.learner

    def publish(self, role: str = "worker") -> None:
        """Nothing to copy: one agent acts, learns and is evaluated."""

    def step(self) -> dict[str, torch.Tensor]:
        assert self.learner is not None
        return self.learner.step()

    def evaluate(self) -> EvalResult:
        assert self.learner is not None
        return self.learner.evaluate()

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()


def set_learning_rate(optimizers: Iterable[torch.optim.Optimizer], lr: float) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


class Family(Protocol):
    """What differs between the algorithms a pod trains: their config, their roles, their
    training files. The round loop sees nothing else of an algorithm."""

    config_class: ClassVar[type[RunConfig]]

    def preset(self, algorithm: str, env: str, hyperparameters: dict[str, Any]) -> dict: ...
    def roles(self, given: Roles, algorithm: str) -> Roles: ...
    def save(self, directory: Path, learner: Any, config: Any) -> None: ...
    def load(self, directory: Path, learner: Any, config: Any) -> None: ...


class OnPolicy:
    """PPO (services/pod/train.py): the roles the pod was given, fused or as processes."""

    config_class = TrainConfig

    def preset(self, algorithm: str, env: str, hyperparameters: dict[str, Any]) -> dict:
        base = preset(env)
        base["ppo"] = {**POD_DEFAULTS, **base["ppo"], **hyperparameters}
        return base

    def roles(self, given: Roles, algorithm: str) -> Roles:
        return given

    def save(self, directory: Path, learner: Learner, config: TrainConfig) -> None:
        save_training_files(directory, learner, config)

    def load(self, directory: Path, learner: Learner, config: TrainConfig) -> None:
        load_training_files(directory, learner)
        # The optimiser state came with the parent's learning rate; use the proposed one.
        set_learning_rate([learner.agent.optimizer], config.ppo.learning_rate)


class OffPolicy:
    """SAC, TD3, DDPG and the DQN family (services/pod/offpolicy.py), always fused: their
    worker steps one vector step at a time into a replay buffer the learner samples, which
    the process split (services/pod/multiprocess.py, built around PPO's rollouts) lacks."""

    config_class = OffPolicyConfig

    def preset(self, algorithm: str, env: str, hyperparameters: dict[str, Any]) -> dict:
        base = offpolicy.preset(algorithm, env)
        # The agent's own names go under its config; the rest are the loop's (batch, replay).
        own = AGENT_CONFIGS[algorithm].model_fields
        base[algorithm] = {
            **base.get(algorithm, {}),
            **{k: v for k, v in hyperparameters.items() if k in own},
        }
        base.update({k: v for k, v in hyperparameters.items() if k not in own})
        return base

    def roles(self, given: Roles, algorithm: str) -> Roles:
        if isinstance(given, FusedOffPolicyRoles):
            return given
        if not isinstance(given, FusedRoles):
            log.warning(
                "off-policy agents train fused: worker, learner and evaluator in this process",
                algorithm=algorithm,
                asked=type(given).__name__,
            )
        given.close()
        return FusedOffPolicyRoles()

    def save(self, directory: Path, learner: OffPolicyRoles, config: OffPolicyConfig) -> None:
        offpolicy.save_offpolicy_files(directory, learner, config)

    def load(self, directory: Path, learner: OffPolicyRoles, config: OffPolicyConfig) -> None:
        offpolicy.load_offpolicy_files(directory, learner)  # weights, optimiser, replay buffer
        # A child explores with its own random stream, not its parent's next draws.
        learner.generator.manual_seed(config.seed)
        set_learning_rate(learner.agent.optimizers().values(), config.agent_config.learning_rate)


def family_of(algorithm: str) -> Family:
    """The family that trains ``algorithm``; the class itself is looked up by registered name
    when the roles are built (services/registry.py)."""
    if algorithm == "ppo":
        return OnPolicy()
    if algorithm in OFF_POLICY_ALGORITHMS:
        return OffPolicy()
    raise HyperparameterError(
        f"algorithm {algorithm!r} is not trainable by a pod; pods train: "
        f"{', '.join(('ppo', *OFF_POLICY_ALGORITHMS))}"
    )


def pod_config(
    spec: ExperimentSpec,
    hyperparameters: dict[str, Any],
    seed: int,
    device: str = "cpu",
    threads: int = 1,
    algorithm: str | None = None,
) -> RunConfig:
    """The preset for the algorithm and env, the pod's run fields, then the generator's
    hyperparameters on top: those the algorithm has (a name only another algorithm of the
    spec has is ignored; a name none has is an error). ``algorithm`` defaults to the spec's
    one algorithm."""
    if algorithm is None:
        if len(spec.algorithms) != 1:
            raise HyperparameterError(
                f"the spec lists several algorithms ({', '.join(spec.algorithms)}): name one"
            )
        [algorithm] = spec.algorithms
    family = family_of(algorithm)
    check_hyperparameter_names(hyperparameters, {*spec.algorithms, algorithm})
    names = hyperparameter_names(algorithm) or frozenset()
    own = {k: v for k, v in hyperparameters.items() if k in names}
    base = family.preset(algorithm, spec.env.name, own)
    base.pop("target_return", None)  # the orchestrator ends the experiment, not the pod
    if spec.budget.total_env_steps:
        base["total_env_steps"] = spec.budget.total_env_steps
    try:
        return family.config_class.model_validate(
            {
                **base,
                "env_kwargs": {**base.get("env_kwargs", {}), **spec.env.kwargs},
                "eval_episodes": spec.evaluation.episodes,
                "device": device,
                "seed": seed,
                "eval_seed": eval_seed(spec),
                "torch_threads": threads,
            }
        )
    except ValidationError as exc:
        fields = "; ".join(line.strip() for line in describe_errors(exc))
        raise HyperparameterError(f"invalid hyperparameters: {fields}") from exc


def eval_seed(spec: ExperimentSpec) -> int:
    """Every pod of an experiment evaluates on the same start states, so that scores compare
    agents rather than luck of the draw (Pendulum's start angle alone moves a return by ~100)."""
    if spec.evaluation.seed is not None:
        return spec.evaluation.seed
    return zlib.crc32(f"eval:{spec.name}".encode()) % (2**31)


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

    def submission(self, pod_id: str, env_steps: int, evaluation: EvalResult) -> dict[str, Any]:
        """The updater's submission for this agent's latest evaluation (without files)."""
        return {
            "submission_id": uuid.uuid4().hex,  # the same for every retry of this report
            "pod_id": pod_id,
            "algorithm": self.algorithm,
            "hyperparameters": self.hyperparameters,
            "parent_id": self.parent_id,
            "generation": self.generation,
            "env_steps": env_steps,
            "score": evaluation.mean,
            "eval": {
                "mean": evaluation.mean,
                "std": evaluation.std,
                "episodes": len(evaluation.episodes),
            },
        }

    def record(self, answer: SubmissionResponse, score: float) -> None:
        """Take in the updater's answer to a submission scored ``score``."""
        self.score, self.rank = score, answer.rank
        self.reports += 1
        if answer.accepted:
            # The next report of this agent descends from the one just kept.
            self.candidate_id = answer.candidate_id
            self.parent_id, self.generation = self.candidate_id, self.generation + 1


def fetch_parent(
    client: LeaderboardClient, directory: Path, checkpoint: ManifestCheckpoint
) -> Path:
    """Download a parent's training files into ``directory``, verified against its manifest."""
    files = client.download(checkpoint)
    if MANIFEST not in files:
        raise CheckpointError(f"candidate {checkpoint.candidate_id} has no {MANIFEST}")
    try:
        original = json.loads(files.pop(MANIFEST))
    except ValueError as exc:
        raise CheckpointError(f"the parent's {MANIFEST} is not JSON: {exc}") from exc
    meta = {k: v for k, v in original.items() if k not in ("files", "format")}
    # The bytes are in memory and ``download`` checked them: compare the manifest with what
    # was written (its own manifest's entries) rather than read and hash them all again.
    digests = write_files(directory, files, meta)
    written = {name: {"sha256": digests[name], "bytes": len(data)} for name, data in files.items()}
    if written != original.get("files"):
        raise CheckpointError("the parent's files do not match its manifest")
    return directory


class LoopSettings(TypedDict, total=False):
    """``PodLoop``'s optional settings, which every runtime passes through unchanged."""

    work_dir: Path | None
    metrics: PodMetrics | None
    device: str
    threads: int
    grace_s: float


class PodLoop:
    """What a single-agent pod (``PodRuntime``) and a population pod
    (services/pod/population_runtime.py) share: their settings, the round loop's outline,
    stopping, a round of training and sending one agent's report."""

    def __init__(
        self,
        experiment_id: str,
        pod_id: str,
        spec: ExperimentSpec,
        client: LeaderboardClient,
        work_dir: Path | None = None,
        metrics: PodMetrics | None = None,
        device: str = "cpu",
        threads: int = 1,
        grace_s: float = 30.0,
    ) -> None:
        self.experiment_id, self.pod_id, self.spec = experiment_id, pod_id, spec
        self.client = client
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix=f"podium-{pod_id}-"))
        self.metrics = metrics or PodMetrics(
            experiment_id, pod_id, spec.evaluation.higher_is_better
        )
        self.device, self.threads, self.grace_s = device, threads, grace_s
        self.ready_after_reports, self.ready_after_env_steps = ready_rule(spec)
        self.seed = zlib.crc32(pod_id.encode()) % (2**31)
        self.stopping = False
        self.rounds = 0
        self.submissions: list[dict[str, Any]] = []  # answers of this pod's reports

    # -- signals ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler): report, then return."""
        self.stopping = True
        # Leave time for the final evaluation inside the orchestrator's grace period.
        self.client.deadline = time.monotonic() + 0.7 * self.grace_s

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        self.begin()
        while not self.stopping:
            self.train_round()
            if self.rounds % self.spec.evaluation.every_rounds == 0:
                self.report()
                if not self.stopping:
                    self.maybe_exploit()
        self.finish()

    def begin(self) -> None:
        raise NotImplementedError

    def train_round(self) -> None:
        raise NotImplementedError

    def report(self) -> None:
        raise NotImplementedError

    def maybe_exploit(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """The final report, once stopped."""
        raise NotImplementedError

    def release(self, manifest: Manifest) -> None:
        """Let go of the parent's files the manifest leased, if it leased any."""
        if manifest.lease_id:
            self.client.release(manifest.lease_id)

    def better_parent(self, agent: Agent, pod_id: str, env_steps: int) -> Manifest | None:
        """PBT's exploit for ``agent`` (``env_steps``: its learner's count): once it is ready,
        ask the generator; its manifest when it proposes a parent that scored better (whose
        lease the caller releases once it is loaded), else None (the lease released)."""
        if not is_ready(agent, env_steps, self.ready_after_reports, self.ready_after_env_steps):
            return None  # the best there is, or not trained long enough to be judged
        manifest = self.client.generate(pod_id, algorithm=agent.algorithm, score=agent.score)
        if parent_is_better(manifest, agent, self.spec.evaluation.higher_is_better):
            return manifest
        self.release(manifest)
        return None

    def train_for_round(self, trainee: Trainee, step: Any) -> tuple[int, int, float]:
        """Call ``step`` until ``trainee`` has trained a round (``spec.round``) or the pod
        stops; the env steps, updates and seconds it took."""
        start_steps, start_updates = trainee.env_steps, trainee.updates
        start = time.monotonic()
        round_steps, round_seconds = self.spec.round.env_steps, self.spec.round.seconds
        while not self.stopping:
            step()
            steps = trainee.env_steps - start_steps
            if round_steps is not None and steps >= round_steps:
                break
            if round_seconds is not None and time.monotonic() - start >= round_seconds:
                break
        self.rounds += 1
        return (
            trainee.env_steps - start_steps,
            trainee.updates - start_updates,
            time.monotonic() - start,
        )

    def send(
        self,
        agent: Agent,
        pod_id: str,
        env_steps: int,
        evaluation: EvalResult,
        directory: Path,
        final: bool,
        entry: dict[str, Any] | None = None,
        **context: Any,
    ) -> None:
        """Submit ``agent``'s evaluation and the training files in ``directory``; record the
        answer (in ``submissions``, with ``entry`` on top, and in the agent) and log it."""
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir())}
        result = agent.submission(pod_id, env_steps, evaluation)
        answer = self.client.submit(result, files)
        self.metrics.submissions.inc()
        self.submissions.append(
            {
                **answer.model_dump(),
                "submission_id": result["submission_id"],
                "env_steps": env_steps,
                **(entry or {}),
            }
        )
        agent.record(answer, evaluation.mean)
        log.info(
            "reported",
            final=final,
            **context,
            submission=result["submission_id"],
            score=evaluation.mean,
            env_steps=env_steps,
            accepted=answer.accepted,
            candidate=answer.candidate_id,
            rank=answer.rank,
            duplicate=answer.duplicate,
        )


class PodRuntime(PodLoop):
    """A pod training one agent at a time (see the module's docstring)."""

    def __init__(
        self,
        experiment_id: str,
        pod_id: str,
        spec: ExperimentSpec,
        client: LeaderboardClient,
        roles: Roles,
        **settings: Unpack[LoopSettings],
    ) -> None:
        super().__init__(experiment_id, pod_id, spec, client, **settings)
        self.roles = roles
        self.agent = Agent()
        self.family: Family = OnPolicy()
        self.config: RunConfig | None = None
        self.unreported_steps = 0

    def begin(self) -> None:
        self.start(self.client.generate(self.pod_id))

    def finish(self) -> None:
        if self.unreported_steps or not self.submissions:
            self.report(final=True)
        else:  # the last report already holds this agent: a copy would only crowd the board
            log.info("nothing trained since the last report; no final report needed")

    def start(self, manifest: Manifest) -> None:
        """Build the agent the manifest describes: fresh, or the parent's files + new
        hyperparameters. The parent's lease is released once its files are loaded."""
        hyperparameters = dict(manifest.hyperparameters)
        algorithm = manifest.algorithm
        self.seed += 1  # a restart explores with its own random stream
        family = family_of(algorithm)
        config = pod_config(
            self.spec, hyperparameters, self.seed, self.device, self.threads, algorithm
        )
        if config.torch_threads:  # as train() does: small nets on many threads crawl
            torch.set_num_threads(config.torch_threads)
        self.roles = family.roles(self.roles, algorithm)
        learner = self.build_agent(config)
        parent_id, generation = None, 0
        checkpoint = manifest.checkpoint
        try:
            if isinstance(checkpoint, ManifestCheckpoint):
                try:
                    self.load_parent(family, learner, config, checkpoint)
                    parent_id, generation = manifest.parent_id, manifest.generation
                except CheckpointError as exc:
                    # Hyperparameters that change the network's shape (or a smaller replay
                    # buffer) cannot take the parent's files: train them from scratch.
                    log.warning("parent does not fit; starting fresh", error=str(exc))
                    learner = self.build_agent(config)
        finally:
            self.release(manifest)
        self.roles.publish("worker")
        self.family, self.config = family, config
        self.agent = Agent(
            algorithm=algorithm,
            hyperparameters=hyperparameters,
            parent_id=parent_id,
            generation=generation,
            env_steps_at_start=learner.env_steps,
        )
        log.info(
            "agent built",
            algorithm=algorithm,
            decision=manifest.decision,
            parent=parent_id,
            generation=generation,
            hyperparameters=hyperparameters,
            # Search-space names of another algorithm of the mix: carried, not applied.
            ignored=sorted(set(hyperparameters) - (hyperparameter_names(algorithm) or set())),
        )

    def build_agent(self, config: RunConfig) -> Trainee:
        try:
            return self.roles.build(config)
        except ValueError as exc:  # e.g. DQN on a continuous env, SAC on a discrete one
            raise HyperparameterError(
                f"cannot train {config.algorithm} on {config.env}: {exc}"
            ) from exc

    def load_parent(
        self, family: Family, learner: Trainee, config: RunConfig, checkpoint: ManifestCheckpoint
    ) -> None:
        directory = fetch_parent(self.client, self.work_dir / "parent", checkpoint)
        family.load(directory, learner, config)

    def train_round(self) -> None:
        assert self.config is not None
        learner = self.roles.learner
        assert learner is not None
        steps, updates, seconds = self.train_for_round(learner, self.roles.step)
        self.unreported_steps += steps
        self.metrics.round_done(steps, updates, seconds)

    def report(self, final: bool = False) -> None:
        """Evaluate and send the score and training files to the updater."""
        assert self.config is not None and self.roles.learner is not None
        evaluation = self.roles.evaluate()
        if not math.isfinite(evaluation.mean):
            raise RuntimeError(f"the evaluation returned a non-finite mean ({evaluation.mean})")
        self.metrics.evaluated(evaluation.mean)
        directory = self.work_dir / "latest"
        self.family.save(directory, self.roles.learner, self.config)
        self.send(self.agent, self.pod_id, self.unreported_steps, evaluation, directory, final)
        self.unreported_steps = 0

    def maybe_exploit(self) -> None:
        """Restart from the generator's parent when that one scored better."""
        learner = self.roles.learner
        assert learner is not None
        manifest = self.better_parent(self.agent, self.pod_id, learner.env_steps)
        if manifest is None:
            return
        log.info(
            "restarting from a better parent",
            parent=manifest.parent_id,
            own_score=self.agent.score,
        )
        self.start(manifest)

    def close(self) -> None:
        self.roles.close()
        self.client.close()
        self.metrics.close()
