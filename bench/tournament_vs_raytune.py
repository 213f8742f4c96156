"""The peer side by side: a Podium tournament vs Ray Tune's PopulationBasedTraining driving
Stable-Baselines3, on the same task, cores, population and settings.

    python bench/tournament_vs_raytune.py [--env Pendulum-v1] [--pods 4] [--reps 3]
                                          [--cpus 0,1] [--cap-s 600]

Each arm is launched the way its user launches it, as a process (tree) of its own:

- ``podium``: ``podium run SPEC`` (the embedded platform: Redis, leaderboard, orchestrator,
  local pods) with a PBT tournament of P pods (``population: {min_pods: P, max_pods: P}``,
  ``resources.cpu: cores / P``); the run ends when the leaderboard's best reaches the target.
- ``ray``: this file with ``--ray-driver``: ``ray.init`` then ``tune.Tuner`` with
  ``PopulationBasedTraining`` over P trials of a class trainable wrapping SB3 (SAC, TD3 or
  PPO). A trainable trains one Podium round of env steps per ``step``, evaluates
  deterministically on as many episodes as the Podium spec, and saves/loads the SB3 model and
  its replay buffer (off-policy: Podium's exploit copies the replay buffer too) or its
  ``VecNormalize`` statistics (PPO) in the Tune checkpoint directory, so PBT's exploit copies
  the agent. A stopper ends every trial once one reports the target.
- ``podium-pop``: as ``podium``, but one pod training the P agents as one batched population
  (``population.agents_per_pod: P``); ``podium-pairs``: P/2 pods of two batched agents each
  (``resources.cpu: 2 cores / (P/2)``), so a population pod's one busy thread has a core each.
- ``podium-warm``, ``podium-pairs-warm``: as ``podium``, ``podium-pairs``, on a platform whose
  compile cache already holds the task's
  programs, as a user's runs of a spec find it after ``podium compile SPEC`` (the cache is the
  platform's, kept across experiments; docs/compiled-loop.md): run once, untimed, before the
  first repetition; the timed runs keep the spec's ``compile: auto``.
- ``podium-pairs-up`` and ``ray-up``: the same tournaments submitted to services that already
  run, as a CI pipeline submits to a platform: ``podium up`` (its compile cache filled as the
  ``-warm`` arms') and ``ray start --head``, each started once on the same CPU set and given one
  untimed run first; each repetition is then ``podium submit SPEC --wait`` or a Ray driver that
  connects (``ray.init(address=...)``), and the clock starts at that command's launch. CPU and
  RSS count the command's tree and the service's processes (CPU: what they used from the
  launch on).
- ``podium-exec``: as ``podium``, with the local backend's pod launcher off
  (``PODIUM_POD_LAUNCHER=false``): every pod a new interpreter that imports torch itself, as
  before the launcher (services/pod/runtime/launcher.py).

Both arms get the same hyperparameters: SB3's are mapped from Podium's preset for the
(algorithm, env) (``sb3_kwargs``) with the trial's draw from the spec's search space on top; PBT's
perturbation interval, quantile, resample probability and factors are the Podium generator's
(``pbt_scheduler``). Both are pinned to the same CPU set (``os.sched_setaffinity`` of this
process, inherited by the children), with one torch thread per agent, and repetitions
interleave the arms (the order alternates) with paired seeds.

Measured per run: wall time from launch to the target (start-up included) and from submission
(Podium: the experiment's creation; Ray: ``ray.init`` done), CPU seconds of the process tree
(psutil, sampled every 0.2 s: up to the target, interpolated, and in all), peak RSS of the tree
(sum of the processes' RSS, so shared pages count more than once), env steps to the target
(all agents' reports up to the first at the target, not counting steps inherited by an exploit)
and start-up (launch to the first score on the board). Prints one JSON line per run, then a
markdown table of medians and the ratios. Needs the bench extra: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml
from ports import free_port
from sb3_timing import cpu_model

ROOT = Path(__file__).resolve().parents[1]
PODIUM = str(Path(sys.executable).with_name("podium"))  # the CLI of this interpreter's install
RAY = str(Path(sys.executable).with_name("ray"))
# The task's Podium spec (the search space, round, evaluation and PBT options both arms use)
# and the edits that turn it into another task's.
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "Pendulum-v1": ("examples/pendulum-sac.yaml", {}),
    "MountainCarContinuous-v0": (
        "examples/pendulum-sac.yaml",
        {
            "name": "mountaincar-sac",
            "env": {"name": "MountainCarContinuous-v0"},
            "target_return": 90.0,
            # An exploring agent scores below the idle ones (the action cost): without a
            # margin PBT's exploit overwrites it with a copy of an idle one (docs/
            # benchmarks.md, "Tournament learning quality"). Ray's PBT has no such option.
            "generator": {
                "strategy": "pbt",
                "options": {"ready_reports": 2, "ready_env_steps": 4096, "exploit_margin": 10},
            },
        },
    ),
    # PPO on MuJoCo HalfCheetah: Podium through EnvPool, SB3 through gymnasium's MuJoCo env of
    # the same version (the same transitions, tests/pod/envs/test_envpool_adapter.py), each as
    # its users run it.
    "HalfCheetah-v5": ("examples/halfcheetah.yaml", {}),
    # SAC on the same task: the off-policy preset
    # (services/contracts/algorithms/sac/presets/HalfCheetah-v5.yaml)
    # reaches 3,000 in a fraction of PPO's env steps; PBT over its learning rate, soft-update
    # rate and batch size, judged after two rounds, bottom quarter replaced.
    "HalfCheetah-v5-sac": (
        "examples/halfcheetah.yaml",
        {
            "name": "halfcheetah-sac",
            "algorithms": {"sac": 1.0},
            "search_space": {
                "learning_rate": {"type": "log_uniform", "low": 3.0e-4, "high": 3.0e-3},
                "tau": {"type": "uniform", "low": 0.002, "high": 0.02},
                "batch_size": {"type": "choice", "values": [256, 512]},
            },
            "generator": {
                "strategy": "pbt",
                "options": {"ready_env_steps": 20480, "truncation": 0.25},
            },
            "round": {"env_steps": 10240},
        },
    ),
}
# The same, for population pods (arms podium-pop, podium-pairs): PBT over the learning
# rate and soft-update rate only. A population's agents share their batch size (it shapes the
# minibatch tensors), so a spec whose search space draws it is refused for population pods;
# every arm of this task, Ray's too, gets the same narrower space.
TASKS["Pendulum-v1-pop"] = (
    "examples/pendulum-sac.yaml",
    {
        "name": "pendulum-sac-pop",
        "search_space": {
            k: v
            for k, v in yaml.safe_load((ROOT / "examples/pendulum-sac.yaml").read_text())[
                "search_space"
            ].items()
            if k != "batch_size"
        },
    },
)
_path, _sac = TASKS["HalfCheetah-v5-sac"]
TASKS["HalfCheetah-v5-sac-pop"] = (
    _path,
    {
        **copy.deepcopy(_sac),
        "name": "halfcheetah-sac-pop",
        "search_space": {k: v for k, v in _sac["search_space"].items() if k != "batch_size"},
    },
)


# --- the shared settings ---------------------------------------------------------------------


def podium_spec(
    env: str, pods: int, cores: int, rep: int, cap_s: float, agents_per_pod: int = 1
) -> dict[str, Any]:
    """The task's spec with P agents sharing ``cores``, as P / ``agents_per_pod`` pods each
    training that many agents as one batched population; the repetition's seeds and the cap."""
    path, edits = TASKS[env]
    spec = yaml.safe_load((ROOT / path).read_text())
    spec.update(copy.deepcopy(edits))
    spec["name"] = f"{spec['name']}-{rep}"
    n = pods // agents_per_pod
    spec["population"] = {"min_pods": n, "max_pods": n, "agents_per_pod": agents_per_pod}
    spec["resources"] = {**spec.get("resources", {}), "cpu": cores / n}
    spec["generator"].setdefault("options", {})["seed"] = rep
    spec["evaluation"]["seed"] = rep
    spec["budget"]["wall_time_s"] = cap_s
    return spec


