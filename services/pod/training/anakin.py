"""One PPO iteration as one function over explicit state (Podracer's "Anakin", Hessel et al.
2021; issue 33, deliverable 1, first step), for P agents at once and a torch-native env.

``ppo_iteration(shape, state, hp)`` is the whole iteration, a pure function of its inputs:

* rollout of ``num_steps`` vector steps: observation normalisation (running statistics frozen
  for the rollout, as ``RolloutWorker``), a sampled action (Gumbel-max, as
  ``CategoricalActor.sample``), the env step with same-step autoreset as a functional step of
  the env's state (``cartpole_step``: the equations of ``CartPoleEnv`` out of place, no
  ``self.state`` to mutate), storage into (T, P, N, ...) buffers;
* GAE(γ, λ), truncated episodes bootstrapped from their final observation (as ``PPO.update``);
* ``update_epochs`` x ``num_minibatches`` updates: clipped surrogate, value loss (optionally
  clipped), entropy bonus, per-minibatch advantage normalisation, gradients from
  ``torch.func.vmap(torch.func.grad(loss))`` over the agent axis (P is a batch dimension, not a
  loop), global-norm clipping per agent, Adam (torch's formula) and the annealed learning rate
  as a tensor; the observation statistics merge after the update, as ``PPO.update`` does.

Randomness is counter-based (``uniform_bits``: a 32-bit integer hash of the agent's seed, the
iteration counter, a stream id and the element's index), so no ``torch.Generator`` enters
the program, compiled and eager give the same draws, and an iteration is reproducible from
its state alone. Shuffles are ``argsort`` of such bits (stable, so ties cannot reorder).

Everything PBT changes is a tensor of shape (P,) in ``hp`` (``HYPERPARAMETERS``): new values
are new inputs of the same graph, not a recompile. What would change the graph (P, env count,
rollout length, epochs, minibatches, network) is ``AnakinShape``, fixed per program.

``AnakinPPO`` runs it: ``compile="off"`` (eager), ``"iteration"`` (the whole iteration as one
``torch.compile(fullgraph=True)`` program) or ``"steps"`` (two programs, the rollout step and
the minibatch update, looped in Python; GAE, the shuffles and the noise stay eager). Both
compile and give eager's results. ``"steps"`` is the one kept for CPU: the whole iteration
unrolls T steps and E x M updates into one graph, which runs faster per env step but whose
compile takes minutes (it grows faster than T), while the two programs compile in seconds
whatever T; the whole iteration wins only once its compile is paid for by tens of millions of
env steps or kept in a cache (docs/benchmarks.md, "Anakin iteration", has the numbers).
Not wired into the trainers yet: ``OnPolicyTrainer`` and ``PopulationTrainer`` are
unchanged. Only discrete-action ``CartPoleEnv`` has a functional step so far.
"""

from __future__ import annotations

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
from services.pod.algorithms.ppo import PPO
from services.pod.envs.base import TorchVecEnv
from services.pod.envs.cartpole import CartPoleEnv

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
STATS = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac")
_ADAM_BETAS, _ADAM_EPS = (0.9, 0.999), 1e-5  # as PPO's optimiser
_M32 = 0xFFFFFFFF
# Random streams: one per use, so draws for different purposes never coincide.
_INIT, _RESET, _ACTION, _SHUFFLE = 0, 1, 2, 3
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "relu": torch.relu,
    "elu": F.elu,
}


