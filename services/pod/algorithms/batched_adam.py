"""Adam for P agents at once: each agent's parameters one row of a (P, N) tensor, each its own
learning rate and step count; PBT's copy of one row from another; one row to and from a single
agent's ``torch.optim.Adam`` state (``load_row``, ``row_state``: ``load_adam_state`` and
``adam_state`` on the row's views, which take any layout of one tensor per parameter, e.g. the
Anakin trainer's).

The population of PPO agents (services/pod/training/population.py), the off-policy stacks
(services/pod/algorithms/stacked.py) and the portfolio gradient's agents
(services/pod/trading/portfolio_gradient.py) step their agents with it. The
update is torch.optim.Adam's for every agent alone (tests/pod/algorithms/test_batched_adam.py
checks it against P separate ``torch.optim.Adam``): torch's fused Adam kernel, in one call for
all rows (each a contiguous tensor with its own step count), runs with a learning rate of 1
into a zeroed buffer, which then holds ``-m_hat / (sqrt(v_hat) + eps)``; scaling that by each
agent's learning rate is the agent's step. One kernel for the whole population, where P
``torch.optim.Adam`` would run one per tensor per agent.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch


class BatchedAdam:
    """Adam over the rows of ``params`` (P, N), updated in place.

    ``lr`` (P,): each agent's learning rate, held by reference (a caller that changes an
    agent's rate in this tensor changes the step). ``grad`` (P, N): where the caller writes
    the agents' gradients before ``step()`` (or passes them to ``step``). ``moments`` (2, P, N):
    the first and second moments (``exp_avg``, ``exp_avg_sq``); ``steps`` (P,): each agent's
    step count, float32 as the fused kernel reads it.
    """

    def __init__(
        self,
        params: torch.Tensor,
        lr: torch.Tensor,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if params.dim() != 2 or lr.shape != params.shape[:1]:
            raise ValueError(
                f"need params (P, N) and lr (P,); got {tuple(params.shape)}, {tuple(lr.shape)}"
            )
        if not params.is_contiguous():
            raise ValueError("params must be contiguous: the kernel steps its rows in place")
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.grad = torch.zeros_like(params)
        self.moments = torch.zeros(2, *params.shape, dtype=params.dtype, device=params.device)
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=params.device)
        self._delta = torch.zeros_like(params)
        # The kernel takes lists of tensors: one row per agent, views made once.
        self._rows = [
            list(x.unbind(0)) for x in (self._delta, self.grad, self.moments[0], self.moments[1])
        ]
        self._steps = list(self.steps.unbind(0))

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.moments[0]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.moments[1]

    @torch.no_grad()
    def step(self, grad: torch.Tensor | None = None, lr: torch.Tensor | None = None) -> None:
        """One Adam step of every agent on ``grad`` (default: what is in ``self.grad``), with
        ``lr`` (P,) instead of ``self.lr`` for this step (an annealed rate)."""
        if grad is not None:
            self.grad.copy_(grad)
        self.steps += 1  # the kernel reads the step counts after the increment
        self._delta.zero_()
        deltas, grads, exp_avgs, exp_avg_sqs = self._rows
        torch._fused_adam_(
            deltas,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            self._steps,
            lr=1.0,
            beta1=self.betas[0],
            beta2=self.betas[1],
            weight_decay=0.0,
            eps=self.eps,
            amsgrad=False,
            maximize=False,
        )
        rate = self.lr if lr is None else lr
        self.params.addcmul_(rate.to(self.params.dtype).unsqueeze(1), self._delta)

    @torch.no_grad()
    def copy(self, dst: int, src: int) -> None:
        """PBT's exploit: agent ``dst`` restarts from agent ``src``'s parameters, moments and
        step count (the bias correction goes on from the source's count: a young agent's would
        shrink a mature one's steps for hundreds of steps). The learning rate is a
        hyperparameter: whoever explores sets ``lr[dst]``."""
        self.params[dst] = self.params[src]
        self.moments[:, dst] = self.moments[:, src]
        self.steps[dst] = self.steps[src]

    def _row(self, i: int, params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Row ``i``'s ``exp_avg`` and ``exp_avg_sq``, each as views shaped as ``params`` (the
        row's tensors, in its order)."""
        sizes = [t.numel() for t in params]
        if sum(sizes) != self.params.shape[1]:
            raise ValueError(f"params hold {sum(sizes)} numbers, a row {self.params.shape[1]}")
        rows = (row[i].split(sizes) for row in self.moments)
        return [[m.view(t.shape) for m, t in zip(row, params, strict=True)] for row in rows]

    def load_row(
        self, i: int, params: Sequence[torch.Tensor], state: Mapping[torch.Tensor, Any]
    ) -> None:
        """Row ``i`` from a single agent's ``torch.optim.Adam`` ``state`` of ``params`` (the
        row's tensors, in its order): ``load_adam_state``."""
        self.steps[i] = load_adam_state(params, state, *self._row(i, params))

    def row_state(
        self, i: int, params: Sequence[torch.Tensor]
    ) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Row ``i`` as a single agent's ``torch.optim.Adam`` holds the state of ``params``
        (the row's tensors, in its order): ``adam_state``."""
        return adam_state(params, float(self.steps[i]), *self._row(i, params))


@torch.no_grad()
def load_adam_state(
    params: Sequence[torch.Tensor],
    state: Mapping[torch.Tensor, Any],
    exp_avg: Sequence[torch.Tensor],
    exp_avg_sq: Sequence[torch.Tensor],
) -> float:
    """Copy a single agent's ``torch.optim.Adam`` ``state`` of ``params`` into ``exp_avg`` and
    ``exp_avg_sq`` (one tensor per parameter, shaped as it, written in place: a ``BatchedAdam``
    row's views, the Anakin state's slot) and return its step count; zeros and 0 where that
    optimiser never stepped them all (a fresh agent, a TD3 actor before its first delayed
    update)."""
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
    """The state a single agent's ``torch.optim.Adam`` holds for ``params`` after ``steps``
    steps with moments ``exp_avg`` and ``exp_avg_sq`` (one tensor per parameter, shaped as it):
    copies; empty where ``steps`` is 0 (so that optimiser starts as a fresh one)."""
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


def adam_state_dict(
    state: Sequence[Mapping[str, torch.Tensor]], params: int, **settings: Any
) -> dict[str, Any]:
    """What ``torch.optim.Adam(ps, **settings).state_dict()`` gives for ``params`` parameters
    ``ps`` whose per-parameter ``state`` (step, exp_avg, exp_avg_sq, in ``ps``' order; empty:
    a fresh optimiser) is given, without building the optimiser: a process's first one imports
    torch._dynamo (about a second), which a trainer that only writes the state to files (the
    Anakin trainer's checkpoints) never needs otherwise. The param group holds Adam's own
    defaults, read from its signature, with ``settings`` over them."""
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(torch.optim.Adam.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    group = {**defaults, **settings, "params": list(range(params))}
    return {"state": dict(enumerate(state)), "param_groups": [group]}
