"""The Anakin trainer: P PPO agents (P >= 1) trained by the Anakin iteration
(services/pod/training/anakin.py: the rollout on a functional env, GAE and every minibatch update
of all agents as compiled programs over explicit state) and scored by the compiled greedy
evaluation (services/pod/training/anakin_eval.py).

Which PPO trainer a pod or ``podium train`` gets is ``PPOConfig.compile``'s (trainer.py
``build_trainer`` asks ``declines``): ``off`` never this one; ``on`` this one wherever it can
train the configs; ``auto`` where it can and the measured rules say it wins
(services/pod/algorithms/compiled.py ``ANAKIN_AUTO``: device type, P, batch size, and the compile
against what it saves over the run's horizon, plus, on a CPU, what earlier runs of the same
programs lost training eagerly: the compile cache keeps that tally). Where it cannot (an env
without a functional step, a plugin env, env arguments, settings the iteration does not have,
roles in other processes, learner replicas, no C++ compiler) the eager trainer trains, and
one log line names why (``trainer.chosen``).

Each slot saves and loads the training files a single PPO agent has
(services/pod/training/onpolicy.py): weights, Adam moments and step, observation statistics,
config and counters. So a slot's files load into any PPO pod and ``podium export``, and any
PPO pod's files (a PBT parent) load into a slot. Loading one writes into the state tensors the
compiled programs take as inputs, and its hyperparameters into the (P,) tensors: no recompile.

Compile seconds (dynamo and inductor, for the iteration's programs and the evaluation's) are
``compile_seconds``, logged when they grow (``compile.done``) and exported by the pod
(services/pod/runtime/metrics.py ``podium_pod_compile_seconds``).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from services import registry
from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.logs import get_logger
from services.pod.algorithms import aot_program
from services.pod.algorithms.batched_adam import adam_state, load_adam_state
from services.pod.algorithms.compiled import (
    AnakinRule,
    anakin_auto,
    anakin_rule,
    compiler_missing,
)
from services.pod.algorithms.ppo import PPO, PPO_STATS
from services.pod.config import PPORunConfig
from services.pod.envs.registry import list_envs, make_env
from services.pod.roles.evaluator import EvalResult
from services.pod.roles.learner import RolloutLearner
from services.pod.training import anakin, anakin_eval
from services.pod.training.anakin import (
    FUNCTIONAL_ENVS,
    HYPERPARAMETERS,
    AnakinCompile,
    AnakinPPO,
    unsupported,
)
from services.pod.training.population_trainer import PPOSlotsTrainer
from services.pod.training.trainer import Counters, Declined, Roles

log = get_logger(__name__)
T = TypeVar("T")

#: Fields every slot shares (the program's shape and the rest of the recipe): all but the
#: per-agent hyperparameters and the compile switch.
_PER_AGENT = {*HYPERPARAMETERS, "compile"}


def _shared(config: PPORunConfig) -> dict:
    return {k: v for k, v in config.ppo.model_dump().items() if k not in _PER_AGENT}


def compile_clock() -> float:
    """Seconds spent compiling in this process so far: dynamo's own per-frame timing (which
    includes inductor's), and the building or loading of programs compiled ahead of time."""
    dynamo = 0.0
    # Asked twice per iteration: where nothing imported dynamo (the programs were loaded
    # ahead of time), it compiled nothing, and importing it here would cost a second.
    if "torch._dynamo.utils" in sys.modules:
        from torch._dynamo.utils import compilation_time_metrics

        dynamo = sum(compilation_time_metrics.get("_compile.compile_inner", ()))
    return float(dynamo) + aot_program.SECONDS[0]


def _note_eager(
    signature: str, rule: AnakinRule, agents: int, eval_every: int, env_steps: int
) -> None:
    """Add what ``env_steps`` per agent of eager training cost against ``rule``'s Anakin
    trainer (its evaluations too) to the compile cache's tally for ``signature``."""
    seconds = rule.saved_s(agents, env_steps, evaluations=env_steps / eval_every)
    aot_program.add_eager_seconds(signature, seconds)


