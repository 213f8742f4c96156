"""A population of P PPO agents trained in one process with torch.func (stack + vmap).

The P agents share an architecture (``PPOConfig``: network, rollout shape, epochs) and differ
in their weights, their seeds and their hyperparameters, which are tensors of shape (P,):
``learning_rate``, ``ent_coef``, ``clip_coef``, ``vf_coef``, ``gamma``, ``gae_lambda``. One
batched env holds ``P * num_envs`` sub-environments; agent p owns the slice
``[p * num_envs, (p + 1) * num_envs)``.

Every step is the PPO of ``services.pod.algorithms.ppo`` for P agents at once: the networks
run under ``vmap`` (``functional_call`` on the parameters of ``stack_module_state``); GAE, the
clipped-surrogate loss, the gradient clipping and Adam are written over a leading agent axis,
with each agent's coefficients as a (P, 1) column. The agents' losses are independent, so one
backward of their sum gives every agent its own gradient. The parameters live in one flat
(P, n_params) tensor (the stacked tensors are views into it), so clipping and Adam are a few
ops for the whole population instead of one kernel per tensor per agent. Random draws (action
noise, minibatch permutations) come from the population's generator, outside vmap.

Results equal P sequential ``PPO`` agents built with the same seeds and fed the same rollouts
(tests/pod/test_population.py). The pod runtime submits the P agents as P candidates:
``evaluate()`` scores them, ``learner(i)`` and ``config(i)`` are what
``services.pod.checkpoint.save_training_files`` needs for candidate i, ``hyperparameters``
lists each agent's values, and ``set_agent(i, parent, hyperparameters)`` puts a parent from
the leaderboard into slot i (PBT's exploit and explore).

Not supported here (refused at construction): gSDE exploration and ``target_kl`` (which would
stop some agents' epochs early and break the lock-step).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import gymnasium as gym
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from services.pod.algorithms.policies import _LOG_SQRT_2PI, CategoricalActor
from services.pod.algorithms.ppo import PPO, PPOConfig, gae
from services.pod.envs.base import VecEnv
from services.pod.envs.registry import make_env
from services.pod.evaluator import EvalResult
from services.pod.learner import Learner
from services.pod.worker import Rollout

#: PPOConfig fields that may differ between the agents of a population.
HYPERPARAMETERS = ("learning_rate", "ent_coef", "clip_coef", "vf_coef", "gamma", "gae_lambda")
_ADAM_BETAS, _ADAM_EPS = (0.9, 0.999), 1e-5  # as PPO's optimiser
_STATS = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac")


class _ActorCritic(nn.Module):
    """The actor and critic of one agent behind one ``forward``, for ``functional_call``."""

    def __init__(self, actor: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        self.actor = actor
        self.critic = critic

    def forward(self, obs: torch.Tensor, what: str = "act"):
        if what == "act":  # logits (discrete) or mean (continuous)
            return self.actor.net(obs)
        value = self.critic(obs).squeeze(-1)
        if what == "value":
            return value
        return self.actor.net(obs), value  # "nets": both networks' outputs


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
    """``RunningMeanStd.merge`` for P running statistics at once (Chan et al.)."""
    old_mean, old_var, old_count = stats
    delta = mean - old_mean
    total = old_count + count
    c = (count / total).view(-1, *([1] * (delta.dim() - 1)))
    oc = old_count.view_as(c)
    m2 = old_var * oc + var * count + delta.square() * oc * count / total.view_as(c)
    stats[0] = old_mean + delta * c
    stats[1] = m2 / total.view_as(c)
    stats[2] = total


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
        self._model = copy.deepcopy(models[0]).to("meta")
        # One flat tensor, the stacked parameters as views into it: the optimiser and the
        # gradient clipping are then a few ops over the whole population.
        self._names = list(params)
        self._shapes = [params[n].shape[1:] for n in self._names]
        self.flat = torch.cat([params[n].detach().reshape(p, -1) for n in self._names], 1)
        self.params: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape in zip(self._names, self._shapes, strict=True):
            numel = math.prod(shape)
            self.params[name] = self.flat[:, offset : offset + numel].view(p, *shape)
            offset += numel
        self._exp_avg = torch.zeros_like(self.flat)
        self._exp_avg_sq = torch.zeros_like(self.flat)
        self._adam_delta = torch.zeros_like(self.flat)
        self._adam_step_count = torch.zeros((), device=self.device)
        self.adam_steps = 0
        self._whole_batch = True

        def hp(name: str) -> torch.Tensor:
            values = [float(getattr(c, name)) for c in self.configs]
            return torch.tensor(values, device=self.device, dtype=torch.float32)

        self.lr, self.ent_coef, self.clip_coef = (
            hp("learning_rate"),
            hp("ent_coef"),
            hp("clip_coef"),
        )
        self.vf_coef, self.gamma, self.gae_lambda = hp("vf_coef"), hp("gamma"), hp("gae_lambda")
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

        def act(params, buffers, obs):
            return functional_call(self._model, (params, buffers), (obs,))

        def value(params, buffers, obs):
            return functional_call(self._model, (params, buffers), (obs,), {"what": "value"})

        self._act = vmap(act)
        self._value = vmap(value)

        def nets(params, buffers, obs):
            return functional_call(self._model, (params, buffers), (obs,), {"what": "nets"})

        self._nets = vmap(nets)

    # -- the loss of all P agents ---------------------------------------------------------------
    def _log_prob_entropy(self, params, out: torch.Tensor, actions: torch.Tensor):
        """The actor's distribution math (as policies.py) on (P, B, ...) network outputs."""
        if self.discrete:
            logp_all = torch.log_softmax(out, dim=-1)
            logp = logp_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            return logp, -(logp_all.exp() * logp_all).sum(-1)
        log_std = params["actor.log_std"].unsqueeze(1)
        z = (actions - out) * torch.exp(-log_std)
        logp = (-0.5 * z.square() - log_std - _LOG_SQRT_2PI).sum(-1)
        entropy = (0.5 + _LOG_SQRT_2PI + log_std).sum(-1).expand(logp.shape)
        return logp, entropy

    def _loss(self, params, obs, actions, old_logp, adv, returns, old_values, hp):
        """PPO's loss for every agent, (P,), and its statistics, (P, 5).

        Only the networks run under vmap (``functional_call`` on the stacked parameters); the
        loss itself is element-wise, so it is written over (P, B) directly, with each agent's
        clip / entropy / value coefficients as a (P, 1) column. Under vmap each of its ~40
        small ops would pay vmap's per-op cost, which at these sizes is most of the time.
        """
        cfg = self.base_config
        clip, ent_coef, vf_coef = hp[:, 0:1], hp[:, 1], hp[:, 2]
        out, value = self._nets(params, self.buffers, obs)
        logp, entropy = self._log_prob_entropy(params, out, actions)
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
        out = self._act(self.params, self.buffers, obs)
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
        out = self._act(self.params, self.buffers, self._normalize(raw))
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
            values = self._value(self.params, self.buffers, b_obs).view(p, steps, envs)
            next_value = self._value(self.params, self.buffers, rollout.next_obs)
            gamma = self.gamma.view(p, 1)
            if bool(rollout.truncated.any()):
                final = rollout.final_obs.reshape(p, batch, *obs_shape)
                final_value = self._value(self.params, self.buffers, final).view(p, steps, envs)
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
        rows = torch.arange(p, device=self.device).unsqueeze(1)
        stats = torch.zeros(p, len(_STATS), device=self.device)
        for epoch in range(cfg.update_epochs):
            if self._whole_batch:
                minibatches = [data]
            else:
                keys = torch.rand((p, batch), generator=self.generator, device=self.device)
                perm = keys.argsort(1)[:, : n_mb * mb_size]
                shuffled = [x[rows, perm] for x in data]
                minibatches = list(zip(*(x.split(mb_size, 1) for x in shuffled), strict=True))
            for mb in minibatches:
                # The agents' losses are independent, so the gradient of their sum with
                # respect to the stacked parameters is every agent's own gradient; one
                # backward through the vmapped loss is ~30% faster on CPU than vmapping
                # torch.func.grad (both give the same numbers).
                params = {n: t.detach().requires_grad_() for n, t in self.params.items()}
                losses, mb_stats = self._loss(params, *mb, hp)
                grads = torch.autograd.grad(losses.sum(), list(params.values()))
                self._adam_step(list(grads), lr)
                if epoch == cfg.update_epochs - 1:
                    stats += mb_stats
        if cfg.norm_obs:
            _merge(self.obs_rms, *rollout.obs_stats)
        self.env_steps += rollout.env_steps_per_agent
        self.updates += 1
        per_agent = (stats / n_mb).tolist()
        lrs = lr.tolist()
        return [
            {**dict(zip(_STATS, row, strict=True)), "lr": lrs[i]} for i, row in enumerate(per_agent)
        ]

    @torch.no_grad()
    def _adam_step(self, grads: list[torch.Tensor], lr: torch.Tensor) -> None:
        """Clip each agent's gradient by its global norm, then Adam with per-agent LRs.

        torch's fused Adam kernel (one pass for the moments and the step) runs with lr = 1
        into a zeroed buffer, which then holds ``-m_hat / (sqrt(v_hat) + eps)``; scaling it by
        each agent's LR is the per-agent step. Same formula as torch.optim.Adam.
        """
        p = self.size
        g = torch.cat([x.reshape(p, -1) for x in grads], 1)
        norm = torch.linalg.vector_norm(g, dim=1, keepdim=True)
        g.mul_((self.base_config.max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
        self.adam_steps += 1
        self._adam_step_count += 1  # the kernel reads the step count after the increment
        self._adam_delta.zero_()
        torch._fused_adam_(
            [self._adam_delta],
            [g],
            [self._exp_avg],
            [self._exp_avg_sq],
            [],
            [self._adam_step_count],
            lr=1.0,
            beta1=_ADAM_BETAS[0],
            beta2=_ADAM_BETAS[1],
            weight_decay=0.0,
            eps=_ADAM_EPS,
            amsgrad=False,
            maximize=False,
        )
        self.flat.addcmul_(lr.unsqueeze(1), self._adam_delta)

    # -- scoring and hand-over to the pod runtime ----------------------------------------------
    @torch.no_grad()
    def evaluate(self, seed: int = 10_000, max_steps: int | None = None) -> list[EvalResult]:
        """Score every agent deterministically on its slice of ``eval_env`` (as ``Evaluator``:
        one episode per sub-environment, same start states for every agent)."""
        env = self.eval_env
        if env is None:
            raise ValueError("this population has no eval_env")
        p = self.size
        per_agent = env.num_envs // p
        obs, _ = env.reset(seed=seed)
        returns = torch.zeros(env.num_envs, device=env.device)
        finished = torch.zeros(env.num_envs, dtype=torch.bool, device=env.device)
        steps = 0
        limit = max_steps or env.max_episode_steps or 10_000
        for t in range(limit):
            action = self._deterministic(obs.view(p, per_agent, *obs.shape[1:]))
            obs, _, term, trunc, info = env.step(action.reshape(env.num_envs, *action.shape[2:]))
            steps += per_agent
            done = (term | trunc) & ~finished
            returns = torch.where(done, info["episode_return"].float(), returns)
            finished |= done
            if t % 32 == 31 and bool(finished.all()):
                break
        results = []
        for i in range(p):
            mine = slice(i * per_agent, (i + 1) * per_agent)
            episodes = returns[mine][finished[mine]].tolist()
            if not episodes:
                raise RuntimeError(f"agent {i}: no evaluation episode finished in {limit} steps")
            mean = sum(episodes) / len(episodes)
            std = math.sqrt(sum((r - mean) ** 2 for r in episodes) / len(episodes))
            results.append(EvalResult(mean=mean, std=std, episodes=episodes, env_steps=steps))
        return results

    @property
    def hyperparameters(self) -> list[dict[str, float]]:
        return [{k: float(getattr(c, k)) for k in HYPERPARAMETERS} for c in self.configs]

    def config(self, i: int) -> PPOConfig:
        return self.configs[i]

    def agent(self, i: int) -> PPO:
        """Agent i as a standalone ``PPO`` module: weights, statistics and Adam state."""
        obs_space: gym.Space = self.env.single_observation_space
        agent = PPO(obs_space, self.env.single_action_space, self.configs[i]).to(self.device)
        state = {}
        for name, tensor in self.params.items():
            key = f"policy.{name}" if name.startswith("actor.") else name
            state[key] = tensor[i].detach().clone()
        for name, tensor in self.buffers.items():
            key = f"policy.{name}" if name.startswith("actor.") else name
            state[key] = tensor[i].clone()
        for key, stats in (("policy.obs_rms", self.obs_rms), ("return_rms", self.return_rms)):
            for field, tensor in zip(("mean", "var", "count"), stats, strict=True):
                state[f"{key}.{field}"] = tensor[i].clone()
        agent.load_state_dict(state)
        if self.adam_steps:
            named = dict(agent.named_parameters())
            offset = 0
            for name, shape in zip(self._names, self._shapes, strict=True):
                numel = math.prod(shape)
                param = named[f"policy.{name}" if name.startswith("actor.") else name]
                part = slice(offset, offset + numel)
                agent.optimizer.state[param] = {
                    "step": torch.tensor(float(self.adam_steps), device=self.device),
                    "exp_avg": self._exp_avg[i, part].reshape(shape).clone(),
                    "exp_avg_sq": self._exp_avg_sq[i, part].reshape(shape).clone(),
                }
                offset += numel
        return agent

    def learner(self, i: int) -> Learner:
        """A ``Learner`` of agent i, with its counters, for ``save_training_files``."""
        learner = Learner(self.agent(i), self.total_env_steps)
        learner.env_steps, learner.updates = self.env_steps, self.updates
        return learner

    @torch.no_grad()
    def set_agent(
        self, i: int, agent: PPO, hyperparameters: Mapping[str, float] | None = None
    ) -> None:
        """Put ``agent`` (e.g. a leaderboard parent, PBT's exploit) in slot i, with new
        hyperparameters on top of slot i's (explore). Its Adam moments come along; the step
        count stays the population's (the agents step in lock-step)."""
        if hyperparameters:
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
        state = agent.state_dict()
        named = dict(agent.named_parameters())
        offset = 0
        for name, shape in zip(self._names, self._shapes, strict=True):
            key = f"policy.{name}" if name.startswith("actor.") else name
            numel = math.prod(shape)
            self.params[name][i] = state[key]
            moments = agent.optimizer.state.get(named[key], {})
            part = slice(offset, offset + numel)
            for mine, theirs in ((self._exp_avg, "exp_avg"), (self._exp_avg_sq, "exp_avg_sq")):
                mine[i, part] = moments[theirs].reshape(-1) if theirs in moments else 0.0
            offset += numel
        for key, stats in (("policy.obs_rms", self.obs_rms), ("return_rms", self.return_rms)):
            for k, field in enumerate(("mean", "var", "count")):
                stats[k][i] = state[f"{key}.{field}"]


def build_population(
    env_name: str,
    config: PPOConfig,
    hyperparameters: Sequence[Mapping[str, float]],
    seed: int = 0,
    total_env_steps: int = 1,
    eval_episodes: int = 10,
    device: str = "cpu",
    env_kwargs: Mapping[str, object] | None = None,
) -> PopulationPPO:
    """A population on ``env_name``: one batched env of ``P * config.num_envs`` for training
    and one of ``P * eval_episodes`` for scoring; agent i is seeded ``seed + i``."""
    p = len(hyperparameters)
    kwargs = dict(env_kwargs or {})
    env = make_env(env_name, p * config.num_envs, device=device, seed=seed, **kwargs)
    eval_env = make_env(env_name, p * eval_episodes, device=device, seed=seed + 10_000, **kwargs)
    return PopulationPPO(
        env,
        config,
        hyperparameters,
        [seed + i for i in range(p)],
        total_env_steps=total_env_steps,
        eval_env=eval_env,
    )