def sb3_kwargs(algorithm: str, env: str, hyper: dict[str, Any]) -> dict[str, Any]:
    """SB3 constructor arguments for Podium's preset of (``algorithm``, ``env``) with ``hyper``
    (a draw from the search space: loop or agent field names) on top. One SB3 step is one
    step of all ``num_envs`` envs, so Podium's ``updates_per_step`` (per env step) becomes
    ``gradient_steps`` per vector step. PPO: ``sb3_ppo_kwargs``."""
    if algorithm == "ppo":
        return sb3_ppo_kwargs(env, hyper)
    from services.contracts.algorithms.card import card
    from services.contracts.algorithms.offpolicy import ReplayLoopConfig
    from services.pod.training.presets import preset

    data = preset(algorithm, env)
    loop_fields = set(ReplayLoopConfig.model_fields)
    loop = ReplayLoopConfig.model_validate(
        {k: v for k, v in {**data, **hyper}.items() if k in loop_fields}
    )
    agent = card(algorithm).config.model_validate(
        {**data.get(algorithm, {}), **{k: v for k, v in hyper.items() if k not in loop_fields}}
    )
    kwargs: dict[str, Any] = {
        "learning_rate": agent.learning_rate,
        "gamma": agent.gamma,
        "tau": agent.tau,
        "batch_size": loop.batch_size,
        "buffer_size": loop.buffer_size,
        "learning_starts": loop.learning_starts,
        "train_freq": 1,
        "gradient_steps": max(1, round(loop.updates_per_step * loop.num_envs)),
        "policy_kwargs": {"net_arch": list(agent.hidden_sizes)},
        "n_envs": loop.num_envs,
    }
    if algorithm == "sac":
        kwargs["ent_coef"] = (
            f"auto_{agent.init_alpha:g}" if agent.autotune_alpha else agent.init_alpha
        )
    elif algorithm == "td3":
        kwargs.update(
            noise_std=agent.exploration_noise,
            policy_delay=agent.policy_delay,
            target_policy_noise=agent.policy_noise,
            target_noise_clip=agent.noise_clip,
        )
    return kwargs


def sb3_ppo_kwargs(env: str, hyper: dict[str, Any]) -> dict[str, Any]:
    """SB3 PPO's constructor arguments for Podium's PPO preset of ``env`` as a pod trains it
    (no LR annealing: a pod has no fixed horizon) with ``hyper`` on top, plus ``n_envs`` and
    the ``VecNormalize`` switches. SB3's defaults already match the rest: Adam's eps 1e-5,
    advantages normalised per minibatch, no value clipping, bootstrapping at truncation."""
    from services.contracts.algorithms.ppo.config import PPOConfig
    from services.pod.algorithms.policies import ACTIVATIONS
    from services.pod.training.presets import preset

    cfg = PPOConfig.model_validate({**preset("ppo", env).get("ppo", {}), **hyper})
    if cfg.target_kl is not None or cfg.clip_vloss or cfg.sde_sample_freq:
        raise SystemExit("the preset uses a PPO option this mapping does not carry over")
    return {
        "learning_rate": cfg.learning_rate,
        "n_steps": cfg.num_steps,
        "batch_size": cfg.minibatch_size,
        "n_epochs": cfg.update_epochs,
        "gamma": cfg.gamma,
        "gae_lambda": cfg.gae_lambda,
        "clip_range": cfg.clip_coef,
        "ent_coef": cfg.ent_coef,
        "vf_coef": cfg.vf_coef,
        "max_grad_norm": cfg.max_grad_norm,
        "policy_kwargs": {
            "net_arch": list(cfg.hidden_sizes),
            "activation_fn": ACTIVATIONS[cfg.activation],
            "log_std_init": cfg.log_std_init,
        },
        "n_envs": cfg.num_envs,
        "norm_obs": cfg.norm_obs,
        "norm_reward": cfg.norm_reward,
    }


def sb3_env(env_id: str, n_envs: int, seed: int) -> Any:
    """SB3's vector env of a Podium env name (an EnvPool task runs as gymnasium's own)."""
    from stable_baselines3.common.env_util import make_vec_env

    from services.contracts.envpool_tasks import ENVPOOL_PREFIX

    return make_vec_env(env_id.removeprefix(ENVPOOL_PREFIX), n_envs=n_envs, seed=seed)


def sb3_model(
    algorithm: str, env_id: str, hyper: dict[str, Any], seed: int, make_env: Any = None
) -> tuple[Any, Any]:
    """An SB3 model with the settings of ``sb3_kwargs`` on its vector env, and the env (PPO:
    wrapped in ``VecNormalize`` where the preset normalises). ``make_env(env_id, n_envs,
    seed)`` builds the vector env (default ``sb3_env``)."""
    import numpy as np
    import stable_baselines3 as sb3
    from stable_baselines3.common.noise import NormalActionNoise
    from stable_baselines3.common.vec_env import VecNormalize

    kwargs = sb3_kwargs(algorithm, env_id, hyper)
    env = (make_env or sb3_env)(env_id, kwargs.pop("n_envs"), seed)
    if algorithm == "ppo":
        norm = {"norm_obs": kwargs.pop("norm_obs"), "norm_reward": kwargs.pop("norm_reward")}
        if any(norm.values()):
            env = VecNormalize(env, gamma=kwargs["gamma"], **norm)
        return sb3.PPO("MlpPolicy", env, seed=seed, device="cpu", **kwargs), env
    if "noise_std" in kwargs:
        dim = env.action_space.shape[0]
        std = kwargs.pop("noise_std")
        kwargs["action_noise"] = NormalActionNoise(np.zeros(dim), std * np.ones(dim))
    cls = {"sac": sb3.SAC, "td3": sb3.TD3}[algorithm]
    model = cls("MlpPolicy", env, seed=seed, device="cpu", **kwargs)
    if pink_noise(algorithm, env_id):
        set_pink_noise(model, env.num_envs, seed)
    return model, env


