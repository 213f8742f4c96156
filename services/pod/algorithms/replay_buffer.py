"""Replay buffer for the off-policy agents: a ring of preallocated tensors on the env's device.

Transitions arrive a whole batch of sub-environments at a time and stay on the device they
were collected on (the GPU-side buffer of ElegantRL-podracer): adding is one slice copy per
field, sampling is one ``randint`` and one gather per field, and nothing ever goes through the
host. The stored ``next_obs`` of a transition that ended an episode is the episode's final
observation (``info["final_obs"]``), and only ``terminated`` is kept: a truncated transition
is bootstrapped from its final observation like any other, because a time limit is not part of
the MDP.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FIELDS = ("obs", "action", "reward", "next_obs", "terminated")


class Batch(NamedTuple):
    obs: torch.Tensor  # (B, *obs_shape)
    action: torch.Tensor  # (B,) int64 discrete, (B, A) continuous
    reward: torch.Tensor  # (B,) float32
    next_obs: torch.Tensor  # (B, *obs_shape): final obs where the episode ended
    terminated: torch.Tensor  # (B,) float32, 1.0 where the MDP ended (no bootstrap)


class ReplayBuffer:
    """Fixed-capacity FIFO of transitions, stored as contiguous (capacity, ...) tensors."""

    def __init__(
        self,
        capacity: int,
        obs_shape: tuple[int, ...],
        action_shape: tuple[int, ...],
        action_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.obs = torch.zeros((capacity, *obs_shape), device=self.device)
        self.action = torch.zeros((capacity, *action_shape), device=self.device, dtype=action_dtype)
        self.reward = torch.zeros(capacity, device=self.device)
        self.next_obs = torch.zeros_like(self.obs)
        # Stored as float so the TD target multiplies by (1 - terminated) without a cast.
        self.terminated = torch.zeros(capacity, device=self.device)
        # Write position and fill level are host ints: the loop knows them without a sync.
        self.pos = 0
        self.size = 0
        # The fill level on the device too, for a compiled update that samples by itself.
        self.filled = torch.zeros((), dtype=torch.int64, device=self.device)

    def __len__(self) -> int:
        return self.size

    @torch.no_grad()
    def add(
        self,
        obs: torch.Tensor,
        action: torch.Tensor,
        reward: torch.Tensor,
        next_obs: torch.Tensor,
        terminated: torch.Tensor,
    ) -> None:
        """Append a batch of N transitions, overwriting the oldest once the ring is full."""
        n = obs.shape[0]
        if n > self.capacity:  # only the newest ``capacity`` survive, where one-by-one puts them
            self.pos = (self.pos + n - self.capacity) % self.capacity
            obs, action, reward, next_obs, terminated = (
                t[n - self.capacity :] for t in (obs, action, reward, next_obs, terminated)
            )
            n = self.capacity
        values = (obs, action, reward, next_obs, terminated)
        first = min(n, self.capacity - self.pos)  # rows before the end of the ring
        for name, value in zip(FIELDS, values, strict=True):
            store = getattr(self, name)
            store[self.pos : self.pos + first] = value[:first]
            if first < n:  # wrap around to the start
                store[: n - first] = value[first:]
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)
        self.filled.fill_(self.size)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> Batch:
        """``batch_size`` transitions drawn uniformly, with replacement, from the filled slots."""
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        idx = torch.randint(0, self.size, (batch_size,), device=self.device, generator=generator)
        return Batch(*(getattr(self, name).index_select(0, idx) for name in FIELDS))

    # -- training files ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The filled part of the ring plus its write position, as safetensors-able tensors."""
        state = {name: getattr(self, name)[: self.size] for name in FIELDS}
        state["pos"] = torch.tensor(self.pos, dtype=torch.int64)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if missing := [name for name in (*FIELDS, "pos") if name not in state]:
            raise ValueError(f"replay buffer state lacks {missing}")
        size = int(state["obs"].shape[0])
        if size > self.capacity:
            raise ValueError(f"replay buffer state holds {size} rows, capacity is {self.capacity}")
        for name in FIELDS:
            store, value = getattr(self, name), state[name]
            if value.shape[1:] != store.shape[1:] or value.shape[0] != size:
                raise ValueError(
                    f"replay buffer field {name!r} has shape {tuple(value.shape)}, expected "
                    f"({size}, {', '.join(map(str, store.shape[1:]))})"
                )
            store[:size] = value.to(store.device, store.dtype)
        pos = int(state["pos"])
        if not 0 <= pos < self.capacity or (size < self.capacity and pos != size % self.capacity):
            raise ValueError(f"replay buffer position {pos} does not fit {size} rows")
        self.size, self.pos = size, pos
        self.filled.fill_(size)
