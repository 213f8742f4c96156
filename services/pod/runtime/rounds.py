"""The training pod's round loop over its ``spec.population.agents_per_pod`` agents ("slots"),
trained by one trainer (services/pod/training/trainer.py). To the leaderboard each slot is a pod
of its own: the pod's id for a single agent, ``<pod id>.m<i>`` in a population.

* Start: each slot asks the generator where to start (algorithm, hyperparameters, maybe a
  parent's training files); the trainer is built from the slots' configs (the preset with the
  generator's hyperparameters on top, services/pod/training/presets.py), and each parent's
  files go into its slot.
* Round: ``spec.round`` env steps (or seconds) per slot, all slots at once.
* Report (every ``evaluation.every_rounds`` rounds): one evaluation of every slot on the
  experiment's shared evaluation start states, then each slot is submitted with its training
  files as its own candidate, with its own lineage (services/pod/runtime/lineage.py).
* PBT across pods: after each report, each ready slot asks the generator again; a proposed
  parent (of the same algorithm) that scored better than the slot's agent (exploit) replaces
  it, with the proposed hyperparameters (explore); the other slots train on.
* PBT inside the pod (``spec.population.exploit``): every ``every_env_steps`` env steps the pod
  ranks its slots (recent training returns, or an evaluation) and the trainer copies the top
  agents into the bottom slots in place, with explored hyperparameters (``select``); a copy
  reports as a child of its source's last candidate.
* Stop (SIGTERM, or ``max_env_steps`` reached): the update in flight finishes, then one
  evaluation and a final report of every slot trained since its last report.

In an algorithm mix, a search-space name only some algorithms take is ignored by the others'
pods (it still travels with the candidate, so the generator's strategies see every name).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.api_client import LeaderboardClient
from services.contracts.algorithms.hyperparameters import (  # torch-free, shared with the spec
    HyperparameterError,
    check_hyperparameter_names,
    check_population,
    hyperparameter_names,
)
from services.contracts.leaderboard import Manifest, ManifestCheckpoint
from services.contracts.search_space import pinned_names
from services.contracts.spec import ExperimentSpec
from services.contracts.strategies import parent_is_better
from services.logs import get_logger
from services.pod.runtime import activity
from services.pod.runtime.compile_share import CompileShare
from services.pod.runtime.in_pod_pbt import InPodPBT
from services.pod.runtime.lineage import Lineage, ReadyRule
from services.pod.runtime.metrics import PodMetrics
from services.pod.runtime.pod_files import PodFiles
from services.pod.training.checkpoint import MANIFEST, CheckpointError, write_files
from services.pod.training.presets import pod_config
from services.pod.training.tensorboard import Board
from services.pod.training.trainer import RunConfig, Trainer, build_trainer

log = get_logger(__name__)

__all__ = ["HyperparameterError", "PodRuntime", "RuntimeSettings", "check_hyperparameter_names"]


@dataclass(frozen=True)
class RuntimeSettings:
    """How the orchestrator runs this pod (services/pod/__main__.py reads them)."""

    work_dir: Path | None = None
    device: str = "cpu"
    threads: int = 1
    grace_s: float = 30.0  # the orchestrator's termination grace period
    #: Env steps this pod may still take (summed over its slots) before the experiment's
    #: budget is spent; None: no limit. The pod stops before a step that would exceed it.
    max_env_steps: int | None = None
    #: The ensemble algorithm the orchestrator gave this pod; None: the generator draws one.
    algorithm: str | None = None
    #: Where this pod writes its TensorBoard event files (a population: each agent's in
    #: ``m<i>/`` below it); None: none written.
    tensorboard_dir: Path | None = None
    #: The compile cache directory this process uses (``TORCHINDUCTOR_CACHE_DIR``), shared with
    #: the experiment's other pods through the leaderboard (compile_share.py); None: not shared.
    compile_cache_dir: Path | None = None
    #: How long a pod waits for another pod's compile of its programs before compiling itself.
    compile_wait_s: float = 900.0
    #: When this pod's process started (epoch seconds): its start-up is measured from there.
    started_at: float | None = None


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


class PodRuntime:
    """One pod: its slots' lineages, its trainer, the round loop (see the module docstring)."""

    def __init__(
        self,
        experiment_id: str,
        pod_id: str,
        spec: ExperimentSpec,
        client: LeaderboardClient,
        settings: RuntimeSettings | None = None,
        metrics: PodMetrics | None = None,
        files: PodFiles | None = None,
    ) -> None:
        size = spec.population.agents_per_pod
        if size > 1:  # the spec validator's own check, for a spec that reached us raw
            check_population(
                size, spec.algorithms, spec.search_space, pinned_names(spec.search_space)
            )
        self.pod_id, self.spec = pod_id, spec
        self.client = client
        self.settings = settings or RuntimeSettings()
        self.work_dir = Path(self.settings.work_dir or tempfile.mkdtemp(prefix=f"podium-{pod_id}-"))
        self.metrics = metrics or PodMetrics(
            experiment_id, pod_id, spec.evaluation.higher_is_better
        )
        self.files = files  # the TensorBoard files and log lines kept beyond the pod
        self.ready = ReadyRule.of(spec)
        self.seed = zlib.crc32(pod_id.encode()) % (2**31)
        self.slots = [
            Lineage(pod_id=pod_id if size == 1 else f"{pod_id}.m{i}") for i in range(size)
        ]
        self.trainer: Trainer | None = None
        self.stopping = False
        self.rounds = 0
        self.env_steps = 0  # taken by this pod, summed over its slots
        self.submissions: list[dict[str, Any]] = []  # answers of this pod's reports
        self.train_seconds = 0.0  # spent in rounds (the env-steps/s curve's clock)
        self.board, self.boards = self.open_boards()
        cache = self.settings.compile_cache_dir
        self.compile_share = (
            CompileShare(client, pod_id, cache, self.settings.compile_wait_s, lambda: self.stopping)
            if cache is not None
            else None
        )
        rule = spec.population.exploit
        self.pbt = (
            InPodPBT(rule, spec.search_space, size, pod_id, spec.evaluation.higher_is_better)
            if rule is not None
            else None
        )
        self.started_at = self.settings.started_at or time.time()
        #: Seconds from the process's start to its first env step and to its first report.
        self.startup: dict[str, float] = {}

    @property
    def size(self) -> int:
        """The slots: agents trained by this pod."""
        return len(self.slots)

    def slot_dir(self, i: int, name: str) -> Path:
        """Where slot i's ``name`` files go (``latest``, ``parent``)."""
        return self.work_dir / (f"m{i}" if self.size > 1 else "") / name

    def open_boards(self) -> tuple[Board, list[Board]]:
        """The pod's TensorBoard writer (its training curves) and each slot's (its evaluations
        and hyperparameters): one and the same for a single agent."""
        root = self.settings.tensorboard_dir
        # Every round is a point: rounds are seconds apart, no need to thin them out.
        pod = Board(root, min_interval_s=0.0)
        if root is None or self.size == 1:
            return pod, [pod] * self.size
        return pod, [Board(root / f"m{i}", min_interval_s=0.0) for i in range(self.size)]

    @property
    def board_step(self) -> int:
        """The curves' x axis: env steps each slot took in this pod (a parent's files bring
        their own counters, which would send a curve back or forth)."""
        return self.env_steps // self.size

    # -- signals ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler): report, then return."""
        self.stopping = True
        # Leave time for the final evaluation inside the orchestrator's grace period.
        self.client.deadline = time.monotonic() + 0.7 * self.settings.grace_s

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        activity.now("loading")
        self.start()
        while not self.stopping:
            activity.now("training")
            self.train_round()
            if self.stopping:
                break  # the final report comes next
            if self.rounds % self.spec.evaluation.every_rounds == 0:
                activity.now("evaluating")
                self.report()
                if not self.stopping:
                    self.maybe_exploit()
        activity.now("evaluating")
        self.finish()

    def finish(self) -> None:
        """The final report of every slot trained since its last report."""
        due = [i for i, s in enumerate(self.slots) if s.unreported_steps or not self.submissions]
        if due:
            self.report(final=True, due=due)
        else:  # the last reports already hold these agents: copies would crowd the board
            log.info("nothing trained since the last report; no final report needed")

    # -- building the slots ----------------------------------------------------------------
    def start(self, manifests: list[Manifest] | None = None) -> None:
        """Build the trainer for the generator's manifests (asked once per slot unless given),
        then each parent's files into its slot, its lease released once loaded (or not wanted)."""
        torch.set_num_threads(self.settings.threads)
        manifests = list(manifests or [])
        try:
            for slot in self.slots[len(manifests) :]:
                manifests.append(self.client.generate(slot.pod_id, self.settings.algorithm))
            configs = [self.slot_config(m) for m in manifests]
            if self.compile_share is not None:  # another pod's compile, before ours starts
                self.compile_share.before_build(configs)
            if self.trainer is not None:
                self.trainer.close()
                self.trainer = None
            try:
                horizon = self.horizon_env_steps(configs[0])
                self.trainer = build_trainer(configs, horizon)
            except HyperparameterError:
                raise
            except (ValueError, TypeError, ImportError) as exc:  # DQN on Pendulum; no extra
                config = configs[0]
                raise HyperparameterError(
                    f"cannot train {config.algorithm} on {config.env}: {exc}"
                ) from exc
            for i, (manifest, config) in enumerate(zip(manifests, configs, strict=True)):
                self.place(i, manifest, config, fresh=True)
        finally:
            for manifest in manifests:
                self.release(manifest)

    def horizon_env_steps(self, config: RunConfig) -> int | None:
        """Env steps each slot can expect to train: this pod's share of the experiment's
        budget (``spec.budget.total_env_steps`` over ``max_pods`` pods of ``size`` agents), at
        least a round; and where the experiment has a target, at most twice the env steps the
        preset's runs took to reach theirs (``config.expected_env_steps``: a tournament stops
        at its target, as ``podium train`` does). None with neither. What a compile must pay
        for (``compile: auto``, services/pod/algorithms/compiled.py ``Decision``)."""
        horizon = None
        if total := self.spec.budget.total_env_steps:
            share = total // (self.spec.population.max_pods * self.size)
            horizon = max(share, self.spec.round.env_steps or 0, 1)
        expected = getattr(config, "expected_env_steps", None)
        if self.spec.target_return is not None and expected:
            horizon = 2 * expected if horizon is None else min(horizon, 2 * expected)
        return horizon

    def slot_config(self, manifest: Manifest) -> RunConfig:
        """The manifest's agent's run config, seeded on: every agent explores its own stream."""
        hyperparameters, algorithm = manifest.hyperparameters, manifest.algorithm
        if self.size > 1:
            pinned = pinned_names(self.spec.search_space)
            check_population(self.size, [algorithm], hyperparameters, pinned)
        self.seed += 1
        return self.config_for(hyperparameters, algorithm, self.seed)

    def config_for(self, hyperparameters: dict[str, Any], algorithm: str, seed: int) -> RunConfig:
        s = self.settings
        return pod_config(self.spec, hyperparameters, seed, s.device, s.threads, algorithm)

    def place(self, i: int, manifest: Manifest, config: RunConfig, fresh: bool) -> None:
        """Put the manifest's agent into slot i: the parent's training files with the proposed
        hyperparameters, or fresh weights (``fresh``: the slot already holds them)."""
        trainer = self.trainer
        assert trainer is not None
        parent_id, generation = None, 0
        if isinstance(manifest.checkpoint, ManifestCheckpoint):
            try:
                parent = self.slot_dir(i, "parent")
                files = fetch_parent(self.client, parent, manifest.checkpoint)
                self.into_slot(i, config, lambda t: t.load(i, files, config))
                parent_id, generation = manifest.parent_id, manifest.generation
            except CheckpointError as exc:
                # Hyperparameters that change the network's shape (or a smaller replay
                # buffer) cannot take the parent's files: train them from scratch.
                log.warning("parent does not fit; starting fresh", slot=i, error=str(exc))
                self.into_slot(i, config, lambda t: t.reset(i, config))
        elif not fresh:
            self.into_slot(i, config, lambda t: t.reset(i, config))
        trainer = self.trainer  # a new one where the slot's config needed it
        algorithm, hyperparameters = manifest.algorithm, dict(manifest.hyperparameters)
        self.slots[i] = Lineage(
            pod_id=self.slots[i].pod_id,
            algorithm=algorithm,
            hyperparameters=hyperparameters,
            parent_id=parent_id,
            generation=generation,
            env_steps_at_start=trainer.counters(i).env_steps,
        )
        self.boards[i].hyperparameters(
            {
                "algorithm": algorithm,
                "parent": str(parent_id),
                "generation": generation,
                **hyperparameters,
            },
            step=self.board_step,
        )
        log.info(
            "agent built",
            slot=i,
            algorithm=algorithm,
            decision=manifest.decision,
            parent=parent_id,
            generation=generation,
            hyperparameters=hyperparameters,
            # Search-space names of another algorithm of the mix: carried, not applied.
            ignored=sorted(set(hyperparameters) - (hyperparameter_names(algorithm) or set())),
        )

    def release(self, manifest: Manifest) -> None:
        """Let go of the parent's files the manifest leased, if it leased any."""
        if manifest.lease_id:
            self.client.release(manifest.lease_id)

    # -- a round, a report, PBT ------------------------------------------------------------
    def train_round(self) -> None:
        """Step until every slot has trained a round (``spec.round``), the pod stops, or the
        next step would take it past ``max_env_steps`` (then it stops)."""
        trainer = self.trainer
        assert trainer is not None
        start_steps, start_updates = trainer.env_steps, trainer.updates
        start = time.monotonic()
        round_steps, round_seconds = self.spec.round.env_steps, self.spec.round.seconds
        budget = self.settings.max_env_steps
        while not self.stopping:
            taken = (trainer.env_steps - start_steps) * self.size
            if (
                budget is not None
                and self.env_steps + taken + self.size * (trainer.step_env_steps) > budget
            ):
                log.info("the experiment's env-step budget is spent", max_env_steps=budget)
                self.stopping = True
                break
            trainer.step()
            if "first_env_step" not in self.startup:
                self.started("first_env_step", trainer)
            if self.compile_share is not None:
                self.compile_share.stepped(trainer.compile_seconds, trainer.compiles_later)
            if self.pbt is not None and self.pbt.due(trainer.env_steps):
                self.select()
            steps = trainer.env_steps - start_steps
            if round_steps is not None and steps >= round_steps:
                break
            if round_seconds is not None and time.monotonic() - start >= round_seconds:
                break
        trainer.wait()  # the round's seconds count its training, not only its launches
        self.rounds += 1
        steps, updates = trainer.env_steps - start_steps, trainer.updates - start_updates
        for slot in self.slots:  # steps and updates are per slot
            slot.unreported_steps += steps
        self.env_steps += steps * self.size
        seconds = time.monotonic() - start
        self.metrics.round_done(steps * self.size, updates * self.size, seconds)
        self.metrics.compiled(trainer.compile_seconds)
        self.train_seconds += seconds
        if steps and self.board.enabled:  # the trainer's statistics of its last update
            record = {"env_steps": self.board_step, "train_seconds": self.train_seconds}
            self.board.record({**record, **trainer.progress()})

    def report(self, final: bool = False, due: list[int] | None = None) -> None:
        """One evaluation of every slot, then a submission per slot in ``due`` (all)."""
        trainer = self.trainer
        assert trainer is not None
        results = trainer.evaluate()
        self.metrics.compiled(trainer.compile_seconds)
        due = list(range(self.size)) if due is None else due
        for i in due:
            if not math.isfinite(results[i].mean):
                raise RuntimeError(f"slot {i}: the evaluation returned a non-finite mean")
        self.metrics.evaluated(*(results[i].mean for i in due))
        for i in due:
            result = {"eval/return": results[i].mean, "eval/return_std": results[i].std}
            self.boards[i].scalars(result, self.board_step)
        for board in (self.board, *self.boards):
            board.flush()  # a report is the moment the curves should show
        for i in due:
            slot, evaluation = self.slots[i], results[i]
            directory = self.slot_dir(i, "latest")
            trainer.save(i, directory)
            files = {p.name: p.read_bytes() for p in sorted(directory.iterdir())}
            result = slot.submission(
                slot.unreported_steps,
                evaluation,
                trainer.counters(i).env_steps,
                trainer.step_env_steps,
            )
            answer = self.client.submit(result, files)
            self.metrics.submissions.inc()
            self.submissions.append(
                {**answer.model_dump(), "submission_id": result["submission_id"],
                 "env_steps": slot.unreported_steps, "member": i, "final": final}
            )  # fmt: skip
            slot.record(answer, evaluation.mean)
            log.info(
                "reported",
                final=final,
                slot=i,
                pod=slot.pod_id,
                submission=result["submission_id"],
                score=evaluation.mean,
                env_steps=slot.unreported_steps,
                accepted=answer.accepted,
                candidate=answer.candidate_id,
                rank=answer.rank,
                duplicate=answer.duplicate,
            )
            slot.unreported_steps = 0
        if self.compile_share is not None:
            self.compile_share.reported(trainer.compiles_later and not final)
        if self.files is not None:
            self.files.reported()
        if "first_report" not in self.startup:
            self.started("first_report", trainer)

    def started(self, milestone: str, trainer: Trainer) -> None:
        """Log and export the seconds from the process's start to ``milestone`` (start-up)."""
        seconds = time.time() - self.started_at
        self.startup[milestone] = seconds
        self.metrics.started(milestone, seconds)
        log.info(
            f"pod.{milestone}",
            seconds=round(seconds, 3),
            compile_s=round(trainer.compile_seconds, 3),
        )

    def better_parent(self, i: int) -> Manifest | None:
        """PBT's exploit for slot i: once it is ready, ask the generator; its manifest when it
        proposes a parent that scored better (whose lease the caller releases once it is
        loaded), else None (the lease released)."""
        assert self.trainer is not None
        slot = self.slots[i]
        if not self.ready.is_ready(slot, self.trainer.counters(i).env_steps):
            return None  # the best there is, or not trained long enough to be judged
        manifest = self.client.generate(slot.pod_id, algorithm=slot.algorithm, score=slot.score)
        if parent_is_better(
            manifest, slot, self.spec.evaluation.higher_is_better, self.ready.exploit_margin
        ):
            return manifest
        self.release(manifest)
        return None

    def select(self) -> None:
        """PBT among this pod's slots (services/pod/runtime/in_pod_pbt.py). A copy descends
        from what its source's next report would: its source's last candidate."""
        trainer, pbt = self.trainer, self.pbt
        assert trainer is not None and pbt is not None
        before = list(self.slots)  # a source replaced later in the decision was copied first
        if pbt.rule.by == "evaluation":
            activity.now("evaluating")
        copies = pbt.select(
            trainer,
            [s.hyperparameters for s in before],
            [s.env_steps_at_start for s in before],
            lambda hp, src, dst: self.config_for(
                hp, before[src].algorithm, trainer.config(dst).seed
            ),
        )
        activity.now("training")
        for c in copies:
            old, parent = before[c.dst], before[c.src]
            self.slots[c.dst] = Lineage(
                pod_id=old.pod_id,
                algorithm=parent.algorithm,
                hyperparameters=c.hyperparameters,
                parent_id=parent.parent_id,
                generation=parent.generation,
                env_steps_at_start=trainer.counters(c.dst).env_steps,
                unreported_steps=old.unreported_steps,  # the experiment's budget counts them
            )
            self.metrics.exploits.inc()
            self.boards[c.dst].hyperparameters(
                {"algorithm": parent.algorithm, "parent": f"m{c.src}", **c.hyperparameters},
                step=self.board_step,
            )
            log.info(
                "pbt in the pod: copied",
                slot=c.dst,
                source=c.src,
                score=c.scores[c.dst],
                source_score=c.scores[c.src],
                explore=c.how,
                hyperparameters=c.hyperparameters,
            )

    def into_slot(self, i: int, config: RunConfig, put: Callable[[Trainer], None]) -> None:
        """``put`` the slot's new agent into the trainer. A single agent's settings that fix
        the trainer's programs (epochs, minibatches, network, envs) may differ from its parent's
        or its own last ones: then a trainer for the new config, built anew, takes it (a
        population's slots share them: refused)."""
        assert self.trainer is not None
        try:
            put(self.trainer)
        except HyperparameterError:
            if self.size != 1:
                raise
            self.trainer.close()
            self.trainer = None
            self.trainer = build_trainer([config], self.horizon_env_steps(config))
            put(self.trainer)

    def maybe_exploit(self) -> None:
        """Per slot: replace its agent by the generator's parent when that one scored better
        (PBT's exploit, with the explored hyperparameters)."""
        for i, slot in enumerate(self.slots):
            if self.stopping:
                return
            manifest = self.better_parent(i)
            if manifest is None:
                continue
            try:
                try:
                    config = self.slot_config(manifest)
                except HyperparameterError as exc:  # e.g. a parent from another kind of pod
                    log.warning("parent does not fit this pod", slot=i, error=str(exc))
                    continue
                activity.now("loading")
                log.info(
                    "restarting from a better parent",
                    slot=i,
                    parent=manifest.parent_id,
                    own_score=slot.score,
                )
                self.place(i, manifest, config, fresh=False)
            finally:
                self.release(manifest)

    def close(self, keep_client: bool = False) -> None:
        """Release everything; the leaderboard client too unless ``keep_client`` (the pod's
        files are uploaded with it after the loop, services/pod/__main__.py)."""
        if self.compile_share is not None:
            self.compile_share.close()
        if self.trainer is not None:
            self.trainer.close()
        if not keep_client:
            self.client.close()
        self.metrics.close()
        for board in (self.board, *self.boards):  # closing twice is harmless
            board.close()
