"""Train one off-policy agent (SAC, TD3, DDPG, DQN family) in one process, fused.

The same worker → learner → evaluator split as PPO's loop (services/pod/train.py), in the
shape off-policy methods need. Read it top to bottom, one vector step at a time:

* worker: step every sub-environment with the exploring policy (uniform random actions until
  ``learning_starts``) and append the N transitions to the replay buffer, which lives on the
  env's device;
* learner: ``updates_per_step`` gradient updates per env step (the update-to-data ratio), each
  on a fresh minibatch sampled from the buffer;
* evaluator: every ``eval_every_steps`` env steps, deterministic episodes on its own env; the
  clock stops meanwhile, and training stops once ``target_return`` is reached.

Many cheap torch-native sub-environments and few large-batch updates is what makes this fast
in wall time: on a CPU a SAC update of 64x64 networks costs ~2.5 ms (mostly per-op overhead
and small matmuls) while a vector step of 32 sub-environments costs tens of microseconds, so
wall time tracks the number of gradient steps, and fresh data is nearly free.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, model_validator

from services import registry
from services.pod.algorithms.offpolicy_config import (
    OFF_POLICY_ALGORITHMS,
    DDPGConfig,
    DQNConfig,
    ReplayLoopConfig,
    SACConfig,
    TD3Config,
)
from services.pod.algorithms.replay_buffer import ReplayBuffer
from services.pod.checkpoint import (
    CheckpointError,
    json_bytes,
    optimizer_from_files,
    optimizer_to_files,
    read_files,
    tensor_bytes,
    write_files,
)
from services.pod.envs.base import VecEnv
from services.pod.evaluator import EvalResult, Evaluator
from services.pod.train import SOLVED_AT, RunConfig, TrainResult


class OffPolicyConfig(RunConfig, ReplayLoopConfig):
    """One off-policy training run: the run's fields, the loop's hyperparameters
    (``ReplayLoopConfig``: envs, replay, batch, update-to-data ratio), and the field named by
    ``algorithm`` holds the agent's."""

    env: str = "Pendulum-v1"
    algorithm: str = "sac"
    total_env_steps: int = Field(100_000, ge=1, description="Training budget in env steps.")
    eval_every_steps: int = Field(2_048, ge=1)
    sac: SACConfig = Field(default_factory=SACConfig)
    td3: TD3Config = Field(default_factory=TD3Config)
    ddpg: DDPGConfig = Field(default_factory=DDPGConfig)
    dqn: DQNConfig = Field(default_factory=DQNConfig)

    @model_validator(mode="after")
    def _known_algorithm(self) -> OffPolicyConfig:
        if self.algorithm not in OFF_POLICY_ALGORITHMS:
            raise ValueError(
                f"algorithm: {self.algorithm!r} is not an off-policy algorithm "
                f"(one of {', '.join(OFF_POLICY_ALGORITHMS)})"
            )
        return self

    @property
    def agent_config(self) -> BaseModel:
        return getattr(self, self.algorithm)


#: Tuned starting points per (algorithm, env); a config file or --set overrides any field.
#: Many envs, large batches, a low update-to-data ratio (0.25) and a high learning rate: few
#: gradient steps, each on plenty of fresh data, is what costs the least wall time here. In
#: sweeps over seeds 1-4 the Pendulum presets solved in 6-9k env steps (~1.3-2k updates), the
#: CartPole one (D3QN) in 17-29k env steps (~2-3.5k updates) over seeds 0-4.
_PENDULUM_LOOP: dict[str, Any] = {
    "num_envs": 32,
    "total_env_steps": 40_000,
    "learning_starts": 1_024,
    "batch_size": 512,
    "updates_per_step": 0.25,
    "eval_every_steps": 1_024,
}
# SAC, TD3 and DDPG solve Pendulum with the same loop and network settings.
_PENDULUM_AGENT = {"learning_rate": 2e-3, "gamma": 0.98, "hidden_sizes": [64, 64], "tau": 0.02}
PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    **{
        (name, "Pendulum-v1"): {**_PENDULUM_LOOP, name: dict(_PENDULUM_AGENT)}
        for name in ("sac", "td3", "ddpg")
    },
    ("dqn", "CartPole-v1"): {
        "num_envs": 16,
        "total_env_steps": 60_000,
        "learning_starts": 1_024,
        "batch_size": 256,
        "updates_per_step": 0.125,
        "eval_every_steps": 1_024,
        "dqn": {
            "double": True,
            "dueling": True,
            "learning_rate": 2.3e-3,
            "hidden_sizes": [64, 64],
            "exploration_steps": 2_000,
            "epsilon_end": 0.01,
        },
    },
}


