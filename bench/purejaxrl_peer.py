"""PureJaxRL's PPO against Podium's, on PureJaxRL's own recipes, one machine, interleaved.

Recipes (``--recipe``):

* ``cartpole``: purejaxrl/ppo.py's CartPole-v1 config: per agent 4 envs x 128 steps, 4 epochs x 4
  minibatches, 64x64 tanh actor and critic, Adam at 2.5e-4 annealed to 0, 5e5 env steps, entropy
  0.01, the value loss clipped, raw observations;
* ``pendulum``: purejaxrl/ppo_continuous_action.py's config on gymnax's Pendulum-v1 (the script
  trains Brax tasks, which do not install here; its recipe is otherwise unchanged): per agent
  2,048 envs x 10 steps, 4 epochs x 32 minibatches, 256x256 tanh, a Gaussian policy with a
  state-independent log-std, Adam at 3e-4 (no annealing), entropy 0, observations and rewards
  normalised by running statistics, actions clipped;
* ``pendulum-preset``: Podium's own PPO preset for Pendulum-v1 (128 envs x 16 steps, gSDE,
  10 epochs x 8 minibatches), Podium only: the compiled iteration against the eager one.

Sides, run in turn for each seed and P so that machine noise hits them alike:

* ``purejaxrl``: its ``make_train``, transcribed below (nothing is downloaded at run time), one
  ``jax.jit(jax.vmap(train))`` call for all P agents, as its README trains seeds;
* ``podium``: ``podium train``'s trainer (P = 1) or a population pod's (P > 1) with
  ``ppo.compile: on``: the whole iteration compiled;
* ``podium-eager``: the same trainer with ``ppo.compile: off``.

Measured per side: ``startup_s`` (PureJaxRL: ``jit(...).lower().compile()``; Podium: building
the trainer and its first two iterations, which is where it compiles), ``train_s`` (the rest of
the budget; ``steps_per_s`` = P x those env steps / ``train_s``), ``wall_s`` = both, and after the
clock each agent's greedy return (10 episodes on its own side's env) and ``solved`` (the fraction
at the env's target). Printed: a line per run, then medians over seeds and, per seed, the ratios
of Podium's steps/s to PureJaxRL's and of compiled to eager (each seed's runs are neighbours in
time). ``--out`` gets the JSON.

On CPU every side gets one core: XLA's CPU backend one thread (``XLA_FLAGS`` below, set before
jax is imported), torch one thread, the process pinned to ``--core``. Both run with the
allocator Podium's pods run with (services/malloc.py; ``apt install libtcmalloc-minimal4``).

    .venv/bin/pip install -e '.[bench]'                 # jax[cpu], gymnax, flax, optax
    .venv/bin/python bench/purejaxrl_peer.py --recipe cartpole --agents 1 --seeds 3
    .venv/bin/python bench/purejaxrl_peer.py --recipe pendulum --agents 1 --seeds 3
    .venv/bin/python bench/purejaxrl_peer.py --recipe pendulum-preset --steps 100000
    .venv/bin/python bench/purejaxrl_peer.py --device cuda   # P = 1 64 1024; needs jax[cuda12]
"""

from __future__ import annotations

import os

# Before torch: the pod's package lets MKL choose its kernels by the CPU's instruction sets.
import services.pod

# One XLA CPU thread, as torch has one; read when jax starts its CPU backend, so set before the
# import (an XLA_FLAGS already in the environment wins). On a GPU these only touch the host side.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import argparse
import json
import math
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

from services.contracts.envs import target_return
from services.pod.training import fit
from services.pod.training.presets import train_config
from services.pod.training.trainer import Trainer, build_trainer

EVAL_EPISODES = 10


@dataclass(frozen=True)
class Recipe:
    env: str
    #: PureJaxRL's config (its script's ``__main__``, DEBUG off); None: Podium's preset only.
    purejaxrl: dict[str, Any] | None
    #: Podium's settings on top of its preset for ``env`` (``podium train --set`` layers).
    podium: dict[str, Any]


