"""Running mean/variance statistics, kept as module buffers so they travel with the weights."""

from __future__ import annotations

import torch
from torch import nn


def batch_stats(
    x: torch.Tensor, feature_shape: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, population variance and count of ``x`` over all dims before ``feature_shape``."""
    flat = x.reshape(-1, *feature_shape).to(torch.float64)
    count = torch.tensor(float(flat.shape[0]), dtype=torch.float64, device=x.device)
    return flat.mean(0), flat.var(0, unbiased=False), count


def merge_batched(
    old: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mean: torch.Tensor,
    var: torch.Tensor,
    count: torch.Tensor | float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``RunningMeanStd.merge`` (Chan et al.) for P running statistics at once, out of place:
    ``old`` and the result are (mean, var, count) with a leading agent axis, count (P,)."""
    old_mean, old_var, old_count = old
    delta = mean - old_mean
    total = old_count + count
    c = (count / total).view(-1, *([1] * (delta.dim() - 1)))
    oc = old_count.view_as(c)
    m2 = old_var * oc + var * count + delta.square() * oc * count / total.view_as(c)
    return old_mean + delta * c, m2 / total.view_as(c), total


class RunningMeanStd(nn.Module):
    """Streaming mean and variance (Chan et al.'s parallel algorithm) as buffers, so ``state_dict``
    (and so the safetensors checkpoint) holds them: an actor is useless without them."""

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = 1e-4, clip: float = 10.0):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(epsilon, dtype=torch.float64))
        self.clip = clip

    def batch_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return batch_stats(x, tuple(self.mean.shape))

    @torch.no_grad()
    def merge(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        delta = mean - self.mean
        total = self.count + count
        new_mean = self.mean + delta * count / total
        m2 = self.var * self.count + var * count + delta.square() * self.count * count / total
        self.mean.copy_(new_mean)
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def update(self, x: torch.Tensor) -> None:
        self.merge(*self.batch_stats(x))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        std = torch.sqrt(self.var + 1e-8).to(x.dtype)
        return ((x - self.mean.to(x.dtype)) / std).clamp(-self.clip, self.clip)
