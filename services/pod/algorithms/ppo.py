"""Proximal Policy Optimization (Schulman et al. 2017) with GAE, as the learner runs it.

The update reads like the algorithm: compute values, bootstrap truncated episodes from their
final observation, GAE(γ, λ), then a few epochs of clipped-surrogate minibatch steps with an
entropy bonus and a value loss, gradients clipped by global norm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import gymnasium as gym
import torch
from torch import nn

from services.contracts.algorithms.ppo.config import PPOConfig
from services.pod.algorithms.batched_adam import adam_state_dict
from services.pod.algorithms.compiled import Compiled
from services.pod.algorithms.normalization import RunningMeanStd
from services.pod.algorithms.policies import Actor, Policy, build_actor, build_critic
from services.pod.algorithms.rollout import Rollout


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    next_value: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and λ-returns, all (T, N).

    ``dones[t]`` marks that the episode ended after step t (terminated or truncated); the
    caller has already added γ·V(final_obs) to the reward of truncated steps, so cutting the
    trace at every ``done`` is right for both kinds of ending.
    """
    not_done = (~dones).to(values.dtype)
    advantages = torch.empty_like(values)
    last = torch.zeros_like(next_value)
    for t in range(values.shape[0] - 1, -1, -1):
        following = next_value if t == values.shape[0] - 1 else values[t + 1]
        delta = rewards[t] + gamma * following * not_done[t] - values[t]
        last = delta + gamma * lam * not_done[t] * last
        advantages[t] = last
    return advantages, advantages + values


#: The statistics ``ppo_objective`` returns, in order.
PPO_STATS = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac")
#: PPO's Adam (what every PPO update, one agent or a population, steps with).
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-5


