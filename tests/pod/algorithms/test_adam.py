"""Adam, once (services/pod/algorithms/adam.py): every agent's row steps as torch.optim.Adam
steps that agent alone, eager and compiled, and PBT's copy carries the whole optimiser state."""

from __future__ import annotations

import pytest
import torch

from services.pod.algorithms.adam import AdamState, BatchedAdam, adam_
from services.pod.algorithms.flat import Layout


@pytest.mark.parametrize(
    ("dtype", "eps", "tol"),
    [(torch.float64, 1e-8, {"rtol": 1e-12, "atol": 1e-12}), (torch.float32, 1e-5, {})],
)
def test_each_row_steps_as_torch_optim_adam_alone(dtype: torch.dtype, eps: float, tol) -> None:
    """P agents, each its own learning rate, 20 steps, an annealed rate on some: the rows equal
    P separate torch.optim.Adam (within float rounding), moments and step counts included."""
    torch.manual_seed(0)
    p, n = 3, 7
    start = torch.randn(p, n, dtype=dtype)
    lr = torch.tensor([0.1, 0.01, 0.003], dtype=dtype)
    adam = BatchedAdam(start.clone(), lr.clone(), betas=(0.9, 0.99), eps=eps)
    alone = [torch.nn.Parameter(start[i].clone()) for i in range(p)]
    optims = [
        torch.optim.Adam([w], lr=float(lr[i]), betas=(0.9, 0.99), eps=eps)
        for i, w in enumerate(alone)
    ]
    for k in range(20):
        grads = torch.randn(p, n, dtype=dtype)
        fraction = 1.0 - k / 40 if k % 2 else 1.0  # the population anneals its rate
        for i, (w, opt) in enumerate(zip(alone, optims, strict=True)):
            opt.param_groups[0]["lr"] = float(lr[i]) * fraction
            w.grad = grads[i].clone()
            opt.step()
        adam.step(grads, lr=lr * fraction)
    for i, (w, opt) in enumerate(zip(alone, optims, strict=True)):
        torch.testing.assert_close(adam.params[i], w.detach(), **tol)
        state = opt.state[w]
        torch.testing.assert_close(adam.exp_avg[i], state["exp_avg"], **tol)
        torch.testing.assert_close(adam.exp_avg_sq[i], state["exp_avg_sq"], **tol)
        assert adam.steps[i].item() == state["step"].item() == 20


def test_copy_restarts_one_row_from_another() -> None:
    """PBT's copy: the source's parameters, moments and step count; the copy then steps
    exactly as the source would with its own learning rate, and the rows stay apart."""
    torch.manual_seed(0)
    lr = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    adam = BatchedAdam(torch.randn(3, 4, dtype=torch.float64), lr)
    for _ in range(3):
        adam.step(torch.randn(3, 4, dtype=torch.float64))
    adam.step(torch.randn(3, 4, dtype=torch.float64) * torch.tensor([[1.0], [1.0], [0.0]]))
    adam.copy(0, 2)
    lr[0] = 0.24  # explore: the caller's learning rate for the copy
    torch.testing.assert_close(adam.params[0], adam.params[2])
    torch.testing.assert_close(adam.moments[:, 0], adam.moments[:, 2])
    assert adam.steps[0] == adam.steps[2] == 4 and adam.steps[1] == 4
    same = torch.randn(4, dtype=torch.float64)
    before = adam.params.clone()
    adam.step(torch.stack([same, torch.zeros(4, dtype=torch.float64), same]))
    torch.testing.assert_close(
        (adam.params[0] - before[0]) / 0.24, (adam.params[2] - before[2]) / 0.3
    )
    assert adam.steps.tolist() == [5.0, 5.0, 5.0]


def test_the_state_lives_with_the_parameters_and_bad_shapes_are_refused() -> None:
    """Moments and step counts are made where the parameters are (a pod on ``device=cuda``
    steps them there): on the meta device here, which any machine has."""
    params = torch.zeros(2, 5, dtype=torch.float64, device="meta")
    adam = BatchedAdam(params, torch.ones(2, dtype=torch.float64, device="meta"))
    assert adam.moments.device == adam.steps.device == params.device
    with pytest.raises(ValueError, match=r"lr \(P,\)"):
        BatchedAdam(torch.zeros(2, 5), torch.ones(3))


