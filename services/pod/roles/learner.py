"""The learner: turns what the worker collected into updates, the single writer of the agents'
state (weights, optimiser, normalisation statistics, counters); workers and evaluators only
read the policy. On-policy, ``PPOLearner`` runs ``ppo.learn`` (services/pod/algorithms/ppo.py)
over each rollout; off-policy, ``ReplayLearner`` pays the update-to-data ratio
(``UpdateSchedule``) for P stacked agents (services/pod/algorithms/stacked.py), ``k`` updates
per call of the K-step update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.contracts.algorithms.ppo.config import PPOConfig
from services.pod.algorithms import ppo
from services.pod.algorithms.compiled import BoundProgram, CompileFailedError, Graphed, Program
from services.pod.algorithms.policies import mode
from services.pod.algorithms.ppo import PPO
from services.pod.algorithms.stacked import KStep, Stack, StackedReplay
from services.pod.config import PPORunConfig, same_spaces
from services.pod.envs.base import TorchVecEnv, VecEnv
from services.pod.envs.functional import FunctionalEnv
from services.pod.envs.registry import functional_env, is_functional, make_env
from services.pod.roles.evaluator import (
    EvalResult,
    evaluate_groups,
    greedy_scores,
    greedy_steps,
    results,
)
from services.pod.roles.worker import Carry, HostStep, collect, rollout, start_carry

#: Rollout steps per compiled call: a call costs tens of µs of host time, the compile grows with
#: the steps; half as many from ``MANY_ENVS`` sub-envs (all agents') on (docs/benchmarks.md).
ROLLOUT_CHUNK, MANY_ENVS = 8, 16

# The programs, module-level: every trainer of the same shape in a process (a PBT child's,
# a restarted slot's) reuses them.
_CHUNK = Program(rollout, "rollout")
_BATCH = Program(ppo.batch, "batch")
_UPDATE = Program(ppo.minibatch_update, "minibatch_update")
_EVALUATE = Program(greedy_steps, "evaluate")


def chunk_length(num_steps: int, envs: int) -> int:
    """Rollout steps per call: ``num_steps``' largest divisor <= the most for ``envs`` sub-envs."""
    most = min(ROLLOUT_CHUNK if envs < MANY_ENVS else ROLLOUT_CHUNK // 2, num_steps)
    return max(k for k in range(1, most + 1) if not num_steps % k)


class PPOLearner:
    """PPO's learner for the on-policy trainer: P >= 1 agents on one env, the rollout's carry,
    the iteration (the worker's rollout, then ``ppo.learn``), eager or compiled, and the
    agents' greedy evaluation. ``env``: a functional env (rollout and evaluation are pure
    functions: they compile) or a host-stepped ``VecEnv`` of P x N sub-environments."""

    def __init__(
        self,
        env: FunctionalEnv | VecEnv,
        config: PPOConfig,
        agents: Sequence[PPO],
        hyperparameters: Sequence[Mapping[str, float]],
        seeds: Sequence[int],
        total_env_steps: int,
        device: torch.device,
        max_episode_steps: int | None = None,
        reset_seed: int = 0,
    ) -> None:
        self.size = len(agents)
        self.device = device
        self.shape, self.state, self.hp = ppo.build(
            config, agents, hyperparameters, total_env_steps, device, max_episode_steps
        )
        self.state["seed"].copy_(torch.tensor(list(seeds), device=device))
        self.fn = env if isinstance(env, FunctionalEnv) else None
        self.host = HostStep(env, self.size) if self.fn is None else None
        self.after_epoch: Callable[[ppo.State], None] | None = None
        shape = self.shape
        if self.fn is not None:
            self.carry = start_carry(shape, self.fn, None, self.state["seed"])
        else:
            assert self.host is not None
            obs, _ = self.host.env.reset(seed=reset_seed)
            obs = obs.view(self.size, shape.num_envs, -1)
            self.carry = start_carry(shape, None, obs, self.state["seed"])
        self._parts: dict[bool, tuple[Callable, Callable, Callable]] = {}
        self._graph: Graphed | None = None
        self._evaluate: BoundProgram | None = None

    def _programs(self, compiled: bool) -> tuple[Callable, Callable, Callable]:
        """The iteration's parts, eager or compiled: the rollout, the batch, the update."""
        if compiled in self._parts:
            return self._parts[compiled]
        shape, device = self.shape, self.device
        env = self.fn if self.fn is not None else self.host
        chunk = shape.num_steps
        if compiled and self.fn is not None:
            chunk = chunk_length(shape.num_steps, shape.agents * shape.num_envs)
            chunk_program = _CHUNK.bind(device)

            def chunk_fn(*args: Any) -> Any:
                return chunk_program(shape, env, *args, chunk)
        else:
            chunk_fn = functools.partial(rollout, shape, env, steps=chunk)
        batch_fn: Callable = ppo.batch
        update_fn: Callable = ppo.minibatch_update
        if compiled:
            batch_fn = _BATCH.bind(device)
            update_fn = _UPDATE.bind(device)
        run = functools.partial(collect, shape, chunk_fn=chunk_fn, chunk=chunk)
        self._parts[compiled] = (run, batch_fn, update_fn)
        return self._parts[compiled]

    def iterate(self, compiled: bool = False) -> dict[str, torch.Tensor]:
        """One iteration (rollout, update) of every agent, ``ppo.learn``'s metrics as tensors. On
        a GPU the compiled iteration of a functional env replays as one CUDA graph."""
        graphed = compiled and self.device.type == "cuda" and self.fn is not None
        if graphed and self.after_epoch is None:
            if self._graph is None:
                self._graph = Graphed(lambda: self._iteration(True, True), "ppo iteration")
            return {k: v.clone() for k, v in self._graph().items()}
        return self._iteration(compiled, False)

    def collect(self, compiled: bool = False, in_place: bool = False) -> dict[str, torch.Tensor]:
        """The iteration's rollout with the current weights (``iterate``: this, then ``learn``)."""
        carry, roll = self._programs(compiled)[0](self.state, self.carry, self.hp)
        if in_place:  # a CUDA graph reads and writes the same carry tensors every replay
            _copy_into(self.carry, carry)
        else:
            self.carry = carry
        return roll

    def learn(self, roll: Mapping[str, torch.Tensor], compiled: bool = False) -> dict:
        """The iteration's update (GAE, epochs x minibatches) from ``collect``'s rollout."""
        _, batch_fn, update_fn = self._programs(compiled)
        return ppo.learn(
            self.shape, self.state, roll, self.hp, update_fn, batch_fn, self.after_epoch
        )

    def _iteration(self, compiled: bool, in_place: bool) -> dict[str, torch.Tensor]:
        return self.learn(self.collect(compiled, in_place), compiled)

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> torch.Tensor:
        """Every agent's greedy env actions for raw observations (P * n, D), agent p's slice p."""
        shape, p = self.shape, self.size
        norm = ppo.normalize(shape, self.state, obs.view(p, -1, shape.obs_dim))
        action = mode(shape.policy, shape.layout.views(self.state["params"]), norm)
        return action.reshape(obs.shape[0], *action.shape[2:])

    @torch.no_grad()
    def evaluate(
        self, env: FunctionalEnv | VecEnv, start: torch.Tensor | None, seed: int, compiled: bool
    ) -> list[EvalResult]:
        """Score every agent greedily: on a functional env from ``start`` (P, N, state_dim),
        one program; on a ``VecEnv`` of P x N sub-environments from its reset with ``seed``."""
        if isinstance(env, FunctionalEnv):
            state = self.state
            args = (self.shape, env, state["params"], state["obs_mean"], state["obs_var"], start)
            if compiled and self._evaluate is None:
                self._evaluate = _EVALUATE.bind(self.device)
            steps = self._evaluate if compiled else greedy_steps
            return results(*greedy_scores(*args, steps))
        return evaluate_groups(env, self.act, groups=self.size, seed=seed)

    def agent(self, i: int, agent: PPO) -> PPO:
        """Agent ``i`` (weights, statistics, Adam state) written into ``agent``, a fresh PPO."""
        return ppo.get_agent(self.shape, self.state, i, agent)

    def put(self, i: int, agent: PPO, config: PPOConfig, seed: int, env_steps: int) -> None:
        """``agent`` (with ``config``'s per-agent hyperparameters) into slot ``i``, in place:
        the tensors the programs take stay the same objects, nothing compiles again."""
        ppo.put_agent(self.shape, self.state, i, agent)
        ppo.set_hyperparameters(self.shape, self.hp, i, config, per_agent(config))
        self.state["seed"][i] = seed  # the slot explores with its own random stream
        self.state["env_steps"][i] = float(env_steps)

    def copy(self, dst: int, src: int, config: PPOConfig) -> None:
        """PBT's exploit inside the population: agent ``dst`` restarts from agent ``src``
        with ``config``'s hyperparameters (explore)."""
        ppo.copy_agent(self.state, dst, src)
        ppo.set_hyperparameters(self.shape, self.hp, dst, config)

    def hyperparameters(self, i: int) -> dict[str, float]:
        return {name: float(self.hp[name][i]) for name in self.shape.hyperparameters}


def per_agent(config: PPOConfig) -> dict[str, float]:
    """``config``'s numbers: what the shape's ``hyperparameters`` set its agent's tensors from."""
    return {
        k: float(v)
        for k, v in config.model_dump().items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _copy_into(carry: Carry, new: Carry) -> None:
    """Write ``new``'s tensors into ``carry``'s, in place."""
    olds = [carry.obs, carry.discounted, carry.sde, *(carry.env or ())]
    news = [new.obs, new.discounted, new.sde, *(new.env or ())]
    for old, value in zip(olds, news, strict=True):
        if value is not old:
            old.copy_(value)


@dataclass
class PPOEnvs:
    """A PPO run's envs: the functional env of training and of evaluation and the
    evaluation's start states where the env is functional, else the host-stepped envs of
    training and of evaluation (P x N and P x episodes sub-environments)."""

    fn: FunctionalEnv | None = None
    eval_fn: FunctionalEnv | None = None
    start: torch.Tensor | None = None
    env: VecEnv | None = None
    eval_env: VecEnv | None = None

    @classmethod
    def build(cls, config: PPORunConfig, slots: int = 1) -> PPOEnvs:
        device = torch.device(config.device)
        kwargs = config.env_kwargs
        eval_kwargs = {**kwargs, **config.eval_env_kwargs}
        out = cls()
        if is_functional(config.env):
            out.fn = functional_env(config.env, device, **kwargs)
            out.eval_fn = same_spaces(out.fn, functional_env(config.env, device, **eval_kwargs))
            # Every agent's episodes start as a single agent's would (``VecEnv.reset``).
            episodes = config.eval_episodes
            evaluation = make_env(config.env, slots * episodes, device=device, **eval_kwargs)
            assert isinstance(evaluation, TorchVecEnv)
            evaluation.reset(seed=config.evaluation_seed, groups=slots)
            out.start = evaluation.state.view(slots, episodes, -1).clone()
            evaluation.close()
            return out
        out.env, out.eval_env = config.make_envs(config.agent_config.num_envs, slots)
        return out

    @property
    def train(self) -> FunctionalEnv | VecEnv:
        train = self.fn if self.fn is not None else self.env
        assert train is not None
        return train

    @property
    def evaluation(self) -> FunctionalEnv | VecEnv:
        evaluation = self.eval_fn if self.eval_fn is not None else self.eval_env
        assert evaluation is not None
        return evaluation

    def spaces(self) -> tuple[Any, Any]:
        """The observation and action spaces of one sub-environment."""
        return self.train.single_observation_space, self.train.single_action_space

    def close(self) -> None:
        for env in (self.env, self.eval_env):
            if env is not None:
                env.close()
        self.env = self.eval_env = None


class UpdateSchedule:
    """The update-to-data ratio, as every replay learner pays it: once ``learning_starts`` env steps
    are in, each env step owes ``updates_per_step`` updates; what is short of a whole call of ``k``
    updates (one eager, ``updates_per_call`` compiled) stays owed, as ``update_debt``, for the next
    steps. It counts the env steps seen and, by the learner that pays them, the updates (the agents'
    schedules, e.g. TD3's policy delay, DQN's target period, count from ``updates``)."""

    def __init__(self, learning_starts: int, updates_per_step: float, k: int = 1) -> None:
        self.learning_starts, self.updates_per_step, self.k = learning_starts, updates_per_step, k
        self.env_steps = 0
        self.updates = 0
        self.update_debt = 0.0  # fractional updates owed to the update-to-data ratio

    def owed(self, env_steps: int) -> int:
        """Count ``env_steps`` new env steps; the calls of ``k`` updates now owed (taken off
        the debt: the caller runs them and counts them in ``updates``)."""
        self.env_steps += env_steps
        if self.env_steps < self.learning_starts:
            return 0
        self.update_debt += env_steps * self.updates_per_step
        calls = int(self.update_debt) // self.k
        # Whole updates off a float under 2**53 are exact: the debt of paying a call at a time.
        self.update_debt -= calls * self.k
        return calls


class ReplayLearner(UpdateSchedule):
    """The learner of P stacked agents and their ``StackedReplay``: the schedule paid for every
    agent at once, ``k`` updates per call of ``kstep``. The agents share its clock
    (``env_steps``, ``updates``); each slot's own counters are the clock plus the offset of the
    files it was loaded from (``place``), kept on the host for its training files and on the
    device (``slot_env_steps``, ``slot_updates``, counted in place) for what reads them every
    step without a host-to-device copy: DQN's ε schedule (the worker) and target period."""

    def __init__(
        self,
        population: Stack,
        replay: StackedReplay,
        learning_starts: int,
        updates_per_step: float,
        kstep: KStep,
        compiled: bool = False,
        k: int = 1,
    ) -> None:
        super().__init__(learning_starts, updates_per_step, k if compiled else 1)
        self.population, self.replay, self.kstep = population, replay, kstep
        self.compiled = compiled
        # DQN's targets move on each slot's own update count, as a single DQN pod's do; the
        # other agents' schedules (TD3's policy delay) run on the population's.
        self.slot_steps = population.slot_updates
        p, device = replay.p, replay.device
        self.offsets = [(0, 0)] * p  # each slot's (env steps, updates) less the clock's
        self.slot_env_steps = torch.zeros(p, dtype=torch.int64, device=device)
        self.slot_updates = torch.zeros(p, dtype=torch.int64, device=device)

    def learn(self, env_steps: int) -> dict[str, torch.Tensor]:
        """Count ``env_steps`` new env steps of every agent, then run the updates they owe;
        the last update's statistics, (P,) each (empty when none ran)."""
        calls = self.owed(env_steps)
        self.slot_env_steps.add_(env_steps)
        stats: dict[str, torch.Tensor] = {}
        for done in range(calls):
            slot_updates = self.slot_updates if self.slot_steps else None
            try:
                stats = self.kstep(self.k, self.updates + 1, self.compiled, slot_updates)
            except CompileFailedError:
                self.update_debt += (calls - done) * self.k  # still owed
                raise
            self.updates += self.k
            self.slot_updates.add_(self.k)
        return stats

    def compile(self, compiled: bool, k: int) -> None:
        """From now on, pay the updates compiled (``k`` per call) or eager (one)."""
        self.compiled, self.k = compiled, k if compiled else 1

    def slot_counters(self, slot: int) -> tuple[int, int]:
        """Slot ``slot``'s env steps and updates (read on the host: no sync)."""
        env_steps, updates = self.offsets[slot]
        return self.env_steps + env_steps, self.updates + updates

    def place(self, slot: int, env_steps: int, updates: int) -> None:
        """Slot ``slot`` goes on from ``env_steps`` and ``updates`` (its files', or zero)."""
        self.offsets[slot] = (env_steps - self.env_steps, updates - self.updates)
        self.slot_env_steps[slot] = env_steps
        self.slot_updates[slot] = updates