def preset(algorithm: str, env: str) -> dict[str, Any]:
    """The preset for (``algorithm``, ``env``) with the env's solve threshold as target."""
    base: dict[str, Any] = {"algorithm": algorithm, "env": env, "target_return": SOLVED_AT.get(env)}
    overrides = PRESETS.get((algorithm, env), {})
    return {**base, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in overrides.items()}}


@dataclass
class OffPolicyRoles:
    """One off-policy agent and what trains it, fused in this process: the worker's env, the
    agent (the learner's state), the replay buffer and the evaluator. ``step`` is one vector
    step of worker → replay → learner; ``train_offpolicy`` and the pod's rounds
    (services/pod/runtime.py) both drive it."""

    config: OffPolicyConfig
    env: VecEnv
    agent: torch.nn.Module
    buffer: ReplayBuffer
    evaluator: Evaluator
    generator: torch.Generator  # exploration noise and minibatch sampling
    env_steps: int = 0
    updates: int = 0
    update_debt: float = 0.0  # fractional updates owed to the update-to-data ratio
    obs: torch.Tensor | None = None  # the worker's current observations; None: reset first
    # Returns of finished episodes, summed on the device and read only when a record is made.
    return_sum: torch.Tensor = field(init=False)
    episodes: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.return_sum = torch.zeros((), device=self.env.device, dtype=torch.float64)
        self.episodes = torch.zeros((), device=self.env.device, dtype=torch.int64)

    @property
    def policy(self) -> torch.nn.Module:
        return self.agent.policy

    def counters(self) -> dict[str, Any]:
        return {
            "env_steps": self.env_steps,
            "updates": self.updates,
            "update_debt": self.update_debt,
        }

    def reset(self) -> None:
        """Start fresh episodes (seeded by the env steps so far, so a resumed run differs)."""
        self.obs, _ = self.env.reset(seed=self.config.seed + self.env_steps)
        self.return_sum.zero_()
        self.episodes.zero_()

    def step(self) -> dict[str, torch.Tensor]:
        """One vector step of every sub-environment, then the updates it owes; returns the
        last update's statistics (empty when none ran)."""
        if self.obs is None:
            self.reset()
        cfg, agent, gen, n = self.config, self.agent, self.generator, self.env.num_envs
        # Worker: act, step, remember.
        if self.env_steps < cfg.learning_starts:
            action = agent.random_action(n, gen)
        else:
            action = agent.explore(self.obs, gen, self.env_steps)
        next_obs, reward, terminated, truncated, info = self.env.step(agent.to_env(action))
        # next_obs of an ended episode is its final observation, not the reset one.
        self.buffer.add(self.obs, action, reward, info["final_obs"], terminated)
        self.obs = next_obs
        self.env_steps += n
        self.return_sum += info["episode_return"].sum()  # zero where no episode ended
        self.episodes += (terminated | truncated).sum()

        # Learner: updates owed to the update-to-data ratio.
        stats: dict[str, torch.Tensor] = {}
        if self.env_steps >= cfg.learning_starts:
            self.update_debt += n * cfg.updates_per_step
            owed = int(self.update_debt)
            self.update_debt -= owed
            for _ in range(owed):
                # The agents' schedules (policy delay, target updates) count from this number.
                self.updates += 1
                stats = agent.update(self.buffer.sample(cfg.batch_size, gen), gen, self.updates)
        return stats

    def evaluate(self) -> EvalResult:
        return self.evaluator.evaluate(self.agent.policy)

    def train_return(self) -> float | None:
        """Mean return of the episodes finished since the last call (None if none did)."""
        episodes = int(self.episodes)
        if not episodes:
            return None
        mean = float(self.return_sum) / episodes
        self.return_sum.zero_()
        self.episodes.zero_()
        return mean

    def close(self) -> None:
        self.env.close()
        self.evaluator.env.close()


def build(config: OffPolicyConfig) -> OffPolicyRoles:
    """Construct env, agent, replay buffer and evaluator for ``config``."""
    # Looked up by registered name: a config can name an algorithm, never a module.
    algorithm = registry.load(registry.ALGORITHMS, config.algorithm, kind="algorithm")
    torch.manual_seed(config.seed)
    env, eval_env = config.make_envs(config.num_envs)
    obs_space, action_space = env.single_observation_space, env.single_action_space
    agent = algorithm(obs_space, action_space, config.agent_config).to(config.device)
    buffer = ReplayBuffer(
        config.buffer_size,
        tuple(obs_space.shape),
        agent.action_shape,
        torch.int64 if agent.discrete else torch.float32,
        device=env.device,
    )
    generator = torch.Generator(device=env.device)
    generator.manual_seed(config.seed)
    evaluator = Evaluator(eval_env, seed=config.evaluation_seed)
    return OffPolicyRoles(
        config=config,
        env=env,
        agent=agent,
        buffer=buffer,
        evaluator=evaluator,
        generator=generator,
    )