def pink_noise(algorithm: str, env_id: str) -> bool:
    """Whether Podium's preset for (``algorithm``, ``env_id``) explores with pink noise."""
    from services.pod.training.presets import preset

    return algorithm == "sac" and preset(algorithm, env_id).get("sac", {}).get("action_noise") == (
        "pink"
    )


def set_pink_noise(model: Any, n_envs: int, seed: int, horizon: int = 1000) -> None:
    """SB3 SAC acting with pink noise, as Podium's preset does: pink-noise-rl's
    ``PinkNoiseDist`` (by the pink-noise paper's authors), with one noise signal per env of
    the vector env (its own draws one signal shared by all envs) and only when acting: the
    training batch's reparameterised sample keeps SAC's Gaussian noise (the package would
    broadcast one noise value over the whole batch). Like the package, and unlike Podium
    (which starts a fresh signal per episode), a signal runs on across episodes."""
    import numpy as np
    from pink.cnrl import ColoredNoiseProcess
    from pink.sb3 import PinkNoiseDist
    from stable_baselines3.common.distributions import SquashedDiagGaussianDistribution

    dims = model.action_space.shape[0]

    class PerEnvPinkNoiseDist(PinkNoiseDist):
        def __init__(self) -> None:
            super().__init__(horizon, dims)
            self.gen = ColoredNoiseProcess(
                beta=1.0, size=(n_envs, dims, horizon), rng=np.random.default_rng(seed)
            )

        def sample(self) -> Any:
            if self.distribution.mean.shape[0] != n_envs:  # a training batch
                return SquashedDiagGaussianDistribution.sample(self)
            return super().sample()

    model.actor.action_dist = PerEnvPinkNoiseDist()


def tune_space(search_space: dict[str, Any]) -> dict[str, Any]:
    """The spec's search space as Tune domains (initial draws and PBT's resampling)."""
    from ray import tune

    out: dict[str, Any] = {}
    for name, d in search_space.items():
        if d["type"] == "log_uniform":
            out[name] = tune.loguniform(d["low"], d["high"])
        elif d["type"] == "uniform":
            out[name] = tune.uniform(d["low"], d["high"])
        elif d["type"] == "int_uniform":
            out[name] = tune.randint(d["low"], d["high"] + 1)
        elif d["type"] == "choice":
            out[name] = tune.choice(d["values"])
        else:
            raise SystemExit(f"search space type {d['type']} has no Tune twin")
    return out


