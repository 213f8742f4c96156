"""P agents' tensors as the rows of one flat (P, n) tensor, with named views into it: how every
batched algorithm holds its agents' weights, gradients and optimiser moments.

One tensor per part of the agents, not one per layer: the optimiser and the gradient clip are
then a few ops for all P agents, a compiled program takes and returns few tensors (each costs
host time per call), and PBT's exploit of one agent by another is a row copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Layout:
    """Where each of one agent's tensors lies in a row of a flat (P, N) tensor. Frozen and of
    plain tuples: a compiled program is specialised on it as a constant, and a stack rebuilt
    with the same shapes must hash and compare equal to reuse the program."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> Layout:
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += t.numel()
        return cls(tuple(names), tuple(tuple(t.shape) for t in tensors), tuple(offsets), total)

    def views(
        self, flat: torch.Tensor, prefix: str = "", start: int = 0
    ) -> dict[str, torch.Tensor]:
        """name (without ``prefix``) → (P, *shape) view of ``flat`` from column ``start``."""
        p = flat.shape[0]
        return {
            name.removeprefix(prefix): flat[:, start + o : start + o + math.prod(s)].view(p, *s)
            for name, s, o in zip(self.names, self.shapes, self.offsets, strict=True)
        }


def flat_rows(tensors: Mapping[str, torch.Tensor], keys: Iterable[str]) -> torch.Tensor:
    """``tensors[k]`` (P, ...) for ``keys`` in order, one (P, n) tensor: ``Layout.views`` undone."""
    rows = [tensors[k] for k in keys]
    return torch.cat([t.reshape(t.shape[0], -1) for t in rows], dim=1)


def stack(
    modules: Sequence[nn.Module], names: Sequence[str] | None = None
) -> tuple[torch.Tensor, Layout]:
    """The parameters of ``modules`` (one agent each, of one shape) as a flat (P, n) tensor
    (detached) and its layout; ``names``: which parameters and in what order (default: all,
    in ``named_parameters`` order)."""
    named = [dict(m.named_parameters()) for m in modules]
    names = list(names if names is not None else named[0])
    layout = Layout.of(names, [named[0][n] for n in names])
    flat = torch.stack([torch.cat([p[n].detach().reshape(-1) for n in names]) for p in named])
    return flat.contiguous(), layout


def row_views(layout: Layout, flat: torch.Tensor, row: int) -> list[torch.Tensor]:
    """Row ``row`` of ``flat`` as one view per tensor of ``layout``, shaped as the tensor."""
    return [v[row] for v in layout.views(flat).values()]
