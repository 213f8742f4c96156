"""Proximal Policy Optimization (Schulman et al. 2017) with GAE, for P >= 1 agents at once.

The update reads like the algorithm: values, truncated episodes bootstrapped from their final
observation, GAE(γ, λ), then a few epochs of clipped-surrogate minibatch steps with an entropy
bonus and a value loss, each agent's gradient clipped by its global norm, Adam. It is written
once, as functions over explicit state (``PPOShape``: what fixes the computation; a state of
tensors; per-agent hyperparameters as (P,) tensors, so PBT changes values, never programs), and
run eager, compiled or as a CUDA graph by the on-policy trainer
(services/pod/training/onpolicy.py) on a rollout (services/pod/roles/worker.py).

* The P agents' weights are the rows of one flat (P, n) tensor (services/pod/algorithms/flat.py),
  their MLPs batched matmuls (services/pod/algorithms/policies.py); the agents' losses are
  independent, so the gradient of their sum is every agent's own.
* Observation normalisation: running statistics per agent, frozen during a rollout, merged after
  the update (every sample is scored under the statistics it was collected with). Reward
  normalisation: rewards scaled by the running std of each env's discounted return.
* ``target_kl``: an agent whose last minibatch's KL crossed it stops its epochs; in lock-step its
  later updates are masked (weights, moments and step kept), so no agent waits for another.

``PPO`` is one agent as a module: where its weights are made and named, what its training files
hold and what ``podium export`` gives back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import gymnasium as gym
import torch
from torch import nn

from services.contracts.algorithms.card import AlgorithmCard
from services.contracts.algorithms.ppo import CARD
from services.contracts.algorithms.ppo.config import PPOConfig
from services.pod.algorithms import policies as pi
from services.pod.algorithms.adam import AdamState, adam_, adam_state, clip_rows, load_adam_state
from services.pod.algorithms.compiled import grad as compiled_grad
from services.pod.algorithms.counter_random import stream_bits, to_uniform
from services.pod.algorithms.flat import Layout, flat_rows, stack
from services.pod.algorithms.normalization import RunningMeanStd, merge_batched
from services.pod.algorithms.policies import Policy, PolicySpec, build_actor, build_critic

#: The statistics of an update, per agent, in order.
PPO_STATS = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac")
#: PPO's Adam.
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-5
#: The per-agent hyperparameters every on-policy algorithm's update reads (the rollout's
#: discount, GAE, the optimiser, the gradient clip), (P,) tensors.
MACHINERY: tuple[str, ...] = ("learning_rate", "gamma", "gae_lambda", "max_grad_norm")


def hyperparameter_names(card: AlgorithmCard) -> tuple[str, ...]:
    """An on-policy algorithm's per-agent hyperparameters, (P,) tensors: what its card lets a
    population vary, and ``MACHINERY``."""
    own = card.population.hyperparameters if card.population else ()
    return tuple(dict.fromkeys((*own, *MACHINERY)))


#: PPO's.
HYPERPARAMETERS = hyperparameter_names(CARD)
State = dict[str, torch.Tensor]


class PPO(nn.Module):
    """One PPO agent: policy (actor + observation statistics), critic, return statistics and
    Adam's state in ``torch.optim.Adam``'s format (what its training files hold). A second
    on-policy algorithm is a subclass with its own ``name``, ``card`` (whose config extends
    ``PPOConfig``: the rollout, GAE and network settings) and ``loss``; the on-policy trainer
    runs it through the same rollout, batch and update."""

    name = "ppo"
    card = CARD

    @staticmethod
    def loss(
        shape: PPOShape,
        params: Mapping[str, torch.Tensor],
        minibatch: Sequence[torch.Tensor],
        hp: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The update's loss (``ppo_loss``'s contract): every agent's loss summed, and their
        statistics (P, len(PPO_STATS))."""
        return ppo_loss(shape, params, minibatch, hp)

    def __init__(
        self, obs_space: gym.spaces.Box, action_space: gym.Space, config: PPOConfig
    ) -> None:
        super().__init__()
        self.config = config
        actor = build_actor(
            obs_space,
            action_space,
            config.hidden_sizes,
            config.activation,
            config.log_std_init,
            squash=config.action_bounds == "squash",
            sde_period=config.sde_sample_freq,
        )
        self.policy = Policy(actor, tuple(obs_space.shape), normalize_obs=config.norm_obs)
        self.critic = build_critic(obs_space, config.hidden_sizes, config.activation)
        self.return_rms = RunningMeanStd(())
        self.optimizer = AdamState(self.trained().parameters(), config.learning_rate, eps=ADAM_EPS)

    def trained(self) -> nn.ModuleDict:
        """The trained networks under the flat layout's names (``actor.*``, ``critic.*``)."""
        return nn.ModuleDict({"actor": self.policy.actor, "critic": self.critic})

    def spec(self) -> PolicySpec:
        return pi.policy_spec(self.policy.actor, self.critic)


