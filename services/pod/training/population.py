"""A population of P PPO agents trained in one process: stacked weights, batched matmuls.

Kept in one file although long: the acting, the loss and the hand-written backward below all work on
one private layout (a flat (P, n_params) parameter tensor with views into it), which splitting the
class would have to expose. Adam is services/pod/algorithms/batched_adam.py's, over the flat
tensor's rows.

The P agents share an architecture (``PPOConfig``: network, rollout shape, epochs) and differ
in their weights, their seeds and their hyperparameters, which are tensors of shape (P,):
``learning_rate``, ``ent_coef``, ``clip_coef``, ``vf_coef``, ``gamma``, ``gae_lambda``. One
batched env holds ``P * num_envs`` sub-environments; agent p owns the slice
``[p * num_envs, (p + 1) * num_envs)``.

Every step is the PPO of ``services.pod.algorithms.ppo`` for P agents at once. The agents' modules
are stacked with ``torch.func.stack_module_state``; their MLPs run as batched matmuls over the agent
axis (one ``baddbmm`` per layer for all P agents, which is what ``vmap`` makes of ``nn.Linear``,
without vmap's per-op dispatch, which at these sizes costs a sizeable share of a gradient step:
docs/benchmarks.md). GAE, the clipped-surrogate loss, the gradient clipping and Adam are written
over a leading agent axis, with each agent's coefficients as a (P, 1) column. The agents' losses are
independent, so one backward of their sum gives every agent its own gradient. The parameters live in
one flat (P, n_params) tensor (the stacked tensors are views into it), so clipping and Adam are a
few ops for the whole population instead of one kernel per tensor per agent. Random draws (action
noise, minibatch permutations) come from the population's generator.

Results equal P sequential ``PPO`` agents built with the same seeds and fed the same rollouts
(tests/pod/test_population.py). services/pod/training/population_trainer.py trains the P agents as
the P slots of a trainer: ``evaluate()`` scores them, ``learner(i)`` is agent i as a
single-agent learner (whose training files any PPO pod loads), ``hyperparameters`` lists each
agent's values, and ``set_agent(i, parent, hyperparameters)`` puts a parent from the
leaderboard into slot i (PBT's exploit and explore).

Not supported here (refused at construction): gSDE exploration and ``target_kl`` (which would stop
some agents' epochs early and break the lock-step); networks other than the MLPs of
``services.pod.algorithms.policies``."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import torch
from torch import nn
from torch.func import stack_module_state

from services.contracts.algorithms.ppo import CARD
from services.pod.algorithms.batched_adam import BatchedAdam
from services.pod.algorithms.normalization import merge_batched
from services.pod.algorithms.policies import _LOG_SQRT_2PI, ACTIVATIONS, CategoricalActor
from services.pod.algorithms.ppo import ADAM_BETAS, ADAM_EPS, PPO, PPO_STATS, PPOConfig, gae
from services.pod.algorithms.rollout import Rollout
from services.pod.envs.base import VecEnv
from services.pod.envs.registry import make_env
from services.pod.roles.evaluator import EvalResult, evaluate_groups
from services.pod.roles.learner import RolloutLearner

#: The PPOConfig fields that may differ between the agents (PPO's card's population).
HYPERPARAMETERS: tuple[str, ...] = CARD.population.hyperparameters if CARD.population else ()


def _agent_name(name: str) -> str:
    """A stacked parameter's or buffer's name in a single ``PPO`` agent (the actor is its
    policy's)."""
    return f"policy.{name}" if name.startswith("actor.") else name


class _ActorCritic(nn.Module):
    """The actor and critic of one agent under one root, so that the stacked parameters are
    named ``actor.*`` and ``critic.*``."""

    def __init__(self, actor: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        self.actor = actor
        self.critic = critic


def slow_tanh_cpu(cpuinfo: str) -> bool:
    """Whether torch's float32 tanh is the slow kernel on the CPU that ``cpuinfo`` (the text
    of /proc/cpuinfo) describes: on AMD (an EPYC) it was several times slower than the
    sigmoid form below, on an Intel Xeon the sigmoid form is the slower one
    (docs/benchmarks.md, "Vectorized populations"). Decided by the vendor, not timed, so
    that a machine always trains the same agents from the same seeds."""
    for line in cpuinfo.splitlines():
        if line.startswith("vendor_id"):
            return "GenuineIntel" not in line
    return False  # not x86 (e.g. ARM): torch's own kernel


@functools.cache
def _slow_tanh() -> bool:
    try:
        return slow_tanh_cpu(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def _tanh_(x: torch.Tensor) -> torch.Tensor:
    """tanh in place; as 2·sigmoid(2x) − 1 on a CPU whose tanh kernel is slow.

    A single agent hardly notices (its step is per-op overhead), but once the population pays
    that overhead once for all P agents, the activations of a slow tanh were the largest cost
    of a gradient step. The sigmoid form agrees with ``torch.tanh`` to float precision.
    """
    if x.device.type != "cpu" or not _slow_tanh():
        return x.tanh_()
    return x.mul_(2).sigmoid_().mul_(2).sub_(1)


#: Activation (in place, on a fresh tensor) and its backward given the activation's output:
#: the MLP backward needs only each layer's output, not its input.
_ACTIVATION_FNS: dict[str, tuple[Callable, Callable]] = {
    "tanh": (_tanh_, lambda grad, y: torch.ops.aten.tanh_backward(grad, y)),
    "relu": (torch.relu_, lambda grad, y: torch.ops.aten.threshold_backward(grad, y, 0)),
    "elu": (
        lambda x: torch.nn.functional.elu(x, inplace=True),
        lambda grad, y: torch.ops.aten.elu_backward(grad, 1.0, 1, 1, True, y),
    ),
}


def _linear_layers(prefix: str, net: nn.Sequential, activation: type[nn.Module]) -> list[str]:
    """The names of ``net``'s Linear layers; ``net`` must be Linear, activation, …, Linear
    (as ``policies.mlp`` builds it)."""
    names = []
    for k, module in enumerate(net):
        expected = nn.Linear if k % 2 == 0 else activation
        if not isinstance(module, expected) or len(net) % 2 == 0:
            raise ValueError(f"populations train MLPs (Linear, activation, …); {prefix}: {net}")
        if expected is nn.Linear:
            names.append(f"{prefix}.{k}")
    return names


@dataclass
class PopulationRollout:
    """T steps of E sub-environments for each of P agents; agent first: (P, T, E, ...)."""

    obs: torch.Tensor  # normalised as each agent saw them
    actions: torch.Tensor
    logprobs: torch.Tensor
    rewards: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    final_obs: torch.Tensor
    next_obs: torch.Tensor  # (P, E, *obs_shape)
    obs_stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (P, D), (P, D), ()
    return_stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (P,), (P,), ()
    episode_returns: list[torch.Tensor]  # per agent, episodes finished in this rollout

    @property
    def env_steps_per_agent(self) -> int:
        return self.rewards[0].numel()

    def agent(self, i: int) -> Rollout:
        """Agent i's part as the single-agent ``Rollout`` that ``PPO.update`` takes."""
        mean, var, count = self.obs_stats
        r_mean, r_var, r_count = self.return_stats
        return Rollout(
            obs=self.obs[i],
            actions=self.actions[i],
            logprobs=self.logprobs[i],
            rewards=self.rewards[i],
            terminated=self.terminated[i],
            truncated=self.truncated[i],
            final_obs=self.final_obs[i],
            next_obs=self.next_obs[i],
            obs_stats=(mean[i], var[i], count),
            return_stats=(r_mean[i], r_var[i], r_count),
            episode_returns=self.episode_returns[i],
            episode_lengths=torch.zeros(0, dtype=torch.int64),
        )


def _merge(stats: list[torch.Tensor], mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor):
    """``RunningMeanStd.merge`` for P running statistics at once, into ``stats``."""
    stats[:] = merge_batched((stats[0], stats[1], stats[2]), mean, var, count)


class PopulationPPO:
    """P PPO agents stacked; ``collect`` → ``update`` → ``evaluate`` as the fused pod loop."""

    def __init__(
        self,
        env: VecEnv,
        config: PPOConfig,
        hyperparameters: Sequence[Mapping[str, float]],
        seeds: Sequence[int],
        total_env_steps: int = 1,
        eval_env: VecEnv | None = None,
    ) -> None:
        p = len(hyperparameters)
        if p < 1 or len(seeds) != p:
            raise ValueError("need one hyperparameter mapping and one seed per agent (P >= 1)")
        if config.sde_sample_freq or config.target_kl is not None:
            raise ValueError("populations support neither gSDE (sde_sample_freq) nor target_kl")
        for hp in hyperparameters:
            unknown = sorted(set(hp) - set(HYPERPARAMETERS))
            if unknown:
                raise ValueError(
                    f"per-agent hyperparameters can be {', '.join(HYPERPARAMETERS)}; "
                    f"got {', '.join(unknown)}"
                )
        if env.num_envs != p * config.num_envs:
            raise ValueError(
                f"the env needs P * num_envs = {p * config.num_envs} sub-environments, "
                f"has {env.num_envs}"
            )
        self.size, self.env, self.eval_env, self.base_config = p, env, eval_env, config
        self.device = env.device
        # Each agent is built exactly as a sequential PPO agent with its seed would be.
        self.configs = [config.model_copy(update=dict(hp)) for hp in hyperparameters]
        for c in self.configs:
            PPOConfig.model_validate(c.model_dump())  # range checks of the per-agent values
        agents = []
        for seed, cfg in zip(seeds, self.configs, strict=True):
            torch.manual_seed(seed)
            agents.append(
                PPO(env.single_observation_space, env.single_action_space, cfg).to(self.device)
            )
        self.seeds = list(seeds)
        self._template = agents[0]
        self.discrete = isinstance(agents[0].policy.actor, CategoricalActor)
        models = [_ActorCritic(a.policy.actor, a.critic) for a in agents]
        params, buffers = stack_module_state(models)
        self.buffers = buffers
        activation = ACTIVATIONS[config.activation]
        self._actor_layers = _linear_layers("actor.net", agents[0].policy.actor.net, activation)
        self._critic_layers = _linear_layers("critic", agents[0].critic, activation)
        self._activate, self._activate_backward = _ACTIVATION_FNS[config.activation]
        layers = self._actor_layers + self._critic_layers
        expected = {f"{n}.{w}" for n in layers for w in ("weight", "bias")}
        if not self.discrete:
            expected.add("actor.log_std")
        if set(params) != expected:  # every parameter must get its gradient in _backward
            raise ValueError(f"unexpected parameters {sorted(set(params) ^ expected)}")
        # One flat tensor, the stacked parameters as views into it: the optimiser and the
        # gradient clipping are then a few ops over the whole population. The gradient has
        # the same layout, and the backward writes each parameter's part in place.
        self._names = list(params)
        self._shapes = [params[n].shape[1:] for n in self._names]
        self.flat = torch.cat([params[n].detach().reshape(p, -1) for n in self._names], 1)

        def hp(name: str) -> torch.Tensor:
            values = [float(getattr(c, name)) for c in self.configs]
            return torch.tensor(values, device=self.device, dtype=torch.float32)

        self.lr, self.ent_coef, self.clip_coef = (
            hp("learning_rate"),
            hp("ent_coef"),
            hp("clip_coef"),
        )
        self.vf_coef, self.gamma, self.gae_lambda = hp("vf_coef"), hp("gamma"), hp("gae_lambda")
        # Adam over the flat tensor's rows, with the learning-rate column by reference (explore's
        # new rates, ``_set_hyperparameters``, land in it). Its step count is per agent: a parent
        # put into a slot brings its own, and the bias correction must go on from it (a young
        # population's count would shrink a mature parent's steps several times over for hundreds of
        # steps).
        self.adam = BatchedAdam(self.flat, self.lr, betas=ADAM_BETAS, eps=ADAM_EPS)
        self.grad = self.adam.grad
        self.params: dict[str, torch.Tensor] = {}
        self._grads: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape in zip(self._names, self._shapes, strict=True):
            numel = math.prod(shape)
            self.params[name] = self.flat[:, offset : offset + numel].view(p, *shape)
            self._grads[name] = self.grad[:, offset : offset + numel].view(p, *shape)
            offset += numel
        self.adam_steps = self.adam.steps
        self._whole_batch = True
        d = tuple(env.single_observation_space.shape)
        self.obs_rms = [
            torch.zeros((p, *d), dtype=torch.float64, device=self.device),
            torch.ones((p, *d), dtype=torch.float64, device=self.device),
            torch.full((p,), 1e-4, dtype=torch.float64, device=self.device),
        ]
        self.return_rms = [
            torch.zeros(p, dtype=torch.float64, device=self.device),
            torch.ones(p, dtype=torch.float64, device=self.device),
            torch.full((p,), 1e-4, dtype=torch.float64, device=self.device),
        ]
        self.total_env_steps = max(1, int(total_env_steps))
        self.env_steps = 0  # per agent
        self.updates = 0
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seeds[0])
        self._raw_obs, _ = env.reset(seed=self.seeds[0])
        self._discounted = torch.zeros(env.num_envs, dtype=torch.float64, device=self.device)

    # -- the networks of all P agents ----------------------------------------------------------
    def _forward(self, layers: list[str], x: torch.Tensor) -> list[torch.Tensor]:
        """P MLPs at once on x (P, B, in): the input and every layer's output (activated but
        the last), which is all their backward needs. Each Linear is one ``baddbmm`` over the
        agent axis; no autograd graph is recorded (the backward is ``_backward``)."""
        outputs = [x]
        for k, name in enumerate(layers):
            weight, bias = self.params[f"{name}.weight"], self.params[f"{name}.bias"]
            x = torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))
            if k < len(layers) - 1:
                x = self._activate(x)
            outputs.append(x)
        return outputs

    def _backward(self, layers: list[str], outputs: list[torch.Tensor], grad: torch.Tensor):
        """Backpropagate ``grad`` (P, B, out), the loss's gradient at the MLP's output, and
        write every layer's weight and bias gradients into their part of ``self.grad``."""
        for k in range(len(layers) - 1, -1, -1):
            name, x = layers[k], outputs[k]
            weight, weight_grad = self.params[f"{name}.weight"], self._grads[f"{name}.weight"]
            torch.sum(grad, 1, out=self._grads[f"{name}.bias"])
            # gradᵀ·x, with the wider of (out, in) as the product's last dimension: MKL's
            # batched gemm is several times slower with a narrow one (docs/benchmarks.md).
            if weight.shape[2] < weight.shape[1]:
                weight_grad.transpose(1, 2).copy_(torch.bmm(x.transpose(1, 2), grad))
            else:
                weight_grad.copy_(torch.bmm(grad.transpose(1, 2), x))
            if k:
                grad = self._activate_backward(torch.bmm(grad, weight), x)

    def _act(self, obs: torch.Tensor) -> torch.Tensor:
        """(P, B, D) normalised observations → logits (discrete) or means (continuous)."""
        return self._forward(self._actor_layers, obs.flatten(2))[-1]

    def _value(self, obs: torch.Tensor) -> torch.Tensor:
        """(P, B, D) normalised observations → values (P, B)."""
        return self._forward(self._critic_layers, obs.flatten(2))[-1].squeeze(-1)

    # -- the loss of all P agents ---------------------------------------------------------------
    def _log_prob_entropy(
        self, out: torch.Tensor, actions: torch.Tensor, log_std: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The actor's distribution math (as policies.py) on (P, B, ...) network outputs."""
        if log_std is None:
            logp_all = torch.log_softmax(out, dim=-1)
            logp = logp_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            return logp, -(logp_all.exp() * logp_all).sum(-1)
        log_std = log_std.unsqueeze(1)
        z = (actions - out) * torch.exp(-log_std)
        logp = (-0.5 * z.square() - log_std - _LOG_SQRT_2PI).sum(-1)
        entropy = (0.5 + _LOG_SQRT_2PI + log_std).sum(-1).expand(logp.shape)
        return logp, entropy

    def _loss(self, out, value, log_std, actions, old_logp, adv, returns, old_values, hp):
        """PPO's loss for every agent, (P,), and its statistics, (P, 5), from the networks'
        outputs (P, B, ...) and values (P, B).

        Element-wise over (P, B), with each agent's clip / entropy / value coefficients as a
        (P, 1) column; every op here runs once for the whole population.
        """
        cfg = self.base_config
        clip, ent_coef, vf_coef = hp[:, 0:1], hp[:, 1], hp[:, 2]
        logp, entropy = self._log_prob_entropy(out, actions, log_std)
        log_ratio = logp - old_logp
        ratio = log_ratio.exp()
        if cfg.norm_adv and not self._whole_batch:
            adv = (adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-8)
        clipped_ratio = torch.minimum(torch.maximum(ratio, 1 - clip), 1 + clip)
        pg_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean(1)
        if cfg.clip_vloss:
            v_clipped = old_values + torch.minimum(torch.maximum(value - old_values, -clip), clip)
            v_loss = 0.5 * torch.max((value - returns).square(), (v_clipped - returns).square())
            v_loss = v_loss.mean(1)
        else:
            v_loss = 0.5 * (value - returns).square().mean(1)
        entropy_mean = entropy.mean(1)
        loss = pg_loss - ent_coef * entropy_mean + vf_coef * v_loss
        with torch.no_grad():
            approx_kl = ((ratio - 1) - log_ratio).mean(1)
            clipfrac = ((ratio - 1).abs() > clip).float().mean(1)
            stats = torch.stack((pg_loss, v_loss, entropy_mean, approx_kl, clipfrac), 1)
        return loss, stats

    # -- acting --------------------------------------------------------------------------------
    def _normalize(self, raw: torch.Tensor) -> torch.Tensor:
        """(P, E, D) raw → normalised with each agent's statistics (as RunningMeanStd)."""
        if not self.base_config.norm_obs:
            return raw
        mean, var, _ = self.obs_rms
        std = torch.sqrt(var + 1e-8).to(raw.dtype).unsqueeze(1)
        return ((raw - mean.to(raw.dtype).unsqueeze(1)) / std).clamp(-10.0, 10.0)

    def _log_std(self) -> torch.Tensor:
        return self.params["actor.log_std"].unsqueeze(1)  # (P, 1, A)

    def _sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions and log-probs for (P, E, D) normalised observations; noise drawn here."""
        out = self._act(obs)
        if self.discrete:  # Gumbel-max, as CategoricalActor.sample
            logp_all = torch.log_softmax(out, dim=-1)
            u = torch.rand(logp_all.shape, generator=self.generator, device=self.device)
            action = torch.argmax(logp_all - torch.log(-torch.log(u.clamp_min(1e-20))), dim=-1)
            return action, logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        log_std = self._log_std()
        noise = torch.randn(out.shape, generator=self.generator, device=self.device)
        u = out + noise * log_std.exp()
        logp = (-0.5 * noise.square() - log_std - _LOG_SQRT_2PI).sum(-1)
        return u, logp

    def _to_env(self, action: torch.Tensor) -> torch.Tensor:
        return self._template.policy.actor.to_env(action)

    def _deterministic(self, raw: torch.Tensor) -> torch.Tensor:
        out = self._act(self._normalize(raw))
        return torch.argmax(out, dim=-1) if self.discrete else self._to_env(out)

    @torch.no_grad()
    def collect(self) -> PopulationRollout:
        """``num_steps`` steps of every agent on its own slice of the batched env."""
        cfg, env, p = self.base_config, self.env, self.size
        e, steps = cfg.num_envs, cfg.num_steps
        obs_shape = tuple(self._raw_obs.shape[1:])
        raw = torch.empty((p, steps, e, *obs_shape), device=self.device)
        obs, final_obs = torch.empty_like(raw), torch.empty_like(raw)
        logprobs = torch.empty((p, steps, e), device=self.device)
        rewards = torch.empty_like(logprobs)
        terminated = torch.empty((p, steps, e), dtype=torch.bool, device=self.device)
        truncated = torch.empty_like(terminated)
        returns = torch.empty((p, steps, e), dtype=torch.float64, device=self.device)
        ep_return = torch.zeros((p, steps, e), device=self.device)
        actions: torch.Tensor | None = None
        gamma = self.gamma.to(torch.float64).repeat_interleave(e)
        raw_obs = self._raw_obs
        for t in range(steps):
            batch = raw_obs.view(p, e, *obs_shape)
            raw[:, t] = batch
            norm = self._normalize(batch)
            obs[:, t] = norm
            action, logprob = self._sample(norm)
            if actions is None:
                actions = torch.empty(
                    (p, steps, *action.shape[1:]), dtype=action.dtype, device=self.device
                )
            actions[:, t] = action
            logprobs[:, t] = logprob
            flat_action = self._to_env(action).reshape(p * e, *action.shape[2:])
            raw_obs, reward, term, trunc, info = env.step(flat_action)
            rewards[:, t] = reward.view(p, e)
            terminated[:, t] = term.view(p, e)
            truncated[:, t] = trunc.view(p, e)
            final_obs[:, t] = self._normalize(info["final_obs"].view(p, e, *obs_shape))
            self._discounted.mul_(gamma).add_(reward)
            returns[:, t] = self._discounted.view(p, e)
            self._discounted.masked_fill_(term | trunc, 0.0)
            ep_return[:, t] = info["episode_return"].view(p, e)
        self._raw_obs = raw_obs
        assert actions is not None
        done = terminated | truncated
        flat_raw = raw.reshape(p, steps * e, *obs_shape).to(torch.float64)
        count = torch.tensor(float(steps * e), dtype=torch.float64, device=self.device)
        flat_ret = returns.reshape(p, -1)
        return PopulationRollout(
            obs=obs,
            actions=actions,
            logprobs=logprobs,
            rewards=rewards,
            terminated=terminated,
            truncated=truncated,
            final_obs=final_obs,
            next_obs=self._normalize(raw_obs.view(p, e, *obs_shape)),
            obs_stats=(flat_raw.mean(1), flat_raw.var(1, unbiased=False), count),
            return_stats=(flat_ret.mean(1), flat_ret.var(1, unbiased=False), count),
            episode_returns=[ep_return[i][done[i]] for i in range(p)],
        )

    # -- learning ------------------------------------------------------------------------------
    def update(self, rollout: PopulationRollout, lr_fraction: float | None = None):
        """One PPO update of every agent; returns each agent's statistics (a list of P dicts).

        ``lr_fraction`` defaults to the budget left, as ``Learner`` anneals it.
        """
        cfg, p = self.base_config, self.size
        if lr_fraction is None:
            lr_fraction = max(0.0, 1.0 - self.env_steps / self.total_env_steps)
        lr = self.lr * lr_fraction if cfg.anneal_lr else self.lr
        _, steps, envs = rollout.rewards.shape
        obs_shape = rollout.obs.shape[3:]
        batch = steps * envs

        with torch.no_grad():
            rewards = rollout.rewards
            if cfg.norm_reward:
                _merge(self.return_rms, *rollout.return_stats)
                scale = torch.sqrt(self.return_rms[1] + 1e-8).to(rewards.dtype)
                rewards = rewards / scale.view(p, 1, 1)
            b_obs = rollout.obs.reshape(p, batch, *obs_shape)
            values = self._value(b_obs).view(p, steps, envs)
            next_value = self._value(rollout.next_obs)
            gamma = self.gamma.view(p, 1)
            if bool(rollout.truncated.any()):
                final = rollout.final_obs.reshape(p, batch, *obs_shape)
                final_value = self._value(final).view(p, steps, envs)
                bootstrap = gamma.unsqueeze(1) * final_value
                rewards = torch.where(rollout.truncated, rewards + bootstrap, rewards)
            dones = rollout.terminated | rollout.truncated
            # GAE over (T, P, E) with per-agent γ and λ broadcast over (P, 1).
            advantages, returns = gae(
                rewards.transpose(0, 1),
                values.transpose(0, 1),
                dones.transpose(0, 1),
                next_value,
                gamma,
                self.gae_lambda.view(p, 1),
            )
            advantages, returns = advantages.transpose(0, 1), returns.transpose(0, 1)

        b_actions = rollout.actions.reshape(p, batch, *rollout.actions.shape[3:])
        b_adv = advantages.reshape(p, batch)
        n_mb = min(cfg.num_minibatches, batch)
        mb_size = batch // n_mb
        self._whole_batch = n_mb == 1
        if cfg.norm_adv and self._whole_batch:
            b_adv = (b_adv - b_adv.mean(1, keepdim=True)) / (b_adv.std(1, keepdim=True) + 1e-8)
        data = (
            b_obs,
            b_actions,
            rollout.logprobs.reshape(p, batch),
            b_adv,
            returns.reshape(p, batch),
            values.reshape(p, batch),
        )
        hp = torch.stack((self.clip_coef, self.ent_coef, self.vf_coef), 1)
        rows = torch.arange(p, device=self.device).view(1, p, 1)
        stats = torch.zeros(p, len(PPO_STATS), device=self.device)
        for epoch in range(cfg.update_epochs):
            if self._whole_batch:
                minibatches = [data]
            else:
                # Each agent its own permutation; one gather per tensor lays every minibatch out
                # contiguously as (n_mb, P, mb_size, ...), so that the batched matmuls read it
                # without copies.
                keys = torch.rand((p, batch), generator=self.generator, device=self.device)
                perm = keys.argsort(1)[:, : n_mb * mb_size].view(p, n_mb, mb_size)
                perm = perm.transpose(0, 1)
                minibatches = list(zip(*(x[rows, perm] for x in data), strict=True))
            for mb in minibatches:
                mb_stats = self._gradient_step(mb, hp)
                self._adam_step(lr)
                if epoch == cfg.update_epochs - 1:
                    stats += mb_stats
        if cfg.norm_obs:
            _merge(self.obs_rms, *rollout.obs_stats)
        self.env_steps += rollout.env_steps_per_agent
        self.updates += 1
        per_agent = (stats / n_mb).tolist()
        lrs = lr.tolist()
        return [
            {**dict(zip(PPO_STATS, row, strict=True)), "lr": lrs[i]}
            for i, row in enumerate(per_agent)
        ]

    @torch.no_grad()
    def _gradient_step(self, minibatch: tuple[torch.Tensor, ...], hp: torch.Tensor):
        """Every agent's gradient on its minibatch, into ``self.grad``; returns the loss
        statistics (P, 5).

        The agents' losses are independent, so the gradient of their sum is every agent's
        own gradient. Autograd differentiates only the loss with respect to the networks'
        outputs (and the log-std); the MLPs' backward is written out (``_backward``): no graph
        of their ops is recorded, and weight gradients land in the flat gradient without a
        copy of the whole. That, and the batched matmuls, is faster than autograd through
        ``vmap``ed ``functional_call`` (docs/benchmarks.md, "Vectorized populations").
        """
        obs, actions, old_logp, adv, returns, old_values = minibatch
        actor = self._forward(self._actor_layers, obs)
        critic = self._forward(self._critic_layers, obs)
        out = actor[-1].requires_grad_()
        value = critic[-1].squeeze(-1).detach().requires_grad_()
        leaves = [out, value]
        log_std = None
        if not self.discrete:
            log_std = self.params["actor.log_std"].detach().requires_grad_()
            leaves.append(log_std)
        with torch.enable_grad():
            losses, stats = self._loss(
                out, value, log_std, actions, old_logp, adv, returns, old_values, hp
            )
            grads = torch.autograd.grad(losses.sum(), leaves)
        self._backward(self._actor_layers, actor, grads[0])
        self._backward(self._critic_layers, critic, grads[1].unsqueeze(-1))
        if log_std is not None:
            self._grads["actor.log_std"].copy_(grads[2])
        return stats

    @torch.no_grad()
    def _adam_step(self, lr: torch.Tensor) -> None:
        """Clip each agent's gradient by its global norm, then Adam with per-agent LRs
        (``lr``: this update's, annealed) over the flat tensor's rows."""
        g = self.grad
        norm = torch.linalg.vector_norm(g, dim=1, keepdim=True)
        g.mul_((self.base_config.max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
        self.adam.step(lr=lr)

    # -- scoring and hand-over to the trainer ------------------------------------------------
    def evaluate(self, seed: int = 10_000, max_steps: int | None = None) -> list[EvalResult]:
        """Score every agent deterministically on its slice of ``eval_env`` (one episode per
        sub-environment), each from the start states a single agent's evaluator starts from
        (services/pod/roles/evaluator.py ``evaluate_groups``)."""
        env = self.eval_env
        if env is None:
            raise ValueError("this population has no eval_env")
        p = self.size

        def act(obs: torch.Tensor) -> torch.Tensor:
            action = self._deterministic(obs.view(p, -1, *obs.shape[1:]))
            return action.reshape(env.num_envs, *action.shape[2:])

        return evaluate_groups(env, act, groups=p, seed=seed, max_steps=max_steps)

    @property
    def hyperparameters(self) -> list[dict[str, float]]:
        return [{k: float(getattr(c, k)) for k in HYPERPARAMETERS} for c in self.configs]

    def config(self, i: int) -> PPOConfig:
        return self.configs[i]

    def agent(self, i: int, adam_state: bool = True) -> PPO:
        """Agent i as a standalone ``PPO`` module: weights, statistics and (``adam_state``)
        Adam state. Without it (an agent to act, e.g. to backtest) no optimiser is built:
        a process's first one imports torch._dynamo, a start-up cost of its own."""
        obs_space: gym.Space = self.env.single_observation_space
        agent = PPO(obs_space, self.env.single_action_space, self.configs[i]).to(self.device)
        state = {}
        for name, tensor in self.params.items():
            state[_agent_name(name)] = tensor[i].detach().clone()
        for name, tensor in self.buffers.items():
            state[_agent_name(name)] = tensor[i].clone()
        for key, stats in (("policy.obs_rms", self.obs_rms), ("return_rms", self.return_rms)):
            for field, tensor in zip(("mean", "var", "count"), stats, strict=True):
                state[f"{key}.{field}"] = tensor[i].clone()
        agent.load_state_dict(state)
        if adam_state and (moments := self.adam.row_state(i, self._row(agent))):
            agent.optimizer.state.update(moments)
        return agent

    def _row(self, agent: PPO) -> list[torch.Tensor]:
        """``agent``'s parameters in the order of a row of ``flat``."""
        named = dict(agent.named_parameters())
        return [named[_agent_name(name)] for name in self._names]

    def learner(self, i: int) -> RolloutLearner:
        """A ``RolloutLearner`` of agent i, with the population's counters."""
        learner = RolloutLearner(self.agent(i), self.total_env_steps)
        learner.env_steps, learner.updates = self.env_steps, self.updates
        return learner

    @torch.no_grad()
    def set_agent(
        self, i: int, agent: PPO, hyperparameters: Mapping[str, float] | None = None
    ) -> None:
        """Put ``agent`` (e.g. a leaderboard parent, PBT's exploit) in slot i, with new
        hyperparameters on top of slot i's (explore). Its Adam moments and step count come along."""
        if hyperparameters:
            self._set_hyperparameters(i, hyperparameters)
        state = agent.state_dict()
        for name in self._names:
            self.params[name][i] = state[_agent_name(name)]
        self.adam.load_row(i, self._row(agent), agent.optimizer.state)
        for key, stats in (("policy.obs_rms", self.obs_rms), ("return_rms", self.return_rms)):
            for k, field in enumerate(("mean", "var", "count")):
                stats[k][i] = state[f"{key}.{field}"]

    @torch.no_grad()
    def copy_agent(
        self, dst: int, src: int, hyperparameters: Mapping[str, float] | None = None
    ) -> None:
        """``set_agent(dst, self.agent(src), hyperparameters)`` without the standalone agent
        between (PBT's exploit within the population): slot ``src``'s weights, statistics,
        Adam moments and step count into slot ``dst``, with new hyperparameters on top of
        slot ``dst``'s. ``dst`` keeps its own hyperparameters otherwise, as with
        ``set_agent``."""
        if hyperparameters:
            self._set_hyperparameters(dst, hyperparameters)
        self.adam.copy(dst, src)
        for tensor in (*self.buffers.values(), *self.obs_rms, *self.return_rms):
            tensor[dst] = tensor[src]

    def _set_hyperparameters(self, i: int, hyperparameters: Mapping[str, float]) -> None:
        unknown = sorted(set(hyperparameters) - set(HYPERPARAMETERS))
        if unknown:
            raise ValueError(f"per-agent hyperparameters can be {', '.join(HYPERPARAMETERS)}")
        config = self.configs[i].model_copy(update=dict(hyperparameters))
        self.configs[i] = PPOConfig.model_validate(config.model_dump())
        for name, column in (
            ("learning_rate", self.lr),
            ("ent_coef", self.ent_coef),
            ("clip_coef", self.clip_coef),
            ("vf_coef", self.vf_coef),
            ("gamma", self.gamma),
            ("gae_lambda", self.gae_lambda),
        ):
            column[i] = float(getattr(self.configs[i], name))


def build_population(
    env_name: str,
    config: PPOConfig,
    hyperparameters: Sequence[Mapping[str, float]],
    seed: int = 0,
    total_env_steps: int = 1,
    eval_episodes: int = 10,
    device: str = "cpu",
    env_kwargs: Mapping[str, object] | None = None,
    eval_env_kwargs: Mapping[str, object] | None = None,
) -> PopulationPPO:
    """A population on ``env_name``: one batched env of ``P * config.num_envs`` for training
    and one of ``P * eval_episodes`` for scoring (``eval_env_kwargs`` on top of
    ``env_kwargs``); agent i is seeded ``seed + i``."""
    p = len(hyperparameters)
    kwargs = dict(env_kwargs or {})
    env = make_env(env_name, p * config.num_envs, device=device, seed=seed, **kwargs)
    eval_kwargs = {**kwargs, **(eval_env_kwargs or {})}
    eval_env = make_env(
        env_name, p * eval_episodes, device=device, seed=seed + 10_000, **eval_kwargs
    )
    return PopulationPPO(
        env,
        config,
        hyperparameters,
        [seed + i for i in range(p)],
        total_env_steps=total_env_steps,
        eval_env=eval_env,
    )
