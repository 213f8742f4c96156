"""PureJaxRL's PPO against Podium's on one recipe, one machine, interleaved (issue 33, part 4).

The recipe is PureJaxRL's CartPole-v1 config (purejaxrl/ppo.py's ``__main__``): per agent 4 envs
x 128 steps, 4 epochs x 4 minibatches, a 64x64 tanh actor and critic, Adam at 2.5e-4 annealed
to 0, 5e5 env steps, gamma 0.99, GAE lambda 0.95, clip 0.2 (the value loss clipped too), entropy
0.01, value 0.5, gradient norm 0.5, advantages normalised per minibatch, no observation
normalisation. P agents with different seeds:

* PureJaxRL: its ``make_train``, transcribed below (nothing can be downloaded at run time here),
  one ``jax.jit(jax.vmap(train))`` call for all P agents, as its README trains seeds;
* Podium: P = 1 through ``podium train``'s trainer (``services.pod.training.fit.build``: the
  on-policy trainer), P > 1 through the population trainer (what a pod with
  ``population.agents_per_pod: P`` trains), both picked by ``trainer_class``.

For each seed and P, PureJaxRL then Podium, so machine noise hits both alike. Measured per side:

* ``startup_s``: PureJaxRL's compile (``jit(...).lower().compile()``), Podium's ``build`` (envs,
  agents); the imports are done once before either and counted on neither side;
* ``train_s``: the training call itself (PureJaxRL: the compiled call; Podium: its steps, as
  ``fit``'s clock counts them), and ``steps_per_s`` = P x env steps / ``train_s``;
* ``wall_s`` = ``startup_s`` + ``train_s``: the wall time to the budget for every agent;
* returns, after the clock stops: each agent's mean over 10 greedy episodes on its own side's
  CartPole, and ``solved``: the fraction of agents at >= 475.

On CPU both sides get one core: XLA's CPU backend one thread (``XLA_FLAGS`` below, set before
jax is imported), torch one thread (``torch_threads: 1``, Podium's default), and the process is
pinned to ``--core``. Printed: a line per run, then a table of medians over seeds and the ratios
(PureJaxRL / Podium for throughput, Podium / PureJaxRL for wall time); ``--out`` gets the JSON.

    .venv/bin/pip install -e '.[bench]'                 # jax[cpu], gymnax, flax, optax
    .venv/bin/python bench/purejaxrl_peer.py --agents 1 8 --seeds 3
    .venv/bin/python bench/purejaxrl_peer.py --agents 64 --seeds 1 --steps 50000   # short
    .venv/bin/python bench/purejaxrl_peer.py --device cuda   # P = 1 64 1024; needs jax[cuda12]
"""

from __future__ import annotations

import os

# One XLA CPU thread, as torch has one; read when jax starts its CPU backend, so set before the
# import (an XLA_FLAGS already in the environment wins). On a GPU these only touch the host side.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import struct
from flax.linen.initializers import constant, orthogonal
from flax.training.train_state import TrainState

from services.contracts.algorithms.ppo.config import PPOConfig
from services.pod.config import PPORunConfig
from services.pod.training import fit
from services.pod.training.trainer import Trainer, build_trainer

ENV_NAME = "CartPole-v1"
SOLVED = 475.0
EVAL_EPISODES = 10

# PureJaxRL's own config for CartPole-v1 (purejaxrl/ppo.py, ``__main__``), DEBUG off.
PUREJAXRL_CONFIG: dict[str, Any] = {
    "LR": 2.5e-4,
    "NUM_ENVS": 4,
    "NUM_STEPS": 128,
    "TOTAL_TIMESTEPS": 5e5,
    "UPDATE_EPOCHS": 4,
    "NUM_MINIBATCHES": 4,
    "GAMMA": 0.99,
    "GAE_LAMBDA": 0.95,
    "CLIP_EPS": 0.2,
    "ENT_COEF": 0.01,
    "VF_COEF": 0.5,
    "MAX_GRAD_NORM": 0.5,
    "ACTIVATION": "tanh",
    "ENV_NAME": ENV_NAME,
    "ANNEAL_LR": True,
}


