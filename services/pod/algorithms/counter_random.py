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
from collections.abc import Mapping, Sequence

import torch

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds, Wellons' "lowbias32") on int64 tensors
    holding values below 2**32. Both multipliers are below 2**31, so no product leaves int64:
    no signed overflow, whose wrapping eager and compiled (C++, Triton) code would not agree on."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def stream_bits(
    seed: torch.Tensor, counter: torch.Tensor, streams: Sequence[int], size: int,
    offset: torch.Tensor | int = 0,
) -> torch.Tensor:  # fmt: skip
    """int64 hash values in [0, 2**32) of (seed, counter, stream, index) for each of
    ``streams`` and index ``offset`` .. ``offset + size - 1``: (seed.numel(), len(streams),
    size), an independent draw per seed (an agent's, say) and element. Several streams are one
    pass of ops (eager code pays per op, not per element); ``offset`` draws a slice of a larger
    draw on its own (a tensor: one program serves every slice)."""
    # Salts filled on the device: no host tensor (an upload a step on a GPU), and no arange
    # times a constant, which inductor computes in 32-bit index arithmetic (it overflows).
    salt = torch.cat([seed.new_full((1,), s * 0x2545F491) for s in streams])
    key = mix32(seed & _M32).unsqueeze(-1)
    key = mix32((key + mix32((counter & _M32).unsqueeze(-1) ^ salt)) & _M32)
    key = key.reshape(-1, len(streams), 1)
    index = torch.arange(size, device=seed.device, dtype=torch.int64) + offset
    return mix32(mix32((key + index) & _M32) ^ key)


def draws(
    seed: torch.Tensor, counter: torch.Tensor, uniform: Mapping[int, tuple[int, ...]],
    normal: Mapping[int, tuple[int, ...]] | None = None,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:  # fmt: skip
    """``uniform``'s and ``normal``'s draws, ``{stream: shape}`` each, from one ``stream_bits``
    pass: the values of one call per stream (a normal of stream s: uniforms 2s and 2s + 1)."""
    shapes = dict(uniform)
    for u, shape in [(u, v) for s, v in (normal or {}).items() for u in (2 * s, 2 * s + 1)]:
        if shapes.setdefault(u, shape) != shape:
            raise ValueError(f"stream {u} drawn twice: as {shapes[u]} and as {shape}")
    streams, sizes = sorted(shapes), {s: math.prod(shape) for s, shape in shapes.items()}
    block = to_uniform(stream_bits(seed, counter, streams, max(sizes.values())))
    u = {s: block[:, i, : sizes[s]].view(*seed.shape, *shapes[s]) for i, s in enumerate(streams)}
    return {s: u[s] for s in uniform}, {s: box_muller(u[2 * s], u[2 * s + 1]) for s in normal or {}}


def uniform(
    seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """float32 uniforms in (0, 1), never 0 or 1 (Gumbel noise and Box-Muller take logs), shaped
    ``(*seed.shape, *shape)``; 24 bits each, exact in float32."""
    return draws(seed, counter, {stream: shape})[0][stream]


def to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """``stream_bits``' values as ``uniform``'s float32 uniforms (part of one draw, say)."""
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def box_muller(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """Standard normals from two uniforms in (0, 1) each."""
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)
