"""Policy and value networks shared by the algorithms.

Distributions are written out by hand instead of through ``torch.distributions``: at the small
batch sizes of a rollout step the distribution objects' argument checking and broadcasting cost
more than the math, and the pod spends most of its time in exactly these calls.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from services.contracts.algorithms.ppo.config import Activation
from services.pod.algorithms.normalization import RunningMeanStd

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def mlp(
    in_dim: int,
    hidden: list[int],
    out_dim: int,
    activation: Activation = "tanh",
    out_gain: float = 1.0,
) -> nn.Sequential:
    """An MLP with orthogonal init (gain sqrt(2) inside, ``out_gain`` on the last layer).

    Orthogonal init with a small policy-head gain is one of the PPO details that matter
    (Engstrom et al. 2020; Huang et al. 2022): the initial policy stays near uniform.
    """
    layers: list[nn.Module] = []
    last = in_dim
    for width in hidden:
        linear = nn.Linear(last, width)
        nn.init.orthogonal_(linear.weight, math.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers += [linear, ACTIVATIONS[activation]()]
        last = width
    head = nn.Linear(last, out_dim)
    nn.init.orthogonal_(head.weight, out_gain)
    nn.init.zeros_(head.bias)
    layers.append(head)
    return nn.Sequential(*layers)


class CategoricalActor(nn.Module):
    """Discrete actions: logits from an MLP."""

    def __init__(self, obs_dim: int, n: int, hidden: list[int], activation: Activation = "tanh"):
        super().__init__()
        self.net = mlp(obs_dim, hidden, n, activation, out_gain=0.01)

    def draw_noise(self, n: int, generator: torch.Generator | None, device: torch.device):
        """The randomness of ``sample`` for ``n`` observations, drawn apart from it: a compiled
        rollout step (services/pod/algorithms/compiled.py) cannot take a generator."""
        return torch.rand((n, self.net[-1].out_features), generator=generator, device=device)

    def sample(
        self,
        obs: torch.Tensor,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ):
        """Return (action, log-prob) of a sampled action (Gumbel-max trick); ``noise``:
        ``draw_noise``'s uniforms, else drawn here from ``generator``."""
        logp_all = torch.log_softmax(self.net(obs), dim=-1)
        u = noise
        if u is None:
            u = torch.rand(logp_all.shape, generator=generator, device=obs.device)
        action = torch.argmax(logp_all - torch.log(-torch.log(u.clamp_min(1e-20))), dim=-1)
        return action, logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)

    def log_prob_entropy(self, obs: torch.Tensor, action: torch.Tensor):
        logp_all = torch.log_softmax(self.net(obs), dim=-1)
        logp = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.argmax(self.net(obs), dim=-1)

    def to_env(self, action: torch.Tensor) -> torch.Tensor:
        return action


class GaussianActor(nn.Module):
    """Continuous actions: a diagonal Gaussian with a state-independent log-std.

    The sample ``u`` is what gets stored and scored; the env receives ``to_env(u)``: either
    ``u`` clipped to the action bounds (the log-prob stays that of the unclipped sample, as in
    SB3/CleanRL), or, with ``squash``, ``tanh(u)`` rescaled to the bounds. Storing the pre-tanh
    ``u`` avoids atanh of values at the bounds; the tanh Jacobian term is the same in both terms
    of the PPO ratio, so it is left out of the log-prob.
    """

    def __init__(
        self,
        obs_dim: int,
        space: gym.spaces.Box,
        hidden: list[int],
        activation: Activation = "tanh",
        log_std_init: float = 0.0,
        squash: bool = False,
    ):
        super().__init__()
        act_dim = int(np.prod(space.shape))
        self.net = mlp(obs_dim, hidden, act_dim, activation, out_gain=0.01)
        self.log_std = nn.Parameter(torch.full((act_dim,), float(log_std_init)))
        self.squash = squash
        self.register_buffer("low", torch.as_tensor(space.low, dtype=torch.float32))
        self.register_buffer("high", torch.as_tensor(space.high, dtype=torch.float32))

    def draw_noise(self, n: int, generator: torch.Generator | None, device: torch.device):
        """The randomness of ``sample`` for ``n`` observations (see ``CategoricalActor``)."""
        return torch.randn((n, self.net[-1].out_features), generator=generator, device=device)

    def sample(
        self,
        obs: torch.Tensor,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ):
        mean = self.net(obs)
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=obs.device)
        u = mean + noise * self.log_std.exp()
        logp = (-0.5 * noise.square() - self.log_std - _LOG_SQRT_2PI).sum(-1)
        return u, logp

    def log_prob_entropy(self, obs: torch.Tensor, u: torch.Tensor):
        mean = self.net(obs)
        z = (u - mean) * torch.exp(-self.log_std)
        logp = (-0.5 * z.square() - self.log_std - _LOG_SQRT_2PI).sum(-1)
        entropy = (0.5 + _LOG_SQRT_2PI + self.log_std).sum(-1).expand(logp.shape)
        return logp, entropy

    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.to_env(self.net(obs))

    def to_env(self, u: torch.Tensor) -> torch.Tensor:
        if self.squash:
            return self.low + (torch.tanh(u) + 1.0) * 0.5 * (self.high - self.low)
        return torch.maximum(torch.minimum(u, self.high), self.low)