# -- what fixes the programs ------------------------------------------------------------------
@dataclass(frozen=True)
class PPOShape:
    """Everything a PPO program is specialised on: change any of it and it compiles again."""

    agents: int
    num_envs: int
    num_steps: int
    epochs: int
    minibatches: int
    obs_dim: int
    policy: PolicySpec
    #: Where each actor and critic tensor lies in a row of the flat ``params``.
    layout: Layout
    norm_obs: bool
    norm_reward: bool
    norm_adv: bool
    clip_vloss: bool
    target_kl: bool
    #: The algorithm's loss (``PPO.loss``; in the repr by name, which keys the compile cache's
    #: notes across processes) and its per-agent hyperparameters.
    loss: Callable[..., tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    loss_name: str
    hyperparameters: tuple[str, ...]
    #: The time limit of the env's episodes (None: unknown or none): how many truncations a
    #: rollout can hold, so that only their final observations are valued.
    max_episode_steps: int | None = None

    @property
    def batch(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch(self) -> int:
        return self.batch // self.minibatches


_SHAPES: dict[PPOShape, PPOShape] = {}


def unsupported(config: PPOConfig) -> str | None:
    """Why PPO's batched update cannot train ``config`` (None: it can)."""
    if config.batch_size % config.num_minibatches:
        return (
            f"num_minibatches ({config.num_minibatches}) must divide num_envs * num_steps "
            f"({config.batch_size})"
        )
    return None


def build(
    config: PPOConfig,
    agents: Sequence[PPO],
    hyperparameters: Sequence[Mapping[str, float]],
    total_env_steps: int,
    device: torch.device,
    max_episode_steps: int | None = None,
) -> tuple[PPOShape, State, State]:
    """Shape, state and hyperparameter tensors for ``agents`` (one PPO module each, of one
    shape; their weights, statistics and Adam state are taken)."""
    if reason := unsupported(config):
        raise ValueError(reason)
    first = agents[0]
    p = len(agents)
    flat, layout = stack([a.trained() for a in agents])
    spec = first.spec()
    shape = PPOShape(
        agents=p,
        num_envs=config.num_envs,
        num_steps=config.num_steps,
        epochs=config.update_epochs,
        minibatches=config.num_minibatches,
        obs_dim=int(first.policy.obs_rms.mean.numel()),
        policy=spec,
        layout=layout,
        norm_obs=config.norm_obs,
        norm_reward=config.norm_reward,
        norm_adv=config.norm_adv,
        clip_vloss=config.clip_vloss,
        target_kl=config.target_kl is not None,
        loss=type(first).loss,
        loss_name=f"{type(first).__module__}.{type(first).__qualname__}.loss",
        hyperparameters=hyperparameter_names(type(first).card),
        max_episode_steps=max_episode_steps,
    )
    # One object per distinct shape: compiled programs take it as a constant, and an equal
    # shape (a rebuilt trainer's) must meet their guards, however dynamo guards an object.
    shape = _SHAPES.setdefault(shape, shape)
    d = shape.obs_dim
    f64 = {"dtype": torch.float64, "device": device}
    state: State = {
        "params": flat.to(device),
        "exp_avg": torch.zeros(p, layout.size, device=device),
        "exp_avg_sq": torch.zeros(p, layout.size, device=device),
        "adam_step": torch.zeros(p, device=device),
        "obs_mean": torch.zeros(p, d, **f64),
        "obs_var": torch.ones(p, d, **f64),
        "obs_count": torch.full((p,), 1e-4, **f64),
        "ret_mean": torch.zeros(p, **f64),
        "ret_var": torch.ones(p, **f64),
        "ret_count": torch.full((p,), 1e-4, **f64),
        "env_steps": torch.zeros(p, **f64),
        "seed": torch.zeros(p, dtype=torch.int64, device=device),
        "iteration": torch.zeros((), dtype=torch.int64, device=device),
    }
    hp: State = {name: torch.zeros(p, device=device) for name in shape.hyperparameters}
    hp["target_kl"] = torch.full((p,), math.inf, device=device)
    hp["anneal_lr"] = torch.tensor(float(config.anneal_lr), device=device)
    hp["total_env_steps"] = torch.tensor(float(max(1, total_env_steps)), device=device)
    for i, (agent, values) in enumerate(zip(agents, hyperparameters, strict=True)):
        put_agent(shape, state, i, agent)
        set_hyperparameters(shape, hp, i, config, values)
    return shape, state, hp


def set_hyperparameters(
    shape: PPOShape, hp: State, i: int, config: PPOConfig, values: Mapping[str, float] | None = None
) -> None:
    """Agent i's hyperparameter tensors: ``config``'s, with ``values`` over them."""
    for name in shape.hyperparameters:
        hp[name][i] = float((values or {}).get(name, getattr(config, name)))
    if config.target_kl is not None:
        hp["target_kl"][i] = config.target_kl


@torch.no_grad()
def put_agent(shape: PPOShape, state: State, i: int, agent: PPO) -> None:
    """Write ``agent`` (weights, statistics, Adam state) into row i of ``state``, in place."""
    params = list(agent.trained().parameters())
    views = [shape.layout.views(state[k]) for k in ("params", "exp_avg", "exp_avg_sq")]
    for name, param in zip(shape.layout.names, params, strict=True):
        views[0][name][i] = param
    moments = [[view[name][i] for name in shape.layout.names] for view in views[1:]]
    state["adam_step"][i] = load_adam_state(params, agent.optimizer.state, *moments)
    for keys, rms in ((OBS_STATS, agent.policy.obs_rms), (RET_STATS, agent.return_rms)):
        for key, value in zip(keys, (rms.mean, rms.var, rms.count), strict=True):
            state[key][i] = value


@torch.no_grad()
def get_agent(shape: PPOShape, state: State, i: int, agent: PPO) -> PPO:
    """Row i of ``state`` (weights, statistics, Adam state) written into ``agent``; returns it."""
    params = list(agent.trained().parameters())
    views = [shape.layout.views(state[k]) for k in ("params", "exp_avg", "exp_avg_sq")]
    for name, param in zip(shape.layout.names, params, strict=True):
        param.copy_(views[0][name][i])
    moments = [[view[name][i] for name in shape.layout.names] for view in views[1:]]
    agent.optimizer.state = adam_state(params, float(state["adam_step"][i]), *moments)
    for keys, rms in ((OBS_STATS, agent.policy.obs_rms), (RET_STATS, agent.return_rms)):
        for key, value in zip(keys, (rms.mean, rms.var, rms.count), strict=True):
            value.copy_(state[key][i])
    return agent


@torch.no_grad()
def copy_agent(state: State, dst: int, src: int) -> None:
    """PBT's exploit inside one state: agent ``dst`` becomes agent ``src`` (weights, Adam's
    moments and step, statistics); hyperparameters are the caller's."""
    for key in (*OPT, *OBS_STATS, *RET_STATS):
        state[key][dst] = state[key][src]


# -- acting -----------------------------------------------------------------------------------
def normalize(
    shape: PPOShape, state: Mapping[str, torch.Tensor], raw: torch.Tensor
) -> torch.Tensor:
    """Each agent's observation normalisation (frozen statistics) on raw (P, N, D)."""
    if not shape.norm_obs:
        return raw
    mean = state["obs_mean"].unsqueeze(1).to(raw.dtype)
    std = torch.sqrt(state["obs_var"] + 1e-8).unsqueeze(1).to(raw.dtype)
    return ((raw - mean) / std).clamp(-10.0, 10.0)


# -- GAE --------------------------------------------------------------------------------------
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    next_value: torch.Tensor,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and λ-returns, all (T, ...), the steps first.
    ``dones[t]`` marks that the episode ended after step t (terminated or truncated); the
    caller has already added γ·V(final_obs) to the reward of truncated steps, so cutting the
    trace at every ``done`` is right for both kinds of ending. ``gamma`` and ``lam`` broadcast
    against a step's values (per agent: (P, 1) for (P, N) steps)."""
    not_done = (~dones).to(values.dtype)
    following = torch.cat((values[1:], next_value.unsqueeze(0)), 0)
    # The TD errors of all steps at once; only the trace is sequential.
    delta = rewards + gamma * following * not_done - values
    decay = gamma * lam * not_done
    last = torch.zeros_like(next_value)
    trace = []
    for t in range(values.shape[0] - 1, -1, -1):
        last = delta[t] + decay[t] * last
        trace.append(last)
    advantages = torch.stack(trace[::-1])
    return advantages, advantages + values


def _bootstrap_values(
    shape: PPOShape, params: Mapping, final_obs: torch.Tensor, truncated: torch.Tensor
) -> torch.Tensor:
    """V(final observation) at the truncated steps, (T, P, N); any value elsewhere (never
    read). A rollout of T steps truncates each env at most c = ceil(T / time limit) times, so
    the critic runs on the c final observations per env that a fixed-size top-k of the
    truncation flags picks (a static shape, for the programs and CUDA graphs), not on all of
    them, which would cost as much as the rollout's own values."""
    t_, p, n, d = final_obs.shape
    limit = shape.max_episode_steps
    c = math.ceil(t_ / limit) if limit else t_
    if c >= t_:
        flat = final_obs.transpose(0, 1).reshape(p, t_ * n, d)
        return pi.value(shape.policy, params, flat).view(p, t_, n).transpose(0, 1)
    per_env = final_obs.permute(1, 2, 0, 3)  # (P, N, T, D)
    steps = torch.topk(truncated.permute(1, 2, 0).to(torch.float32), c, dim=-1).indices
    picked = torch.take_along_dim(per_env, steps.unsqueeze(-1), dim=2)  # (P, N, c, D)
    v = pi.value(shape.policy, params, picked.reshape(p, n * c, d)).view(p, n, c)
    full = torch.zeros(p, n, t_, dtype=v.dtype, device=v.device).scatter(-1, steps, v)
    return full.permute(2, 0, 1)


# -- between the rollout and the updates ------------------------------------------------------
#: What ``batch`` gives the updates, each (P, batch, ...), in ``minibatch_update``'s order.
DATA = ("obs", "actions", "logprobs", "advantages", "returns", "values")
#: The statistics ``batch`` merges (written back after the update).
OBS_STATS = ("obs_mean", "obs_var", "obs_count")
RET_STATS = ("ret_mean", "ret_var", "ret_count")


def batch(
    shape: PPOShape, state: Mapping[str, torch.Tensor], roll: Mapping[str, torch.Tensor],
    hp: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Everything between a rollout (``roll``: (T, P, N, ...), services/pod/roles/worker.py)
    and the updates: values, reward scaling, bootstrapped truncations, GAE, the data laid out
    per agent, the minibatch orders, the annealed learning rate, the rollout's finished
    episodes, and the merged observation and return statistics."""
    p, t_, n, d = shape.agents, shape.num_steps, shape.num_envs, shape.obs_dim
    params = shape.layout.views(state["params"])
    obs = roll["obs"].transpose(0, 1).reshape(p, t_ * n, d)
    with torch.no_grad():
        values = pi.value(shape.policy, params, obs).view(p, t_, n).transpose(0, 1)
        next_value = pi.value(shape.policy, params, roll["next_obs"])
        out: dict[str, torch.Tensor] = {}
        rewards = roll["rewards"].to(values.dtype)
        if shape.norm_reward:
            returns = roll["discounted"].transpose(0, 1).reshape(p, -1)
            merged = merge_batched(
                (state["ret_mean"], state["ret_var"], state["ret_count"]),
                returns.mean(1), returns.var(1, unbiased=False), float(t_ * n),
            )  # fmt: skip
            out.update(zip(RET_STATS, merged, strict=True))
            rewards = rewards / torch.sqrt(merged[1] + 1e-8).to(rewards.dtype).view(1, p, 1)
        gamma = hp["gamma"].view(p, 1)
        truncated = roll["truncated"]
        final_values = _bootstrap_values(shape, params, roll["final_obs"], truncated)
        # A truncated episode did not end in the MDP: bootstrap it from its final state.
        rewards = torch.where(truncated, rewards + gamma * final_values, rewards)
        dones = roll["terminated"] | truncated
        adv, ret = gae(rewards, values, dones, next_value, gamma, hp["gae_lambda"].view(p, 1))
    per_agent = lambda x: x.transpose(0, 1).reshape(p, t_ * n, *x.shape[3:])  # noqa: E731
    out.update(
        obs=obs,
        actions=per_agent(roll["actions"]),
        logprobs=per_agent(roll["logprobs"]),
        advantages=per_agent(adv),
        returns=per_agent(ret),
        values=per_agent(values),
        orders=shuffles(shape, state),
    )
    frac = (1.0 - state["env_steps"] / hp["total_env_steps"]).clamp(min=0.0).to(torch.float32)
    frac = torch.where(hp["anneal_lr"] > 0, frac, torch.ones_like(frac))
    out["lr"] = hp["learning_rate"] * frac
    out["episodes"] = dones.sum((0, 2))  # (P,)
    out["return_sum"] = roll["episode_return"].sum((0, 2))  # (P,)
    if shape.norm_obs:
        raw = roll["raw"].transpose(0, 1).reshape(p, -1, d).to(torch.float64)
        old = (state["obs_mean"], state["obs_var"], state["obs_count"])
        merged = merge_batched(old, raw.mean(1), raw.var(1, unbiased=False), float(raw.shape[1]))
        out.update(zip(OBS_STATS, merged, strict=True))
    return out


#: The random stream of the minibatch orders (the rollout's are services/pod/roles/worker.py's).
SHUFFLE_STREAM = 3


def shuffles(shape: PPOShape, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The iteration's minibatch orders (P, epochs, batch): argsorts of counter-based random
    bits (stable, so ties cannot reorder)."""
    size = shape.epochs * shape.batch
    bits = stream_bits(state["seed"], state["iteration"], (SHUFFLE_STREAM,), size)
    return torch.argsort(bits.view(shape.agents, shape.epochs, shape.batch), dim=-1, stable=True)


# -- the update -------------------------------------------------------------------------------
def ppo_loss(
    shape: PPOShape,
    params: Mapping[str, torch.Tensor],
    minibatch: Sequence[torch.Tensor],
    hp: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every agent's PPO loss on its minibatch (clipped surrogate, entropy bonus, value loss),
    summed (each agent's gradient is its own), and their statistics (P, 5), detached.
    ``params``: the agents' tensors by name, (P, ...) each."""
    obs, actions, old_logp, adv, returns, old_values = minibatch
    p = shape.agents
    logp, entropy = pi.log_prob_entropy(shape.policy, params, obs, actions)
    new_value = pi.value(shape.policy, params, obs)
    clip = hp["clip_coef"].view(p, 1)
    log_ratio = logp - old_logp
    ratio = log_ratio.exp()
    if shape.norm_adv:
        adv = (adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-8)
    clipped_ratio = torch.minimum(torch.maximum(ratio, 1 - clip), 1 + clip)
    pg_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean(1)
    if shape.clip_vloss:
        v_clipped = old_values + torch.minimum(torch.maximum(new_value - old_values, -clip), clip)
        v_loss = 0.5 * torch.max(
            (new_value - returns).square(), (v_clipped - returns).square()
        ).mean(1)
    else:
        v_loss = 0.5 * (new_value - returns).square().mean(1)
    entropy_mean = entropy.mean(1)
    loss = pg_loss - hp["ent_coef"] * entropy_mean + hp["vf_coef"] * v_loss
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean(1)
        clipfrac = ((ratio - 1).abs() > clip).float().mean(1)
        stats = torch.stack((pg_loss, v_loss, entropy_mean, approx_kl, clipfrac), 1)
    return loss.sum(), stats


#: The optimiser's part of the state: what ``minibatch_update`` updates in place.
OPT = ("params", "exp_avg", "exp_avg_sq", "adam_step")


def minibatch_update(
    shape: PPOShape,
    opt: Mapping[str, torch.Tensor],
    data: Sequence[torch.Tensor],
    idx: torch.Tensor,
    hp: Mapping[str, torch.Tensor],
    lr: torch.Tensor,
    active: torch.Tensor,
) -> torch.Tensor:
    """One gradient step of every agent on its samples ``idx`` (P, minibatch) of ``data``
    (each (P, batch, ...)), in place on ``opt`` (``OPT``): the gradient of the summed losses,
    each agent's clipped to its global norm, Adam. ``active`` (P,) bool: agents still
    updating (``target_kl``); the others keep their state. Returns the statistics (P, 5). The
    gather is inside, so that a compiled update is one call."""
    p = shape.agents
    minibatch = [
        torch.take_along_dim(x, idx.view(p, -1, *([1] * (x.dim() - 2))), dim=1) for x in data
    ]
    # The gradient of each tensor, then one flat row per agent: a gradient taken of the flat
    # row itself would be assembled from every view's slice, element by element.
    views = shape.layout.views(opt["params"])
    grads, stats = compiled_grad(lambda w: shape.loss(shape, w, minibatch, hp))(views)
    grad = clip_rows(flat_rows(grads, views), hp["max_grad_norm"])
    params, m, v, steps = (opt[k] for k in OPT)
    if shape.target_kl:
        kept = [t.clone() for t in (params, m, v, steps)]
    adam_(params, grad, m, v, steps, lr, ADAM_BETAS, ADAM_EPS)
    if shape.target_kl:
        for new, old in zip((params, m, v, steps), kept, strict=True):
            mask = active.view(p, *([1] * (new.dim() - 1)))
            new.copy_(torch.where(mask, new, old))
    return stats


def learn(
    shape: PPOShape,
    state: State,
    roll: Mapping[str, torch.Tensor],
    hp: Mapping[str, torch.Tensor],
    update_fn: Callable[..., torch.Tensor] = minibatch_update,
    batch_fn: Callable[..., dict[str, torch.Tensor]] = batch,
    after_epoch: Callable[[State], None] | None = None,
) -> dict[str, torch.Tensor]:
    """``batch`` (or its compiled program), then epochs x minibatches of ``minibatch_update``
    (or its), all on ``state`` in place; then the merged statistics and the counters. Returns
    the metrics as tensors (read them at a report, not every iteration): ``stats`` (P, 5) of
    each agent's last epoch, ``lr`` (P,), ``episodes`` and ``return_sum`` (P,) of the rollout.
    ``after_epoch``: fused learner replicas average there (services/pod/training/fusion.py)."""
    p = shape.agents
    b = batch_fn(shape, state, roll, hp)
    data = [b[key] for key in DATA]
    lr = b["lr"]
    opt = {k: state[k] for k in OPT}
    active = torch.ones(p, dtype=torch.bool, device=lr.device)
    reported = torch.zeros(p, len(PPO_STATS), device=lr.device)
    for epoch in range(shape.epochs):
        # Each minibatch's indices as a view, taken at once: a compiled update is a few tens
        # of microseconds, and each eager op between two costs a few.
        orders = b["orders"][:, epoch].view(p, shape.minibatches, shape.minibatch).unbind(1)
        stats = [update_fn(shape, opt, data, idx, hp, lr, active) for idx in orders]
        mean = torch.stack(stats).mean(0)
        if shape.target_kl:
            reported = torch.where(active.unsqueeze(1), mean, reported)
            active = active & (stats[-1][:, 3] <= hp["target_kl"])
        else:
            reported = mean
        if after_epoch is not None:
            after_epoch(state)
    with torch.no_grad():
        for key in (
            *(OBS_STATS if shape.norm_obs else ()),
            *(RET_STATS if shape.norm_reward else ()),
        ):
            state[key].copy_(b[key])
        state["env_steps"].add_(shape.batch)
        state["iteration"].add_(1)
    return {"stats": reported, "lr": lr, "episodes": b["episodes"], "return_sum": b["return_sum"]}


def rollout_noise(
    shape: PPOShape, seed: torch.Tensor, iteration: torch.Tensor, stream: int, per_step: int,
    start: torch.Tensor | int, steps: int,
) -> torch.Tensor:  # fmt: skip
    """Uniforms (steps, P, per_step) for rollout steps ``start`` .. ``start + steps - 1`` of an
    iteration: one counter-based sequence per iteration and stream, step by step, so any run of
    steps is a slice drawn alone (a compiled chunk draws its own; eager code the whole rollout)."""
    bits = stream_bits(seed, iteration, (stream,), steps * per_step, start * per_step)
    return to_uniform(bits).view(shape.agents, steps, per_step).transpose(0, 1)
