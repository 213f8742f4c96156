"""A whole greedy evaluation as one program (issue 33, deliverable 3): N episodes of every one
of P agents on a functional env (services/pod/training/anakin.py ``FUNCTIONAL_ENVS``), batched
over the agents, as one function of tensors.

``greedy_returns(shape, params, obs_mean, obs_var, start)`` plays one episode per start state
and agent: normalise (the agent's frozen statistics), act greedily (the mode of the policy,
as ``Policy.act_deterministic``), step the functional env, add the reward while the episode
lasts. The loop is ``torch._higher_order_ops.while_loop`` (stop when every episode has ended
or at the time limit, where an episode still running is truncated, as the env truncates it),
so ``torch.compile(fullgraph=True)`` captures it as one program whose body compiles once,
whatever the episode length: no host read until the returns come back.

It scores what ``Evaluator`` (services/pod/roles/evaluator.py) scores for the same weights
and start states: ``start_states`` takes them from the evaluation env exactly as
``evaluate_groups`` does (one env of the episode count reset with the evaluation seed, the
same states for every agent). tests/pod/test_anakin_trainer.py checks the two agree.

A finished episode's state is held (not reset) for the rest of the loop, so every quantity
stays finite and the returns are the episodes' own.

The FX graph cache does not store graphs holding ``while_loop`` in torch 2.13 ("Can't cache
HigherOrderOperator"): a new process traces this program again, but its C++ kernels come from
inductor's cache directory (services/pod/runtime/compile_cache.py), which is most of a CPU
compile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
from torch._higher_order_ops.while_loop import while_loop

from services.pod.algorithms import aot_program
from services.pod.envs.base import TorchVecEnv
from services.pod.roles.evaluator import EvalResult
from services.pod.training.anakin import FUNCTIONAL_ENVS, AnakinShape, _mlp_batched, normalize


def greedy_returns(
    shape: AnakinShape,
    params: torch.Tensor,
    obs_mean: torch.Tensor,
    obs_var: torch.Tensor,
    start: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy episodes of all P agents from ``start`` (P, N, state_dim): the returns (P, N)
    and the number of vector steps taken (0-dim); ``params``: the flat (P, n) weights."""
    step_fn, _ = FUNCTIONAL_ENVS[shape.env]
    norm = {"obs_mean": obs_mean, "obs_var": obs_var}

    def cond(
        t: torch.Tensor, state: torch.Tensor, returns: torch.Tensor, alive: torch.Tensor
    ) -> torch.Tensor:
        return (t < shape.max_episode_steps) & alive.any()

    def body(
        t: torch.Tensor, state: torch.Tensor, returns: torch.Tensor, alive: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        obs = normalize(norm, state.to(torch.float32), shape)
        # The views are taken inside the loop's body: views of one tensor passed into it
        # would be aliased inputs, which while_loop refuses.
        actor = shape.views(params)
        logits = _mlp_batched(actor, shape.actor_layers, shape.activation, obs)
        new, reward, terminated = step_fn(state, logits.argmax(-1))
        returns = returns + reward * alive.to(reward.dtype)
        alive = alive & ~terminated
        state = torch.where(alive.unsqueeze(-1), new, state)
        return t + 1, state, returns, alive

    p, n = start.shape[0], start.shape[1]
    carry = (
        torch.zeros((), dtype=torch.int64, device=start.device),
        start,
        torch.zeros(p, n, dtype=torch.float32, device=start.device),
        torch.ones(p, n, dtype=torch.bool, device=start.device),
    )
    t, _, returns, _ = while_loop(cond, body, carry)
    return returns, t


def start_states(env: TorchVecEnv, seed: int, agents: int) -> torch.Tensor:
    """(P, N, state_dim): the start states ``evaluate_groups`` gives each agent on ``env`` (N
    sub-environments, reset with ``seed``), the same for every agent."""
    env.reset(seed=seed)
    return env.state.clone().unsqueeze(0).expand(agents, -1, -1).contiguous()


def results(returns: torch.Tensor, steps: torch.Tensor) -> list[EvalResult]:
    """One ``EvalResult`` per agent from ``greedy_returns``' output (the one host read)."""
    rows, taken = returns.tolist(), int(steps)
    out = []
    for episodes in rows:
        mean = sum(episodes) / len(episodes)
        std = (sum((r - mean) ** 2 for r in episodes) / len(episodes)) ** 0.5
        env_steps = taken * len(episodes)
        out.append(EvalResult(mean=mean, std=std, episodes=episodes, env_steps=env_steps))
    return out


class _Program:
    """``greedy_returns`` compiled on first use (importing this module compiles nothing); one
    per process, so every trainer of the same shape, a PBT child's included, reuses it.

    On a CPU it is compiled ahead of time (services/pod/algorithms/aot_program.py), one
    program per shape and episode count, which a new process loads from the compile cache
    instead of tracing it again, and whose call skips dynamo; where that fails, through
    ``torch.compile``."""

    def __init__(self) -> None:
        self._compiled: Callable | None = None
        self._aot = aot_program.Programs()

    def __call__(self, shape: AnakinShape, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``greedy_returns(shape, *tensors)``."""
        if aot_program.used_on(tensors[0].device):
            args = [t.contiguous() for t in tensors]
            # One program per shape and episode count (the start states' second dimension).
            program = self._aot.get(
                "greedy_returns", shape, args[-1].shape, args,
                lambda: functools.partial(greedy_returns, shape),
            )  # fmt: skip
            if program is not None:
                return tuple(program(*args))
        if self._compiled is None:
            self._compiled = torch.compile(greedy_returns, fullgraph=True)
        return self._compiled(shape, *tensors)

    def reset(self) -> None:
        self._compiled = None
        self._aot.clear()


compiled_greedy_returns = _Program()


def _inputs(state: Mapping, start: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``greedy_returns``' tensors: the agents' weights and observation statistics, and the
    episodes' start states."""
    return state["params"], state["obs_mean"], state["obs_var"], start


def program_jobs(shape: AnakinShape, state: Mapping, start: torch.Tensor) -> list[aot_program.Job]:
    """The evaluation's program compiled ahead of time as ``evaluate`` will ask for it: for
    ``aot_program.build_concurrently``."""
    args = [t.contiguous() for t in _inputs(state, start)]
    fn = functools.partial(greedy_returns, shape)
    return [aot_program.Job("greedy_returns", fn, args, repr(shape))]


@torch.no_grad()
def evaluate(
    shape: AnakinShape,
    state: Mapping,
    start: torch.Tensor,
    compiled: bool = False,
) -> list[EvalResult]:
    """Score every agent of an Anakin ``state`` (services/pod/training/anakin.py) greedily
    from ``start``; ``compiled``: the compiled program, else the same function eagerly."""
    fn = compiled_greedy_returns if compiled else greedy_returns
    returns, steps = fn(shape, *_inputs(state, start))
    return results(returns, steps)
