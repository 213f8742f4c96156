"""Policy and value networks, and the policies' distributions, written once for P agents.

The networks are ``nn.Module``s where they are made (orthogonal init) and named (the state
dict of a training file): ``mlp``, the actors, ``build_critic``. What they compute is written
here once as functions of a ``PolicySpec`` (what fixes the computation: a constant of every
compiled program) and the agents' weights as views of a flat (P, n) tensor
(services/pod/algorithms/flat.py), each layer one batched matmul for all P agents; one agent is
P = 1. Every user runs these: the training loops (eager, compiled, captured), the evaluation,
a worker in another process, the backtest, ``podium export``'s policy (``Policy``, whose
methods call them on the module's own weights as a stack of one).

Distributions are written out by hand, not through ``torch.distributions``: at the small batch
sizes of a rollout step their checks and broadcasting cost more than the maths.

* ``categorical``: discrete actions, logits from the MLP; sampled by the Gumbel-max trick on
  given uniforms.
* ``gaussian``: continuous actions, a diagonal Gaussian with a state-independent log-std. The
  sample ``u`` is what is stored and scored; the env receives ``to_env(u)``: ``u`` clipped to
  the action bounds (the log-prob that of the unclipped sample, as in SB3/CleanRL) or, with
  ``squash``, ``tanh(u)`` rescaled to them (the tanh Jacobian is the same in both terms of
  PPO's ratio, so it is left out).
* ``sde``: generalised state-dependent exploration (gSDE, Raffin et al. 2021): the noise is
  ``ε = φ(s)ᵀ W`` with ``φ`` the actor's last hidden features and ``W`` a (features × actions)
  matrix per sub-environment drawn from N(0, σ²) and redrawn only every ``sde_period`` steps,
  so exploration is smooth in time and in state (what swing-up tasks need); the action is
  Gaussian with variance ``φ(s)² · σ²`` (features detached, as in SB3).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.contracts.algorithms.ppo.config import Activation
from services.pod.algorithms.normalization import RunningMeanStd

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
Params = Mapping[str, torch.Tensor]
#: The most rows (of all P agents) ``mlp_forward`` computes without the matmul library, compiled.
FUSED_ROWS = 4


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


def linear_layers(prefix: str, net: nn.Sequential) -> tuple[str, ...]:
    """The names (``prefix.k``) of ``net``'s Linear layers, which must alternate with
    activations as ``mlp`` builds them."""
    names = []
    for k, module in enumerate(net):
        expected = nn.Linear if k % 2 == 0 else nn.Module
        if not isinstance(module, expected) or (k % 2 and isinstance(module, nn.Linear)):
            raise ValueError(f"expected an MLP of Linear and activation layers; {prefix}: {net}")
        if k % 2 == 0:
            names.append(f"{prefix}.{k}")
    return tuple(names)


def activate(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "tanh":
        if x.device.type == "cpu" and torch.compiler.is_compiling():
            # tanh through the sigmoid: inductor's CPU tanh kernel is several times slower
            # than its sigmoid (docs/benchmarks.md); the values agree to 2e-7.
            return 2.0 * torch.sigmoid(2.0 * x) - 1.0
        return torch.tanh(x)
    return torch.relu(x) if name == "relu" else F.elu(x)


def mlp_forward(
    params: Params, layers: Sequence[str], activation: str, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """P MLPs on ``x`` (P, B, in), one batched matmul per layer: the output (P, B, out) and
    the last hidden features (the input of the last layer)."""
    hidden = x
    # Compiled on a CPU, a layer of a few rows in all (one agent's step of a few sub-envs) is
    # cheaper as a fused multiply-sum than as a call of the matmul library (docs/benchmarks.md).
    fused = x.shape[:2].numel() <= FUSED_ROWS and x.is_cpu and torch.compiler.is_compiling()
    for i, name in enumerate(layers):
        w, b = params[f"{name}.weight"], params[f"{name}.bias"]
        if fused:
            out = (hidden.unsqueeze(2) * w.unsqueeze(1)).sum(-1) + b.unsqueeze(1)
        else:
            out = torch.baddbmm(b.unsqueeze(1), hidden, w.transpose(1, 2))
        if i == len(layers) - 1:
            return out, hidden
        hidden = activate(activation, out)
    raise ValueError("an MLP has at least one layer")


# -- what fixes a policy's computation --------------------------------------------------------
Kind = Literal["categorical", "gaussian", "sde"]


@dataclass(frozen=True)
class PolicySpec:
    """A policy and its critic as computations (hashable: a compiled program's constant)."""

    kind: Kind
    actor_layers: tuple[str, ...]
    critic_layers: tuple[str, ...]
    activation: str
    #: Discrete actions: their count; continuous: the action's dimension.
    actions: int
    #: Continuous: the action bounds, per dimension.
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()
    squash: bool = False
    sde_period: int = 0
    #: gSDE's feature count (the last hidden layer's width).
    latent_features: int = 0

    @property
    def discrete(self) -> bool:
        return self.kind == "categorical"

    @property
    def action_shape(self) -> tuple[int, ...]:
        return () if self.discrete else (self.actions,)


def to_env(spec: PolicySpec, action: torch.Tensor) -> torch.Tensor:
    """What the env receives for a sampled action: discrete as it is, continuous clipped to
    the bounds or squashed into them."""
    if spec.discrete:
        return action
    if len(set(spec.low)) == 1 and len(set(spec.high)) == 1:
        low: float | torch.Tensor = spec.low[0]
        high: float | torch.Tensor = spec.high[0]
    else:  # a constant of a compiled program
        low = torch.tensor(spec.low, dtype=action.dtype, device=action.device)
        high = torch.tensor(spec.high, dtype=action.dtype, device=action.device)
    if spec.squash:
        return low + (torch.tanh(action) + 1.0) * 0.5 * (high - low)
    if isinstance(low, float):
        return action.clamp(low, high)  # type: ignore[arg-type]
    return torch.maximum(torch.minimum(action, high), low)


def _actor(spec: PolicySpec, params: Params, obs: torch.Tensor):
    out, latent = mlp_forward(params, spec.actor_layers, spec.activation, obs)
    return out, latent


def _sde_var(params: Params, latent: torch.Tensor) -> torch.Tensor:
    """gSDE's action variance φ(s)² · σ² (+1e-6), (P, B, A), the features detached."""
    std = params["actor.log_std"].exp()  # (P, L, A)
    return torch.bmm(latent.detach().square(), std.square()) + 1e-6


def sample(
    spec: PolicySpec,
    params: Params,
    obs: torch.Tensor,
    noise: torch.Tensor,
    sde_noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(action, log-prob) of every agent's sampled action for ``obs`` (P, B, D).
    ``noise`` (P, B, A): uniforms (categorical: Gumbel-max) or standard normals (gaussian);
    ``sde_noise`` (P, B, L, A): gSDE's current noise matrices."""
    out, latent = _actor(spec, params, obs)
    if spec.kind == "categorical":
        logp_all = torch.log_softmax(out, -1)
        gumbel = -torch.log(-torch.log(noise.clamp_min(1e-20)))
        action = torch.argmax(logp_all + gumbel, -1)
        return action, logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    if spec.kind == "gaussian":
        log_std = params["actor.log_std"].unsqueeze(1)  # (P, 1, A)
        action = out + noise * log_std.exp()
        logp = (-0.5 * noise.square() - log_std - LOG_SQRT_2PI).sum(-1)
        return action, logp
    assert sde_noise is not None
    eps = torch.einsum("pbl,pbla->pba", latent.detach(), sde_noise)
    var = _sde_var(params, latent)
    logp = (-0.5 * eps.square() / var - 0.5 * var.log() - LOG_SQRT_2PI).sum(-1)
    return out + eps, logp


def sde_noise(spec: PolicySpec, params: Params, normal: torch.Tensor) -> torch.Tensor:
    """gSDE's noise matrices from standard normals (P, N, L, A): N(0, σ²) per entry."""
    return normal * params["actor.log_std"].detach().exp().unsqueeze(1)


def log_prob_entropy(
    spec: PolicySpec, params: Params, obs: torch.Tensor, action: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability and entropy of ``action`` (P, B[, A]) under every agent's policy."""
    out, latent = _actor(spec, params, obs)
    if spec.kind == "categorical":
        logp_all = torch.log_softmax(out, -1)
        logp = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        return logp, -(logp_all.exp() * logp_all).sum(-1)
    if spec.kind == "gaussian":
        log_std = params["actor.log_std"].unsqueeze(1)
        z = (action - out) * torch.exp(-log_std)
        logp = (-0.5 * z.square() - log_std - LOG_SQRT_2PI).sum(-1)
        entropy = (0.5 + LOG_SQRT_2PI + log_std).sum(-1).expand(logp.shape)
        return logp, entropy
    var = _sde_var(params, latent)
    logp = (-0.5 * (action - out).square() / var - 0.5 * var.log() - LOG_SQRT_2PI).sum(-1)
    return logp, (0.5 + LOG_SQRT_2PI + 0.5 * var.log()).sum(-1)


def mode(spec: PolicySpec, params: Params, obs: torch.Tensor) -> torch.Tensor:
    """Every agent's deterministic env action (the distribution's mode) for ``obs``."""
    out, _ = _actor(spec, params, obs)
    return torch.argmax(out, -1) if spec.discrete else to_env(spec, out)


def value(spec: PolicySpec, params: Params, obs: torch.Tensor) -> torch.Tensor:
    """Every agent's critic on ``obs`` (P, B, D): (P, B)."""
    out, _ = mlp_forward(params, spec.critic_layers, spec.activation, obs)
    return out.squeeze(-1)


# -- the modules: where the weights are made and named ----------------------------------------
class _Acting(nn.Module):
    """An actor module acts with the functions above on its own weights (a stack of one)."""

    net: nn.Sequential

    def spec(self) -> PolicySpec:
        return policy_spec(self, None)  # type: ignore[arg-type]

    @torch.no_grad()
    def deterministic(self, obs: torch.Tensor) -> torch.Tensor:
        """The env action of the distribution's mode for observations (B, D)."""
        return mode(self.spec(), module_params(self, "actor."), obs.unsqueeze(0))[0]


class CategoricalActor(_Acting):
    """Discrete actions: logits from an MLP."""

    def __init__(self, obs_dim: int, n: int, hidden: list[int], activation: Activation = "tanh"):
        super().__init__()
        self.activation = activation
        self.net = mlp(obs_dim, hidden, n, activation, out_gain=0.01)


class GaussianActor(_Acting):
    """Continuous actions: the mean from an MLP, a state-independent log-std (module
    docstring), the env's bounds."""

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
        self.activation = activation
        act_dim = int(np.prod(space.shape))
        self.net = mlp(obs_dim, hidden, act_dim, activation, out_gain=0.01)
        self.log_std = nn.Parameter(torch.full((act_dim,), float(log_std_init)))
        self.squash = squash
        self.register_buffer("low", torch.as_tensor(space.low, dtype=torch.float32))
        self.register_buffer("high", torch.as_tensor(space.high, dtype=torch.float32))


class SDEActor(GaussianActor):
    """gSDE's actor: one σ per (feature, action) pair (module docstring)."""

    def __init__(self, *args, noise_period: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        latent, act_dim = self.net[-1].in_features, self.net[-1].out_features
        with torch.no_grad():  # one σ per (feature, action) pair, same initial value
            self.log_std = nn.Parameter(self.log_std.detach()[0].expand(latent, act_dim).clone())
        self.noise_period = noise_period


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
        return SDEActor(*args, noise_period=sde_period) if sde_period > 0 else GaussianActor(*args)
    raise ValueError(f"unsupported action space {action_space!r} (Discrete and Box are)")


def build_critic(obs_space: gym.spaces.Box, hidden: list[int], activation: Activation = "tanh"):
    return mlp(int(np.prod(obs_space.shape)), hidden, 1, activation, out_gain=1.0)


def policy_spec(actor: Actor, critic: nn.Sequential | None) -> PolicySpec:
    """The computation of ``actor`` and ``critic`` (named ``actor.*`` and ``critic.*``; no
    critic: an actor to act with)."""
    critic_layers = linear_layers("critic", critic) if critic is not None else ()
    actor_layers = linear_layers("actor.net", actor.net)
    activation = actor.activation
    if isinstance(actor, CategoricalActor):
        n = actor.net[-1].out_features
        return PolicySpec("categorical", actor_layers, critic_layers, activation, n)
    low = tuple(float(v) for v in actor.low.flatten())
    high = tuple(float(v) for v in actor.high.flatten())
    kind: Kind = "sde" if isinstance(actor, SDEActor) else "gaussian"
    sde = isinstance(actor, SDEActor)
    period = actor.noise_period if sde else 0
    latent = actor.net[-1].in_features if sde else 0
    dim = actor.net[-1].out_features
    return PolicySpec(
        kind, actor_layers, critic_layers, activation, dim, low, high, actor.squash, period,
        latent,
    )  # fmt: skip


def module_params(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """``module``'s parameters as a stack of one: name (with ``prefix``) → (1, *shape)."""
    return {f"{prefix}{n}": p.unsqueeze(0) for n, p in module.named_parameters()}


class Policy(nn.Module):
    """What a worker or an evaluator needs to act: the actor and its input normalisation.

    The learner owns the same object or sends ``state_dict()`` of it (separate processes);
    nothing else is needed to run a trained agent.
    """

    def __init__(self, actor: nn.Module, obs_shape: tuple[int, ...], normalize_obs: bool = True):
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
