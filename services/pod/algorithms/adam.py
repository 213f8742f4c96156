"""Adam, once: the update of every agent's parameters (rows of a flat (P, n) tensor,
services/pod/algorithms/flat.py), each agent with its own learning rate and step count, in
plain tensor ops that run eager, compiled and inside a CUDA graph alike; and the conversion of
one row to and from the state a single agent's ``torch.optim.Adam`` holds, which is the
training files' format (services/pod/training/checkpoint.py).

The update is torch.optim.Adam's for each agent alone (tests/pod/algorithms/test_adam.py checks
it against P separate ``torch.optim.Adam``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from services.pod.algorithms.flat import Layout, row_views


def adam_(
    params: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    steps: torch.Tensor,
    lr: torch.Tensor,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> None:
    """One Adam step of every row of ``params`` (P, n), in place: ``grad`` its gradient,
    ``exp_avg`` / ``exp_avg_sq`` (P, n) the moments, ``steps`` (P,) float the step counts
    (incremented), ``lr`` (P,) the learning rates (a row whose rate is 0 keeps its weights;
    its moments still move, as torch.optim.Adam's would with lr 0)."""
    b1, b2 = betas
    steps.add_(1)
    exp_avg.lerp_(grad, 1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    # The bias corrections in the weights' precision (torch's Adam takes them in double).
    t = steps.to(params.dtype)
    step_size = _per_agent(lr / (1 - torch.pow(b1, t)))
    root = _per_agent((1 - torch.pow(b2, t)).sqrt())
    denom = (exp_avg_sq.sqrt() / root.unsqueeze(1)).add_(eps)
    params.sub_(step_size.unsqueeze(1) * exp_avg / denom)


def _per_agent(x: torch.Tensor) -> torch.Tensor:
    """``x`` (P,), computed once per agent. Compiled for a CPU, inductor would fold it into
    the loop over each agent's row and compute it again (two powers, a root) for every
    vector of the row, a third of a small network's Adam step; a reduction is a buffer of
    its own, so ``x`` goes through one (the largest of two copies of itself)."""
    if x.device.type == "cpu" and torch.compiler.is_compiling():
        return x.unsqueeze(-1).expand(*x.shape, 2).amax(-1)
    return x


def clip_rows(grad: torch.Tensor, max_norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_`` for every agent: row p (agent p's whole gradient) scaled to a norm
    of at most ``max_norm[p]`` (infinite: not clipped)."""
    return grad * (max_norm / (grad.norm(dim=1) + 1e-6)).clamp(max=1.0).unsqueeze(1)


class BatchedAdam:
    """The Adam state of a flat (P, n) ``params`` tensor: ``exp_avg`` and ``exp_avg_sq``
    (P, n), ``steps`` (P,) float32; ``lr`` (P,) each agent's rate, held by reference (a PBT
    explore writes into it). ``step(grad)`` is ``adam_`` on them."""

    def __init__(
        self,
        params: torch.Tensor,
        lr: torch.Tensor,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if params.dim() != 2 or lr.shape != params.shape[:1]:
            raise ValueError(
                f"need params (P, n) and lr (P,); got {tuple(params.shape)}, {tuple(lr.shape)}"
            )
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        #: Both moments in one (2, P, n) tensor (one file entry, one PBT row copy).
        self.moments = torch.zeros(2, *params.shape, dtype=params.dtype, device=params.device)
        self.exp_avg, self.exp_avg_sq = self.moments[0], self.moments[1]
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=params.device)

    @torch.no_grad()
    def step(self, grad: torch.Tensor, lr: torch.Tensor | None = None) -> None:
        """One step of every agent on ``grad`` (P, n), with ``lr`` (P,) instead of ``self.lr``
        for this step (an annealed rate)."""
        rate = self.lr if lr is None else lr
        adam_(
            self.params, grad, self.exp_avg, self.exp_avg_sq, self.steps, rate, self.betas, self.eps
        )

    @torch.no_grad()
    def copy(self, dst: int, src: int) -> None:
        """PBT's exploit: agent ``dst`` restarts from agent ``src``'s parameters, moments and
        step count (the bias correction goes on from the source's count)."""
        self.params[dst] = self.params[src]
        self.moments[:, dst] = self.moments[:, src]
        self.steps[dst] = self.steps[src]

    def load_row(
        self, i: int, layout: Layout, params: Sequence[torch.Tensor], state: Mapping
    ) -> None:
        """Row ``i``'s moments and step count from a single agent's ``torch.optim.Adam`` state
        of ``params`` (its tensors in ``layout``'s order)."""
        moments = [row_views(layout, m, i) for m in (self.exp_avg, self.exp_avg_sq)]
        self.steps[i] = load_adam_state(params, state, *moments)

    def row_state(
        self, i: int, layout: Layout, params: Sequence[torch.Tensor]
    ) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Row ``i`` as a single agent's ``torch.optim.Adam`` holds the state of ``params``."""
        moments = [row_views(layout, m, i) for m in (self.exp_avg, self.exp_avg_sq)]
        return adam_state(params, float(self.steps[i]), *moments)


@torch.no_grad()
def load_adam_state(
    params: Sequence[torch.Tensor],
    state: Mapping[torch.Tensor, Any],
    exp_avg: Sequence[torch.Tensor],
    exp_avg_sq: Sequence[torch.Tensor],
) -> float:
    """Copy a single agent's ``torch.optim.Adam`` ``state`` of ``params`` into ``exp_avg`` and
    ``exp_avg_sq`` (a tensor per parameter, in place); return its step count. Zeros and 0 where it
    never stepped them all (a fresh agent, a TD3 actor before its first delayed update)."""
    if not all(t in state and "step" in state[t] for t in params):
        for moment in (*exp_avg, *exp_avg_sq):
            moment.zero_()
        return 0.0
    for t, m, v in zip(params, exp_avg, exp_avg_sq, strict=True):
        m.copy_(state[t]["exp_avg"])
        v.copy_(state[t]["exp_avg_sq"])
    return float(state[params[0]]["step"])


@torch.no_grad()
def adam_state(
    params: Sequence[torch.Tensor],
    steps: float,
    exp_avg: Sequence[torch.Tensor],
    exp_avg_sq: Sequence[torch.Tensor],
) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
    """The state a single agent's ``torch.optim.Adam`` holds for ``params`` after ``steps`` steps
    with moments ``exp_avg``, ``exp_avg_sq``: copies; empty (a fresh optimiser's) at ``steps`` 0."""
    if steps == 0:
        return {}
    return {
        t: {
            # As torch's fused Adam keeps it: a float32 tensor on the parameter's device.
            "step": torch.tensor(steps, dtype=torch.float32, device=t.device),
            "exp_avg": m.clone(),
            "exp_avg_sq": v.clone(),
        }
        for t, m, v in zip(params, exp_avg, exp_avg_sq, strict=True)
    }


class AdamState:
    """One agent's Adam state as a single agent's ``torch.optim.Adam`` holds it, without the
    optimiser (a process's first one imports torch._dynamo: about a second of each pod's start):
    ``state`` maps each of ``params`` that stepped to its ``step``, ``exp_avg``, ``exp_avg_sq``;
    ``state_dict`` / ``load_state_dict`` speak ``torch.optim.Adam``'s format (the training
    files'). Agents train as rows of a stack (``BatchedAdam``: ``load_row``, ``row_state``)."""

    def __init__(self, params: Sequence[torch.Tensor], lr: float, **settings: Any) -> None:
        self.params, self.lr, self.settings = list(params), lr, {"fused": True, **settings}
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def state_dict(self) -> dict[str, Any]:
        """What ``torch.optim.Adam(params, lr, **settings).state_dict()`` would give with this
        state. The param group: Adam's own defaults, from its signature, the settings over them."""
        defaults = {
            name: parameter.default
            for name, parameter in inspect.signature(torch.optim.Adam.__init__).parameters.items()
            if parameter.default is not inspect.Parameter.empty
        }
        group = {**defaults, "lr": self.lr, **self.settings}
        group["params"] = list(range(len(self.params)))
        state = {i: self.state[t] for i, t in enumerate(self.params) if t in self.state}
        return {"state": state, "param_groups": [group]}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take ``torch.optim.Adam.state_dict()``'s format (copies, on the parameters' devices;
        the learning rate stays this agent's config's); ValueError where it does not fit."""
        groups, entries = state["param_groups"], state["state"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"optimizer state: not one group of {len(self.params)} parameters")
        loaded = {}
        for index, t in zip(groups[0]["params"], self.params, strict=True):
            if index not in entries:
                continue
            entry = entries[index]
            step = entry.get("step")
            if not isinstance(step, int | float) and not (
                isinstance(step, torch.Tensor) and step.numel() == 1
            ):
                raise ValueError(f"optimizer state: parameter {index} has no step count")
            if not all(isinstance(entry.get(k), torch.Tensor) for k in ("exp_avg", "exp_avg_sq")):
                raise ValueError(f"optimizer state: parameter {index} has no moments")
            for key in ("exp_avg", "exp_avg_sq"):
                if entry[key].shape != t.shape:
                    raise ValueError(f"optimizer state: {key} of shape {tuple(entry[key].shape)}")
            moments = [entry[key].to(t) for key in ("exp_avg", "exp_avg_sq")]
            loaded |= adam_state([t], float(step), *([m] for m in moments))
        self.state = loaded