def podium_config(total_env_steps: int, seed: int, device: str) -> PPORunConfig:
    """The same recipe in Podium's terms (PPOConfig's CleanRL names)."""
    c = PUREJAXRL_CONFIG
    ppo = PPOConfig(
        num_envs=c["NUM_ENVS"],
        num_steps=c["NUM_STEPS"],
        learning_rate=c["LR"],
        anneal_lr=c["ANNEAL_LR"],
        gamma=c["GAMMA"],
        gae_lambda=c["GAE_LAMBDA"],
        num_minibatches=c["NUM_MINIBATCHES"],
        update_epochs=c["UPDATE_EPOCHS"],
        clip_coef=c["CLIP_EPS"],
        clip_vloss=True,  # PureJaxRL clips the value loss
        ent_coef=c["ENT_COEF"],
        vf_coef=c["VF_COEF"],
        max_grad_norm=c["MAX_GRAD_NORM"],
        norm_adv=True,  # per minibatch, as PureJaxRL's loss does
        norm_obs=False,  # PureJaxRL feeds raw observations
        norm_reward=False,
        hidden_sizes=[64, 64],
        activation=c["ACTIVATION"],
    )
    return PPORunConfig(
        env=ENV_NAME,
        total_env_steps=total_env_steps,
        eval_every_steps=total_env_steps,  # no evaluation inside the clock
        eval_episodes=EVAL_EPISODES,
        seed=seed,
        device=device,
        torch_threads=1,
        ppo=ppo,
    )


# --------------------------------------------------------------------------------------------
# PureJaxRL: a transcription of make_train in github.com/luchris429/purejaxrl, purejaxrl/ppo.py
# (commit 31756b1, 2024-09-09), with its LogWrapper from purejaxrl/wrappers.py and its
# hyperparameters (PUREJAXRL_CONFIG above). The algorithm is theirs line for line; what differs:
# * distrax.Categorical is the few lines of ``Categorical`` below (the same maths: sample with
#   jax.random.categorical, log-softmax log-probabilities, entropy), so that the bench does not
#   need distrax and tensorflow-probability;
# * FlattenObservationWrapper is left out: CartPole's observation is already flat;
# * the returned metric is two numbers per update (the returns and the count of the episodes that
#   ended in the rollout) instead of the whole ``traj_batch.info``, which at P = 1,024 agents
#   would be ~10 GB (the bench reads only the trained parameters); the DEBUG callback is left out;
# * NUM_UPDATES is made an int (newer JAX refuses a float scan length); ruff's formatting.
# --------------------------------------------------------------------------------------------


class Categorical:
    """distrax.Categorical's sample, log_prob and entropy for logits."""

    def __init__(self, logits: jax.Array) -> None:
        self.logits = jax.nn.log_softmax(logits, axis=-1)

    def sample(self, seed: jax.Array) -> jax.Array:
        return jax.random.categorical(seed, self.logits, axis=-1)

    def log_prob(self, value: jax.Array) -> jax.Array:
        return jnp.take_along_axis(self.logits, value[..., None].astype(jnp.int32), -1)[..., 0]

    def entropy(self) -> jax.Array:
        return -jnp.sum(jnp.exp(self.logits) * self.logits, axis=-1)


@struct.dataclass
class LogEnvState:
    env_state: Any
    episode_returns: float
    episode_lengths: int
    returned_episode_returns: float
    returned_episode_lengths: int
    timestep: int


class LogWrapper:
    """Log the episode returns and lengths (purejaxrl/wrappers.py)."""

    def __init__(self, env: Any) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    @partial(jax.jit, static_argnums=(0,))
    def reset(self, key: jax.Array, params: Any = None) -> tuple[jax.Array, LogEnvState]:
        obs, env_state = self._env.reset(key, params)
        state = LogEnvState(env_state, 0, 0, 0, 0, 0)
        return obs, state

    @partial(jax.jit, static_argnums=(0,))
    def step(
        self, key: jax.Array, state: LogEnvState, action: jax.Array, params: Any = None
    ) -> tuple[jax.Array, LogEnvState, jax.Array, jax.Array, dict[str, Any]]:
        obs, env_state, reward, done, info = self._env.step(key, state.env_state, action, params)
        new_episode_return = state.episode_returns + reward
        new_episode_length = state.episode_lengths + 1
        state = LogEnvState(
            env_state=env_state,
            episode_returns=new_episode_return * (1 - done),
            episode_lengths=new_episode_length * (1 - done),
            returned_episode_returns=state.returned_episode_returns * (1 - done)
            + new_episode_return * done,
            returned_episode_lengths=state.returned_episode_lengths * (1 - done)
            + new_episode_length * done,
            timestep=state.timestep + 1,
        )
        info["returned_episode_returns"] = state.returned_episode_returns
        info["returned_episode_lengths"] = state.returned_episode_lengths
        info["timestep"] = state.timestep
        info["returned_episode"] = done
        return obs, state, reward, done, info