Callback = Callable[[dict[str, float]], None]


def train_offpolicy(
    config: OffPolicyConfig,
    out_dir: Path | None = None,
    on_progress: Callback | None = None,
    roles: OffPolicyRoles | None = None,
) -> TrainResult:  # the same record as the on-policy loop
    """Train until the budget is spent or the evaluation reaches ``target_return``.

    ``roles`` (built from ``config``) lets a caller build them first (and so validate, or
    resume with ``load_offpolicy_files``); the run then continues from ``roles.env_steps``.
    """
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    r = roles or build(config)
    result = TrainResult(config=config)
    r.reset()
    next_eval = (r.env_steps // config.eval_every_steps + 1) * config.eval_every_steps
    stats: dict[str, torch.Tensor] = {}
    clock = 0.0
    while r.env_steps < config.total_env_steps:
        start = time.perf_counter()
        stats = r.step() or stats  # worker and learner
        clock += time.perf_counter() - start

        # Evaluator.
        last = r.env_steps >= config.total_env_steps
        if r.env_steps < next_eval and not last:
            continue
        next_eval += config.eval_every_steps
        evaluation = r.evaluate()
        record: dict[str, float] = {
            "env_steps": r.env_steps,
            "updates": r.updates,
            "train_seconds": clock,
            **{k: float(v) for k, v in stats.items()},
            "eval_return": evaluation.mean,
            "eval_std": evaluation.std,
        }
        if (train_return := r.train_return()) is not None:
            record["train_return"] = train_return
        if out_dir is not None:
            save_offpolicy_files(out_dir / "checkpoints" / "latest", r, config)
            if r.evaluator.best is evaluation:
                save_offpolicy_files(out_dir / "checkpoints" / "best", r, config)
        if config.target_return is not None and evaluation.mean >= config.target_return:
            result.solved_at_env_steps = r.env_steps
        result.history.append(record)
        if on_progress is not None:
            on_progress(record)
        if result.solved_at_env_steps is not None:
            break
    result.best = r.evaluator.best
    result.train_seconds = clock
    return result


# -- training files --------------------------------------------------------------------------
def save_offpolicy_files(
    directory: Path, roles: OffPolicyRoles, config: OffPolicyConfig
) -> dict[str, str]:
    """Write the full training state, replay buffer included; returns file name → sha256.

    ``actor.safetensors`` is the policy alone (enough to act), ``critic.safetensors`` every
    other network (critics, targets, temperature).
    """
    agent = roles.agent
    state = agent.state_dict()
    files = {
        "actor.safetensors": tensor_bytes(agent.policy.state_dict()),
        "critic.safetensors": tensor_bytes(
            {k: v for k, v in state.items() if not k.startswith("policy.")}
        ),
        "replay_buffer.safetensors": tensor_bytes(roles.buffer.state_dict()),
        "rng.safetensors": tensor_bytes({"generator": roles.generator.get_state()}),
        "hyperparameters.json": json_bytes(config.model_dump(mode="json")),
        "counters.json": json_bytes(roles.counters()),
    }
    for name, optimizer in agent.optimizers().items():
        tensors, meta = optimizer_to_files(optimizer)
        files[f"{name}.safetensors"] = tensors
        files[f"{name}.json"] = meta
    return write_files(directory, files, {"algorithm": agent.name})


def load_offpolicy_files(directory: Path, roles: OffPolicyRoles) -> None:
    """Restore ``roles`` from verified training files. Raises ``CheckpointError``."""
    files = read_files(directory)
    agent = roles.agent
    if (found := files.manifest.get("algorithm")) != agent.name:
        raise CheckpointError(f"{directory}: checkpoint of {found!r}, agent is {agent.name!r}")
    optimizers = agent.optimizers()
    needed = {"actor", "critic", "replay_buffer", "rng", *optimizers}
    if missing := needed - files.tensors.keys():
        raise CheckpointError(f"{directory}: missing {sorted(missing)}")
    state = {f"policy.{k}": v for k, v in files.tensors["actor"].items()}
    state |= files.tensors["critic"]
    try:
        agent.load_state_dict(state, strict=True)
        roles.buffer.load_state_dict(files.tensors["replay_buffer"])
        roles.generator.set_state(files.tensors["rng"]["generator"])
        for name, optimizer in optimizers.items():
            optimizer.load_state_dict(
                optimizer_from_files(files.tensors[name], files.documents[name])
            )
        counters = files.documents["counters"]
        roles.env_steps = int(counters["env_steps"])
        roles.updates = int(counters["updates"])
        roles.update_debt = float(counters["update_debt"])
        # Older files also hold "agent_updates": it always equalled "updates", so it is ignored.
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{directory}: does not fit this agent: {exc}") from exc