# -- counter-based randomness ------------------------------------------------------------------
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 holding values < 2**32.

    The multipliers are < 2**31, so every product stays below 2**63: no signed overflow,
    which would be undefined behaviour in the C++ inductor generates.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniform_bits(
    seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """(P, *shape) int64 hash values in [0, 2**32) of (seed[p], counter, stream, index)."""
    p = seed.shape[0]
    key = _mix32(seed & _M32)
    key = _mix32((key + _mix32((counter & _M32) ^ (stream * 0x2545F491))) & _M32)
    index = torch.arange(math.prod(shape), device=seed.device, dtype=torch.int64)
    bits = _mix32((key.view(p, 1) + index) & _M32)
    return _mix32(bits ^ key.view(p, 1)).view(p, *shape)


def uniform(
    seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """(P, *shape) float32 uniforms in (0, 1), never 0 or 1 (Gumbel noise takes log(-log u))."""
    bits = uniform_bits(seed, counter, stream, shape)
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


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
    force_over_mass = torch.tensor([-c.force_mag, c.force_mag], dtype=dt) / c.total_mass
    temp = torch.addcmul(
        force_over_mass.to(state.device)[actions],
        theta_dot * theta_dot,
        sintheta,
        value=c.polemass_length / c.total_mass,
    )
    neg_gravity = torch.tensor(-c.gravity, dtype=dt, device=state.device)
    neg_4l_3 = torch.tensor(-c.length * 4.0 / 3.0, dtype=dt, device=state.device)
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

    @property
    def batch(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch(self) -> int:
        return self.batch // self.minibatches


_SHAPES: dict[AnakinShape, AnakinShape] = {}


def _linear_names(prefix: str, net: nn.Sequential) -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}" for i, m in enumerate(net) if isinstance(m, nn.Linear))


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
    if env not in FUNCTIONAL_ENVS:
        raise ValueError(
            f"env: no functional step for {env.__name__}; have "
            f"{', '.join(e.__name__ for e in FUNCTIONAL_ENVS)}"
        )
    if config.norm_reward or config.target_kl is not None or config.sde_sample_freq:
        raise ValueError("norm_reward, target_kl and gSDE are not supported by the Anakin loop")
    if config.batch_size % config.num_minibatches:
        raise ValueError("num_minibatches must divide num_envs * num_steps")
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
    )
    # One object per distinct shape: the compiled programs take it as an argument, and a PBT
    # child's equal shape must meet the guards of its parent's graphs, however dynamo guards
    # a user object (by value or by identity).
    shape = _SHAPES.setdefault(shape, shape)
    models = [nn.ModuleDict({"actor": a.policy.actor, "critic": a.critic}) for a in agents]
    stacked, _ = stack_module_state(models)
    params = {k: v.detach().to(device).contiguous() for k, v in stacked.items()}
    seed_t = torch.tensor(list(seeds), dtype=torch.int64, device=device)
    _, initial = FUNCTIONAL_ENVS[env]
    env_state = initial(
        uniform(seed_t, torch.tensor(-1, device=device), _INIT, (shape.num_envs, shape.state_dim))
    )
    d = shape.obs_dim
    state: State = {
        "params": params,
        "exp_avg": {k: torch.zeros_like(v) for k, v in params.items()},
        "exp_avg_sq": {k: torch.zeros_like(v) for k, v in params.items()},
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


def rollout_noise(shape: AnakinShape, state: State) -> tuple[torch.Tensor, torch.Tensor]:
    """The iteration's uniforms, (T, P, N, n_actions) for the actions' Gumbel noise and
    (T, P, N, state_dim) for the initial states of the episodes that autoreset."""
    seed, it, t_, n = state["seed"], state["iteration"], shape.num_steps, shape.num_envs
    action_u = uniform(seed, it, _ACTION, (t_, n, shape.n_actions)).transpose(0, 1)
    reset_u = uniform(seed, it, _RESET, (t_, n, shape.state_dim)).transpose(0, 1)
    return action_u, reset_u


def collect(
    shape: AnakinShape, state: State, step_fn: Callable[..., tuple[torch.Tensor, ...]] | None = None
) -> dict[str, torch.Tensor]:
    """T vector steps into buffers of shape (T, P, N, ...); ``step_fn``: ``rollout_step`` or
    its compiled program."""
    step_fn = step_fn or rollout_step
    t_ = shape.num_steps
    action_u, reset_u = rollout_noise(shape, state)
    keys = ("obs", "actions", "logprobs", "rewards", "terminated", "truncated", "final_obs")
    steps: dict[str, list[torch.Tensor]] = {k: [] for k in ("raw", *keys, "finished_return")}
    norm_state = {k: state[k] for k in ("obs_mean", "obs_var")}
    env_state, ep_return, ep_length = state["env"], state["ep_return"], state["ep_length"]
    for t in range(t_):
        steps["raw"].append(env_state.to(torch.float32))
        (env_state, ep_return, ep_length, *out) = step_fn(
            shape,
            state["params"],
            norm_state,
            env_state,
            ep_return,
            ep_length,
            action_u[t],
            reset_u[t],
        )
        for key, value in zip((*keys, "finished_return"), out, strict=True):
            steps[key].append(value)
    # One stack per quantity at the end rather than a copy per quantity per step: the same
    # (T, P, N, ...) buffers, for a tenth of the dispatches where this loop runs in Python.
    buf = {k: torch.stack(v) for k, v in steps.items()}
    buf["env"], buf["ep_return"], buf["ep_length"] = env_state, ep_return, ep_length
    buf["next_obs"] = normalize(norm_state, env_state.to(torch.float32), shape)
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
    log_ratio = logp - old_logp
    ratio = log_ratio.exp()
    if shape.norm_adv:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    clipped = ratio.clamp(1 - clip_coef, 1 + clip_coef)
    pg_loss = torch.max(-adv * ratio, -adv * clipped).mean()
    value = _mlp(params, shape.critic_layers, shape.activation, obs).squeeze(-1)
    if shape.clip_vloss:
        v_clipped = old_values + (value - old_values).clamp(-clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((value - returns).square(), (v_clipped - returns).square()).mean()
    else:
        v_loss = 0.5 * (value - returns).square().mean()
    entropy_mean = entropy.mean()
    loss = pg_loss - ent_coef * entropy_mean + vf_coef * v_loss
    approx_kl = ((ratio - 1) - log_ratio).mean()
    clipfrac = ((ratio - 1).abs() > clip_coef).float().mean()
    stats = torch.stack((pg_loss, v_loss, entropy_mean, approx_kl, clipfrac)).detach()
    return loss, stats


def minibatch_update(
    shape: AnakinShape,
    opt: Mapping[str, torch.Tensor | dict[str, torch.Tensor]],
    minibatch: tuple[torch.Tensor, ...],
    hp: Hyper,
    lr: torch.Tensor,
) -> tuple[dict, torch.Tensor]:
    """One gradient step of all P agents: per-agent gradients (vmap of grad), global-norm
    clipping per agent, Adam. ``opt``: params, exp_avg, exp_avg_sq (dicts), adam_step (P,).
    Returns the new ``opt`` and the loss statistics (P, 5)."""
    params = opt["params"]
    grad_fn = vmap(grad(_loss, has_aux=True), in_dims=(0, None, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    grads, stats = grad_fn(
        params, shape, *minibatch, hp["clip_coef"], hp["ent_coef"], hp["vf_coef"]
    )
    p = shape.agents
    # clip_grad_norm_: coefficient max_norm / (norm + 1e-6), at most 1, per agent.
    sq = sum(g.reshape(p, -1).square().sum(1) for g in grads.values())
    coef = (hp["max_grad_norm"] / (torch.sqrt(sq) + 1e-6)).clamp(max=1.0)
    b1, b2 = _ADAM_BETAS
    step = opt["adam_step"] + 1
    bc1 = 1 - torch.pow(b1, step)
    bc2_sqrt = torch.sqrt(1 - torch.pow(b2, step))
    step_size = lr / bc1
    new_params, new_m, new_v = {}, {}, {}
    for name, value in params.items():
        extra = (1,) * (value.dim() - 1)
        g = grads[name] * coef.view(p, *extra)
        m = opt["exp_avg"][name].lerp(g, 1 - b1)
        v = opt["exp_avg_sq"][name] * b2 + (1 - b2) * g * g
        denom = torch.sqrt(v) / bc2_sqrt.view(p, *extra) + _ADAM_EPS
        new_params[name] = value - step_size.view(p, *extra) * m / denom
        new_m[name], new_v[name] = m, v
    new_opt = {"params": new_params, "exp_avg": new_m, "exp_avg_sq": new_v, "adam_step": step}
    return new_opt, stats


def advantages(
    shape: AnakinShape, params: Mapping[str, torch.Tensor], roll: Mapping, hp: Hyper
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values, GAE advantages and λ-returns, all (P, T, N), as ``PPO.update`` computes them."""
    t_, p, n, d = shape.num_steps, shape.agents, shape.num_envs, shape.obs_dim

    def value(x: torch.Tensor) -> torch.Tensor:  # x (P, B, D)
        return _mlp_batched(params, shape.critic_layers, shape.activation, x).squeeze(-1)

    obs = roll["obs"].transpose(0, 1).reshape(p, t_ * n, d)
    values = value(obs).view(p, t_, n)
    final_values = value(roll["final_obs"].transpose(0, 1).reshape(p, t_ * n, d)).view(p, t_, n)
    next_value = value(roll["next_obs"])
    gamma, lam = hp["gamma"].view(p, 1), hp["gae_lambda"].view(p, 1)
    truncated = roll["truncated"].transpose(0, 1)
    rewards = roll["rewards"].transpose(0, 1)
    # A truncated episode did not end in the MDP: bootstrap it from its final state.
    rewards = torch.where(truncated, rewards + gamma.unsqueeze(-1) * final_values, rewards)
    not_done = (~(roll["terminated"].transpose(0, 1) | truncated)).to(values.dtype)
    # The TD errors of all steps at once; only the trace itself is sequential, one addcmul
    # per step (the loop is T ops, not 5T: in eager and in the two-program mode, where this
    # runs uncompiled, each op is a dispatch).
    following = torch.cat((values[:, 1:], next_value.unsqueeze(1)), 1)
    delta = rewards + gamma.unsqueeze(-1) * following * not_done - values
    decay = (gamma * lam).unsqueeze(-1) * not_done
    last = torch.zeros_like(next_value)
    trace = []
    for t in range(t_ - 1, -1, -1):
        last = torch.addcmul(delta[:, t], decay[:, t], last)
        trace.append(last)
    adv = torch.stack(trace[::-1], 1)
    return values, adv, adv + values


def permutations(shape: AnakinShape, state: State) -> torch.Tensor:
    """(P, epochs, batch) minibatch orders: argsort of counter-based random bits."""
    bits = uniform_bits(state["seed"], state["iteration"], _SHUFFLE, (shape.epochs, shape.batch))
    return torch.argsort(bits, dim=-1, stable=True)


def _merge_obs_stats(shape: AnakinShape, state: State, raw: torch.Tensor) -> dict:
    """``RunningMeanStd.merge`` of the rollout's raw observations (T, P, N, D), per agent."""
    p = shape.agents
    flat = raw.transpose(0, 1).reshape(p, -1, shape.obs_dim).to(torch.float64)
    mean, var = flat.mean(1), flat.var(1, unbiased=False)
    count = float(flat.shape[1])
    old_mean, old_var, old_count = state["obs_mean"], state["obs_var"], state["obs_count"]
    delta = mean - old_mean
    total = old_count + count
    oc = old_count.view(p, 1)
    m2 = old_var * oc + var * count + delta.square() * oc * count / total.view(p, 1)
    return {
        "obs_mean": old_mean + delta * (count / total).view(p, 1),
        "obs_var": m2 / total.view(p, 1),
        "obs_count": total,
    }


def learn(
    shape: AnakinShape,
    state: State,
    roll: Mapping[str, torch.Tensor],
    hp: Hyper,
    update_fn: Callable[..., tuple[dict, torch.Tensor]] | None = None,
) -> tuple[State, dict[str, torch.Tensor]]:
    """GAE, then epochs x minibatches of ``minibatch_update`` (or its compiled program)."""
    update_fn = update_fn or minibatch_update
    p, t_, n, d = shape.agents, shape.num_steps, shape.num_envs, shape.obs_dim
    params = state["params"]
    values, adv, returns = advantages(shape, params, roll, hp)
    data = (
        roll["obs"].transpose(0, 1).reshape(p, t_ * n, d),
        roll["actions"].transpose(0, 1).reshape(p, t_ * n),
        roll["logprobs"].transpose(0, 1).reshape(p, t_ * n),
        adv.reshape(p, t_ * n),
        returns.reshape(p, t_ * n),
        values.reshape(p, t_ * n),
    )
    frac = (1.0 - state["iteration"] / state["total_iterations"]).clamp(min=0.0)
    frac = torch.where(hp["anneal_lr"] > 0, frac, torch.ones_like(frac))
    lr = hp["learning_rate"] * frac
    perms = permutations(shape, state)
    opt = {k: state[k] for k in ("params", "exp_avg", "exp_avg_sq", "adam_step")}
    sums = torch.zeros(p, len(STATS), device=lr.device)
    for epoch in range(shape.epochs):
        order = perms[:, epoch].view(p, shape.minibatches, shape.minibatch)
        for m in range(shape.minibatches):
            idx = order[:, m]
            minibatch = tuple(
                torch.take_along_dim(x, idx.view(p, -1, *([1] * (x.dim() - 2))), dim=1)
                for x in data
            )
            opt, stats = update_fn(shape, opt, minibatch, hp, lr)
            if epoch == shape.epochs - 1:
                sums = sums + stats
    new_state: State = dict(state)
    new_state.update(opt)
    if shape.norm_obs:
        new_state.update(_merge_obs_stats(shape, state, roll["raw"]))
    new_state["env"], new_state["ep_return"] = roll["env"], roll["ep_return"]
    new_state["ep_length"] = roll["ep_length"]
    new_state["iteration"] = state["iteration"] + 1
    done = roll["terminated"] | roll["truncated"]
    episodes = done.sum((0, 2))
    metrics = {
        "stats": sums / shape.minibatches,  # (P, 5), last epoch's mean
        "lr": lr,
        "episodes": episodes,  # (P,) finished in this rollout
        "return_sum": roll["finished_return"].sum((0, 2)),  # (P,)
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
    ) -> None:
        iterations = max(1, math.ceil(total_env_steps / config.batch_size))
        self.config = config
        self.shape, self.state, self.hp = build(
            config, seeds, hyperparameters, iterations, device=device
        )
        self.compile = compile
        self.iterations = 0

    @property
    def env_steps(self) -> int:
        """Env steps per agent so far."""
        return self.iterations * self.shape.batch

    def step(self) -> dict[str, torch.Tensor]:
        """One iteration; the metrics stay tensors (read them at a report, not every step)."""
        if self.compile == "iteration":
            self.state, metrics = _PROGRAMS.iteration(self.shape, self.state, self.hp)
        elif self.compile == "steps":
            roll = collect(self.shape, self.state, _PROGRAMS.rollout_step)
            self.state, metrics = learn(
                self.shape, self.state, roll, self.hp, _PROGRAMS.minibatch_update
            )
        else:
            self.state, metrics = ppo_iteration(self.shape, self.state, self.hp)
        self.iterations += 1
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
        params = self.state["params"]
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


class _Programs:
    """The compiled programs, built on first use (importing this module compiles nothing)."""

    def __init__(self) -> None:
        self._cache: dict[str, Callable] = {}

    def _get(self, name: str, fn: Callable) -> Callable:
        if name not in self._cache:
            self._cache[name] = torch.compile(fn, fullgraph=True)
        return self._cache[name]

    @property
    def iteration(self) -> Callable:
        return self._get("iteration", ppo_iteration)

    @property
    def rollout_step(self) -> Callable:
        return self._get("rollout_step", rollout_step)

    @property
    def minibatch_update(self) -> Callable:
        return self._get("minibatch_update", minibatch_update)

    def reset(self) -> None:
        """Forget the programs (tests: a fresh compile to count)."""
        self._cache.clear()


_PROGRAMS = _Programs()