def _purejaxrl_in_podium_terms(c: dict[str, Any], continuous: bool) -> dict[str, Any]:
    """PureJaxRL's config in Podium's (PPOConfig's CleanRL names)."""
    return {
        "num_envs": c["NUM_ENVS"],
        "num_steps": c["NUM_STEPS"],
        "learning_rate": c["LR"],
        "anneal_lr": c["ANNEAL_LR"],
        "gamma": c["GAMMA"],
        "gae_lambda": c["GAE_LAMBDA"],
        "num_minibatches": c["NUM_MINIBATCHES"],
        "update_epochs": c["UPDATE_EPOCHS"],
        "clip_coef": c["CLIP_EPS"],
        "clip_vloss": True,  # PureJaxRL clips the value loss
        "ent_coef": c["ENT_COEF"],
        "vf_coef": c["VF_COEF"],
        "max_grad_norm": c["MAX_GRAD_NORM"],
        "norm_adv": True,  # per minibatch, as PureJaxRL's loss does
        "norm_obs": c.get("NORMALIZE_ENV", False),
        "norm_reward": c.get("NORMALIZE_ENV", False),
        "hidden_sizes": [c["WIDTH"]] * 2,
        "activation": c["ACTIVATION"],
        # PureJaxRL's Gaussian: a state-independent log-std from 0, no gSDE.
        **({"log_std_init": 0.0, "sde_sample_freq": 0} if continuous else {}),
    }


_COMMON = {
    "UPDATE_EPOCHS": 4,
    "GAMMA": 0.99,
    "GAE_LAMBDA": 0.95,
    "CLIP_EPS": 0.2,
    "VF_COEF": 0.5,
    "MAX_GRAD_NORM": 0.5,
    "ACTIVATION": "tanh",
}
_CARTPOLE = {
    **_COMMON,
    "LR": 2.5e-4,
    "NUM_ENVS": 4,
    "NUM_STEPS": 128,
    "TOTAL_TIMESTEPS": 5e5,
    "NUM_MINIBATCHES": 4,
    "ENT_COEF": 0.01,
    "ENV_NAME": "CartPole-v1",
    "ANNEAL_LR": True,
    "WIDTH": 64,
    "CONTINUOUS": False,
}
_PENDULUM = {
    **_COMMON,
    "LR": 3e-4,
    "NUM_ENVS": 2048,
    "NUM_STEPS": 10,
    "TOTAL_TIMESTEPS": 1e6,
    "NUM_MINIBATCHES": 32,
    "ENT_COEF": 0.0,
    "ENV_NAME": "Pendulum-v1",
    "ANNEAL_LR": False,
    "NORMALIZE_ENV": True,
    "WIDTH": 256,
    "CONTINUOUS": True,
}
RECIPES = {
    "cartpole": Recipe("CartPole-v1", _CARTPOLE, _purejaxrl_in_podium_terms(_CARTPOLE, False)),
    "pendulum": Recipe("Pendulum-v1", _PENDULUM, _purejaxrl_in_podium_terms(_PENDULUM, True)),
    "pendulum-preset": Recipe("Pendulum-v1", None, {}),
}


def podium_configs(
    recipe: Recipe, agents: int, env_steps: int, seed: int, device: str, compile: str
) -> list[Any]:
    """P run configs: the recipe on top of Podium's preset for the env, agent i seeded
    seed * 10,000 + i, no evaluation inside the clock."""
    return [
        train_config(
            recipe.env,
            [
                {
                    "total_env_steps": env_steps,
                    "eval_every_steps": env_steps,
                    "eval_episodes": EVAL_EPISODES,
                    "target_return": None,
                    "seed": seed * 10_000 + i,
                    "device": device,
                    "torch_threads": 1,
                    "ppo": {**recipe.podium, "compile": compile},
                }
            ],
        )
        for i in range(agents)
    ]


