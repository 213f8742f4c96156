"""One PPO iteration as one function over explicit state (Podracer's "Anakin", Hessel et al.
2021; issue 33), for P agents at once and a torch-native env.

``ppo_iteration(shape, state, hp)`` is the whole iteration, a pure function of its inputs:

* rollout of ``num_steps`` vector steps: observation normalisation (running statistics frozen
  for the rollout, as ``RolloutWorker``), a sampled action (Gumbel-max, as
  ``CategoricalActor.sample``), the env step with same-step autoreset as a functional step of
  the env's state (``cartpole_step``: the equations of ``CartPoleEnv`` out of place, no
  ``self.state`` to mutate), storage into (T, P, N, ...) buffers;
* GAE(γ, λ), truncated episodes bootstrapped from their final observation (as ``PPO.update``),
  as one weighted sum over the steps while the rollout is small (``_gae_matrix``);
* ``update_epochs`` x ``num_minibatches`` updates: clipped surrogate, value loss (optionally
  clipped), entropy bonus, per-minibatch advantage normalisation, gradients from
  ``torch.func.vmap(torch.func.grad(loss))`` over the agent axis (P is a batch dimension, not a
  loop), global-norm clipping per agent, Adam (torch's formula) and the annealed learning rate
  as a tensor; the observation statistics merge after the update, as ``PPO.update`` does.

Randomness is counter-based (services/pod/algorithms/counter_random.py: a 32-bit integer hash
of the agent's seed, the iteration counter, a stream id and the element's index), so no
``torch.Generator`` enters the program, compiled and eager give the same draws, and an
iteration is reproducible from its state alone. An iteration's draw is one sequence: the
actions' noise and the autoresets' initial states step by step (``noise``: a compiled
rollout chunk draws its own slice), then the shuffles (``shuffles``: ``argsort`` of random
bits, stable, so ties cannot reorder).

The state holds each agent's weights and Adam moments as rows of flat (P, n) tensors
(``AnakinShape.layout`` says where each layer lies; ``AnakinShape.views`` gives the layers):
a compiled program's host cost grows with the number of tensors it takes and returns.

Everything PBT changes is a tensor of shape (P,) in ``hp`` (``HYPERPARAMETERS``): new values
are new inputs of the same graph, not a recompile. What would change the graph (P, env count,
rollout length, epochs, minibatches, network) is ``AnakinShape``, fixed per program.

``AnakinPPO`` runs it: ``compile="off"`` (eager), ``"steps"`` (programs looped in Python: a
chunk of ``ROLLOUT_CHUNK`` rollout steps, which draws its own noise, and the minibatch update
with its gather; on a CPU these and ``batch``, everything between the rollout and the
updates, are compiled ahead of time, ``_AheadOfTime``, and loaded by later processes; elsewhere
``batch`` runs eager: through ``torch.compile`` it measured no faster, docs/benchmarks.md) or
``"iteration"`` (the whole iteration as one ``torch.compile(fullgraph=True)`` program, whose
compile takes minutes on a CPU: it unrolls T steps and E x M updates). On a GPU,
``cuda_graph=True`` captures the whole iteration, in any of those modes, as one CUDA graph
after a first iteration run as usual: every iteration after is one replay. The state's
tensors are the graph's static buffers (written in place), and the hyperparameters are
tensors it reads, so a PBT explore needs no capture again. docs/benchmarks.md ("Anakin
iteration", "Anakin on a GPU") has what each mode measured.
Only discrete-action ``CartPoleEnv`` has a functional step so far.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, stack_module_state, vmap

from services.contracts.algorithms.ppo import CARD as PPO_CARD
from services.contracts.algorithms.ppo.config import PPOConfig
from services.logs import get_logger
from services.pod.algorithms import aot_program
from services.pod.algorithms.compiled import trust_vec_isa
from services.pod.algorithms.counter_random import to_uniform, uniform, uniform_bits
from services.pod.algorithms.normalization import merge_batched
from services.pod.algorithms.ppo import ADAM_BETAS, ADAM_EPS, PPO, PPO_STATS, ppo_objective
from services.pod.algorithms.stacked import Layout, flat_rows
from services.pod.envs.base import TorchVecEnv
from services.pod.envs.cartpole import CartPoleEnv

log = get_logger(__name__)

State = dict[str, torch.Tensor | dict[str, torch.Tensor]]
Hyper = dict[str, torch.Tensor]

#: Per-agent hyperparameters, tensors of shape (P,): what a PBT exploit/explore may change (the
#: names PPO's card lets a population vary, and the gradient clip, a tensor here too).
HYPERPARAMETERS = (
    *(PPO_CARD.population.hyperparameters if PPO_CARD.population else ()),
    "max_grad_norm",
)

#: PureJaxRL's CartPole-v1 recipe (purejaxrl/ppo.py) in PPOConfig's names, with Podium's
#: observation normalisation on: what this loop is measured and tested on (bench/, tests/).
PUREJAXRL_CARTPOLE = PPOConfig(
    num_envs=4,
    num_steps=128,
    learning_rate=2.5e-4,
    anneal_lr=True,
    gamma=0.99,
    gae_lambda=0.95,
    num_minibatches=4,
    update_epochs=4,
    clip_coef=0.2,
    clip_vloss=True,
    ent_coef=0.01,
    vf_coef=0.5,
    max_grad_norm=0.5,
    norm_adv=True,
    norm_obs=True,
    hidden_sizes=[64, 64],
    activation="tanh",
)
#: Rollout steps unrolled into one compiled call. Each call of a compiled program costs tens of
#: microseconds on the host whatever it computes, so K steps per call cut that K-fold; the
#: compile grows with K (docs/benchmarks.md, "Anakin iteration": 8 was the knee on a CPU).
ROLLOUT_CHUNK = 8
# Random streams: one per use, so draws for different purposes never coincide.
_INIT, _ITERATION = 0, 1


def _tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh as 2 sigmoid(2x) - 1, within 2e-7 of ``torch.tanh``: on a CPU, eager ``torch.tanh``
    takes several times as long as ``torch.sigmoid`` (docs/benchmarks.md, "Session 24"), and
    GAE evaluates the critic on the whole rollout eagerly."""
    return torch.sigmoid(2.0 * x) * 2.0 - 1.0


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": _tanh,
    "relu": torch.relu,
    "elu": F.elu,
}


