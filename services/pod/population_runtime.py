"""The population pod: ``population.agents_per_pod`` PPO agents trained together in one process.

A pod of an experiment with ``population.agents_per_pod: P`` (P > 1) runs this loop instead of
``PodRuntime``'s: the same round loop, for P agents at once. The agents ("members") share one
network shape, rollout shape and number of epochs, and are trained in lock-step by
``services.pod.population.PopulationPPO`` (stacked weights, batched matmuls; per-agent
hyperparameters as tensors; each member its own slice of one batched env). On a CPU a
population update is several times faster than updating P agents one after another
(docs/benchmarks.md, "Vectorized populations"), and a pod with P members costs one
interpreter, one torch import and one set of envs instead of P.

To the leaderboard, each member is a pod of its own, named ``<pod id>.m<i>``:

* Start: each member asks the generator for its starting point (fresh hyperparameters, or a
  parent's training files with explored hyperparameters) and goes into its slot.
* Round: ``spec.round`` env steps (or seconds) per member, all members at once.
* Report (every ``evaluation.every_rounds`` rounds): one batched evaluation scores every member
  on the experiment's evaluation start states (``eval_seed``; on torch-native envs the same
  start states a single pod's evaluator uses), then each member is submitted as its own
  candidate: its own submission id, hyperparameters, lineage (parent_id, generation) and
  training files in the format a single PPO pod writes, so that any pod, ``podium export`` or
  ``load_training_files`` loads it.
* PBT: after each report, each member that is ready (``ready_reports`` / ``ready_env_steps``,
  as ``PodRuntime``) asks the generator; when it proposes a parent that scored better, the
  parent's training files and the explored hyperparameters replace that member's slot
  (``PopulationPPO.set_agent``), Adam state included. The other members train on.
* SIGTERM (``stop()``): the update in flight finishes, then one evaluation and a final report
  of every member trained since its last report.

Restrictions (refused at start with ``HyperparameterError``, naming what is allowed): the
experiment's algorithm must be ``ppo`` alone, and the search space may vary only the
hyperparameters that can differ within a population (``population.HYPERPARAMETERS``:
learning_rate, ent_coef, clip_coef, vf_coef, gamma, gae_lambda); anything else (network
sizes, num_envs, epochs…) would change the shape the members share. gSDE and ``target_kl`` are
turned off where the env's preset uses them (Pendulum's preset uses gSDE); the members' files
say so, so they load as plain Gaussian-policy PPO agents.

Pod metrics count the pod's work: rounds, env steps and updates summed over the members, and
the best member's score of each evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import Unpack  # typing.Unpack from Python 3.12

from services.api_client import LeaderboardClient
from services.contracts.leaderboard import Manifest, ManifestCheckpoint
from services.contracts.spec import ExperimentSpec
from services.logs import get_logger
from services.pod.algorithms.hyperparameters import check_population
from services.pod.algorithms.ppo import PPO
from services.pod.checkpoint import CheckpointError
from services.pod.evaluator import EvalResult
from services.pod.learner import Learner
from services.pod.population import HYPERPARAMETERS, PopulationPPO, build_population
from services.pod.runtime import (
    Agent,
    HyperparameterError,
    LoopSettings,
    OnPolicy,
    PodLoop,
    eval_seed,
    fetch_parent,
    pod_config,
)
from services.pod.train import TrainConfig

log = get_logger(__name__)

#: PPOConfig settings a population cannot train with, and what it trains with instead.
UNSUPPORTED_PPO = {"sde_sample_freq": 0, "target_kl": None}


def check_population_spec(spec: ExperimentSpec) -> None:
    """Refuse what a population pod cannot train (the spec validator's own check, for a spec
    that reached the pod unvalidated): an algorithm other than PPO, or search-space names that
    are not per-agent hyperparameters of ``PopulationPPO``."""
    check_population(spec.population.agents_per_pod, spec.algorithms, spec.search_space)


def member_config(
    spec: ExperimentSpec,
    hyperparameters: dict[str, Any],
    seed: int,
    device: str = "cpu",
    threads: int = 1,
) -> TrainConfig:
    """A member's run config: a PPO pod's (``pod_config``) without what populations lack."""
    config = pod_config(spec, hyperparameters, seed, device, threads, "ppo")
    assert isinstance(config, TrainConfig)
    changes = {k: v for k, v in UNSUPPORTED_PPO.items() if getattr(config.ppo, k) != v}
    if not changes:
        return config
    return config.model_copy(update={"ppo": config.ppo.model_copy(update=changes)})


@dataclass
class Member(Agent):
    """One agent of the population: who it is on the leaderboard (``Agent``; its
    ``env_steps_at_start`` counts the population's env steps per agent) and its slot."""

    pod_id: str = ""
    config: TrainConfig | None = None  # its hyperparameters and seed: what its files say
    unreported_steps: int = 0
    # Its learner's env steps and updates minus the population's: a parent's counters go on
    # in the member's training files, as they do in a single pod restarted from it.
    steps_offset: int = 0
    updates_offset: int = 0


class PopulationRuntime(PodLoop):
    """A pod training ``spec.population.agents_per_pod`` agents; ``PodRuntime``'s interface
    (``run``, ``stop``, ``close``, ``rounds``, ``submissions``)."""

    def __init__(
        self,
        experiment_id: str,
        pod_id: str,
        spec: ExperimentSpec,
        client: LeaderboardClient,
        **settings: Unpack[LoopSettings],
    ) -> None:
        check_population_spec(spec)
        super().__init__(experiment_id, pod_id, spec, client, **settings)
        self.size = spec.population.agents_per_pod
        self.members = [Member(pod_id=f"{pod_id}.m{i}") for i in range(self.size)]
        self.family = OnPolicy()  # PPO's training files, as a PPO pod saves and loads them
        self.population: PopulationPPO | None = None

    def begin(self) -> None:
        self.start()

    def finish(self) -> None:
        due = [i for i, m in enumerate(self.members) if m.unreported_steps or not self.submissions]
        if due:
            self.report(final=True, due=due)
        else:  # the last reports already hold these agents: copies would crowd the board
            log.info("nothing trained since the last report; no final report needed")

    def _next_seed(self) -> int:
        self.seed += 1  # every agent built explores with its own random stream
        return self.seed

    def start(self) -> None:
        """Ask the generator once per member, build the population with the members'
        hyperparameters, then load the parents of the members that have one."""
        torch.set_num_threads(self.threads)
        manifests: list[Manifest] = []
        try:
            for member in self.members:
                manifests.append(self.client.generate(member.pod_id, algorithm="ppo"))
            first = self.seed + 1
            configs = [self._member_config(manifest, self._next_seed()) for manifest in manifests]
            # The members' shared settings: the PPO pod's, with no hyperparameters on top.
            base = member_config(self.spec, {}, first, self.device, self.threads)
            self.population = build_population(
                base.env,
                base.ppo,
                [{k: getattr(c.ppo, k) for k in HYPERPARAMETERS} for c in configs],
                seed=first,  # member i is seeded first + i, as its config says
                total_env_steps=base.total_env_steps,
                eval_episodes=self.spec.evaluation.episodes,
                device=self.device,
                env_kwargs=base.env_kwargs,
            )
            for i, (manifest, config) in enumerate(zip(manifests, configs, strict=True)):
                self._place(i, manifest, config, fresh_built=True)
        finally:
            for manifest in manifests:
                self.release(manifest)

    def _member_config(self, manifest: Manifest, seed: int) -> TrainConfig:
        hyperparameters = dict(manifest.hyperparameters)
        check_population(self.size, [manifest.algorithm], hyperparameters)
        return member_config(self.spec, hyperparameters, seed, self.device, self.threads)

    def _place(
        self, i: int, manifest: Manifest, config: TrainConfig, fresh_built: bool = False
    ) -> None:
        """Put the manifest's agent into slot i: the parent's training files with the proposed
        hyperparameters, or fresh weights (``fresh_built``: the slot already holds them)."""
        pop = self.population
        assert pop is not None
        hyperparameters = dict(manifest.hyperparameters)
        parent_id, generation = None, 0
        learner: Learner | None = None
        if isinstance(manifest.checkpoint, ManifestCheckpoint):
            learner = self._learner(config)
            try:
                directory = fetch_parent(
                    self.client, self.work_dir / f"m{i}" / "parent", manifest.checkpoint
                )
                self.family.load(directory, learner, config)
                parent_id, generation = manifest.parent_id, manifest.generation
            except CheckpointError as exc:
                log.warning("parent does not fit; starting fresh", member=i, error=str(exc))
                learner = None
        if learner is None and not fresh_built:
            learner = self._learner(config)
        if learner is not None:
            pop.set_agent(i, learner.agent, {k: getattr(config.ppo, k) for k in HYPERPARAMETERS})
        steps, updates = (learner.env_steps, learner.updates) if learner is not None else (0, 0)
        self.members[i] = Member(
            algorithm="ppo",
            hyperparameters=hyperparameters,
            parent_id=parent_id,
            generation=generation,
            env_steps_at_start=pop.env_steps,
            pod_id=self.members[i].pod_id,
            config=config,
            steps_offset=steps - pop.env_steps,
            updates_offset=updates - pop.updates,
        )
        log.info(
            "member built",
            member=i,
            decision=manifest.decision,
            parent=parent_id,
            generation=generation,
            hyperparameters=hyperparameters,
        )

    def _learner(self, config: TrainConfig) -> Learner:
        """A fresh single-agent learner of the population's shape, seeded by ``config``."""
        pop = self.population
        assert pop is not None
        torch.manual_seed(config.seed)
        agent = PPO(pop.env.single_observation_space, pop.env.single_action_space, config.ppo)
        return Learner(agent.to(self.device), config.total_env_steps)

    def train_round(self) -> None:
        pop = self.population
        assert pop is not None
        steps, updates, seconds = self.train_for_round(pop, lambda: pop.update(pop.collect()))
        for member in self.members:  # steps and updates are per member
            member.unreported_steps += steps
        self.metrics.round_done(steps * self.size, updates * self.size, seconds)

    def report(self, final: bool = False, due: list[int] | None = None) -> None:
        """One evaluation of every member, then a submission per member in ``due`` (all)."""
        pop = self.population
        assert pop is not None
        results = pop.evaluate(seed=eval_seed(self.spec))
        due = list(range(self.size)) if due is None else due
        for i in due:
            if not math.isfinite(results[i].mean):
                raise RuntimeError(f"member {i}: non-finite evaluation mean ({results[i].mean})")
        self.metrics.evaluated(*(results[i].mean for i in due))
        for i in due:
            self._submit(i, results[i], final)

    def _submit(self, i: int, evaluation: EvalResult, final: bool) -> None:
        pop, member = self.population, self.members[i]
        assert pop is not None and member.config is not None
        learner = pop.learner(i)
        learner.total_env_steps = member.config.total_env_steps
        learner.env_steps = pop.env_steps + member.steps_offset
        learner.updates = pop.updates + member.updates_offset
        directory = self.work_dir / f"m{i}" / "latest"
        self.family.save(directory, learner, member.config)
        self.send(
            member,
            member.pod_id,
            member.unreported_steps,
            evaluation,
            directory,
            final,
            entry={"member": i, "final": final},
            member=i,
            pod=member.pod_id,
        )
        member.unreported_steps = 0

    def maybe_exploit(self) -> None:
        """Per member: replace it by the generator's parent when that one scored better (PBT's
        exploit, with the explored hyperparameters)."""
        pop = self.population
        assert pop is not None
        for i, member in enumerate(self.members):
            if self.stopping:
                return
            manifest = self.better_parent(member, member.pod_id, pop.env_steps)
            if manifest is None:
                continue
            try:
                config = self._member_config(manifest, self._next_seed())
            except HyperparameterError as exc:  # e.g. a parent from another kind of pod
                log.warning("parent does not fit the population", error=str(exc))
                self.release(manifest)
                continue
            log.info(
                "member restarting from a better parent",
                member=i,
                parent=manifest.parent_id,
                own_score=member.score,
            )
            try:
                self._place(i, manifest, config)
            finally:
                self.release(manifest)

    def close(self) -> None:
        if self.population is not None:
            for env in (self.population.env, self.population.eval_env):
                if env is not None:
                    env.close()
        self.client.close()
        self.metrics.close()