def test_the_compiled_step_is_the_eager_one() -> None:
    """``adam_`` is what every compiled update runs: the same numbers as eager."""
    torch.manual_seed(0)
    p, n = 3, 11
    state = [torch.randn(p, n), torch.zeros(p, n), torch.zeros(p, n), torch.zeros(p)]
    eager = [t.clone() for t in state]
    compiled = torch.compile(adam_, fullgraph=True)
    lr = torch.tensor([0.1, 0.01, 0.0])  # a zero rate keeps the weights
    for _ in range(3):
        grad = torch.randn(p, n)
        compiled(state[0], grad, *state[1:], lr)
        adam_(eager[0], grad, *eager[1:], lr)
    for mine, theirs in zip(state, eager, strict=True):
        torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(state[0][2], eager[0][2])


def test_a_row_moves_to_and_from_a_single_agents_adam_state() -> None:
    """``load_row`` takes one agent's ``torch.optim.Adam`` state (tensors of several shapes,
    in the row's order) into a row, ``row_state`` gives it back as that optimiser holds it; a
    never-stepped optimiser is a zero row, and a zero row an empty state."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.Adam(params, lr=0.1)
    layout = Layout.of(["w", "b"], params)
    adam = BatchedAdam(torch.zeros(3, 10), torch.full((3,), 0.1))
    adam.moments.fill_(7.0)
    adam.steps.fill_(9.0)
    adam.load_row(1, layout, params, opt.state)  # never stepped
    assert adam.steps.tolist() == [9.0, 0.0, 9.0] and not adam.moments[:, 1].any()
    assert adam.row_state(1, layout, params) == {}
    for _ in range(3):
        opt.zero_grad()
        sum(p.square().sum() for p in params).backward()
        opt.step()
    adam.load_row(1, layout, params, opt.state)
    assert adam.steps.tolist() == [9.0, 3.0, 9.0] and bool((adam.moments[:, [0, 2]] == 7).all())
    state = adam.row_state(1, layout, params)
    assert list(state) == params
    for t in params:
        assert float(state[t]["step"]) == 3.0 and state[t]["step"].dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[t][key], opt.state[t][key])
            assert state[t][key].data_ptr() != opt.state[t][key].data_ptr()


@pytest.mark.parametrize("stepped", ["none", "some", "all"])
def test_the_state_without_an_optimizer_is_torch_optim_adams(stepped: str) -> None:
    """``AdamState`` (an agent's Adam state, kept without building an optimiser) takes
    ``torch.optim.Adam(...).state_dict()`` and gives it back: param group, defaults and all, for
    a fresh optimiser, one that stepped some parameters (a TD3 actor between its delayed
    updates) and one that stepped all; a state of other shapes is refused."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.Adam(params, lr=2.5e-4, eps=1e-5, fused=True)
    if stepped != "none":
        loss = params[0].square().sum()
        (loss if stepped == "some" else loss + params[1].sum()).backward()
        opt.step()
    expected = opt.state_dict()
    mine = AdamState(params, 2.5e-4, eps=1e-5)
    if stepped == "none":
        assert mine.state_dict()["param_groups"] == expected["param_groups"]
    mine.load_state_dict(expected)
    assert list(mine.state) == [p for p in params if p in opt.state]
    got = mine.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, values in expected["state"].items():
        assert got["state"][index].keys() == values.keys()
        for key, value in values.items():
            assert torch.equal(got["state"][index][key], value)
            assert got["state"][index][key].data_ptr() != value.data_ptr()
    other = AdamState([torch.nn.Parameter(torch.randn(3, 2)), params[1]], 2.5e-4, eps=1e-5)
    if stepped != "none":
        with pytest.raises(ValueError, match="exp_avg of shape"):
            other.load_state_dict(expected)
    with pytest.raises(ValueError, match="not one group of 1 parameters"):
        AdamState(params[:1], 2.5e-4).load_state_dict(expected)
    if stepped == "all":  # a file's entry that is not a step count and moments
        for bad, match in (({"step": [1]}, "no step count"), ({"exp_avg": 1.0}, "no moments")):
            broken = {**expected, "state": {0: {**expected["state"][0], **bad}, 1: {}}}
            with pytest.raises(ValueError, match=match):
                mine.load_state_dict(broken)