# -- the functional env ------------------------------------------------------------------------
def cartpole_step(
    state: torch.Tensor, actions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``CartPoleEnv._physics_step`` out of place: (new state, reward, terminated).

    The same ops in the same order as the env's (so the same float32 values), on a state of
    any leading shape (..., 4).
    """
    c = CartPoleEnv
    dt = state.dtype
    x, x_dot, theta, theta_dot = state.unbind(-1)
    costheta, sintheta = torch.cos(theta), torch.sin(theta)
    # Constants are made on the device (``full``, a fill kernel), never copied from the host:
    # a host-to-device copy cannot be captured in a CUDA graph.
    force_over_mass = torch.full((), c.force_mag, dtype=dt, device=state.device) / c.total_mass
    temp = torch.addcmul(
        torch.where(actions.bool(), force_over_mass, -force_over_mass),
        theta_dot * theta_dot,
        sintheta,
        value=c.polemass_length / c.total_mass,
    )
    neg_gravity = torch.full((), -c.gravity, dtype=dt, device=state.device)
    neg_4l_3 = torch.full((), -c.length * 4.0 / 3.0, dtype=dt, device=state.device)
    thetaacc = torch.addcmul(sintheta * neg_gravity, costheta, temp)
    thetaacc = thetaacc / torch.addcmul(
        neg_4l_3, costheta, costheta, value=c.length * c.masspole / c.total_mass
    )
    xacc = torch.addcmul(temp, thetaacc, costheta, value=-c.polemass_length / c.total_mass)
    new = torch.stack(
        (
            x.add(x_dot, alpha=c.tau),
            x_dot.add(xacc, alpha=c.tau),
            theta.add(theta_dot, alpha=c.tau),
            theta_dot.add(thetaacc, alpha=c.tau),
        ),
        -1,
    )
    terminated = (new[..., 0].abs() > c.x_threshold) | (
        new[..., 2].abs() > c.theta_threshold_radians
    )
    return new, torch.ones_like(x), terminated


def cartpole_initial(u: torch.Tensor) -> torch.Tensor:
    """``CartPoleEnv._initial_state`` from given uniforms (..., 4): ``low + span * u``."""
    low = torch.full((4,), -0.05, dtype=u.dtype, device=u.device)
    span = torch.full((4,), 0.1, dtype=u.dtype, device=u.device)
    return torch.addcmul(low, span, u)


#: Env class → (functional step, initial state from uniforms); what ``AnakinPPO`` accepts.
FUNCTIONAL_ENVS: dict[type[TorchVecEnv], tuple[Callable, Callable]] = {
    CartPoleEnv: (cartpole_step, cartpole_initial),
}


# -- the static shape and the state ------------------------------------------------------------
@dataclass(frozen=True)
class AnakinShape:
    """What fixes the program: change any of it and it compiles again."""

    agents: int
    num_envs: int
    num_steps: int
    epochs: int
    minibatches: int
    obs_dim: int
    n_actions: int
    state_dim: int
    actor_layers: tuple[str, ...]
    critic_layers: tuple[str, ...]
    activation: str
    norm_obs: bool
    norm_adv: bool
    clip_vloss: bool
    max_episode_steps: int
    env: type[TorchVecEnv]
    #: Where each actor and critic tensor lies in a row of the flat (P, n) ``params``,
    #: ``exp_avg`` and ``exp_avg_sq`` (state-dict names: ``actor.net.0.weight``, ...).
    layout: Layout

    @property
    def batch(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch(self) -> int:
        return self.batch // self.minibatches

    @property
    def noise_per_step(self) -> int:
        """Random numbers a rollout step draws (``noise``): the actions' Gumbel noise and the
        autoresets' initial states of every env."""
        return self.num_envs * (self.n_actions + self.state_dim)

    @property
    def chunk(self) -> int:
        """Rollout steps per call of the rollout program: the largest divisor of
        ``num_steps`` up to ``ROLLOUT_CHUNK``."""
        return max(
            k for k in range(1, min(ROLLOUT_CHUNK, self.num_steps) + 1) if not self.num_steps % k
        )

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """name → (P, *shape) view of a flat (P, n) ``params``, ``exp_avg`` or ``exp_avg_sq``."""
        return self.layout.views(flat, "")


_SHAPES: dict[AnakinShape, AnakinShape] = {}


def _linear_names(prefix: str, net: nn.Sequential) -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}" for i, m in enumerate(net) if isinstance(m, nn.Linear))


#: PPO settings the iteration does not train, each with the test that a config asks for it.
UNSUPPORTED_SETTINGS: dict[str, Callable[[object], bool]] = {
    "norm_reward": bool,
    "target_kl": lambda value: value is not None,
    "sde_sample_freq": bool,
}


def unsupported(config: PPOConfig, env: type[TorchVecEnv] | None = None) -> str | None:
    """Why ``build`` refuses ``config`` on ``env`` (None: it builds them): the one list, which
    the Anakin trainer (services/pod/training/anakin_trainer.py) asks before choosing itself."""
    if env is not None and env not in FUNCTIONAL_ENVS:
        return (
            f"env: no functional step for {env.__name__}; have "
            f"{', '.join(e.__name__ for e in FUNCTIONAL_ENVS)}"
        )
    if bad := [k for k, asks in UNSUPPORTED_SETTINGS.items() if asks(getattr(config, k))]:
        return f"PPO settings the Anakin iteration does not have: {', '.join(bad)}"
    if config.batch_size % config.num_minibatches:
        return "num_minibatches does not divide num_envs * num_steps"
    return None