# --------------------------------------------------------------------------------------------
# PureJaxRL: a transcription of make_train in github.com/luchris429/purejaxrl, purejaxrl/ppo.py
# and purejaxrl/ppo_continuous_action.py (commit 31756b1, 2024-09-09), with the wrappers they use
# from purejaxrl/wrappers.py. The two scripts' make_train are the same line for line but for the
# network's head and the env's wrappers, so they are transcribed once, the config choosing
# (``CONTINUOUS``, ``NORMALIZE_ENV``, ``WIDTH``). What differs from theirs:
# * distrax's Categorical and MultivariateNormalDiag are the few lines of ``Categorical`` and
#   ``DiagGaussian`` below (the same maths), so the bench needs neither distrax nor
#   tensorflow-probability;
# * ppo.py's explicit ``jax.vmap(env.step, ...)`` is its wrappers' ``VecEnv``, which
#   ppo_continuous_action.py uses: the same call;
# * ClipAction clips to the env's action bounds (the line its TODO says it should be) rather
#   than to [-1, 1]: Pendulum's torque ranges over [-2, 2];
# * the returned metric is two numbers per update (the returns and the count of the episodes that
#   ended in the rollout) instead of the whole ``traj_batch.info``, which at P = 1,024 agents
#   would be ~10 GB (the bench reads only the trained parameters); no DEBUG callback;
# * NUM_UPDATES is made an int (newer JAX refuses a float scan length); ruff's formatting.
# --------------------------------------------------------------------------------------------


class Categorical:
    """distrax.Categorical's sample, log_prob, entropy and mode for logits."""

    def __init__(self, logits: jax.Array) -> None:
        self.logits = jax.nn.log_softmax(logits, axis=-1)

    def sample(self, seed: jax.Array) -> jax.Array:
        return jax.random.categorical(seed, self.logits, axis=-1)

    def log_prob(self, value: jax.Array) -> jax.Array:
        return jnp.take_along_axis(self.logits, value[..., None].astype(jnp.int32), -1)[..., 0]

    def entropy(self) -> jax.Array:
        return -jnp.sum(jnp.exp(self.logits) * self.logits, axis=-1)

    def mode(self) -> jax.Array:
        return jnp.argmax(self.logits, axis=-1)


class DiagGaussian:
    """distrax.MultivariateNormalDiag's sample, log_prob, entropy and mode."""

    def __init__(self, loc: jax.Array, scale: jax.Array) -> None:
        self.loc, self.scale = loc, jnp.broadcast_to(scale, loc.shape)

    def sample(self, seed: jax.Array) -> jax.Array:
        return self.loc + self.scale * jax.random.normal(seed, self.loc.shape)

    def log_prob(self, value: jax.Array) -> jax.Array:
        z = (value - self.loc) / self.scale
        return jnp.sum(-0.5 * z**2 - jnp.log(self.scale) - 0.5 * jnp.log(2 * jnp.pi), axis=-1)

    def entropy(self) -> jax.Array:
        return jnp.sum(0.5 + 0.5 * jnp.log(2 * jnp.pi) + jnp.log(self.scale), axis=-1)

    def mode(self) -> jax.Array:
        return self.loc


class GymnaxWrapper:
    def __init__(self, env: Any) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


@struct.dataclass
class LogEnvState:
    env_state: Any
    episode_returns: float
    episode_lengths: int
    returned_episode_returns: float
    returned_episode_lengths: int
    timestep: int


class LogWrapper(GymnaxWrapper):
    """Log the episode returns and lengths."""

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


class ClipAction(GymnaxWrapper):
    def __init__(self, env: Any, low: jax.Array, high: jax.Array) -> None:
        super().__init__(env)
        self.low = low
        self.high = high

    def step(self, key: jax.Array, state: Any, action: jax.Array, params: Any = None) -> Any:
        action = jnp.clip(action, self.low, self.high)
        return self._env.step(key, state, action, params)