def ppo_loss(
    actor: Actor,
    critic: nn.Module,
    obs: torch.Tensor,
    actions: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    clip_coef: float | torch.Tensor,
    ent_coef: float | torch.Tensor,
    vf_coef: float | torch.Tensor,
    norm_adv: bool,
    clip_vloss: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's loss on one minibatch (clipped surrogate, entropy bonus, value loss), and its
    statistics (pg_loss, v_loss, entropy, approx_kl, clipfrac) as one detached tensor.
    The coefficients are floats (eager) or 0-dim tensors (compiled, so that PBT's new values
    are inputs of the graph, not constants baked into it)."""
    logp, entropy = actor.log_prob_entropy(obs, actions)
    new_value = critic(obs).squeeze(-1)
    return ppo_objective(
        logp, entropy, new_value, old_logp, adv, returns, old_values,
        clip_coef, ent_coef, vf_coef, norm_adv, clip_vloss,
    )  # fmt: skip


def ppo_objective(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    new_value: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    clip_coef: float | torch.Tensor,
    ent_coef: float | torch.Tensor,
    vf_coef: float | torch.Tensor,
    norm_adv: bool,
    clip_vloss: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ppo_loss`` from the policy's log-probabilities and entropies and the critic's values
    of the minibatch: what every PPO update shares, whatever computes those (modules here,
    functional weights of a population in services/pod/training/anakin.py)."""
    log_ratio = logp - old_logp
    ratio = log_ratio.exp()
    if norm_adv:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    clipped_ratio = ratio.clamp(1 - clip_coef, 1 + clip_coef)
    pg_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean()
    if clip_vloss:
        v_clipped = old_values + (new_value - old_values).clamp(-clip_coef, clip_coef)
        v_loss = (
            0.5 * torch.max((new_value - returns).square(), (v_clipped - returns).square()).mean()
        )
    else:
        v_loss = 0.5 * (new_value - returns).square().mean()
    entropy_mean = entropy.mean()
    loss = pg_loss - ent_coef * entropy_mean + vf_coef * v_loss
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()
        clipfrac = ((ratio - 1).abs() > clip_coef).float().mean()
        stats = torch.stack((pg_loss, v_loss, entropy_mean, approx_kl, clipfrac))
    return loss, stats


_compiled_loss = Compiled(ppo_loss, "ppo_loss")


class PPO(nn.Module):
    """The PPO agent as the learner holds it: policy (actor + obs statistics) and critic."""

    name = "ppo"

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
        #: Compile the update's loss (services/pod/algorithms/compiled.py); the trainer decides.
        self.compiled = False
        self._optimizer: torch.optim.Adam | None = None
        #: Adam's state per parameter for an optimiser not built yet (``set_optimizer_state``).
        self._pending_state: list[Mapping[str, torch.Tensor]] = []

    @property
    def optimizer(self) -> torch.optim.Adam:
        """Built on first use: an agent read for its weights alone (a population's initial
        agents, a backtest) never needs one, and a process's first optimiser imports
        torch._dynamo (~1 CPU s: docs/benchmarks.md, "Session 13")."""
        if self._optimizer is None:
            # Fused Adam: one kernel for all parameters; with small networks the optimiser
            # step is per-tensor overhead, and this cuts the update's time by about a sixth
            # on CPU.
            self._optimizer = torch.optim.Adam(self.parameters(), **self._adam_settings())
            self._give_state(self._pending_state)
            self._pending_state = []
        return self._optimizer

    def _adam_settings(self) -> dict[str, object]:
        return {"lr": self.config.learning_rate, "eps": ADAM_EPS, "fused": True}

    def set_optimizer_state(self, state: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Adam's state of each parameter (step, exp_avg, exp_avg_sq), in ``parameters()``'
        order (empty: a fresh optimiser's): given to the optimiser now if it is built, else
        when it is."""
        state = list(state)
        if state and len(state) != self._n_params:
            raise ValueError(f"optimizer state: {len(state)} entries for this agent's parameters")
        if self._optimizer is None:
            self._pending_state = state
        else:
            self._give_state(state)

    @property
    def _n_params(self) -> int:
        return sum(1 for _ in self.parameters())

    def _give_state(self, state: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """``state`` (one entry per parameter, or none: fresh) as the built optimiser's."""
        optimizer = self._optimizer
        assert optimizer is not None
        optimizer.state.clear()
        for param, values in zip(self.parameters(), state, strict=False):
            optimizer.state[param] = dict(values)

    def optimizer_state_dict(self) -> dict:
        """``optimizer.state_dict()``, without building the optimiser where it is not built
        yet (``batched_adam.adam_state_dict``): saving an agent whose Adam state was only
        set does not import torch._dynamo."""
        if self._optimizer is not None:
            return self._optimizer.state_dict()
        return adam_state_dict(self._pending_state, self._n_params, **self._adam_settings())

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def update(
        self,
        rollout: Rollout,
        lr_fraction: float = 1.0,
        after_epoch: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """One PPO update on a rollout whose observations are already normalised.

        ``after_epoch`` runs at the end of every epoch: fused learners average there.
        """
        cfg = self.config
        if cfg.anneal_lr:
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.learning_rate * lr_fraction
        actor = self.policy.actor
        steps, envs = rollout.rewards.shape

        with torch.no_grad():
            rewards = rollout.rewards
            if cfg.norm_reward:
                self.return_rms.merge(*rollout.return_stats)
                rewards = rewards / torch.sqrt(self.return_rms.var + 1e-8).to(rewards.dtype)
            values = self.value(rollout.obs.reshape(steps * envs, -1)).view(steps, envs)
            next_value = self.value(rollout.next_obs)
            # A truncated episode did not end in the MDP: bootstrap it from its final state.
            truncated = rollout.truncated
            if bool(truncated.any()):
                idx = truncated.nonzero(as_tuple=True)
                rewards = rewards.clone()
                rewards[idx] += cfg.gamma * self.value(rollout.final_obs[idx])
            dones = rollout.terminated | truncated
            advantages, returns = gae(rewards, values, dones, next_value, cfg.gamma, cfg.gae_lambda)

        b_obs = rollout.obs.reshape(steps * envs, -1)
        b_actions = rollout.actions.reshape(steps * envs, *rollout.actions.shape[2:])
        b_logp = rollout.logprobs.reshape(-1)
        b_adv = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        batch = steps * envs
        n_mb = min(cfg.num_minibatches, batch)
        mb_size = batch // n_mb
        whole_batch = n_mb == 1
        if cfg.norm_adv and whole_batch:  # the same normalisation every epoch: do it once
            b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)
        data = (b_obs, b_actions, b_logp, b_adv, b_returns, b_values)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        # Statistics of the last epoch, summed as tensors and read once: a float() per
        # minibatch would cost more than the statistics themselves.
        sums = torch.zeros(5, device=b_obs.device)
        if self.compiled:
            # Tensors, not floats: a float is a constant of the graph, and PBT changing it
            # would recompile (services/pod/algorithms/compiled.py).
            values3 = (cfg.clip_coef, cfg.ent_coef, cfg.vf_coef)
            coefs: tuple = tuple(torch.tensor(values3, device=b_obs.device).unbind())
            loss_fn = functools.partial(_compiled_loss, type(actor), b_obs.device)
        else:
            coefs, loss_fn = (cfg.clip_coef, cfg.ent_coef, cfg.vf_coef), ppo_loss
        for epoch in range(cfg.update_epochs):
            if whole_batch:  # no shuffle, no gathers
                minibatches = [data]
            else:
                perm = torch.randperm(batch, device=b_obs.device)[: n_mb * mb_size]
                minibatches = [tuple(x[idx] for x in data) for idx in perm.view(n_mb, mb_size)]
            last_epoch = epoch == cfg.update_epochs - 1
            for minibatch in minibatches:
                loss, stats = loss_fn(
                    actor,
                    self.critic,
                    *minibatch,
                    *coefs,
                    norm_adv=cfg.norm_adv and not whole_batch,
                    clip_vloss=cfg.clip_vloss,
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(params, cfg.max_grad_norm, foreach=True)
                self.optimizer.step()

                if last_epoch:
                    sums += stats
            if after_epoch is not None:
                after_epoch()
            if not last_epoch and cfg.target_kl is not None and float(stats[3]) > cfg.target_kl:
                # Stopped early: report the statistics of the minibatch that crossed the line.
                sums = n_mb * stats
                break

        # Observation statistics move only after the update, so every sample of this rollout
        # was scored under the statistics it was collected with.
        if cfg.norm_obs:
            self.policy.obs_rms.merge(*rollout.obs_stats)
        names = PPO_STATS
        out = dict(zip(names, (sums / n_mb).tolist(), strict=True))
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        return out