def pbt_scheduler(spec: dict[str, Any]) -> Any:
    """Ray's PBT with the Podium generator's options as far as they map: a trial may be
    replaced after ``ready_reports`` rounds and ``ready_env_steps`` (Tune: the larger, in
    training iterations of one round each), exploits the top ``quantile``, resamples with
    ``resample_probability``, perturbs by ``perturb_factors``. Podium replaces every pod below
    the best (truncation unset); Tune replaces its bottom ``quantile_fraction`` (at most 0.5),
    here the same share as the top."""
    from ray.tune.schedulers import PopulationBasedTraining

    from services.contracts.strategies import PBTOptions

    opts = PBTOptions.model_validate(
        {k: v for k, v in spec["generator"].get("options", {}).items() if k != "seed"}
    )
    rounds = max(opts.ready_reports, -(-opts.ready_env_steps // spec["round"]["env_steps"]))
    factors = (max(opts.perturb_factors), min(opts.perturb_factors))
    return PopulationBasedTraining(
        time_attr="training_iteration",
        metric="score",
        mode="max",
        perturbation_interval=rounds,
        quantile_fraction=min(opts.quantile, 0.5),
        resample_probability=opts.resample_probability,
        perturbation_factors=factors,
        hyperparam_mutations=tune_space(spec["search_space"]),
        custom_explore_fn=functools.partial(clamp, spec["search_space"]),
    )


def clamp(search_space: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Tune's explore multiplies a value by a factor without keeping it in its domain (a gamma
    of 0.98 x 1.2 = 1.18 fails the trial); Podium's clamps to the bounds, and so does this."""
    for name, d in search_space.items():
        if name in config and "low" in d:
            value = min(max(config[name], d["low"]), d["high"])
            config[name] = round(value) if d["type"] == "int_uniform" else value
    return config


# --- the Ray side ----------------------------------------------------------------------------


def make_trainable(
    algorithm: str,
    env_id: str,
    round_steps: int,
    episodes: int,
    make_env: Any = None,
    evaluate: Any = None,
) -> Any:
    """A Tune class trainable: SB3 ``algorithm`` on ``env_id``, one round per ``step``.

    ``make_env``: as ``sb3_model``'s. ``evaluate(model, train_env) -> dict``: the round's
    result, its ``score`` the one PBT ranks by (default: the mean return of ``episodes``
    deterministic episodes on an env of ``make_env``)."""
    from ray import tune

    class SB3Trainable(tune.Trainable):
        def setup(self, config: dict[str, Any]) -> None:
            import torch
            from stable_baselines3.common.vec_env import VecNormalize

            torch.set_num_threads(1)
            hyper = {k: v for k, v in config.items() if k != "seed"}
            seed = int(config["seed"])
            self.model, self.env = sb3_model(algorithm, env_id, hyper, seed, make_env)
            self.cls = type(self.model)
            self.normalized = isinstance(self.env, VecNormalize)
            if evaluate is None:
                self.eval_env = (make_env or sb3_env)(env_id, episodes, seed + 10_000)
            if evaluate is None and self.normalized:  # the training statistics, frozen
                self.eval_env = VecNormalize(self.eval_env, training=False, norm_reward=False)
            self.copied = False  # whether these weights came from another trial (exploit)

        def apply(self, config: dict[str, Any]) -> None:
            """PBT's explored hyperparameters onto the (restored) model."""
            from stable_baselines3.common.utils import get_schedule_fn

            hyper = {k: v for k, v in config.items() if k != "seed"}
            kwargs = sb3_kwargs(algorithm, env_id, hyper)
            if algorithm == "ppo":
                for name in ("gamma", "gae_lambda", "ent_coef"):
                    setattr(self.model, name, kwargs[name])
                # The rollout buffer and the reward normaliser hold their own copies.
                self.model.rollout_buffer.gamma = kwargs["gamma"]
                self.model.rollout_buffer.gae_lambda = kwargs["gae_lambda"]
                if self.normalized:
                    self.env.gamma = kwargs["gamma"]
                self.model.clip_range = get_schedule_fn(kwargs["clip_range"])
            else:
                for name in ("gamma", "tau", "batch_size", "gradient_steps"):
                    setattr(self.model, name, kwargs[name])
            self.model.learning_rate = kwargs["learning_rate"]
            self.model._setup_lr_schedule()

        def step(self) -> dict[str, Any]:
            from stable_baselines3.common.evaluation import evaluate_policy
            from stable_baselines3.common.vec_env import sync_envs_normalization

            before = self.model.num_timesteps
            self.model.learn(round_steps, reset_num_timesteps=False)
            if evaluate is not None:
                scores = evaluate(self.model, self.env)
            else:
                if self.normalized:
                    sync_envs_normalization(self.env, self.eval_env)
                mean, _ = evaluate_policy(
                    self.model, self.eval_env, n_eval_episodes=episodes, deterministic=True
                )
                scores = {"score": float(mean)}
            return {
                **scores,
                "steps_this_iter": self.model.num_timesteps - before,
                "agent_env_steps": self.model.num_timesteps,
                "copied": self.copied,
            }

        def save_checkpoint(self, checkpoint_dir: str) -> None:
            self.model.save(Path(checkpoint_dir) / "model.zip")
            if algorithm != "ppo":
                self.model.save_replay_buffer(Path(checkpoint_dir) / "replay_buffer.pkl")
            if self.normalized:  # the agent's observation and return statistics
                self.env.save(Path(checkpoint_dir) / "vecnormalize.pkl")

        def load_checkpoint(self, checkpoint_dir: str) -> None:
            from stable_baselines3.common.vec_env import VecNormalize

            # SB3's own format (a zip of torch state dicts; the buffer and the normaliser are
            # pickled): the peer as its users run it, our own checkpoint file's bytes, never a
            # foreign one.
            if self.normalized:
                self.env = VecNormalize.load(
                    str(Path(checkpoint_dir) / "vecnormalize.pkl"), self.env.venv
                )
            self.model = self.cls.load(
                Path(checkpoint_dir) / "model.zip", env=self.env, device="cpu"
            )
            if algorithm != "ppo":
                self.model.load_replay_buffer(Path(checkpoint_dir) / "replay_buffer.pkl")
            if pink_noise(algorithm, env_id):  # the loaded actor has SB3's own distribution
                set_pink_noise(self.model, self.env.num_envs, int(self.config["seed"]))
            self.copied = True
            self.apply(self.config)

        def reset_config(self, new_config: dict[str, Any]) -> bool:
            self.config = new_config
            self.apply(new_config)
            return True

    return SB3Trainable


def start_ray(cores: int) -> None:
    """A local Ray of ``cores`` CPUs, as small as it runs: no dashboard, a small object store,
    the workers' logs kept from the driver."""
    import ray

    ray.init(
        num_cpus=cores,
        include_dashboard=False,
        object_store_memory=200 * 1024**2,
        logging_level="ERROR",
        log_to_driver=False,
    )


def fit_population(
    trainable: Any,
    space: dict[str, Any],
    scheduler: Any,
    job: dict[str, Any],
    *,
    seed: int,
    name: str,
    stop: Any,
    callback: Any,
) -> Any:
    """``job["pods"]`` trials of ``trainable`` (each ``job["cores"] / pods`` CPUs) under
    ``scheduler``, actors reused, the search seeded, within ``job["cap_s"]``; Tune's
    ResultGrid (a failed trial is counted there, not raised)."""
    from ray import tune

    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": job["cores"] / job["pods"]}),
        param_space=space,
        tune_config=tune.TuneConfig(
            scheduler=scheduler,
            num_samples=1,
            reuse_actors=True,
            time_budget_s=job["cap_s"],
            search_alg=tune.search.BasicVariantGenerator(random_state=seed),
        ),
        run_config=tune.RunConfig(
            name=name, storage_path=job["storage"], stop=stop, callbacks=[callback], verbose=0
        ),
    )
    return tuner.fit()


def ray_driver(job: dict[str, Any]) -> None:
    """One Ray Tune PBT run (this process is the Ray driver); writes its timings to
    ``job["out"]``."""
    launched = job["launched"]
    marks: dict[str, Any] = {"imported": None, "ray_up": None, "first_result": None}
    import ray
    from ray import tune

    marks["imported"] = time.time() - launched
    spec, target = job["spec"], job["spec"]["target_return"]
    random.seed(job["rep"])  # PBT's choices of parent and mutation
    if job.get("address"):  # a running cluster (``ray-up``)
        ray.init(address=job["address"], logging_level="ERROR", log_to_driver=False)
    else:
        start_ray(job["cores"])
    marks["ray_up"] = time.time() - launched
    state: dict[str, Any] = {
        "steps": 0,
        "reached": None,
        "steps_at": None,
        "best": None,
        "via_copy": None,
    }

    class Watch(tune.Callback):
        def on_trial_result(self, iteration: int, trials: Any, trial: Any, result: dict) -> None:
            now = time.time() - launched
            marks["first_result"] = marks["first_result"] or now
            state["steps"] += result["steps_this_iter"]
            score = result["score"]
            state["best"] = score if state["best"] is None else max(state["best"], score)
            if score >= target and state["reached"] is None:
                state["reached"], state["steps_at"] = now, state["steps"]
                state["via_copy"] = result["copied"]

    class StopAtTarget(tune.Stopper):
        def __call__(self, trial_id: str, result: dict) -> bool:
            return result["score"] >= target

        def stop_all(self) -> bool:
            return state["reached"] is not None

    pods = job["pods"]
    seeds = tune.grid_search([job["rep"] * 1000 + i for i in range(pods)])  # P trials
    space = {**tune_space(spec["search_space"]), "seed": seeds}
    scheduler = pbt_scheduler(spec)
    trainable = make_trainable(
        job["algorithm"],
        spec["env"]["name"],
        spec["round"]["env_steps"],
        spec["evaluation"]["episodes"],
    )
    grid = fit_population(
        trainable,
        space,
        scheduler,
        job,
        seed=job["rep"],
        name=spec["name"],
        stop=StopAtTarget(),
        callback=Watch(),
    )
    ray.shutdown()
    state["trial_errors"] = grid.num_errors  # Tune reports a failed trial, it does not raise
    state["exploits"] = scheduler._num_perturbations  # no public counter
    Path(job["out"]).write_text(json.dumps({**marks, **state}))


# --- running and measuring either arm --------------------------------------------------------


class TreeSampler(threading.Thread):
    """CPU seconds and RSS of a process and its descendants, sampled every ``every`` s; with
    ``services`` (pids of processes that ran before, e.g. a running platform's) their trees too,
    counting the CPU time they use from the first sample on."""

    def __init__(self, pid: int, every: float = 0.2, services: tuple[int, ...] = ()) -> None:
        super().__init__(daemon=True)
        self.root, self.every = psutil.Process(pid), every
        self.services = [psutil.Process(p) for p in services]
        self.start_t = time.time()
        self.cpu: dict[int, float] = {}  # pid -> its last seen CPU seconds
        self.before = 0.0  # the CPU seconds the processes had at the first sample
        self.series: list[tuple[float, float, int]] = []  # (s since start, CPU s, RSS bytes)
        self.done = threading.Event()

    def _tree(self) -> dict[int, psutil.Process]:
        procs: dict[int, psutil.Process] = {}
        for root in [self.root, *self.services]:
            try:
                for p in [root, *root.children(recursive=True)]:
                    procs[p.pid] = p
            except psutil.NoSuchProcess:
                if root is self.root:
                    raise
        return procs

    def run(self) -> None:
        while not self.done.is_set():
            try:
                procs = self._tree()
            except psutil.NoSuchProcess:
                break
            rss = 0
            for p in procs.values():
                try:
                    with p.oneshot():
                        t = p.cpu_times()
                        self.cpu[p.pid] = t.user + t.system
                        rss += p.memory_info().rss
                except psutil.Error:
                    continue
            if not self.series and self.services:
                self.before = sum(self.cpu.values())
            used = sum(self.cpu.values()) - self.before
            self.series.append((time.time() - self.start_t, used, rss))
            self.done.wait(self.every)

    def cpu_at(self, t: float | None) -> float:
        """CPU seconds of the tree at ``t`` s after the start (interpolated), or in all."""
        if not self.series:
            return 0.0
        if t is None or t >= self.series[-1][0]:
            return self.series[-1][1]
        prev = (0.0, 0.0, 0)
        for s in self.series:
            if s[0] >= t:
                frac = (t - prev[0]) / max(s[0] - prev[0], 1e-9)
                return prev[1] + frac * (s[1] - prev[1])
            prev = s
        return self.series[-1][1]


# A cluster of ``ray start`` asks its drivers for a token unless told not to; ``ray.init``'s
# own does not: the same for both Ray arms.
ENV = {"OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def bench_env(**extra: str) -> dict[str, str]:
    """The environment of every process an arm starts (one torch thread, Ray's settings)."""
    return {**os.environ, **ENV, **extra}


def launch(
    cmd: list[str], log: Path, services: tuple[int, ...] = (), **extra_env: str
) -> tuple[subprocess.Popen, TreeSampler, float]:
    env = bench_env(**extra_env)
    launched = time.time()
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    sampler = TreeSampler(proc.pid, services=services)
    sampler.start_t = launched
    sampler.start()
    return proc, sampler, launched


def finish(proc: subprocess.Popen, sampler: TreeSampler, cap_s: float) -> float:
    try:
        proc.wait(cap_s + 300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    wall = time.time() - sampler.start_t
    sampler.done.set()
    sampler.join()
    return wall


def measured(arm: str, rep: int, sampler: TreeSampler, wall: float, **fields: Any) -> dict:
    reached = fields.get("to_target_s")
    return {
        "arm": arm,
        "rep": rep,
        **fields,
        "cpu_to_target_s": sampler.cpu_at(reached) if reached is not None else None,
        "cpu_total_s": sampler.cpu_at(None),
        "peak_rss_mb": max((s[2] for s in sampler.series), default=0) / 2**20,
        "wall_total_s": wall,
        "load": os.getloadavg()[0],
    }


def via_copy(nodes: list[dict], subs: list[dict], target: float) -> bool | None:
    """Whether the first agent on the board at the target got there from weights copied from
    another pod (an ancestor on another pod), or on its own training alone."""
    hits = sorted(
        (s for s in subs if (s["score"] or -1e300) >= target), key=lambda s: s["decided_at"]
    )
    if not hits:
        return None
    by_id = {n["candidate_id"]: n for n in nodes}
    node = by_id.get(hits[0]["candidate_id"])
    while node is not None and node["parent_id"] is not None:
        parent = by_id.get(node["parent_id"])
        if parent is not None and parent["pod_id"] != node["pod_id"]:
            return True
        node = parent
    return False


def warm_cache(args: argparse.Namespace, cores: int, root: Path, agents_per_pod: int = 1) -> Path:
    """A ``-warm`` arm's compile cache under ``root``, filled once (untimed) by ``podium
    compile`` of the task's spec, as a user prepares a spec's runs (docs/tournaments.md)."""
    data = root / "data"
    cache = data / "compile-cache"
    if cache.exists():
        return cache
    root.mkdir(parents=True, exist_ok=True)
    # Seeds no repetition uses: the timed runs find programs, not agents.
    spec = podium_spec(args.env, args.pods, cores, 10_000, args.cap_s, agents_per_pod)
    cmd = [PODIUM, "compile", spec_file(spec, root)]
    start = time.time()
    with (root / "log").open("w") as log:
        done = subprocess.run([*cmd, "--data-dir", str(data)], stdout=log, stderr=log, check=False)
    print(f"podium compile: exit {done.returncode}, {time.time() - start:.0f} s", flush=True)
    return cache


def spec_file(spec: dict[str, Any], work: Path) -> str:
    """``spec`` written to ``work``/spec.yaml, for a ``podium`` command."""
    path = work / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def podium_command(spec: dict[str, Any], work: Path) -> tuple[list[str], Path]:
    """``podium run`` of ``spec`` (written to ``work``) on ephemeral ports, and its OUT."""
    out = work / "out"
    cmd = [PODIUM, "run", spec_file(spec, work), "--out", str(out), "--quiet"]
    return [*cmd, "--port", "0", "--leaderboard-port", "0"], out


def share_cache(out: Path, cache: Path) -> None:
    """The platform of ``podium run --out OUT`` keeps its compile cache in OUT/data."""
    (out / "data").mkdir(parents=True)
    (out / "data" / "compile-cache").symlink_to(cache, target_is_directory=True)


def run_podium(
    args: argparse.Namespace, rep: int, cores: int, work: Path, arm: str = "podium"
) -> dict[str, Any]:
    shape = arm.removesuffix("-warm")
    agents_per_pod = {"podium-pairs": 2, "podium-pop": args.pods}.get(shape, 1)
    spec = podium_spec(args.env, args.pods, cores, rep, args.cap_s, agents_per_pod)
    cmd, out = podium_command(spec, work)
    if arm.endswith("-warm"):
        root = work.parent / f"warm-{agents_per_pod}"
        share_cache(out, warm_cache(args, cores, root, agents_per_pod))
    launcher = {"PODIUM_POD_LAUNCHER": "false"} if arm == "podium-exec" else {}
    proc, sampler, launched = launch(cmd, work / "log", **launcher)
    wall = finish(proc, sampler, args.cap_s)
    exp = json.loads((out / "experiment.json").read_text())
    subs = json.loads((out / "submissions.json").read_text())
    nodes = json.loads((out / "lineage.json").read_text())["nodes"]
    return podium_measured(args, arm, rep, spec, (proc, sampler, launched, wall), exp, subs, nodes)


def podium_measured(
    args: argparse.Namespace,
    arm: str,
    rep: int,
    spec: dict[str, Any],
    run: tuple[subprocess.Popen, TreeSampler, float, float],
    exp: dict[str, Any],
    subs: list[dict[str, Any]],
    nodes: list[dict[str, Any]],
) -> dict[str, Any]:
    """A Podium run's row from its experiment, its submission log and its lineage."""
    proc, sampler, launched, wall = run
    target = spec["target_return"]
    hits = [s["decided_at"] for s in subs if s["score"] is not None and s["score"] >= target]
    first = min((s["decided_at"] for s in subs), default=None)
    hit = min(hits, default=None)
    return measured(
        arm,
        rep,
        sampler,
        wall,
        to_target_s=hit - launched if hit is not None else None,
        submitted_s=exp["created_at"] - launched,
        first_score_s=first - launched if first else None,
        # As Ray's results count: the reports decided up to the first at the target (the
        # experiment's own count goes on until the orchestrator sees the target).
        env_steps=None
        if hit is None
        else sum(s["env_steps"] for s in subs if s["decided_at"] <= hit),
        via_copy=via_copy(nodes, subs, target),
        best=exp.get("best_score"),
        round_steps=spec["round"]["env_steps"],
        env_steps_in_all=(exp.get("progress") or {}).get("env_steps"),
        pods=args.pods,  # agents
        exit_code=proc.returncode,
    )


# The ``-up`` arms' running services: started once, on first use; ``stop_services`` stops them.
SERVICES: dict[str, Any] = {}
WARMUP_REP = 10_001  # the untimed run's seeds: no repetition's


def podium_submit(spec: dict[str, Any], work: Path, data: Path) -> list[str]:
    """``podium submit --wait`` of ``spec`` (written to ``work``) to the platform on ``data``."""
    return [PODIUM, "submit", spec_file(spec, work), "--wait", "--quiet", "--data-dir", str(data)]


def no_pods_left(up: int, timeout_s: float = 60.0) -> None:
    """Wait until the platform's pods of an earlier run have ended (their final reports)."""
    from services.pod.runtime.launcher import POD_PROCESS_NAME

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        names = []
        for p in psutil.Process(up).children(recursive=True):
            try:
                names.append(p.name())
            except psutil.Error:
                continue
        if POD_PROCESS_NAME not in names:
            return
        time.sleep(0.2)


def podium_up(args: argparse.Namespace, cores: int, root: Path) -> tuple[Path, int]:
    """``podium up`` on ``root``/up/data (its compile cache the pairs' warm one), once, with
    one untimed experiment run on it: its data directory and pid."""
    if "podium" in SERVICES:
        return SERVICES["podium"][0], SERVICES["podium"][1].pid
    from services.cli.platform import read_session

    home = root / "up"
    data = home / "data"
    data.mkdir(parents=True)
    cache = warm_cache(args, cores, root / "warm-2", agents_per_pod=2)
    (data / "compile-cache").symlink_to(cache, target_is_directory=True)
    cmd = [PODIUM, "up", "--data-dir", str(data), "--port", "0", "--leaderboard-port", "0"]
    with (home / "log").open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=bench_env(), stdout=log, stderr=subprocess.STDOUT
        )
    SERVICES["podium"] = (data, proc)
    deadline = time.time() + 120
    while read_session(data) is None:
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError("podium up did not start: " + (home / "log").read_text()[-2000:])
        time.sleep(0.1)
    spec = podium_spec(args.env, args.pods, cores, WARMUP_REP, args.cap_s, agents_per_pod=2)
    start = time.time()
    with (home / "warmup.log").open("wb") as log:
        done = subprocess.run(
            podium_submit(spec, home, data), cwd=ROOT, env=bench_env(),
            stdout=log, stderr=subprocess.STDOUT, check=False,
        )  # fmt: skip
    print(f"podium up: untimed run exit {done.returncode}, {time.time() - start:.0f} s", flush=True)
    return data, proc.pid


def run_podium_up(args: argparse.Namespace, rep: int, cores: int, work: Path) -> dict[str, Any]:
    """``podium submit SPEC --wait`` of the pairs' spec to the running platform."""
    from services.cli.client import PodiumClient, resolve

    data, up = podium_up(args, cores, work.parent)
    no_pods_left(up)
    spec = podium_spec(args.env, args.pods, cores, rep, args.cap_s, agents_per_pod=2)
    cmd = podium_submit(spec, work, data)
    proc, sampler, launched = launch(cmd, work / "log", services=(up,))
    wall = finish(proc, sampler, args.cap_s)
    found = re.search(r"as experiment ([0-9a-f]+)", (work / "log").read_text())
    if found is None:
        raise RuntimeError("podium submit: " + (work / "log").read_text()[-2000:])
    client = PodiumClient(resolve(data_dir=data))
    exp_id = found.group(1)
    exp = client.experiment(exp_id)
    subs = [s.model_dump() for s in client.submissions(exp_id)]
    nodes = [n.model_dump() for n in client.lineage(exp_id).nodes]
    run = (proc, sampler, launched, wall)
    return podium_measured(args, "podium-pairs-up", rep, spec, run, exp, subs, nodes)


def ray_up(args: argparse.Namespace, cores: int, root: Path) -> tuple[str, tuple[int, ...]]:
    """``ray start --head`` on ``cores`` CPUs (as ``start_ray``'s), once, with one untimed
    tournament run on it: its address and its processes."""
    if "ray" in SERVICES:
        return SERVICES["ray"]
    address = f"127.0.0.1:{free_port()}"
    before = set(psutil.pids())
    cmd = [
        RAY, "start", "--head", f"--port={address.split(':')[1]}", f"--num-cpus={cores}",
        "--include-dashboard=false", f"--object-store-memory={200 * 1024**2}",
        f"--temp-dir={root / 'ray'}", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
    ]  # fmt: skip
    with (root / "ray-start.log").open("wb") as log:
        subprocess.run(
            cmd, cwd=ROOT, env=bench_env(), stdout=log, stderr=subprocess.STDOUT,
            check=True,
        )  # fmt: skip
    pids = []
    for pid in set(psutil.pids()) - before:
        try:
            if "ray" in " ".join(psutil.Process(pid).cmdline()):
                pids.append(pid)
        except psutil.Error:
            continue
    SERVICES["ray"] = (address, tuple(pids))
    (root / "ray-warmup").mkdir()
    start = time.time()
    out = run_ray(args, WARMUP_REP, cores, root / "ray-warmup", arm="ray-up")
    took = time.time() - start
    print(f"ray start: untimed run exit {out['exit_code']}, {took:.0f} s", flush=True)
    return SERVICES["ray"]


def stop_services() -> None:
    if "podium" in SERVICES:
        proc = SERVICES.pop("podium")[1]
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    if SERVICES.pop("ray", None):
        subprocess.run([RAY, "stop"], capture_output=True, check=False)


def run_ray(
    args: argparse.Namespace, rep: int, cores: int, work: Path, arm: str = "ray"
) -> dict[str, Any]:
    address, services = ray_up(args, cores, work.parent) if arm == "ray-up" else (None, ())
    spec = podium_spec(args.env, args.pods, cores, rep, args.cap_s)
    job = {
        "spec": spec,
        "rep": rep,
        "pods": args.pods,
        "cores": cores,
        "cap_s": args.cap_s,
        "algorithm": next(iter(spec["algorithms"])),
        "storage": str(work / "tune"),
        "out": str(work / "ray.json"),
        "launched": 0.0,
        "address": address,
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--ray-driver"]
    job_file = work / "job.json"
    proc, sampler, launched = launch([*cmd, str(job_file)], work / "log", services=services)
    job["launched"] = launched
    job_file.write_text(json.dumps(job))  # read by the driver after its imports
    wall = finish(proc, sampler, args.cap_s)
    res = json.loads(Path(job["out"]).read_text()) if Path(job["out"]).exists() else {}
    return measured(
        arm,
        rep,
        sampler,
        wall,
        to_target_s=res.get("reached"),
        submitted_s=res.get("ray_up"),
        first_score_s=res.get("first_result"),
        env_steps=res.get("steps_at"),
        best=res.get("best"),
        round_steps=spec["round"]["env_steps"],
        env_steps_in_all=res.get("steps"),
        pods=args.pods,
        exit_code=proc.returncode,
        imported_s=res.get("imported"),
        via_copy=res.get("via_copy"),
        exploits=res.get("exploits"),
        trial_errors=res.get("trial_errors"),
    )


# The arms: Podium with P pods (a PBT tournament, as Ray's P trials), Podium with one pod
# training the P agents as one batched population (the same PBT among them) or with P/2 pods of
# two, Podium without its pod launcher, Ray Tune + SB3.
RUNNERS = {
    "podium": run_podium,
    "podium-exec": functools.partial(run_podium, arm="podium-exec"),
    "podium-warm": functools.partial(run_podium, arm="podium-warm"),
    "podium-pop": functools.partial(run_podium, arm="podium-pop"),
    "podium-pairs": functools.partial(run_podium, arm="podium-pairs"),
    "podium-pairs-warm": functools.partial(run_podium, arm="podium-pairs-warm"),
    "podium-pairs-up": run_podium_up,
    "ray": run_ray,
    "ray-up": functools.partial(run_ray, arm="ray-up"),
}
RAY_ARMS = ("ray", "ray-up")


def peer(arm: str) -> str:
    """The Ray arm a Podium arm is compared with: the running cluster for a running platform."""
    return "ray-up" if arm.endswith("-up") else "ray"


def podium_speed(algorithm: str, env: str, seed: int, n: int) -> float:
    """One Podium agent's env steps/s over ``n`` env steps (one torch thread, no evaluation in
    the clock), in a new process: the pod's package is imported before torch."""
    # The pod's package before torch, as in every pod process.
    import services.pod  # noqa: F401

    # isort: split
    import torch
    from sb3_timing import timed_podium

    from services.pod.training.fit import train
    from services.pod.training.offpolicy import OffPolicyConfig
    from services.pod.training.presets import preset

    torch.set_num_threads(1)
    cfg = {**preset(algorithm, env), "total_env_steps": n}
    seconds, _ = timed_podium(OffPolicyConfig, train, cfg, seed, n, 1, 1e9)
    return n / seconds


def agent_speed(args: argparse.Namespace) -> None:
    """Per-agent speed alone: one SB3 agent and one Podium agent (the same preset, one torch
    thread, no evaluation in the clock) train ``--speed-steps`` env steps each, alternating,
    ``--reps`` times; prints env steps/s of each and the ratio. Each side runs as its users run
    it: SB3 here, each Podium agent in a process of its own that imports the pod's package
    before torch, as a pod does (MKL's dispatch: services/pod/mkl_dispatch.py)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch
    from sb3_timing import timed_learn
    from stable_baselines3.common.evaluation import evaluate_policy

    spec = podium_spec(args.env, 1, 1, 0, args.cap_s)
    algorithm, n = next(iter(spec["algorithms"])), args.speed_steps
    env = spec["env"]["name"]  # Podium's name (SB3 runs gymnasium's task of it: sb3_env)
    if algorithm not in ("sac", "td3"):
        raise SystemExit(f"--speed-steps times off-policy agents only, not {algorithm}")
    never = 1e9  # a threshold no evaluation reaches: train the whole budget
    rates: dict[str, list[float]] = {"sb3": [], "podium": []}
    extra: dict[str, list[float]] = {"eval_s": [], "checkpoint_s": []}
    for seed in range(args.reps):
        torch.set_num_threads(1)
        model, _ = sb3_model(algorithm, env, {}, seed)
        seconds, _ = timed_learn(model, sb3_env(env, 1, seed), n, never, n, 1)
        rates["sb3"].append(n / seconds)
        # What a trial adds to each round: the evaluation (as many episodes as the spec's, on
        # one Python env each) and the checkpoint PBT may ask for.
        episodes = spec["evaluation"]["episodes"]
        start = time.perf_counter()
        evaluate_policy(model, sb3_env(env, episodes, seed), episodes, deterministic=True)
        extra["eval_s"].append(time.perf_counter() - start)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            model.save(Path(tmp) / "model.zip")
            model.save_replay_buffer(Path(tmp) / "replay_buffer.pkl")
            extra["checkpoint_s"].append(time.perf_counter() - start)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rates["podium"].append(pool.submit(podium_speed, algorithm, env, seed, n).result())
        print(
            json.dumps({"speed": seed, **{k: v[-1] for k, v in {**rates, **extra}.items()}}),
            flush=True,
        )
    sb3, podium = statistics.median(rates["sb3"]), statistics.median(rates["podium"])
    print(
        f"\n| agent | env steps/s (median of {args.reps}) |\n|---|---|\n| SB3 {algorithm} | "
        f"{sb3:,.0f} |\n| Podium {algorithm} | {podium:,.0f} |\n| Podium / SB3 | "
        f"{podium / sb3:.1f}x |\nSB3 per round of {spec['round']['env_steps']} env steps "
        f"(~{spec['round']['env_steps'] / sb3:.1f} s): evaluation "
        f"{statistics.median(extra['eval_s']):.2f} s, checkpoint "
        f"{statistics.median(extra['checkpoint_s']):.2f} s (medians)"
    )


def med(values: list[float | None], cap: float | None = None) -> float | None:
    got = [v if v is not None else cap for v in values]
    got = [v for v in got if v is not None]
    return statistics.median(got) if got else None


def summarize(results: list[dict[str, Any]], cap_s: float) -> None:
    """Markdown table of medians per arm (an unsolved run counts as the cap for time: the
    median is then a lower bound), the Podium/Ray ratios and where the time goes."""
    cols = [
        ("to_target_s", "wall to target s", cap_s),
        ("cpu_to_target_s", "CPU s to target", None),
        ("env_steps", "env steps to target", None),
        ("peak_rss_mb", "peak RSS MB", None),
        ("first_score_s", "launch to first score s", None),
        ("submitted_s", "launch to submitted / Ray up s", None),
        ("steps_per_agent_s", "env steps/s per agent", None),
        ("cpu_ms_per_step", "CPU ms per env step", None),
        ("cpu_total_s", "CPU s in all", None),
        ("wall_total_s", "wall in all s", None),
        ("env_steps_in_all", "env steps in all", None),
        ("best", "best score", None),
    ]
    for r in results:
        # Per-agent speed while the P agents share the cores: env steps between the first
        # score and the target, per agent and second (evaluation and checkpoints included).
        t, f, s = r["to_target_s"], r["first_score_s"], r["env_steps"]
        # The first round's steps (P rounds) are done by the first score: not counted.
        s = s - r["pods"] * r["round_steps"] if s else None
        r["steps_per_agent_s"] = s / r["pods"] / (t - f) if t and f and s and t > f else None
        # CPU time does not grow while a process waits for a core: the load-robust twin.
        c, e = r["cpu_to_target_s"], r["env_steps"]
        r["cpu_ms_per_step"] = 1000 * c / e if c and e else None
    arms = [a for a in RUNNERS if any(r["arm"] == a for r in results)]
    medians = {
        a: {k: med([r.get(k) for r in results if r["arm"] == a], cap) for k, _, cap in cols}
        for a in arms
    }
    print("\n| arm | solved | " + " | ".join(label for _, label, _ in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for a in arms:
        runs = [r for r in results if r["arm"] == a]
        solved = f"{sum(r['to_target_s'] is not None for r in runs)}/{len(runs)}"
        cells = [f"{medians[a][k]:,.1f}" if medians[a][k] is not None else "-" for k, _, _ in cols]
        print(f"| {a} | {solved} | " + " | ".join(cells) + " |")
    podium_arms = [a for a in arms if a not in RAY_ARMS and peer(a) in arms]
    for a in podium_arms:
        # A score is no quantity to divide (Pendulum's are negative, an idle
        # MountainCar's ~0): its column gets no ratio.
        ray = medians[peer(a)]
        ratio = [
            f"{medians[a][k] / ray[k]:.2f}x" if medians[a][k] and ray[k] and k != "best" else "-"
            for k, _, _ in cols
        ]
        print(f"| {a} / {peer(a)} | | " + " | ".join(ratio) + " |")
    # Ray's time (or the cap) over each Podium arm's, per repetition both ran.
    times = {(r["arm"], r["rep"]): r["to_target_s"] or cap_s for r in results}
    for a in podium_arms:
        paired = [
            times[peer(a), rep] / times[a, rep]
            for rep in sorted({r["rep"] for r in results})
            if (a, rep) in times and (peer(a), rep) in times
        ]
        print(
            f"paired {peer(a)}/{a} wall to target per rep: {', '.join(f'{x:.1f}x' for x in paired)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="Pendulum-v1", choices=sorted(TASKS))
    parser.add_argument("--pods", type=int, default=4, help="population size P of both arms")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--first-rep", type=int, default=0)
    parser.add_argument("--cpus", default=None, help="CPU set of both arms, e.g. 0,1 (default all)")
    parser.add_argument("--cap-s", type=float, default=600.0)
    parser.add_argument("--arms", nargs="+", default=["podium", "ray"], choices=sorted(RUNNERS))
    parser.add_argument("--summarize", nargs="+", type=Path, default=None)
    parser.add_argument(
        "--speed-steps",
        type=int,
        default=0,
        help="instead of the tournaments: per-agent speed alone over this many env steps",
    )
    parser.add_argument("--ray-driver", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ray_driver:
        while not args.ray_driver.exists() or not args.ray_driver.stat().st_size:
            time.sleep(0.01)
        ray_driver(json.loads(args.ray_driver.read_text()))
        return
    if args.summarize:
        lines = [ln for f in args.summarize for ln in f.read_text().splitlines()]
        summarize([json.loads(ln) for ln in lines if ln.startswith('{"arm"')], args.cap_s)
        return
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    cores = len(os.sched_getaffinity(0))
    if args.speed_steps:
        agent_speed(args)
        return
    import ray
    import stable_baselines3

    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, pinned to "
        f"{sorted(os.sched_getaffinity(0))}"
        f"; ray {ray.__version__}, stable-baselines3 {stable_baselines3.__version__}; {args.env}, "
        f"P={args.pods}, cap {args.cap_s:g}s; load average {os.getloadavg()}",
        flush=True,
    )
    results = []
    # A SIGTERM (``kill``, a CI job's timeout) stops the running services too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="podium-vs-ray-") as tmp:
        try:
            for rep in range(args.first_rep, args.first_rep + args.reps):
                arms = args.arms[rep % len(args.arms) :] + args.arms[: rep % len(args.arms)]
                for arm in arms:
                    work = Path(tmp) / f"{arm}-{rep}"
                    work.mkdir()
                    out = RUNNERS[arm](args, rep, cores, work)
                    results.append(out)
                    print(json.dumps(out), flush=True)
                    if out["exit_code"] not in (0, None) and arm in RAY_ARMS:
                        print((work / "log").read_text()[-3000:], flush=True)
        finally:
            stop_services()
    summarize(results, args.cap_s)


if __name__ == "__main__":
    main()
