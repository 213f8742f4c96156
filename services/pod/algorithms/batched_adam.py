"""Adam for P agents at once: each agent's parameters one row of a (P, N) tensor, each its own
learning rate and step count; PBT's copy of one row from another; one row to and from a single
agent's ``torch.optim.Adam`` state (``load_row``, ``row_state``).

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

    @torch.no_grad()
    def load_row(
        self, i: int, params: Sequence[torch.Tensor], state: Mapping[torch.Tensor, Any]
    ) -> None:
        """Row ``i``'s moments and step count from a single agent's ``torch.optim.Adam``
        ``state`` of ``params`` (the row's tensors, in its order); zeros where that optimiser
        never stepped them (a TD3 actor before its first delayed update)."""
        if all(t in state and "step" in state[t] for t in params):
            self.steps[i] = float(state[params[0]]["step"])
            for k, key in enumerate(("exp_avg", "exp_avg_sq")):
                self.moments[k, i] = torch.cat([state[t][key].flatten() for t in params])
        else:
            self.steps[i] = 0.0
            self.moments[:, i] = 0.0

    @torch.no_grad()
    def row_state(
        self, i: int, params: Sequence[torch.Tensor]
    ) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Row ``i`` as a single agent's ``torch.optim.Adam`` holds the state of ``params``
        (the row's tensors, in its order): copies, each shaped as its tensor; empty where the
        row never stepped (so that agent's optimiser starts as a fresh one)."""
        steps = float(self.steps[i])
        if steps == 0:
            return {}
        out, offset = {}, 0
        for t in params:
            part = slice(offset, offset + t.numel())
            out[t] = {
                # As torch's fused Adam keeps it: a float32 tensor on the parameter's device.
                "step": torch.tensor(steps, dtype=torch.float32, device=t.device),
                "exp_avg": self.moments[0, i, part].view(t.shape).clone(),
                "exp_avg_sq": self.moments[1, i, part].view(t.shape).clone(),
            }
            offset += t.numel()
        if offset != self.params.shape[1]:
            raise ValueError(f"params hold {offset} numbers, a row {self.params.shape[1]}")
        return out