def build(
    config: PPOConfig,
    seeds: Sequence[int],
    hyperparameters: Sequence[Mapping[str, float]] | None = None,
    total_iterations: int = 1,
    env: type[TorchVecEnv] = CartPoleEnv,
    max_episode_steps: int = 500,
    device: str | torch.device = "cpu",
) -> tuple[AnakinShape, State, Hyper]:
    """Shape, initial state and hyperparameters for ``len(seeds)`` agents of ``config``.

    Agent p's weights are those of ``PPO(...)`` built after ``torch.manual_seed(seeds[p])``
    (as ``PopulationPPO`` builds them), so agent p is a PPO agent Podium already knows how to
    evaluate and save (``agent``). ``hyperparameters[p]`` overrides config's values.
    """
    if reason := unsupported(config, env):
        raise ValueError(reason)
    p = len(seeds)
    hyperparameters = hyperparameters or [{}] * p
    if p < 1 or len(hyperparameters) != p:
        raise ValueError("need one seed (and one hyperparameter mapping) per agent, P >= 1")
    for values in hyperparameters:
        if unknown := sorted(set(values) - set(HYPERPARAMETERS)):
            raise ValueError(f"hyperparameters: unknown {unknown}; have {HYPERPARAMETERS}")
    device = torch.device(device)
    probe = env(num_envs=1)
    obs_space, act_space = probe.single_observation_space, probe.single_action_space
    agents = []
    for seed in seeds:
        torch.manual_seed(seed)
        agents.append(PPO(obs_space, act_space, config))
    models = [nn.ModuleDict({"actor": a.policy.actor, "critic": a.critic}) for a in agents]
    stacked, _ = stack_module_state(models)
    # One flat (P, n) tensor per part of the agent (weights, Adam's moments), not a tensor per
    # layer: each tensor a compiled program takes or returns costs about a microsecond of host
    # time a call (docs/benchmarks.md, "Session 24"), and the update is called 16 times an
    # iteration.
    params = flat_rows(stacked, stacked).detach().to(device)
    first = agents[0]
    shape = AnakinShape(
        agents=p,
        num_envs=config.num_envs,
        num_steps=config.num_steps,
        epochs=config.update_epochs,
        minibatches=config.num_minibatches,
        obs_dim=int(obs_space.shape[0]),
        n_actions=int(act_space.n),
        state_dim=probe.state_dim,
        actor_layers=_linear_names("actor.net", first.policy.actor.net),
        critic_layers=_linear_names("critic", first.critic),
        activation=config.activation,
        norm_obs=config.norm_obs,
        norm_adv=config.norm_adv,
        clip_vloss=config.clip_vloss,
        max_episode_steps=max_episode_steps,
        env=env,
        layout=Layout.of(list(stacked), [v[0] for v in stacked.values()]),
    )
    # One object per distinct shape: the compiled programs take it as an argument, and a PBT
    # child's equal shape must meet the guards of its parent's graphs, however dynamo guards
    # a user object (by value or by identity).
    shape = _SHAPES.setdefault(shape, shape)
    seed_t = torch.tensor(list(seeds), dtype=torch.int64, device=device)
    _, initial = FUNCTIONAL_ENVS[env]
    env_state = initial(
        uniform(seed_t, torch.tensor(-1, device=device), _INIT, (shape.num_envs, shape.state_dim))
    )
    d = shape.obs_dim
    state: State = {
        "params": params,
        "exp_avg": torch.zeros_like(params),
        "exp_avg_sq": torch.zeros_like(params),
        "adam_step": torch.zeros(p, device=device),
        "env": env_state,
        "ep_return": torch.zeros(p, shape.num_envs, device=device),
        "ep_length": torch.zeros(p, shape.num_envs, dtype=torch.int64, device=device),
        "obs_mean": torch.zeros(p, d, dtype=torch.float64, device=device),
        "obs_var": torch.ones(p, d, dtype=torch.float64, device=device),
        "obs_count": torch.full((p,), 1e-4, dtype=torch.float64, device=device),
        "seed": seed_t,
        "iteration": torch.zeros((), dtype=torch.int64, device=device),
        "total_iterations": torch.tensor(float(total_iterations), device=device),
    }
    hp: Hyper = {}
    for name in HYPERPARAMETERS:
        values = [float(h.get(name, getattr(config, name))) for h in hyperparameters]
        hp[name] = torch.tensor(values, device=device)
    hp["anneal_lr"] = torch.tensor(float(config.anneal_lr), device=device)
    return shape, state, hp


# -- networks ----------------------------------------------------------------------------------
def _mlp_batched(
    params: Mapping[str, torch.Tensor], layers: Sequence[str], activation: str, x: torch.Tensor
) -> torch.Tensor:
    """P MLPs on x (P, B, in): one batched matmul per layer for all agents."""
    act = _ACTIVATIONS[activation]
    for i, name in enumerate(layers):
        w, b = params[f"{name}.weight"], params[f"{name}.bias"]
        x = torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))
        if i < len(layers) - 1:
            x = act(x)
    return x


def _mlp(
    params: Mapping[str, torch.Tensor], layers: Sequence[str], activation: str, x: torch.Tensor
) -> torch.Tensor:
    """One agent's MLP (what vmap batches over the agents)."""
    act = _ACTIVATIONS[activation]
    for i, name in enumerate(layers):
        x = F.linear(x, params[f"{name}.weight"], params[f"{name}.bias"])
        if i < len(layers) - 1:
            x = act(x)
    return x


def normalize(state: Mapping, raw: torch.Tensor, shape: AnakinShape) -> torch.Tensor:
    """``RunningMeanStd.normalize`` per agent on raw (P, ..., D)."""
    if not shape.norm_obs:
        return raw
    extra = (1,) * (raw.dim() - 2)
    mean = state["obs_mean"].view(shape.agents, *extra, -1).to(raw.dtype)
    std = torch.sqrt(state["obs_var"] + 1e-8).view(shape.agents, *extra, -1).to(raw.dtype)
    return ((raw - mean) / std).clamp(-10.0, 10.0)


