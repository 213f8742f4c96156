"""On-policy storage: the ``Rollout`` a worker collects (services/pod/roles/worker.py) and an
on-policy update consumes (ppo.py). Beside the replay buffer (replay_buffer.py), the off-policy
storage."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

#: Rollout fields whose length varies from rollout to rollout (episodes that ended in it).
VARIABLE = ("episode_returns", "episode_lengths")


@dataclass
class Rollout:
    """T steps of N sub-environments. Observations are normalised as the policy saw them."""

    obs: torch.Tensor  # (T, N, *obs_shape)
    actions: torch.Tensor  # (T, N) discrete, (T, N, A) continuous (pre-bounds sample)
    logprobs: torch.Tensor  # (T, N)
    rewards: torch.Tensor  # (T, N), raw env rewards
    terminated: torch.Tensor  # (T, N) bool
    truncated: torch.Tensor  # (T, N) bool
    final_obs: torch.Tensor  # (T, N, *obs_shape): last obs of an episode that ended at t
    next_obs: torch.Tensor  # (N, *obs_shape): obs after the last step, for bootstrapping
    obs_stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # raw-obs mean, var, count
    return_stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # discounted-return stats
    episode_returns: torch.Tensor  # returns of episodes that finished in this rollout
    episode_lengths: torch.Tensor

    @property
    def env_steps(self) -> int:
        return self.rewards.numel()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The rollout as named tensors (a tuple field ``f`` as ``f.0``, ``f.1``, …), as a
        worker in another process writes them into shared memory."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                out.update({f"{f.name}.{i}": t for i, t in enumerate(value)})
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], episodes: int, device: str) -> Rollout:
        """The rollout ``tensors`` names, on ``device``; ``VARIABLE`` fields hold ``episodes``
        entries (their shared tensors have room for one per env step)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in tensors:
                t = tensors[f.name]
                values[f.name] = (t[:episodes] if f.name in VARIABLE else t).to(device)
            else:
                parts = [k for k in tensors if k.startswith(f.name + ".")]
                parts.sort(key=lambda k: int(k.rsplit(".", 1)[1]))
                values[f.name] = tuple(tensors[k].to(device) for k in parts)
        return cls(**values)