class AnakinTrainer(PPOSlotsTrainer):
    """``len(configs)`` PPO agents on the Anakin iteration; counters are per agent."""

    # -- choosing it -----------------------------------------------------------------------
    @classmethod
    def unsupported(cls, configs: Sequence[PPORunConfig], roles: Roles | None) -> str | None:
        """Why this trainer cannot train ``configs`` at all (None: it can)."""
        first = configs[0]
        if first.algorithm != "ppo":
            return f"the Anakin iteration trains PPO, not {first.algorithm}"
        if roles is not None and not roles.in_process and len(configs) == 1:
            return "the worker and evaluator run in other processes"
        if first.learners > 1:
            return "learner replicas (learners > 1)"
        if first.env not in list_envs():
            return f"env {first.env!r} is not a torch-native env"
        factory = registry.load(registry.ENVS, first.env, kind="env")
        if factory not in FUNCTIONAL_ENVS:
            return (
                f"env {first.env!r} has no functional step (services/pod/training/anakin.py "
                f"FUNCTIONAL_ENVS: {', '.join(e.__name__ for e in FUNCTIONAL_ENVS)})"
            )
        for config in configs:
            if config.env_kwargs or config.eval_env_kwargs:
                return "env arguments (the functional step has the env's defaults only)"
            if reason := unsupported(config.ppo):
                return reason
            if _shared(config) != _shared(first) or config.device != first.device:
                return "the slots differ in more than their per-agent hyperparameters"
        return None

    @classmethod
    def declines(
        cls,
        configs: Sequence[PPORunConfig],
        roles: Roles | None = None,
        horizon_env_steps: int | None = None,
    ) -> Declined | None:
        """None where ``compile`` asks for this trainer and it can train ``configs``; else
        why the eager trainer trains them (trainer.py ``build_trainer`` logs it)."""
        first = configs[0]
        mode = first.ppo.compile
        if mode == "off":
            return Declined("compile: off", warn=False)
        if reason := cls.unsupported(configs, roles):
            return Declined(reason, warn=mode == "on")
        if reason := compiler_missing(first.device):
            return Declined(reason, warn=mode == "on")
        if mode == "auto":
            horizon = horizon_env_steps or first.total_env_steps
            agents, batch = len(configs), first.ppo.batch_size
            # Programs compiled ahead of time outlive the process: a compile is paid once per
            # cache, so what earlier runs lost without them counts towards it (on CUDA each
            # process compiles again, and every run weighs its own).
            kept = aot_program.used_on(first.device)
            signature = cls.programs_of(configs)
            compiled = kept and aot_program.ready(signature)
            lost = aot_program.eager_seconds(signature) if kept else 0.0
            # A pod evaluates every round, often more than this says: fewer savings counted.
            evaluations = horizon // first.eval_every_steps
            if reason := anakin_auto(
                first.device, agents, batch, horizon, compiled, evaluations, lost
            ):
                rule = anakin_rule(first.device, agents, batch)
                record = None
                if kept and rule is not None and rule.anakin_rate > rule.eager_rate:
                    record = functools.partial(
                        _note_eager, signature, rule, agents, first.eval_every_steps
                    )
                return Declined(reason, warn=False, record=record)
        return None

    @staticmethod
    def programs_of(configs: Sequence[PPORunConfig]) -> str:
        """What fixes this trainer's compiled programs (the agent count and every setting but
        the per-agent hyperparameters, which are tensors in them): a trainer whose programs
        are built marks it in the compile cache, so ``compile: auto`` counts no compile for the
        next one (a restarted pod, a PBT child's, a second ``podium train``). Settings that do
        not touch the programs are in it too: a miss only means a compile is assumed."""
        first = configs[0]
        ppo = first.ppo.model_dump(mode="json", exclude={*HYPERPARAMETERS, "compile"})
        facts = {
            "agents": len(configs),
            "env": first.env,
            "eval_episodes": first.eval_episodes,
            "device": torch.device(first.device).type,
            "ppo": ppo,
        }
        return json.dumps(facts, sort_keys=True)

    # -- the trainer -----------------------------------------------------------------------
    def __init__(
        self,
        configs: Sequence[PPORunConfig],
        roles: Roles | None = None,
        compile: AnakinCompile | None = None,
    ) -> None:
        """``compile``: the runner's mode; default ``"steps"`` unless ``ppo.compile`` is
        ``off`` (then the same functions run eagerly, e.g. for tests)."""
        if reason := self.unsupported(configs, roles):
            raise HyperparameterError(f"the Anakin trainer cannot train these configs: {reason}")
        first = configs[0]
        self.size = len(configs)
        self.configs = list(configs)
        self.device = torch.device(first.device)
        self.mode: AnakinCompile = compile or ("off" if first.ppo.compile == "off" else "steps")
        self.run = AnakinPPO(
            first.ppo,
            [c.seed for c in configs],
            [self._hyperparameters(c) for c in configs],
            total_env_steps=first.total_env_steps,
            compile=self.mode,
            device=self.device,
            env=registry.load(registry.ENVS, first.env, kind="env"),
            # On a GPU the whole iteration replays as one CUDA graph (the slot loads below
            # write into the state in place, so they reach the graph's buffers).
            cuda_graph=self.device.type == "cuda" and self.mode != "off",
        )
        # Every evaluation starts from the states a single agent's Evaluator starts from.
        eval_env = make_env(
            first.env, first.eval_episodes, device=self.device, seed=first.evaluation_seed
        )
        self.start = anakin_eval.start_states(eval_env, first.evaluation_seed, self.size)
        eval_env.close()
        self.offsets = [Counters(0, 0) for _ in configs]
        self.compile_seconds = 0.0
        self._marked = False
        self._metrics: dict[str, torch.Tensor] | None = None

    @staticmethod
    def _hyperparameters(config: PPORunConfig) -> dict[str, float]:
        return {k: float(getattr(config.ppo, k)) for k in HYPERPARAMETERS}

    def _timed(self, program: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, logging the compile seconds it took (a first call, a recompile)."""
        before, start = compile_clock(), time.perf_counter()
        out = fn(*args)
        spent = compile_clock() - before
        if spent > 0:
            self.compile_seconds += spent
            log.info(
                "compile.done",
                program=program,
                compile_s=round(spent, 2),
                first_call_s=round(time.perf_counter() - start, 2),
                total_compile_s=round(self.compile_seconds, 2),
                agents=self.size,
            )
        return out

    @property
    def env_steps(self) -> int:
        return self.run.env_steps

    @property
    def updates(self) -> int:
        return self.run.iterations

    @property
    def step_env_steps(self) -> int:
        return self.run.shape.batch

    def step(self) -> None:
        if not self.run.iterations and not self._marked:
            self._timed("programs", self._build_ahead)
        self._metrics = self._timed("iteration", self.run.step)

    def _build_ahead(self) -> None:
        """Before the first iteration, where programs are compiled ahead of time and this
        cache lacks some: build every program the iteration and the evaluation will ask for
        at once, a process each (``aot_program.build_concurrently``), instead of one after
        another on first use."""
        if self.mode != "steps" or not aot_program.used_on(self.device):
            return
        if aot_program.builders() < 2 or aot_program.ready(self.programs_of(self.configs)):
            return
        run = self.run
        jobs = anakin.program_jobs(run.shape, run.state, run.hp)
        jobs += anakin_eval.program_jobs(run.shape, run.state, self.start)
        aot_program.build_concurrently(jobs)

    def progress(self) -> dict[str, float]:
        """The agents' last-epoch statistics averaged; the mean return of every agent's
        finished training episodes (the host read at an iteration boundary)."""
        if self._metrics is None:
            return {}
        m = self._metrics
        record = dict(zip(PPO_STATS, m["stats"].mean(0).tolist(), strict=True))
        record["lr"] = float(m["lr"].mean())
        episodes = int(m["episodes"].sum())
        if episodes:
            record["train_return"] = float(m["return_sum"].sum()) / episodes
        return record

    def evaluate(self) -> list[EvalResult]:
        compiled = self.mode != "off"
        shape, state = self.run.shape, self.run.state
        results = self._timed(
            "evaluation", anakin_eval.evaluate, shape, state, self.start, compiled
        )
        built = self.run.iterations and not aot_program.COUNTS["failed"]
        if compiled and built and not self._marked and aot_program.used_on(self.device):
            # An iteration and an evaluation have run: every program is built (or loaded), and
            # none fell back to torch.compile (whose warm start still traces).
            aot_program.mark_ready(self.programs_of(self.configs))
            self._marked = True
        return results

    # -- files -----------------------------------------------------------------------------
    def _agent_of(self, slot: int) -> RolloutLearner:
        agent = self.run.agent(slot).to(self.device)
        params, _, *moments = self._views(slot, agent)
        steps = float(self.run.state["adam_step"][slot])
        # Set, not loaded into a torch.optim.Adam: saving writes it from there without
        # building one (a pod saves at every evaluation; the first Adam imports dynamo).
        agent.set_optimizer_state(list(adam_state(params, steps, *moments).values()))
        return RolloutLearner(agent, self.configs[slot].total_env_steps)

    def _views(self, slot: int, agent: PPO) -> list[list[torch.Tensor]]:
        """``agent``'s parameters, then slot ``slot``'s weights, ``exp_avg`` and ``exp_avg_sq``
        of each in the state (views, written in place)."""
        named = {n.removeprefix("policy."): t for n, t in agent.named_parameters()}
        views = self.run.shape.views
        parts = [views(self.run.state[part]) for part in ("params", "exp_avg", "exp_avg_sq")]
        return [list(named.values()), *([part[k][slot] for k in named] for part in parts)]

    def _fresh(self, config: PPORunConfig) -> RolloutLearner:
        if _shared(config) != _shared(self.configs[0]):
            raise HyperparameterError(
                "a slot of this pod takes only the per-agent hyperparameters "
                f"({', '.join(HYPERPARAMETERS)}) of another config"
            )
        probe = self.run.shape.env(num_envs=1)
        torch.manual_seed(config.seed)
        agent = PPO(probe.single_observation_space, probe.single_action_space, config.ppo)
        return RolloutLearner(agent.to(self.device), config.total_env_steps)

    @torch.no_grad()
    def _put(self, slot: int, learner: RolloutLearner, config: PPORunConfig) -> None:
        """Write ``learner``'s agent into slot ``slot`` of the state, in place: the tensors
        the compiled programs take stay the same objects, so nothing recompiles."""
        state, agent = self.run.state, learner.agent
        params, weights, *moments = self._views(slot, agent)
        for weight, param in zip(weights, params, strict=True):
            weight.copy_(param)
        # No moments for a fresh agent: zeros, step 0.
        state["adam_step"][slot] = load_adam_state(params, agent.optimizer.state, *moments)
        rms = agent.policy.obs_rms
        state["obs_mean"][slot] = rms.mean
        state["obs_var"][slot] = rms.var
        state["obs_count"][slot] = rms.count
        state["seed"][slot] = config.seed  # the slot explores with its own random stream
        self.run.set_hyperparameters(slot, self._hyperparameters(config))

    def close(self) -> None:
        """Nothing to close: the env is a tensor of the state."""