# -- rollout -----------------------------------------------------------------------------------
def rollout_step(
    shape: AnakinShape,
    params: Mapping[str, torch.Tensor],
    norm_state: Mapping[str, torch.Tensor],
    env_state: torch.Tensor,
    ep_return: torch.Tensor,
    ep_length: torch.Tensor,
    action_u: torch.Tensor,
    reset_u: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """One vector step of all P agents: normalise, act, step, autoreset.

    Returns (env_state, ep_return, ep_length, obs, action, logp, reward, terminated,
    truncated, final_obs, finished_return), all (P, N, ...)."""
    step, initial = FUNCTIONAL_ENVS[shape.env]
    raw = env_state.to(torch.float32)  # CartPole observes its state
    obs = normalize(norm_state, raw, shape)
    logits = _mlp_batched(params, shape.actor_layers, shape.activation, obs)
    logp_all = torch.log_softmax(logits, -1)
    action = torch.argmax(logp_all - torch.log(-torch.log(action_u)), -1)
    logp = logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    new_state, reward, terminated = step(env_state, action)
    ep_return = ep_return + reward
    ep_length = ep_length + 1
    done = terminated | (ep_length >= shape.max_episode_steps)
    truncated = done ^ terminated
    final_obs = normalize(norm_state, new_state.to(torch.float32), shape)
    finished_return = ep_return * done
    env_state = torch.where(done.unsqueeze(-1), initial(reset_u), new_state)
    ep_return = ep_return.masked_fill(done, 0.0)
    ep_length = ep_length.masked_fill(done, 0)
    return (
        env_state,
        ep_return,
        ep_length,
        obs,
        action,
        logp,
        reward,
        terminated,
        truncated,
        final_obs,
        finished_return,
    )


def noise(
    shape: AnakinShape,
    seed: torch.Tensor,
    iteration: torch.Tensor,
    start: torch.Tensor | int,
    steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers of rollout steps ``start`` .. ``start + steps - 1``: uniforms
    (steps, P, N, n_actions) for the actions' Gumbel noise and (steps, P, N, state_dim) for
    the initial states of the episodes that autoreset.

    One counter-based draw per iteration, laid out step by step, so any run of steps is a
    contiguous slice of it that can be drawn on its own: a compiled rollout chunk draws its
    own inside the program (``start`` a tensor, one program for every chunk), eager code the
    whole rollout at once (in eager code a draw is some thirty integer ops, whatever its
    size)."""
    p, n, a, per_step = shape.agents, shape.num_envs, shape.n_actions, shape.noise_per_step
    bits = uniform_bits(seed, iteration, _ITERATION, (steps * per_step,), start * per_step)
    u = to_uniform(bits).view(p, steps, n, -1).transpose(0, 1)  # (steps, P, N, a + state_dim)
    return u[..., :a], u[..., a:]


def shuffles(shape: AnakinShape, state: State) -> torch.Tensor:
    """The iteration's minibatch orders (P, epochs, batch): argsorts of random bits (stable,
    so ties cannot reorder), the part of the iteration's draw after the rollout's noise."""
    size, after_noise = shape.epochs * shape.batch, shape.num_steps * shape.noise_per_step
    bits = uniform_bits(state["seed"], state["iteration"], _ITERATION, (size,), after_noise)
    return torch.argsort(bits.view(shape.agents, shape.epochs, shape.batch), dim=-1, stable=True)


_STEP_KEYS = ("obs", "actions", "logprobs", "rewards", "terminated", "truncated", "final_obs")


def rollout_chunk(
    shape: AnakinShape,
    params: torch.Tensor,
    norm_state: Mapping[str, torch.Tensor],
    carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    steps: int,
) -> tuple[torch.Tensor, ...]:
    """``rollout_step`` ``steps`` times (one compiled call for them all); ``carry``:
    (env_state, ep_return, ep_length); ``counter``: (seed, iteration, first step), what
    ``noise`` draws from.

    Returns (env_state, ep_return, ep_length, raw, obs, action, logp, reward, terminated,
    truncated, final_obs, finished_return), the last nine stacked (steps, P, N, ...);
    ``params``: the flat (P, n) weights."""
    views = shape.views(params)
    action_u, reset_u = noise(shape, *counter, steps)
    out: list[tuple[torch.Tensor, ...]] = []
    for k in range(steps):
        raw = carry[0].to(torch.float32)  # CartPole observes its state
        env_state, ep_return, ep_length, *step_out = rollout_step(
            shape, views, norm_state, *carry, action_u[k], reset_u[k]
        )
        carry = (env_state, ep_return, ep_length)
        out.append((raw, *step_out))
    stacked = tuple(torch.stack(values) for values in zip(*out, strict=True))
    return (*carry, *stacked)


def collect(
    shape: AnakinShape,
    state: State,
    chunk_fn: Callable[..., tuple[torch.Tensor, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """T vector steps into buffers of shape (T, P, N, ...): in one ``rollout_chunk`` where it
    runs eager or inside a whole-iteration program, else in calls of ``chunk_fn`` (its
    compiled program) of ``shape.chunk`` steps."""
    k = shape.num_steps if chunk_fn is None else shape.chunk
    chunk_fn = chunk_fn or rollout_chunk
    keys = ("raw", *_STEP_KEYS, "finished_return")
    chunks: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
    norm_state = {key: state[key] for key in ("obs_mean", "obs_var")}
    carry = (state["env"], state["ep_return"], state["ep_length"])
    # The chunks' first steps as tensors: inputs of one program, not a program per value.
    starts = torch.arange(0, shape.num_steps, k, device=state["seed"].device)
    for i in range(shape.num_steps // k):
        counter = (state["seed"], state["iteration"], starts[i])
        env_state, ep_return, ep_length, *out = chunk_fn(
            shape, state["params"], norm_state, carry, counter, k
        )
        carry = (env_state, ep_return, ep_length)
        for key, value in zip(keys, out, strict=True):
            chunks[key].append(value)
    buf = {key: torch.cat(v) if len(v) > 1 else v[0] for key, v in chunks.items()}
    buf["env"], buf["ep_return"], buf["ep_length"] = carry
    buf["next_obs"] = normalize(norm_state, carry[0].to(torch.float32), shape)
    return buf


# -- the update --------------------------------------------------------------------------------
def _loss(
    params: Mapping[str, torch.Tensor],
    shape: AnakinShape,
    obs: torch.Tensor,
    actions: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    clip_coef: torch.Tensor,
    ent_coef: torch.Tensor,
    vf_coef: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ppo_loss`` of one agent on one minibatch (vmap runs it for all P)."""
    logp_all = torch.log_softmax(_mlp(params, shape.actor_layers, shape.activation, obs), -1)
    logp = logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    value = _mlp(params, shape.critic_layers, shape.activation, obs).squeeze(-1)
    return ppo_objective(
        logp, entropy, value, old_logp, adv, returns, old_values,
        clip_coef, ent_coef, vf_coef, shape.norm_adv, shape.clip_vloss,
    )  # fmt: skip


def minibatch_update(
    shape: AnakinShape,
    opt: Mapping[str, torch.Tensor],
    data: tuple[torch.Tensor, ...],
    idx: torch.Tensor,
    hp: Hyper,
    lr: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One gradient step of all P agents on the samples ``idx`` (P, minibatch) of ``data``
    (each (P, batch, ...)): per-agent gradients (vmap of grad), global-norm clipping per
    agent, Adam. ``opt``: params, exp_avg, exp_avg_sq (flat, (P, n)), adam_step (P,). Returns
    the new ``opt`` and the loss statistics (P, 5). The gather is inside so that a compiled
    update is one call, not one per tensor gathered."""
    p = shape.agents
    minibatch = tuple(
        torch.take_along_dim(x, idx.view(p, -1, *([1] * (x.dim() - 2))), dim=1) for x in data
    )
    grad_fn = vmap(grad(_loss, has_aux=True), in_dims=(0, None, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    grads, stats = grad_fn(
        shape.views(opt["params"]), shape, *minibatch, hp["clip_coef"], hp["ent_coef"],
        hp["vf_coef"],
    )  # fmt: skip
    g = flat_rows(grads, shape.layout.names)
    # clip_grad_norm_: coefficient max_norm / (norm + 1e-6), at most 1, per agent.
    norm = torch.sqrt(g.square().sum(1, keepdim=True))
    g = g * (hp["max_grad_norm"].view(p, 1) / (norm + 1e-6)).clamp(max=1.0)
    b1, b2 = ADAM_BETAS
    step = opt["adam_step"] + 1
    # Adam's bias corrections 1 - β^step, (P, 2), as exp(step log β), read twice: on a CPU
    # inductor computes a value that holds an exp and has two readers once, into a buffer;
    # a pow it would recompute in the (P, n) update's loop, two per vector of weights.
    bias = 1 - torch.exp(torch.stack((step * math.log(b1), step * math.log(b2)), -1))
    bc1, bc2_sqrt = bias[:, :1], torch.sqrt(bias[:, 1:])
    m = opt["exp_avg"].lerp(g, 1 - b1)
    v = opt["exp_avg_sq"] * b2 + (1 - b2) * g * g
    denom = torch.sqrt(v) / bc2_sqrt + ADAM_EPS
    params = opt["params"] - (lr.view(p, 1) / bc1) * m / denom
    return {"params": params, "exp_avg": m, "exp_avg_sq": v, "adam_step": step}, stats


#: Largest P x N x T x T for which GAE is one weighted sum rather than a T-step loop.
_GAE_MATRIX_MAX = 1 << 23


def _gae_matrix(delta: torch.Tensor, not_done: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """GAE's trace A_t = δ_t + γλ (1 - done_t) A_{t+1} as one weighted sum per env:
    A_t = Σ_{s >= t} (γλ)^(s-t) [no episode ends in t..s-1] δ_s.

    About ten ops whatever T (the loop is T dependent ops, each a dispatch in eager code and
    a kernel in a CUDA graph), for a (P, N, T, T) weight tensor: used while that is small.
    ``delta``, ``not_done``: (P, T, N); ``decay``: γλ, (P,)."""
    p, t_, _ = delta.shape
    done = 1.0 - not_done.transpose(1, 2)  # (P, N, T)
    ended_before = torch.cumsum(done, -1) - done  # episodes ended before step t
    same_episode = ended_before.unsqueeze(-1) == ended_before.unsqueeze(-2)  # [t, s]
    # (γλ)^k for the T lags and a 0 for s < t, then looked up: a power per (t, s) pair costs
    # more than the sum.
    steps = torch.arange(t_, device=delta.device)
    lag = steps.view(1, t_) - steps.view(t_, 1)  # s - t
    lag_index = torch.where(lag >= 0, lag, t_)  # T: the zero after the powers
    powers = F.pad(decay.view(p, 1) ** steps.to(delta.dtype), (0, 1))[:, lag_index]
    weights = powers.unsqueeze(1) * same_episode  # (P, N, T, T)
    adv = torch.matmul(weights, delta.transpose(1, 2).unsqueeze(-1)).squeeze(-1)  # (P, N, T)
    return adv.transpose(1, 2)


def truncated_values(
    shape: AnakinShape,
    value: Callable[[torch.Tensor], torch.Tensor],
    final_obs: torch.Tensor,
    truncated: torch.Tensor,
) -> torch.Tensor:
    """V(final observation) at the truncated steps, (P, T, N); any value elsewhere (where it
    is never read).

    An env truncates only after ``max_episode_steps`` steps of one episode, so at most
    c = ceil(T / max_episode_steps) times in a rollout: the critic runs on c final observations
    per env, picked by a fixed-size top-k of the truncation flags (a static shape, so the
    programs and CUDA graphs keep theirs), not on all T x N of them, which would cost as much
    as the values of the rollout itself. ``final_obs``: (T, P, N, D); ``truncated``: (P, T, N)."""
    t_, p, n, d = shape.num_steps, shape.agents, shape.num_envs, shape.obs_dim
    c = math.ceil(t_ / shape.max_episode_steps)
    if c >= t_:
        return value(final_obs.transpose(0, 1).reshape(p, t_ * n, d)).view(p, t_, n)
    steps = torch.topk(truncated.transpose(1, 2).to(torch.float32), c, dim=-1).indices
    per_env = final_obs.permute(1, 2, 0, 3)  # (P, N, T, D)
    picked = torch.take_along_dim(per_env, steps.unsqueeze(-1), dim=2)  # (P, N, c, D)
    v = value(picked.reshape(p, n * c, d)).view(p, n, c)
    return (
        torch.zeros(p, n, t_, dtype=v.dtype, device=v.device).scatter(-1, steps, v).transpose(1, 2)
    )


def advantages(
    shape: AnakinShape,
    params: torch.Tensor,
    roll: Mapping,
    hp: Hyper,
    trace_loop: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values, GAE advantages and λ-returns, all (P, T, N), as ``PPO.update`` computes them;
    ``params``: the flat (P, n) weights. ``trace_loop``: the trace as a T-step loop, not one
    weighted sum; None: the sum while the rollout is small. A program compiled for a CPU
    wants the loop: inductor fuses it into one kernel, while the sum becomes a T x T
    reduction that recomputes its weights per pair (docs/benchmarks.md, session 27)."""
    t_, p, n, d = shape.num_steps, shape.agents, shape.num_envs, shape.obs_dim
    critic = shape.views(params)

    def value(x: torch.Tensor) -> torch.Tensor:  # x (P, B, D)
        return _mlp_batched(critic, shape.critic_layers, shape.activation, x).squeeze(-1)

    obs = roll["obs"].transpose(0, 1).reshape(p, t_ * n, d)
    values = value(obs).view(p, t_, n)
    next_value = value(roll["next_obs"])
    gamma, lam = hp["gamma"].view(p, 1), hp["gae_lambda"].view(p, 1)
    truncated = roll["truncated"].transpose(0, 1)
    final_values = truncated_values(shape, value, roll["final_obs"], truncated)
    rewards = roll["rewards"].transpose(0, 1)
    # A truncated episode did not end in the MDP: bootstrap it from its final state.
    rewards = torch.where(truncated, rewards + gamma.unsqueeze(-1) * final_values, rewards)
    not_done = (~(roll["terminated"].transpose(0, 1) | truncated)).to(values.dtype)
    # The TD errors of all steps at once; only the trace is sequential.
    following = torch.cat((values[:, 1:], next_value.unsqueeze(1)), 1)
    delta = rewards + gamma.unsqueeze(-1) * following * not_done - values
    if trace_loop is None:
        trace_loop = p * n * t_ * t_ > _GAE_MATRIX_MAX
    if not trace_loop:
        adv = _gae_matrix(delta, not_done, gamma * lam)
    else:
        decay = (gamma * lam).unsqueeze(-1) * not_done
        last = torch.zeros_like(next_value)
        trace = []
        for t in range(t_ - 1, -1, -1):  # T ops; each is a dispatch where this runs eager
            last = torch.addcmul(delta[:, t], decay[:, t], last)
            trace.append(last)
        adv = torch.stack(trace[::-1], 1)
    return values, adv, adv + values


_OBS_STATS = ("obs_mean", "obs_var", "obs_count")


def _merge_obs_stats(shape: AnakinShape, state: State, raw: torch.Tensor) -> dict:
    """``RunningMeanStd.merge`` of the rollout's raw observations (T, P, N, D), per agent."""
    p = shape.agents
    flat = raw.transpose(0, 1).reshape(p, -1, shape.obs_dim).to(torch.float64)
    mean, var = flat.mean(1), flat.var(1, unbiased=False)
    old = (state["obs_mean"], state["obs_var"], state["obs_count"])
    merged = merge_batched(old, mean, var, float(flat.shape[1]))
    return dict(zip(_OBS_STATS, merged, strict=True))


#: The optimiser's part of the state: what ``minibatch_update`` takes and returns.
_OPT_KEYS = ("params", "exp_avg", "exp_avg_sq", "adam_step")
#: What ``batch`` gives the updates: their data, each (P, batch, ...), in ``minibatch_update``'s
#: order.
_DATA_KEYS = ("obs", "actions", "logprobs", "advantages", "returns", "values")
#: What ``batch`` gives besides: the minibatch orders, the learning rate, the rollout's
#: metrics (and with ``norm_obs`` the merged observation statistics, ``_OBS_STATS``).
_BATCH_KEYS = (*_DATA_KEYS, "orders", "lr", "episodes", "return_sum")


def batch(
    shape: AnakinShape,
    state: State,
    roll: Mapping[str, torch.Tensor],
    hp: Hyper,
    trace_loop: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Everything between the rollout and the updates (``_BATCH_KEYS``): GAE, the data laid
    out per agent, the minibatch orders (``shuffles``), the annealed learning rate, the
    rollout's finished episodes and, with ``norm_obs``, the observation statistics merged
    with the rollout's."""
    p, t_, n, d = shape.agents, shape.num_steps, shape.num_envs, shape.obs_dim
    values, adv, returns = advantages(shape, state["params"], roll, hp, trace_loop)
    out = {
        "obs": roll["obs"].transpose(0, 1).reshape(p, t_ * n, d),
        "actions": roll["actions"].transpose(0, 1).reshape(p, t_ * n),
        "logprobs": roll["logprobs"].transpose(0, 1).reshape(p, t_ * n),
        "advantages": adv.reshape(p, t_ * n),
        "returns": returns.reshape(p, t_ * n),
        "values": values.reshape(p, t_ * n),
        "orders": shuffles(shape, state),
    }
    frac = (1.0 - state["iteration"] / state["total_iterations"]).clamp(min=0.0)
    frac = torch.where(hp["anneal_lr"] > 0, frac, torch.ones_like(frac))
    out["lr"] = hp["learning_rate"] * frac
    out["episodes"] = (roll["terminated"] | roll["truncated"]).sum((0, 2))  # (P,)
    out["return_sum"] = roll["finished_return"].sum((0, 2))  # (P,)
    if shape.norm_obs:
        out.update(_merge_obs_stats(shape, state, roll["raw"]))
    return out


def learn(
    shape: AnakinShape,
    state: State,
    roll: Mapping[str, torch.Tensor],
    hp: Hyper,
    update_fn: Callable[..., tuple[dict, torch.Tensor]] | None = None,
    batch_fn: Callable[..., dict[str, torch.Tensor]] | None = None,
) -> tuple[State, dict[str, torch.Tensor]]:
    """``batch`` (or its compiled program), then epochs x minibatches of
    ``minibatch_update`` (or its compiled program)."""
    update_fn = update_fn or minibatch_update
    p = shape.agents
    b = (batch_fn or batch)(shape, state, roll, hp)
    data = tuple(b[key] for key in _DATA_KEYS)
    lr = b["lr"]
    opt = {k: state[k] for k in _OPT_KEYS}
    sums = torch.zeros(p, len(PPO_STATS), device=lr.device)
    for epoch in range(shape.epochs):
        order = b["orders"][:, epoch].view(p, shape.minibatches, shape.minibatch)
        for m in range(shape.minibatches):
            opt, stats = update_fn(shape, opt, data, order[:, m], hp, lr)
            if epoch == shape.epochs - 1:
                sums = sums + stats
    new_state: State = dict(state)
    new_state.update(opt)
    if shape.norm_obs:
        new_state.update({key: b[key] for key in _OBS_STATS})
    new_state["env"], new_state["ep_return"] = roll["env"], roll["ep_return"]
    new_state["ep_length"] = roll["ep_length"]
    new_state["iteration"] = state["iteration"] + 1
    metrics = {
        "stats": sums / shape.minibatches,  # (P, 5), last epoch's mean
        "lr": lr,
        "episodes": b["episodes"],  # (P,) finished in this rollout
        "return_sum": b["return_sum"],  # (P,)
    }
    return new_state, metrics


def ppo_iteration(
    shape: AnakinShape, state: State, hp: Hyper
) -> tuple[State, dict[str, torch.Tensor]]:
    """One whole PPO iteration (rollout, GAE, every minibatch update) of all P agents."""
    return learn(shape, state, collect(shape, state), hp)


# -- the runner --------------------------------------------------------------------------------
AnakinCompile = Literal["off", "iteration", "steps"]


class AnakinPPO:
    """P agents trained by ``ppo_iteration``; ``compile`` chooses eager, one program per
    iteration, or two programs (rollout step, minibatch update) looped in Python.

    The compiled functions are module-level (``_PROGRAMS``), so every ``AnakinPPO`` of the
    same shape in a process, a PBT child say, reuses their graphs.
    """

    def __init__(
        self,
        config: PPOConfig,
        seeds: Sequence[int],
        hyperparameters: Sequence[Mapping[str, float]] | None = None,
        total_env_steps: int = 1,
        compile: AnakinCompile = "off",
        device: str | torch.device = "cpu",
        cuda_graph: bool = False,
        env: type[TorchVecEnv] = CartPoleEnv,
        max_episode_steps: int = 500,
    ) -> None:
        iterations = max(1, math.ceil(total_env_steps / config.batch_size))
        self.config = config
        self.shape, self.state, self.hp = build(
            config, seeds, hyperparameters, iterations, env, max_episode_steps, device
        )
        self.compile = compile
        self.iterations = 0
        if cuda_graph and torch.device(device).type != "cuda":
            raise ValueError("cuda_graph: needs a CUDA device")
        self.cuda_graph = cuda_graph
        self._skip_guards = True
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_metrics: dict[str, torch.Tensor] = {}

    @property
    def env_steps(self) -> int:
        """Env steps per agent so far."""
        return self.iterations * self.shape.batch

    def _iteration(self, state: State) -> tuple[State, dict[str, torch.Tensor]]:
        if self.compile == "iteration":
            return _PROGRAMS.on(state["seed"].device).iteration(self.shape, state, self.hp)
        if self.compile == "steps":
            programs = _PROGRAMS.on(state["seed"].device)
            roll = collect(self.shape, state, programs.rollout_chunk)
            return learn(
                self.shape, state, roll, self.hp, programs.minibatch_update, programs.batch
            )
        return ppo_iteration(self.shape, state, self.hp)

    def step(self) -> dict[str, torch.Tensor]:
        """One iteration; the metrics stay tensors (read them at a report, not every step)."""
        if not self.cuda_graph:
            self.state, metrics = self._run()
        elif self._graph is None:
            metrics = self._warm_up_and_capture()
        else:
            self._graph.replay()
            metrics = {k: v.clone() for k, v in self._graph_metrics.items()}
        self.iterations += 1
        return metrics

    def _run(self) -> tuple[State, dict[str, torch.Tensor]]:
        """One iteration; after two, the compiled programs run without evaluating dynamo's
        guards.

        Checking them costs microseconds per call, a call per rollout chunk and minibatch
        update (docs/benchmarks.md, "Anakin iteration"), and in a pod they cannot fail any
        more: the shape is fixed for the runner's life, every later iteration's inputs are what
        the second iteration's were (outputs of the same programs, tensors written in place),
        and hyperparameters are values, never guarded. The first two iterations run guarded,
        so each program has this shape's entries (the first iteration's inputs come from
        ``build``, the second's from the programs, and may differ in layout). Where the
        unguarded lookup finds no entry (runners of other shapes share the programs in this
        process), dynamo refuses to compile under that stance: the iteration, a pure
        function of ``self.state``, then runs again guarded, as every later one does."""
        guarded = self.compile == "iteration" or not _PROGRAMS.on(self.state["seed"].device).aot
        if self._skip_guards and guarded and self.compile != "off" and self.iterations >= 2:
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return self._iteration(self.state)
            except RuntimeError as exc:
                if "skip_guard_eval_unsafe" not in str(exc):
                    raise
                log.info("compile.guarded", reason="programs shared with another shape")
                self._skip_guards = False
        return self._iteration(self.state)

    def _warm_up_and_capture(self) -> dict[str, torch.Tensor]:
        """The first iteration runs as usual (on a side stream, as torch.cuda.graph asks:
        the compiled programs compile, cuBLAS makes its handles), then the whole iteration
        is captured once as one CUDA graph that reads and writes ``self.state`` in place.

        Every iteration after is one ``replay``: the rollout's T steps, GAE and the E x M
        updates launch from the graph, not from Python. The state's tensors are the graph's
        static buffers; ``set_hyperparameters`` writes into the ``hp`` tensors in place, so
        a PBT explore is a new value in the same graph.
        """
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            new_state, metrics = self._iteration(self.state)
            _copy_into(self.state, new_state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                new_state, captured = self._iteration(self.state)
                _copy_into(self.state, new_state)
        except RuntimeError as exc:  # an op CUDA cannot capture: run on, launched op by op
            log.warning("cuda_graph.failed", error=str(exc).splitlines()[0], fallback="no graph")
            self.cuda_graph = False
            return metrics
        self._graph, self._graph_metrics = graph, captured
        return metrics

    def set_hyperparameters(self, i: int, values: Mapping[str, float]) -> None:
        """PBT's explore for agent i: written into the (P,) tensors, no recompile."""
        for name, value in values.items():
            if name not in HYPERPARAMETERS:
                raise ValueError(f"hyperparameters: unknown {name!r}; have {HYPERPARAMETERS}")
            self.hp[name][i] = float(value)

    def agent(self, i: int) -> PPO:
        """Agent i as a ``PPO`` module (weights and observation statistics), e.g. to evaluate
        it with ``Evaluator`` or save it as a PPO pod's training files."""
        probe = self.shape.env(num_envs=1)
        agent = PPO(probe.single_observation_space, probe.single_action_space, self.config)
        params = self.shape.views(self.state["params"])
        with torch.no_grad():
            for name, tensor in agent.policy.actor.named_parameters(prefix="actor"):
                tensor.copy_(params[name][i])
            for name, tensor in agent.critic.named_parameters(prefix="critic"):
                tensor.copy_(params[name][i])
            rms = agent.policy.obs_rms
            rms.mean.copy_(self.state["obs_mean"][i])
            rms.var.copy_(self.state["obs_var"][i])
            rms.count.copy_(self.state["obs_count"][i])
        return agent


def _copy_into(state: State, new: State) -> None:
    """Write ``new``'s tensors into ``state``'s, in place (a tensor the iteration passed
    through unchanged is skipped)."""
    for key, value in new.items():
        if isinstance(value, dict):
            _copy_into(state[key], value)  # type: ignore[arg-type]
        elif value is not state[key]:
            state[key].copy_(value)  # type: ignore[union-attr]


# -- the programs compiled ahead of time: functions of flat tensors ------------------------------
# Module-level, so that another process can build them (``aot_program.Job``).
def _chunk_program(shape: AnakinShape, steps: int, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    params, mean, var, env, ep_return, ep_length, *counter = flat
    norm = {"obs_mean": mean, "obs_var": var}
    carry = (env, ep_return, ep_length)
    return rollout_chunk(shape, params, norm, carry, tuple(counter), steps)  # type: ignore[arg-type]


def _update_program(
    shape: AnakinShape, n_data: int, *flat: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    n_opt = len(_OPT_KEYS)
    opt_in = dict(zip(_OPT_KEYS, flat[:n_opt], strict=True))
    rest = flat[n_opt + n_data :]
    hp_in = dict(zip(HYPERPARAMETERS, rest[2:], strict=True))
    new, stats = minibatch_update(
        shape, opt_in, flat[n_opt : n_opt + n_data], rest[0], hp_in, rest[1]
    )
    return (*(new[k] for k in _OPT_KEYS), stats)


def _batch_keys(shape: AnakinShape) -> tuple[str, ...]:
    return (*_BATCH_KEYS, *(_OBS_STATS if shape.norm_obs else ()))


def _batch_program(shape: AnakinShape, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n_state, n_roll = len(_BATCH_STATE), len(_BATCH_ROLL)
    state_in = dict(zip(_BATCH_STATE, flat[:n_state], strict=True))
    roll_in = dict(zip(_BATCH_ROLL, flat[n_state : n_state + n_roll], strict=True))
    hp_in = dict(zip(_BATCH_HP, flat[n_state + n_roll :], strict=True))
    out = batch(shape, state_in, roll_in, hp_in, trace_loop=True)  # type: ignore[arg-type]
    return tuple(out[k] for k in _batch_keys(shape))


class _Recorder:
    """Stands in for ``aot_program.Programs`` behind ``_AheadOfTime``: records each program
    asked for as an ``aot_program.Job`` and builds none, so the adapter runs the function
    another way (``_Eager``)."""

    def __init__(self) -> None:
        self.jobs: dict[tuple, aot_program.Job] = {}

    def get(
        self,
        name: str,
        shape: AnakinShape,
        variant: object,
        args: Sequence[torch.Tensor],
        make_fn: Callable[[], Callable[..., Sequence[torch.Tensor]]],
        fallback: str = "",
    ) -> None:
        if (name, variant) not in self.jobs:
            self.jobs[name, variant] = aot_program.Job(name, make_fn(), list(args), repr(shape))


class _Eager:
    """Stands in for ``_Programs`` as ``_AheadOfTime``'s fallback while recording: the
    rollout runs eagerly (its outputs are the batch's inputs); the update does not run, its
    inputs' shapes being all a recording needs (an eager update's first call costs nearly a
    second of functorch's start-up, in a process that otherwise never runs one)."""

    def compiled(self, name: str, fn: Callable) -> Callable:
        return _unchanged if name == "minibatch_update" else fn


def _unchanged(
    shape: AnakinShape, opt: Mapping[str, torch.Tensor], *rest: object
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``minibatch_update``'s outputs, shaped as it gives them: the state as it was."""
    return dict(opt), torch.zeros(shape.agents, len(PPO_STATS), device=opt["params"].device)


def program_jobs(shape: AnakinShape, state: State, hp: Hyper) -> list[aot_program.Job]:
    """The programs compiled ahead of time that an iteration of ``state`` calls, each with
    the inputs its first call passes: recorded from one eager iteration through the same
    adapters (``state`` stays as it was), in the order called (the longest to build first).
    For ``aot_program.build_concurrently``."""
    recorder = _AheadOfTime(_Eager(), _Recorder())  # type: ignore[arg-type]
    roll = collect(shape, state, recorder.rollout_chunk)
    learn(shape, state, roll, hp, recorder.minibatch_update, recorder.batch)
    return list(recorder.programs.jobs.values())  # type: ignore[attr-defined]


class _AheadOfTime:
    """On a CPU, ``rollout_chunk``, ``batch`` and ``minibatch_update`` as programs compiled
    ahead of time (services/pod/algorithms/aot_program.py), one per shape, behind the
    functions' own signatures: a new process loads them from the compile cache instead of
    tracing them again, and a call skips dynamo's lookup and inductor's Python wrapper. A
    program that cannot be built falls back to ``jit``'s ``torch.compile`` (``batch``: eager)."""

    def __init__(self, jit: _Programs, programs: aot_program.Programs | None = None) -> None:
        self.jit = jit
        self.programs = programs or aot_program.Programs()

    def rollout_chunk(
        self,
        shape: AnakinShape,
        params: torch.Tensor,
        norm_state: Mapping[str, torch.Tensor],
        carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        steps: int,
    ) -> tuple[torch.Tensor, ...]:
        stats = (norm_state["obs_mean"], norm_state["obs_var"])
        args = [t.contiguous() for t in (params, *stats, *carry, *counter)]
        program = self.programs.get(
            "rollout_chunk", shape, steps, args,
            lambda: functools.partial(_chunk_program, shape, steps),
        )  # fmt: skip
        if program is None:
            return self.jit.compiled("rollout_chunk", rollout_chunk)(
                shape, params, norm_state, carry, counter, steps
            )
        return tuple(program(*args))

    def minibatch_update(
        self,
        shape: AnakinShape,
        opt: Mapping[str, torch.Tensor],
        data: tuple[torch.Tensor, ...],
        idx: torch.Tensor,
        hp: Hyper,
        lr: torch.Tensor,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs = (*(opt[k] for k in _OPT_KEYS), *data, idx, lr, *(hp[k] for k in HYPERPARAMETERS))
        args = [t.contiguous() for t in inputs]
        program = self.programs.get(
            "minibatch_update", shape, len(data), args,
            lambda: functools.partial(_update_program, shape, len(data)),
        )  # fmt: skip
        if program is None:
            return self.jit.compiled("minibatch_update", minibatch_update)(
                shape, opt, data, idx, hp, lr
            )
        *new, stats = program(*args)
        return dict(zip(_OPT_KEYS, new, strict=True)), stats

    def batch(
        self, shape: AnakinShape, state: State, roll: Mapping[str, torch.Tensor], hp: Hyper
    ) -> dict[str, torch.Tensor]:
        inputs = (
            *(state[k] for k in _BATCH_STATE),
            *(roll[k] for k in _BATCH_ROLL),
            *(hp[k] for k in _BATCH_HP),
        )
        args = [t.contiguous() for t in inputs]  # type: ignore[union-attr]
        program = self.programs.get(
            "batch", shape, None, args, lambda: functools.partial(_batch_program, shape),
            fallback="eager",
        )  # fmt: skip
        if program is None:
            return batch(shape, state, roll, hp)
        return dict(zip(_batch_keys(shape), program(*args), strict=True))


#: What ``batch`` reads of the state, the rollout and the hyperparameters.
_BATCH_STATE = ("params", "seed", "iteration", "total_iterations", *_OBS_STATS)
_BATCH_ROLL = (
    "raw", "obs", "actions", "logprobs", "rewards", "terminated", "truncated", "final_obs",
    "next_obs", "finished_return",
)  # fmt: skip
_BATCH_HP = ("gamma", "gae_lambda", "learning_rate", "anneal_lr")


class _Programs:
    """The compiled programs for one device type, built on first use (importing this module
    compiles nothing)."""

    def __init__(self, device_type: str) -> None:
        self._cache: dict[str, Callable] = {}
        self._cpu = device_type == "cpu"
        # On a CPU every call of a program runs inductor's wrapper on the host: its C++ form
        # takes less of that time than its Python form (docs/benchmarks.md, "Anakin
        # iteration"). On CUDA the CUDA graph replays without any wrapper.
        self._options = {"cpp_wrapper": True} if self._cpu else {}
        # On a CPU the per-call programs are compiled ahead of time (no wrapper at all); on
        # CUDA the whole iteration is captured as one CUDA graph instead.
        self._aot = _AheadOfTime(self) if aot_program.used_on(device_type) else None

    @property
    def aot(self) -> bool:
        """Whether the per-call programs are compiled ahead of time (dynamo is not involved,
        so there are no guards to skip, nor its import to pay)."""
        return self._aot is not None

    def compiled(self, name: str, fn: Callable) -> Callable:
        """``fn`` through ``torch.compile``, compiled once per process."""
        if name not in self._cache:
            if self._cpu:
                trust_vec_isa()
            # dynamic=False: a program per shape (P, envs, steps); the shape is fixed for a
            # pod's life, and a second shape must not turn the first's sizes symbolic.
            self._cache[name] = torch.compile(
                fn, fullgraph=True, dynamic=False, options=self._options
            )
        return self._cache[name]

    @property
    def iteration(self) -> Callable:
        return self.compiled("iteration", ppo_iteration)

    @property
    def rollout_chunk(self) -> Callable:
        if self._aot is not None:
            return self._aot.rollout_chunk
        return self.compiled("rollout_chunk", rollout_chunk)

    @property
    def minibatch_update(self) -> Callable:
        if self._aot is not None:
            return self._aot.minibatch_update
        return self.compiled("minibatch_update", minibatch_update)

    @property
    def batch(self) -> Callable | None:
        """``batch`` as a program where the others are compiled ahead of time; else None:
        it runs eager (through ``torch.compile`` it measured no faster, and on CUDA the
        whole iteration is one graph)."""
        return self._aot.batch if self._aot is not None else None


class _ProgramsByDevice:
    def __init__(self) -> None:
        self._by_type: dict[str, _Programs] = {}

    def on(self, device: torch.device) -> _Programs:
        return self._by_type.setdefault(device.type, _Programs(device.type))

    def reset(self) -> None:
        """Forget the programs (tests: a fresh compile to count)."""
        self._by_type.clear()


_PROGRAMS = _ProgramsByDevice()