class SDEActor(GaussianActor):
    """Gaussian actor with generalised state-dependent exploration (gSDE, Raffin et al. 2021).

    The noise is ``ε = φ(s)ᵀ W`` with ``φ`` the actor's last hidden features and ``W`` a
    (features × actions) matrix per sub-environment, drawn from N(0, σ²) and redrawn only every
    ``noise_period`` steps. Exploration is then smooth in time and in state, which is what
    swing-up tasks (Pendulum, MountainCar) need: independent per-step noise averages out before
    it can pump energy into the system. The action is Gaussian with variance ``φ(s)² · σ²``
    (features detached, as in SB3), so PPO's ratio needs no change.
    """

    def __init__(self, *args, noise_period: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        latent, act_dim = self.net[-1].in_features, self.net[-1].out_features
        with torch.no_grad():  # one σ per (feature, action) pair, same initial value
            self.log_std = nn.Parameter(self.log_std.detach()[0].expand(latent, act_dim).clone())
        self.noise_period = noise_period
        self.noise: torch.Tensor | None = None

    def resample_noise(self, n: int, generator: torch.Generator | None = None) -> None:
        std = self.log_std.detach().exp()
        eps = torch.randn((n, *std.shape), generator=generator, device=std.device)
        self.noise = eps * std

    def _latent_mean_var(self, obs: torch.Tensor):
        latent = self.net[:-1](obs)
        mean = self.net[-1](latent)
        var = latent.detach().square() @ self.log_std.exp().square() + 1e-6
        return latent.detach(), mean, var

    def draw_noise(self, n: int, generator: torch.Generator | None, device: torch.device):
        """Nothing per step: gSDE's noise is ``self.noise``, redrawn every ``noise_period``."""
        return torch.empty((n, 0), device=device)

    def sample(
        self,
        obs: torch.Tensor,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ):
        latent, mean, var = self._latent_mean_var(obs)
        if self.noise is None or self.noise.shape[0] != obs.shape[0]:
            self.resample_noise(obs.shape[0], generator)
        eps = torch.einsum("bl,bla->ba", latent, self.noise)
        logp = (-0.5 * eps.square() / var - 0.5 * var.log() - _LOG_SQRT_2PI).sum(-1)
        return mean + eps, logp

    def log_prob_entropy(self, obs: torch.Tensor, u: torch.Tensor):
        _, mean, var = self._latent_mean_var(obs)
        logp = (-0.5 * (u - mean).square() / var - 0.5 * var.log() - _LOG_SQRT_2PI).sum(-1)
        entropy = (0.5 + _LOG_SQRT_2PI + 0.5 * var.log()).sum(-1)
        return logp, entropy


Actor = CategoricalActor | GaussianActor


def build_actor(
    obs_space: gym.spaces.Box,
    action_space: gym.Space,
    hidden: list[int],
    activation: Activation = "tanh",
    log_std_init: float = 0.0,
    squash: bool = False,
    sde_period: int = 0,
) -> Actor:
    """The actor for an action space; ``sde_period > 0`` selects gSDE exploration."""
    obs_dim = int(np.prod(obs_space.shape))
    if isinstance(action_space, gym.spaces.Discrete):
        return CategoricalActor(obs_dim, int(action_space.n), hidden, activation)
    if isinstance(action_space, gym.spaces.Box):
        args = (obs_dim, action_space, hidden, activation, log_std_init, squash)
        if sde_period > 0:
            return SDEActor(*args, noise_period=sde_period)
        return GaussianActor(*args)
    raise ValueError(f"unsupported action space {action_space!r} (Discrete and Box are)")


def build_critic(obs_space: gym.spaces.Box, hidden: list[int], activation: Activation = "tanh"):
    return mlp(int(np.prod(obs_space.shape)), hidden, 1, activation, out_gain=1.0)


class Policy(nn.Module):
    """What a worker or an evaluator needs to act: the actor and its input normalisation.

    The learner owns the same object (fused) or sends ``state_dict()`` of it (separate
    processes); nothing else is needed to run a trained agent.
    """

    def __init__(self, actor: Actor, obs_shape: tuple[int, ...], normalize_obs: bool = True):
        super().__init__()
        self.actor = actor
        self.normalize_obs = normalize_obs
        self.obs_rms = RunningMeanStd(obs_shape)

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        return self.obs_rms.normalize(obs) if self.normalize_obs else obs

    @torch.no_grad()
    def act_deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """Env action of the deterministic policy (mode of the distribution)."""
        return self.actor.deterministic(self.normalize(obs))
