"""PPO's roles built from a run config: the agent, its worker, and where worker and evaluator
run (``LocalRoles`` in the learner's process; services/pod/roles/multiprocess.py apart).

Every process that builds them from the same config gets the same envs and initial weights,
which is what lets the roles run fused in one process or as three processes or containers.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.logs import get_logger
from services.pod.algorithms.compiled import should_compile
from services.pod.algorithms.ppo import PPO
from services.pod.algorithms.rollout import Rollout
from services.pod.algorithms.spaces import check_action_space
from services.pod.config import PPORunConfig
from services.pod.envs.base import TorchVecEnv, VecEnv
from services.pod.roles.evaluator import EvalResult, Evaluator
from services.pod.roles.learner import RolloutLearner
from services.pod.roles.placement import Roles
from services.pod.roles.worker import FusedRolloutWorker, RolloutWorker

log = get_logger(__name__)


def build_agent(config: PPORunConfig) -> tuple[VecEnv, VecEnv, PPO]:
    """The training env, the evaluation env and a fresh agent, seeded by ``config``: every
    process that builds them from the same config gets the same initial weights."""
    torch.manual_seed(config.seed)
    env, eval_env = config.make_envs(config.ppo.num_envs)
    try:
        check_action_space("ppo", env.single_action_space)
    except ValueError:
        env.close()
        eval_env.close()
        raise
    agent = PPO(env.single_observation_space, env.single_action_space, config.ppo)
    agent.compiled = should_compile(config.ppo.compile, config.device, config.ppo.num_envs)
    return env, eval_env, agent.to(config.device)


def make_worker(config: PPORunConfig, env: VecEnv, agent: PPO) -> RolloutWorker:
    """The fused (Anakin) worker where the agent compiles and the env is torch-native, else
    the eager one; an env that cannot be compiled says so once in the log."""
    cfg = config.ppo
    args = (agent.policy, cfg.num_steps, cfg.gamma, config.seed)
    if agent.compiled and isinstance(env, TorchVecEnv):
        return FusedRolloutWorker(env, *args, compile=True)
    if agent.compiled:
        log.warning("compile.env_not_torch_native", env=config.env, fallback="eager rollout")
    return RolloutWorker(env, *args)


class RolloutRoles(Roles, Protocol):
    """Where PPO's worker and evaluator run (``LocalRoles`` here, services/pod/roles/multiprocess.py
    apart): built for a config, they collect rollouts and evaluate the learner's policy."""

    def build(
        self, config: PPORunConfig, env: VecEnv, eval_env: VecEnv, learner: RolloutLearner
    ) -> None: ...
    def collect(self) -> Rollout: ...
    def evaluate(self) -> EvalResult: ...


class LocalRoles:
    """Worker and evaluator in this process, holding the learner's own policy: nothing to
    copy between them."""

    in_process = True

    def __init__(self) -> None:
        self.worker: RolloutWorker | None = None
        self.evaluator: Evaluator | None = None
        self.learner: RolloutLearner | None = None

    def build(
        self, config: PPORunConfig, env: VecEnv, eval_env: VecEnv, learner: RolloutLearner
    ) -> None:
        self.close()  # a restart from a parent replaces the envs too
        self.worker = make_worker(config, env, learner.agent)
        self.evaluator = Evaluator(eval_env, seed=config.evaluation_seed)
        self.learner = learner

    def collect(self) -> Rollout:
        assert self.worker is not None
        return self.worker.collect()

    def evaluate(self) -> EvalResult:
        assert self.evaluator is not None and self.learner is not None
        return self.evaluator.evaluate(self.learner.policy)

    def close(self) -> None:
        for role in (self.worker, self.evaluator):
            if role is not None:
                role.env.close()
        self.worker = self.evaluator = None
