"""Temporally correlated exploration noise for the continuous off-policy agents.

Each sub-environment draws its own sequence ε_1, ε_2, … of unit-variance noise; DDPG and TD3
act μ(s) + σ ε_t, SAC tanh(μ(s) + σ(s) ε_t). What differs is how ε_t relates to ε_{t−1}:

* ``white``: independent draws (the textbook agents). On a task whose reward needs a long,
  consistent push (MountainCarContinuous: rock back and forth for ~100 steps to reach the
  flag) independent noise averages out; the car jitters at the bottom, and the −0.1 a² action
  cost teaches "do nothing".
* ``ou``: an Ornstein–Uhlenbeck process sampled at unit variance, ε_t = ρ ε_{t−1} +
  √(1 − ρ²) z_t (ρ: ``noise_correlation``); DDPG's original noise, and rl-baselines3-zoo's
  for TD3 on MountainCarContinuous.
* ``pink``: 1/f noise (Eberhard et al., "Pink Noise Is All You Need", ICLR 2023): power
  falls as 1/frequency, between white (flat) and red/Brownian (1/f²), so it holds a direction
  for long stretches yet still covers the whole action range in one episode. A sequence of
  ``noise_horizon`` steps is drawn per env at once (by inverse FFT) and read step by step.

Every sequence restarts when its episode ends (``reset``), so one episode's push does not
leak into the next; and the state is exploration only: a loaded agent starts fresh sequences.
"""

from __future__ import annotations

import math

import torch

from services.contracts.algorithms.offpolicy import ContinuousAgentConfig, NoiseKind


def colored_noise(
    n: int, length: int, beta: float, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """``n`` sequences of ``length`` Gaussian samples with power spectrum ∝ 1/f^β, each of
    unit variance (in expectation): white noise shaped in the frequency domain."""
    freqs = torch.fft.rfftfreq(length, device=device)
    freqs[0] = 1.0 / length  # the lowest frequency one sequence resolves, not infinity
    scale = freqs.pow(-beta / 2.0)
    re = torch.randn((n, len(freqs)), generator=generator, device=device) * scale
    im = torch.randn((n, len(freqs)), generator=generator, device=device) * scale
    im[:, 0] = 0.0  # the DC and (even length) Nyquist terms of a real signal are real
    weights = torch.full_like(scale, 4.0)  # x_t's variance: each pair of terms counts twice
    weights[0] = 1.0
    if length % 2 == 0:
        im[:, -1] = 0.0
        weights[-1] = 1.0
    sigma = (weights * scale.square()).sum().sqrt() / length
    return torch.fft.irfft(torch.complex(re, im), n=length) / sigma


class ActionNoise:
    """Per-env exploration noise ε_t of shape (num_envs, *action_shape) (module docstring)."""

    def __init__(
        self,
        kind: NoiseKind,
        action_shape: tuple[int, ...],
        correlation: float = 0.0,
        horizon: int = 1000,
        beta: float = 1.0,
    ) -> None:
        self.kind, self.action_shape = kind, action_shape
        self.correlation, self.horizon, self.beta = correlation, horizon, beta
        self._state: torch.Tensor | None = None  # ou: ε_{t−1}; pink: (n, horizon, dims)
        self._t: torch.Tensor | None = None  # pink: each env's position in its sequence
        self._fresh: torch.Tensor | None = None  # envs whose episode just began

    @classmethod
    def of(cls, config: ContinuousAgentConfig, action_shape: tuple[int, ...]) -> ActionNoise:
        """The noise a continuous agent's config names."""
        return cls(
            config.action_noise, action_shape, config.noise_correlation, config.noise_horizon
        )

    def reset(self, done: torch.Tensor) -> None:
        """The episodes of the envs where ``done`` ended: their sequences start over."""
        self._fresh = done.clone() if self._fresh is None else self._fresh | done

    def sample(self, n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        shape = (n, *self.action_shape)
        if self.kind == "white":
            return torch.randn(shape, generator=generator, device=device)
        fresh = self._fresh
        if self._state is None or fresh is None or len(fresh) != n:
            fresh = torch.ones(n, dtype=torch.bool, device=device)
        self._fresh = torch.zeros_like(fresh)
        if self.kind == "ou":
            return self._ou(shape, fresh, generator, device)
        return self._pink(shape, fresh, generator, device)

    def _ou(self, shape, fresh, generator, device) -> torch.Tensor:
        z = torch.randn(shape, generator=generator, device=device)
        if self._state is None or self._state.shape != shape:
            self._state = z
            return z.clone()
        rho = self.correlation
        step = self._state.mul(rho).add_(z, alpha=math.sqrt(1.0 - rho * rho))
        # A new episode starts from the stationary distribution, not from the last push.
        self._state = torch.where(fresh.view(-1, *[1] * (len(shape) - 1)), z, step)
        return self._state.clone()

    def _pink(self, shape, fresh, generator, device) -> torch.Tensor:
        n, dims = shape[0], math.prod(shape[1:])
        if self._state is None or self._state.shape[0] != n:
            self._state = torch.empty((n, self.horizon, dims), device=device)
            self._t = torch.zeros(n, dtype=torch.long, device=device)
        assert self._t is not None
        redraw = fresh | (self._t >= self.horizon)
        if redraw.any():
            rows = redraw.nonzero().squeeze(-1)
            sequences = colored_noise(len(rows) * dims, self.horizon, self.beta, generator, device)
            self._state[rows] = sequences.view(len(rows), dims, self.horizon).transpose(1, 2)
            self._t[rows] = 0
        out = self._state[torch.arange(n, device=device), self._t]
        self._t += 1
        return out.view(shape)