class VecEnv(GymnaxWrapper):
    def __init__(self, env: Any) -> None:
        super().__init__(env)
        self.reset = jax.vmap(self._env.reset, in_axes=(0, None))
        self.step = jax.vmap(self._env.step, in_axes=(0, 0, 0, None))


def _update_stats(
    mean: jax.Array, var: jax.Array, count: float, x: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    # The parallel-variance update both of PureJaxRL's normalisers write out in full.
    batch_mean = jnp.mean(x, axis=0)
    batch_var = jnp.var(x, axis=0)
    batch_count = x.shape[0]
    delta = batch_mean - mean
    tot_count = count + batch_count
    new_mean = mean + delta * batch_count / tot_count
    m_a = var * count
    m_b = batch_var * batch_count
    m2 = m_a + m_b + jnp.square(delta) * count * batch_count / tot_count
    return new_mean, m2 / tot_count, tot_count


@struct.dataclass
class NormalizeVecObsEnvState:
    mean: jax.Array
    var: jax.Array
    count: float
    env_state: Any


class NormalizeVecObservation(GymnaxWrapper):
    def reset(self, key: jax.Array, params: Any = None) -> tuple[jax.Array, Any]:
        obs, state = self._env.reset(key, params)
        mean, var, count = _update_stats(jnp.zeros_like(obs), jnp.ones_like(obs), 1e-4, obs)
        state = NormalizeVecObsEnvState(mean=mean, var=var, count=count, env_state=state)
        return (obs - state.mean) / jnp.sqrt(state.var + 1e-8), state

    def step(self, key: jax.Array, state: Any, action: jax.Array, params: Any = None) -> Any:
        obs, env_state, reward, done, info = self._env.step(key, state.env_state, action, params)
        mean, var, count = _update_stats(state.mean, state.var, state.count, obs)
        state = NormalizeVecObsEnvState(mean=mean, var=var, count=count, env_state=env_state)
        return (obs - state.mean) / jnp.sqrt(state.var + 1e-8), state, reward, done, info


@struct.dataclass
class NormalizeVecRewEnvState:
    mean: jax.Array
    var: jax.Array
    count: float
    return_val: float
    env_state: Any


class NormalizeVecReward(GymnaxWrapper):
    def __init__(self, env: Any, gamma: float) -> None:
        super().__init__(env)
        self.gamma = gamma

    def reset(self, key: jax.Array, params: Any = None) -> tuple[jax.Array, Any]:
        obs, state = self._env.reset(key, params)
        batch_count = obs.shape[0]
        state = NormalizeVecRewEnvState(
            mean=0.0, var=1.0, count=1e-4, return_val=jnp.zeros((batch_count,)), env_state=state
        )
        return obs, state

    def step(self, key: jax.Array, state: Any, action: jax.Array, params: Any = None) -> Any:
        obs, env_state, reward, done, info = self._env.step(key, state.env_state, action, params)
        return_val = state.return_val * self.gamma * (1 - done) + reward
        mean, var, count = _update_stats(state.mean, state.var, state.count, return_val)
        state = NormalizeVecRewEnvState(
            mean=mean, var=var, count=count, return_val=return_val, env_state=env_state
        )
        return obs, state, reward / jnp.sqrt(state.var + 1e-8), done, info


class ActorCritic(nn.Module):
    action_dim: int
    activation: str = "tanh"
    width: int = 64
    continuous: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[Categorical | DiagGaussian, jax.Array]:
        activation = nn.relu if self.activation == "relu" else nn.tanh
        w = self.width
        actor_mean = nn.Dense(w, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(x)
        actor_mean = activation(actor_mean)
        actor_mean = nn.Dense(w, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(
            actor_mean
        )
        actor_mean = activation(actor_mean)
        actor_mean = nn.Dense(
            self.action_dim, kernel_init=orthogonal(0.01), bias_init=constant(0.0)
        )(actor_mean)
        if self.continuous:
            actor_logtstd = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
            pi: Categorical | DiagGaussian = DiagGaussian(actor_mean, jnp.exp(actor_logtstd))
        else:
            pi = Categorical(logits=actor_mean)

        critic = nn.Dense(w, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(x)
        critic = activation(critic)
        critic = nn.Dense(w, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(critic)
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


def make_env(config: dict[str, Any]) -> tuple[Any, Any, ActorCritic]:
    """The wrapped env, its params and the network, as each script builds them."""
    env, env_params = gymnax.make(config["ENV_NAME"])
    space = env.action_space(env_params)
    env = LogWrapper(env)
    if config["CONTINUOUS"]:
        env = ClipAction(env, space.low, space.high)
    env = VecEnv(env)
    if config.get("NORMALIZE_ENV"):
        env = NormalizeVecObservation(env)
        env = NormalizeVecReward(env, config["GAMMA"])
    action_dim = space.shape[0] if config["CONTINUOUS"] else space.n
    network = ActorCritic(action_dim, config["ACTIVATION"], config["WIDTH"], config["CONTINUOUS"])
    return env, env_params, network


def make_train(config: dict[str, Any]) -> Any:
    config["NUM_UPDATES"] = int(
        config["TOTAL_TIMESTEPS"] // config["NUM_STEPS"] // config["NUM_ENVS"]
    )
    config["MINIBATCH_SIZE"] = config["NUM_ENVS"] * config["NUM_STEPS"] // config["NUM_MINIBATCHES"]
    env, env_params, network = make_env(config)

    def linear_schedule(count: jax.Array) -> jax.Array:
        frac = (
            1.0
            - (count // (config["NUM_MINIBATCHES"] * config["UPDATE_EPOCHS"]))
            / config["NUM_UPDATES"]
        )
        return config["LR"] * frac

    def train(rng: jax.Array) -> dict[str, Any]:
        # INIT NETWORK
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
        obsv, env_state = env.reset(reset_rng, env_params)

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
                obsv, env_state, reward, done, info = env.step(
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


def purejaxrl_evaluate(
    config: dict[str, Any], params: Any, env_state: Any, rng: jax.Array, episodes: int
) -> jax.Array:
    """One agent's mean return over ``episodes`` greedy episodes of the recipe's gymnax env
    (Podium's evaluator is greedy too), its observations normalised by the statistics training
    ended with: the reward summed until each episode's first done."""
    env, env_params = gymnax.make(config["ENV_NAME"])
    _, _, network = make_env(config)
    space = env.action_space(env_params)
    if config.get("NORMALIZE_ENV"):
        # NormalizeVecReward's state wraps NormalizeVecObservation's, whose statistics have a
        # row per env (it starts them as zeros_like(obs)), all rows equal.
        stats = env_state.env_state

        def norm(obs: jax.Array) -> jax.Array:
            return (obs - stats.mean[0]) / jnp.sqrt(stats.var[0] + 1e-8)
    else:

        def norm(obs: jax.Array) -> jax.Array:
            return obs

    obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(rng, episodes), env_params)

    def step(carry: tuple, key: jax.Array) -> tuple[tuple, None]:
        obs, state, total, alive = carry
        pi, _ = network.apply(params, norm(obs))
        action = pi.mode()
        if config["CONTINUOUS"]:
            action = jnp.clip(action, space.low, space.high)
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
    env_steps: int  # per agent, inside the clock
    startup_s: float
    train_s: float
    eval_returns: list[float]  # per agent, greedy
    target: float

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
        return sum(r >= self.target for r in self.eval_returns) / len(self.eval_returns)


def run_purejaxrl(recipe: Recipe, agents: int, seed: int, env_steps: int, device: str) -> Run:
    assert recipe.purejaxrl is not None
    config = {**recipe.purejaxrl, "TOTAL_TIMESTEPS": env_steps}
    jax_device = jax.devices("cpu" if device == "cpu" else "gpu")[0]
    with jax.default_device(jax_device):
        rngs = jax.random.split(jax.random.PRNGKey(seed), agents)
        start = time.perf_counter()
        compiled = jax.jit(jax.vmap(make_train(config))).lower(rngs).compile()
        startup = time.perf_counter() - start
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(rngs))
        train = time.perf_counter() - start

        _, env_state, *_ = out["runner_state"]
        params = out["runner_state"][0].params
        eval_rngs = jax.random.split(jax.random.PRNGKey(seed + 10_000), agents)
        evaluate = jax.jit(
            jax.vmap(partial(purejaxrl_evaluate, config), in_axes=(0, 0, 0, None)),
            static_argnums=3,
        )
        returns = np.asarray(evaluate(params, env_state, eval_rngs, EVAL_EPISODES))
    steps = config["NUM_UPDATES"] * config["NUM_STEPS"] * config["NUM_ENVS"]
    target = target_return(recipe.env)
    return Run("purejaxrl", agents, seed, steps, startup, train, returns.tolist(), target)


def run_podium(
    recipe: Recipe, agents: int, seed: int, env_steps: int, device: str, compile: str
) -> Run:
    configs = podium_configs(recipe, agents, env_steps, seed, device, compile)
    start = time.perf_counter()
    # P = 1: ``podium train``'s trainer (its thread setting too); P > 1: the population pod's.
    trainer: Trainer = fit.build(configs[0]) if agents == 1 else build_trainer(configs)
    # The first two iterations compile (the first call traces, the second checks its guards).
    for _ in range(2):
        trainer.step()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    startup = time.perf_counter() - start
    first = trainer.env_steps
    start = time.perf_counter()
    while trainer.env_steps < env_steps:  # fit's loop, without its evaluations
        trainer.step()
    sync()
    train = time.perf_counter() - start
    returns = [e.mean for e in trainer.evaluate()]
    steps = trainer.env_steps - first
    trainer.close()
    side = "podium" if compile == "on" else "podium-eager"
    return Run(side, agents, seed, steps, startup, train, returns, target_return(recipe.env))


def median(runs: list[Run], key: str) -> float:
    return statistics.median(getattr(r, key) for r in runs)


def summarise(runs: list[Run], agents: int) -> dict[str, Any]:
    """Medians over seeds for ``agents`` per side, and the ratios of each seed's neighbouring
    runs (the same moment of the machine's load) with their median."""
    row: dict[str, Any] = {"agents": agents}
    by_side = {}
    for side in ("purejaxrl", "podium", "podium-eager"):
        mine = [r for r in runs if r.agents == agents and r.side == side]
        if not mine:
            continue
        by_side[side] = mine
        row[side] = {k: median(mine, k) for k in ("steps_per_s", "wall_s", "startup_s", "solved")}

    def ratios(a: str, b: str, key: str) -> None:
        if a in by_side and b in by_side:
            per_seed = [
                getattr(x, key) / getattr(y, key)
                for x, y in zip(by_side[a], by_side[b], strict=True)
            ]
            row[f"{a} / {b} {key}"] = {"per_seed": per_seed, "median": statistics.median(per_seed)}

    ratios("podium", "purejaxrl", "steps_per_s")
    ratios("podium-eager", "purejaxrl", "steps_per_s")
    ratios("podium", "podium-eager", "steps_per_s")
    ratios("purejaxrl", "podium", "wall_s")
    return row


def main() -> None:
    from services.malloc import reexec_with_allocator, running_allocator

    # Both sides with the allocator Podium's pods and `podium train` run with (tcmalloc, else
    # jemalloc, where the machine has one): the process starts anew with it preloaded.
    reexec_with_allocator()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="cartpole")
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=["purejaxrl", "podium", "podium-eager"],
        default=None,
        help="default: all the recipe has",
    )
    parser.add_argument("--agents", type=int, nargs="+", default=None, help="P values")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="env steps per agent")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--core", type=int, default=0, help="CPU core to pin to (cpu only)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    recipe = RECIPES[args.recipe]
    on_gpu = args.device.startswith("cuda")
    agents = args.agents or ([1, 64, 1024] if on_gpu else [1])
    steps = args.steps or int(recipe.purejaxrl["TOTAL_TIMESTEPS"] if recipe.purejaxrl else 1e5)
    sides = args.sides or (
        ["purejaxrl", "podium", "podium-eager"] if recipe.purejaxrl else ["podium", "podium-eager"]
    )
    out = args.out or Path(f"runs/purejaxrl_peer_{args.recipe}.json")
    if not on_gpu and hasattr(os, "sched_setaffinity"):
        # Every thread so far (the imports start a few), and so every one started later: the
        # libraries' thread pools start lazily, on first use, and inherit it.
        for thread in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread), {args.core})
    torch.set_num_threads(1)
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    field = lambda name: next(  # noqa: E731
        (ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.split(":")[0].strip() == name), "?"
    )
    # The model name alone does not tell CPU generations apart (one "AMD EPYC" has AVX-512,
    # another AVX2 only, at half the speed for both sides).
    flags = field("flags").split()
    isa = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "no AVX")
    cpu = f"{field('model name')} (family {field('cpu family')} model {field('model')}, {isa})"
    machine = (
        f"{cpu}, {os.cpu_count()} cores, pinned to {sorted(os.sched_getaffinity(0))}, "
        f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
        f"device {args.device}, load {os.getloadavg()[0]:.2f}"
    )
    machine += f", malloc {running_allocator().name}, MKL {services.pod.mkl_dispatch.state()}"
    print(f"recipe {args.recipe}; {machine}", flush=True)

    runs: list[Run] = []
    for p in agents:
        for seed in range(args.seeds):
            for side in sides:
                if side == "purejaxrl":
                    run = run_purejaxrl(recipe, p, seed, steps, args.device)
                else:
                    on = "on" if side == "podium" else "off"
                    run = run_podium(recipe, p, seed, steps, args.device, on)
                runs.append(run)
                print(
                    f"P={p:<5} seed {seed} {run.side:>12}: startup {run.startup_s:6.1f} s, "
                    f"train {run.train_s:7.1f} s, {run.steps_per_s:9,.0f} env steps/s, "
                    f"solved {run.solved:4.0%}, mean return {run.mean_return:7.1f} "
                    f"(load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )

    print(f"\n{args.recipe}: {steps:,} env steps per agent, medians over {args.seeds} seed(s)")
    table = [summarise(runs, p) for p in agents]
    for row in table:
        print(f"P = {row['agents']}")
        for side in sides:
            m = row[side]
            print(
                f"  {side:>12}: {m['steps_per_s']:9,.0f} env steps/s, wall {m['wall_s']:6.1f} s "
                f"(startup {m['startup_s']:5.1f}), solved {m['solved']:.0%}"
            )
        for key, value in row.items():
            if " / " in key:
                listed = " / ".join(f"{r:.2f}" for r in value["per_seed"])
                print(f"  {key}: **{value['median']:.2f}x** ({listed})")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "recipe": args.recipe,
        "machine": machine,
        "steps_per_agent": steps,
        "seeds": args.seeds,
        "device": args.device,
        "runs": [{**asdict(r), "wall_s": r.wall_s, "steps_per_s": r.steps_per_s} for r in runs],
        "medians": table,
    }
    out.write_text(json.dumps(record, indent=2, default=float))
    print(f"wrote {out}")
    if any(math.isnan(r.mean_return) for r in runs):
        raise SystemExit("a run's returns are NaN")


if __name__ == "__main__":
    main()
