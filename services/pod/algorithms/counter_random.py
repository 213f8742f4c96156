"""Counter-based random numbers in plain tensor ops: a draw is a 32-bit integer hash of a seed,
a counter, a stream id and the element's index.

What the compiled loops draw from (PPO's rollout, services/pod/roles/worker.py; the off-policy
K-step update, services/pod/algorithms/stacked.py): no ``torch.Generator`` enters
the program, so dynamo has no generator state to refuse and a CUDA graph none to freeze;
compiled and eager code give the same numbers on any device; and a draw is reproducible from
the tensors it is a function of. The counter is a tensor the loop increments; the stream id
keeps the draws of different uses apart.
"""

from __future__ import annotations

import math

import torch

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds, Wellons' "lowbias32") on int64 tensors
    holding values below 2**32. Both multipliers are below 2**31, so no product leaves int64:
    no signed overflow, whose wrapping eager and compiled (C++, Triton) code would not agree on."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniform_bits(
    seed: torch.Tensor,
    counter: torch.Tensor,
    stream: int,
    shape: tuple[int, ...],
    offset: torch.Tensor | int = 0,
) -> torch.Tensor:
    """int64 hash values in [0, 2**32) of (seed, counter, stream, index), shaped
    ``(*seed.shape, *shape)``: one independent draw per seed (an agent's, say) and element.
    ``offset``: the first element's index, so a slice of a larger draw is drawn on its own
    (a tensor: one program serves every slice)."""
    key = mix32(seed & _M32)
    key = mix32((key + mix32((counter & _M32) ^ (stream * 0x2545F491))) & _M32).reshape(-1, 1)
    index = torch.arange(math.prod(shape), device=seed.device, dtype=torch.int64) + offset
    bits = mix32((key + index) & _M32)
    return mix32(bits ^ key).view(*seed.shape, *shape)


def uniform(
    seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """float32 uniforms in (0, 1), never 0 or 1 (Gumbel noise and Box-Muller take logs), shaped
    as ``uniform_bits``; 24 bits each, exact in float32."""
    return to_uniform(uniform_bits(seed, counter, stream, shape))


def to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """``uniform_bits``' values as ``uniform``'s float32 uniforms (part of one draw, say)."""
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def normal(
    seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """Standard normals (Box-Muller) from ``uniform``'s streams 2 * stream and 2 * stream + 1."""
    return box_muller(
        uniform(seed, counter, 2 * stream, shape), uniform(seed, counter, 2 * stream + 1, shape)
    )


def box_muller(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """Standard normals from two uniforms in (0, 1) each."""
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)