class ActorCritic(nn.Module):
    action_dim: int
    activation: str = "tanh"

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[Categorical, jax.Array]:
        activation = nn.relu if self.activation == "relu" else nn.tanh
        actor_mean = nn.Dense(64, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(x)
        actor_mean = activation(actor_mean)
        actor_mean = nn.Dense(64, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(
            actor_mean
        )
        actor_mean = activation(actor_mean)
        actor_mean = nn.Dense(
            self.action_dim, kernel_init=orthogonal(0.01), bias_init=constant(0.0)
        )(actor_mean)
        pi = Categorical(logits=actor_mean)

        critic = nn.Dense(64, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(x)
        critic = activation(critic)
        critic = nn.Dense(64, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(critic)
        critic = activation(critic)
        critic = nn.Dense(1, kernel_init=orthogonal(1.0), bias_init=constant(0.0))(critic)
        return pi, jnp.squeeze(critic, axis=-1)


class Transition(NamedTuple):
    done: jax.Array
    action: jax.Array
    value: jax.Array
    reward: jax.Array
    log_prob: jax.Array
    obs: jax.Array
    info: dict[str, jax.Array]


def make_train(config: dict[str, Any]) -> Any:
    config["NUM_UPDATES"] = int(
        config["TOTAL_TIMESTEPS"] // config["NUM_STEPS"] // config["NUM_ENVS"]
    )
    config["MINIBATCH_SIZE"] = config["NUM_ENVS"] * config["NUM_STEPS"] // config["NUM_MINIBATCHES"]
    env, env_params = gymnax.make(config["ENV_NAME"])
    env = LogWrapper(env)

    def linear_schedule(count: jax.Array) -> jax.Array:
        frac = (
            1.0
            - (count // (config["NUM_MINIBATCHES"] * config["UPDATE_EPOCHS"]))
            / config["NUM_UPDATES"]
        )
        return config["LR"] * frac

    def train(rng: jax.Array) -> dict[str, Any]:
        # INIT NETWORK
        network = ActorCritic(env.action_space(env_params).n, activation=config["ACTIVATION"])
        rng, _rng = jax.random.split(rng)
        init_x = jnp.zeros(env.observation_space(env_params).shape)
        network_params = network.init(_rng, init_x)
        if config["ANNEAL_LR"]:
            tx = optax.chain(
                optax.clip_by_global_norm(config["MAX_GRAD_NORM"]),
                optax.adam(learning_rate=linear_schedule, eps=1e-5),
            )
        else:
            tx = optax.chain(
                optax.clip_by_global_norm(config["MAX_GRAD_NORM"]),
                optax.adam(config["LR"], eps=1e-5),
            )
        train_state = TrainState.create(apply_fn=network.apply, params=network_params, tx=tx)

        # INIT ENV
        rng, _rng = jax.random.split(rng)
        reset_rng = jax.random.split(_rng, config["NUM_ENVS"])
        obsv, env_state = jax.vmap(env.reset, in_axes=(0, None))(reset_rng, env_params)

        # TRAIN LOOP
        def _update_step(runner_state: tuple, unused: None) -> tuple[tuple, jax.Array]:
            # COLLECT TRAJECTORIES
            def _env_step(runner_state: tuple, unused: None) -> tuple[tuple, Transition]:
                train_state, env_state, last_obs, rng = runner_state

                # SELECT ACTION
                rng, _rng = jax.random.split(rng)
                pi, value = network.apply(train_state.params, last_obs)
                action = pi.sample(seed=_rng)
                log_prob = pi.log_prob(action)

                # STEP ENV
                rng, _rng = jax.random.split(rng)
                rng_step = jax.random.split(_rng, config["NUM_ENVS"])
                obsv, env_state, reward, done, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                    rng_step, env_state, action, env_params
                )
                transition = Transition(done, action, value, reward, log_prob, last_obs, info)
                runner_state = (train_state, env_state, obsv, rng)
                return runner_state, transition

            runner_state, traj_batch = jax.lax.scan(
                _env_step, runner_state, None, config["NUM_STEPS"]
            )

            # CALCULATE ADVANTAGE
            train_state, env_state, last_obs, rng = runner_state
            _, last_val = network.apply(train_state.params, last_obs)

            def _calculate_gae(
                traj_batch: Transition, last_val: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
                def _get_advantages(
                    gae_and_next_value: tuple, transition: Transition
                ) -> tuple[tuple, jax.Array]:
                    gae, next_value = gae_and_next_value
                    done, value, reward = transition.done, transition.value, transition.reward
                    delta = reward + config["GAMMA"] * next_value * (1 - done) - value
                    gae = delta + config["GAMMA"] * config["GAE_LAMBDA"] * (1 - done) * gae
                    return (gae, value), gae

                _, advantages = jax.lax.scan(
                    _get_advantages,
                    (jnp.zeros_like(last_val), last_val),
                    traj_batch,
                    reverse=True,
                    unroll=16,
                )
                return advantages, advantages + traj_batch.value

            advantages, targets = _calculate_gae(traj_batch, last_val)

            # UPDATE NETWORK
            def _update_epoch(update_state: tuple, unused: None) -> tuple[tuple, Any]:
                def _update_minbatch(train_state: TrainState, batch_info: tuple) -> tuple:
                    traj_batch, advantages, targets = batch_info

                    def _loss_fn(
                        params: Any, traj_batch: Transition, gae: jax.Array, targets: jax.Array
                    ) -> tuple[jax.Array, tuple]:
                        # RERUN NETWORK
                        pi, value = network.apply(params, traj_batch.obs)
                        log_prob = pi.log_prob(traj_batch.action)

                        # CALCULATE VALUE LOSS
                        value_pred_clipped = traj_batch.value + (value - traj_batch.value).clip(
                            -config["CLIP_EPS"], config["CLIP_EPS"]
                        )
                        value_losses = jnp.square(value - targets)
                        value_losses_clipped = jnp.square(value_pred_clipped - targets)
                        value_loss = 0.5 * jnp.maximum(value_losses, value_losses_clipped).mean()

                        # CALCULATE ACTOR LOSS
                        ratio = jnp.exp(log_prob - traj_batch.log_prob)
                        gae = (gae - gae.mean()) / (gae.std() + 1e-8)
                        loss_actor1 = ratio * gae
                        loss_actor2 = (
                            jnp.clip(ratio, 1.0 - config["CLIP_EPS"], 1.0 + config["CLIP_EPS"])
                            * gae
                        )
                        loss_actor = -jnp.minimum(loss_actor1, loss_actor2)
                        loss_actor = loss_actor.mean()
                        entropy = pi.entropy().mean()

                        total_loss = (
                            loss_actor
                            + config["VF_COEF"] * value_loss
                            - config["ENT_COEF"] * entropy
                        )
                        return total_loss, (value_loss, loss_actor, entropy)

                    grad_fn = jax.value_and_grad(_loss_fn, has_aux=True)
                    total_loss, grads = grad_fn(train_state.params, traj_batch, advantages, targets)
                    train_state = train_state.apply_gradients(grads=grads)
                    return train_state, total_loss

                train_state, traj_batch, advantages, targets, rng = update_state
                rng, _rng = jax.random.split(rng)
                # Batching and Shuffling
                batch_size = config["MINIBATCH_SIZE"] * config["NUM_MINIBATCHES"]
                assert batch_size == config["NUM_STEPS"] * config["NUM_ENVS"], (
                    "batch size must be equal to number of steps * number of envs"
                )
                permutation = jax.random.permutation(_rng, batch_size)
                batch = (traj_batch, advantages, targets)
                batch = jax.tree_util.tree_map(
                    lambda x: x.reshape((batch_size, *x.shape[2:])), batch
                )
                shuffled_batch = jax.tree_util.tree_map(
                    lambda x: jnp.take(x, permutation, axis=0), batch
                )
                # Mini-batch Updates
                minibatches = jax.tree_util.tree_map(
                    lambda x: jnp.reshape(x, [config["NUM_MINIBATCHES"], -1, *x.shape[1:]]),
                    shuffled_batch,
                )
                train_state, total_loss = jax.lax.scan(_update_minbatch, train_state, minibatches)
                update_state = (train_state, traj_batch, advantages, targets, rng)
                return update_state, total_loss

            # Updating Training State and Metrics:
            update_state = (train_state, traj_batch, advantages, targets, rng)
            update_state, _loss_info = jax.lax.scan(
                _update_epoch, update_state, None, config["UPDATE_EPOCHS"]
            )
            train_state = update_state[0]
            # The bench's metric (see the note above): the ended episodes' returns and count.
            info = traj_batch.info
            ended = info["returned_episode"]
            metric = jnp.stack([jnp.sum(info["returned_episode_returns"] * ended), jnp.sum(ended)])
            rng = update_state[-1]

            runner_state = (train_state, env_state, last_obs, rng)
            return runner_state, metric

        rng, _rng = jax.random.split(rng)
        runner_state = (train_state, env_state, obsv, _rng)
        runner_state, metric = jax.lax.scan(_update_step, runner_state, None, config["NUM_UPDATES"])
        return {"runner_state": runner_state, "metrics": metric}

    return train


# ----------------------------------- end of the transcription -------------------------------


def purejaxrl_evaluate(params: Any, rng: jax.Array, episodes: int) -> jax.Array:
    """One agent's mean return over ``episodes`` greedy episodes of gymnax's CartPole-v1
    (Podium's evaluator is greedy too): the reward summed until each episode's first done."""
    env, env_params = gymnax.make(ENV_NAME)
    network = ActorCritic(env.action_space(env_params).n, activation="tanh")
    obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(rng, episodes), env_params)

    def step(carry: tuple, key: jax.Array) -> tuple[tuple, None]:
        obs, state, total, alive = carry
        pi, _ = network.apply(params, obs)
        action = jnp.argmax(pi.logits, axis=-1)
        keys = jax.random.split(key, episodes)
        obs, state, reward, done, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            keys, state, action, env_params
        )
        total = total + reward * alive
        return (obs, state, total, alive * (1 - done)), None

    keys = jax.random.split(rng, env_params.max_steps_in_episode)
    init = (obs, state, jnp.zeros(episodes), jnp.ones(episodes))
    (_, _, total, _), _ = jax.lax.scan(step, init, keys)
    return total.mean()


@dataclass
class Run:
    side: str
    agents: int
    seed: int
    env_steps: int  # per agent
    startup_s: float
    train_s: float
    eval_returns: list[float]  # per agent, greedy

    @property
    def wall_s(self) -> float:
        return self.startup_s + self.train_s

    @property
    def steps_per_s(self) -> float:
        return self.agents * self.env_steps / self.train_s

    @property
    def mean_return(self) -> float:
        return statistics.fmean(self.eval_returns)

    @property
    def solved(self) -> float:
        return sum(r >= SOLVED for r in self.eval_returns) / len(self.eval_returns)


def run_purejaxrl(agents: int, seed: int, env_steps: int, device: str) -> Run:
    config = {**PUREJAXRL_CONFIG, "TOTAL_TIMESTEPS": env_steps}
    jax_device = jax.devices("cpu" if device == "cpu" else "gpu")[0]
    with jax.default_device(jax_device):
        rngs = jax.random.split(jax.random.PRNGKey(seed), agents)
        start = time.perf_counter()
        compiled = jax.jit(jax.vmap(make_train(config))).lower(rngs).compile()
        startup = time.perf_counter() - start
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(rngs))
        train = time.perf_counter() - start

        params = out["runner_state"][0].params
        eval_rngs = jax.random.split(jax.random.PRNGKey(seed + 10_000), agents)
        evaluate = jax.jit(jax.vmap(purejaxrl_evaluate, in_axes=(0, 0, None)), static_argnums=2)
        returns = np.asarray(evaluate(params, eval_rngs, EVAL_EPISODES))
    steps = config["NUM_UPDATES"] * config["NUM_STEPS"] * config["NUM_ENVS"]
    return Run("purejaxrl", agents, seed, steps, startup, train, [float(r) for r in returns])


def run_podium(agents: int, seed: int, env_steps: int, device: str) -> Run:
    # Agent i is seeded seed * 10,000 + i: the population seeds its agents first.seed + i.
    configs = [podium_config(env_steps, seed * 10_000 + i, device) for i in range(agents)]
    start = time.perf_counter()
    # P = 1: ``podium train``'s trainer (its thread setting too); P > 1: the population pod's.
    trainer: Trainer = fit.build(configs[0]) if agents == 1 else build_trainer(configs)
    startup = time.perf_counter() - start
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    start = time.perf_counter()
    while trainer.env_steps < env_steps:  # fit's loop, without its evaluations
        trainer.step()
    sync()
    train = time.perf_counter() - start
    returns = [e.mean for e in trainer.evaluate()]
    steps = trainer.env_steps
    trainer.close()
    return Run("podium", agents, seed, steps, startup, train, returns)


def median(runs: list[Run], key: str) -> float:
    return statistics.median(getattr(r, key) for r in runs)


def summarise(runs: list[Run], agents: int) -> dict[str, Any]:
    """Medians over seeds for ``agents``, and the ratios of each seed's interleaved pair (the two
    runs of a seed see the same moment of the machine's load) with their median."""
    jx = [r for r in runs if r.agents == agents and r.side == "purejaxrl"]
    pd = [r for r in runs if r.agents == agents and r.side == "podium"]
    throughput = [j.steps_per_s / p.steps_per_s for j, p in zip(jx, pd, strict=True)]
    wall = [p.wall_s / j.wall_s for j, p in zip(jx, pd, strict=True)]
    return {
        "agents": agents,
        "purejaxrl_steps_per_s": median(jx, "steps_per_s"),
        "podium_steps_per_s": median(pd, "steps_per_s"),
        "purejaxrl_wall_s": median(jx, "wall_s"),
        "purejaxrl_startup_s": median(jx, "startup_s"),
        "podium_wall_s": median(pd, "wall_s"),
        "podium_startup_s": median(pd, "startup_s"),
        "purejaxrl_solved": median(jx, "solved"),
        "podium_solved": median(pd, "solved"),
        "throughput_ratios": throughput,  # PureJaxRL / Podium, per seed
        "throughput_ratio": statistics.median(throughput),
        "wall_ratios": wall,  # Podium / PureJaxRL, per seed
        "wall_ratio": statistics.median(wall),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=None, help="P values")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500_000, help="env steps per agent")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--core", type=int, default=0, help="CPU core to pin to (cpu only)")
    parser.add_argument("--out", type=Path, default=Path("runs/purejaxrl_peer.json"))
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")
    agents = args.agents or ([1, 64, 1024] if on_gpu else [1, 8, 64])
    if not on_gpu and hasattr(os, "sched_setaffinity"):
        # Every thread so far (the imports start a few), and so every one started later: the
        # libraries' thread pools start lazily, on first use, and inherit it.
        for thread in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread), {args.core})
    torch.set_num_threads(1)
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if "model name" in ln), "?")
    machine = (
        f"{cpu}, {os.cpu_count()} cores, pinned to {sorted(os.sched_getaffinity(0))}, "
        f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
        f"device {args.device}, load {os.getloadavg()[0]:.2f}"
    )
    print(machine, flush=True)

    runs: list[Run] = []
    for p in agents:
        for seed in range(args.seeds):
            for side in (run_purejaxrl, run_podium):
                run = side(p, seed, args.steps, args.device)
                runs.append(run)
                print(
                    f"P={p:<5} seed {seed} {run.side:>9}: startup {run.startup_s:6.1f} s, "
                    f"train {run.train_s:7.1f} s, {run.steps_per_s:9,.0f} env steps/s, "
                    f"solved {run.solved:4.0%}, mean return {run.mean_return:5.1f} "
                    f"(load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )

    print(f"\n{args.steps:,} env steps per agent, medians over {args.seeds} seed(s)")
    print(
        "| P | PureJaxRL steps/s | Podium steps/s | throughput ratio (per seed) "
        "| PureJaxRL wall s (compile) | Podium wall s (build) | wall ratio (per seed) "
        "| solved PureJaxRL, Podium |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    table = [summarise(runs, p) for p in agents]
    for row in table:
        listed = {
            k: " / ".join(f"{r:.1f}" for r in row[f"{k}_ratios"]) for k in ("throughput", "wall")
        }
        print(
            f"| {row['agents']} | {row['purejaxrl_steps_per_s']:,.0f} "
            f"| {row['podium_steps_per_s']:,.0f} | **{row['throughput_ratio']:.1f}x** "
            f"({listed['throughput']}) "
            f"| {row['purejaxrl_wall_s']:.1f} ({row['purejaxrl_startup_s']:.1f}) "
            f"| {row['podium_wall_s']:.1f} ({row['podium_startup_s']:.1f}) "
            f"| **{row['wall_ratio']:.1f}x** ({listed['wall']}) "
            f"| {row['purejaxrl_solved']:.0%}, {row['podium_solved']:.0%} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": machine,
        "steps_per_agent": args.steps,
        "seeds": args.seeds,
        "device": args.device,
        "runs": [{**asdict(r), "wall_s": r.wall_s, "steps_per_s": r.steps_per_s} for r in runs],
        "medians": table,
    }
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
