"""The networks' linear layers (services/pod/algorithms/linear.py): oneDNN's path gives torch's
matmul numbers and gradients (autograd, ``torch.func.grad``, compiled), a policy's layers take
it where the measured cost model says it is faster, and the model picks by its costs."""

from __future__ import annotations

import json

import gymnasium as gym
import pytest
import torch

from services.pod.algorithms import linear as lin
from services.pod.algorithms import policies as pi
from services.pod.algorithms.compiled import grad, per_agent

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@pytest.fixture
def onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer prefers oneDNN."""
    lin.costs()
    monkeypatch.setitem(lin._MEASURED, "smallest", 0.0)
    monkeypatch.setattr(lin, "prefer_onednn", lambda p, m, k, n, autograd=False: True)


@pytest.fixture
def onednn_calls(onednn: None, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Every layer prefers oneDNN; the shapes of its calls (eager) are recorded."""
    calls: list[tuple[int, ...]] = []
    real = lin.onednn_linear

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append((*x.shape, w.shape[0]))
        return real(x, w, b)

    monkeypatch.setattr(lin, "onednn_linear", counted)
    return calls


def _layers(p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(p)
    x = torch.randn(p, 40, 7, generator=g)
    w = torch.randn(p, 5, 7, generator=g)
    return x, w, torch.randn(p, 5, generator=g)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))


@pytest.mark.parametrize("p", [1, 3])
def test_onednn_layers_give_the_matmul_values_and_gradients(
    onednn_calls: list[tuple[int, ...]], p: int
) -> None:
    x, w, b = _layers(p)
    out = lin.batched_linear(x, w, b)
    torch.testing.assert_close(out, _reference(x, w, b))
    assert onednn_calls[:p] == [(40, 7, 5)] * p

    def loss(fn, x, w, b):
        return (fn(x, w, b).tanh() * torch.arange(5.0)).sum()

    want = torch.func.grad(lambda *a: loss(_reference, *a), argnums=(0, 1, 2))(x, w, b)
    got = torch.func.grad(lambda *a: loss(lin.batched_linear, *a), argnums=(0, 1, 2))(x, w, b)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r)
    # The gradients are layers too: (B, out) x (out, in) and (out, B) x (B, in).
    assert (40, 5, 7) in onednn_calls and (5, 40, 7) in onednn_calls

    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss(lin.batched_linear, *leaves).backward()
    for leaf, r in zip(leaves, want, strict=True):
        torch.testing.assert_close(leaf.grad, r)


@pytest.mark.slow
def test_onednn_layers_compile_whole(onednn: None) -> None:
    x, w, b = _layers(2)

    def step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda w: lin.batched_linear(x, w, b).square().sum())(w)

    graphs = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x, w, b), step(x, w, b))
    assert "onednn_linear" in graphs[0].print_readable(print_output=False)
    inductor = torch.compile(step, fullgraph=True, dynamic=False)
    torch.testing.assert_close(inductor(x, w, b), step(x, w, b))


def test_a_policys_layers_take_onednn_where_it_is_faster(
    onednn_calls: list[tuple[int, ...]],
) -> None:
    actor = pi.GaussianActor(3, gym.spaces.Box(-2.0, 2.0, (2,)), [16, 16])
    assert actor.deterministic(torch.randn(12, 3)).shape == (12, 2)
    assert [c[:2] for c in onednn_calls] == [(12, 3), (12, 16), (12, 16)]


def test_the_cost_model_picks_the_faster_library(monkeypatch: pytest.MonkeyPatch) -> None:
    # MKL: 2 µs a call, 1e-11 s a multiply-add; oneDNN: 12 µs a call, twice the rate; eager
    # calls recording the gradient 4 and 40 µs.
    monkeypatch.setattr(lin, "costs", lambda: ((2e-6, 1e-11, 4e-6), (12e-6, 5e-12, 40e-6)))
    assert not lin.prefer_onednn(1, 8, 256, 256)  # 0.5M multiply-adds: the call's cost decides
    assert lin.prefer_onednn(1, 640, 256, 256)
    assert lin.prefer_onednn(1, 64, 256, 256)  # 4M: 33 against 44 µs
    assert not lin.prefer_onednn(1, 64, 256, 256, autograd=True)  # 61 against 46 µs
    # P agents: one oneDNN call each against one batched MKL call.
    assert lin.prefer_onednn(4, 640, 256, 256)
    assert not lin.prefer_onednn(4, 16, 256, 256)
    # Within 10% of MKL is not clearly faster: MKL stays.
    monkeypatch.setattr(lin, "costs", lambda: ((2e-6, 1e-11, 2e-6), (2e-6, 0.95e-11, 2e-6)))
    assert not lin.prefer_onednn(1, 640, 256, 256)
    monkeypatch.setattr(lin, "costs", lambda: None)
    assert not lin.prefer_onednn(1, 640, 256, 256)


def test_the_measured_costs_are_a_call_and_a_rate() -> None:
    measured = lin.costs()
    assert measured is not None
    for per_call, per_mac, per_call_recording in measured:
        assert 0.0 <= per_call < 1e-3 and 0.0 <= per_call_recording < 1e-3
        assert 0.0 < per_mac < 1e-8


def test_a_linear_module_is_nn_linear_through_onednn(onednn_calls: list[tuple[int, ...]]) -> None:
    layer = lin.Linear(7, 5)
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 3, 7)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert onednn_calls == [(6, 7, 5)]


def test_onednn_layers_run_under_vmap(onednn: None) -> None:
    x, w, b = _layers(3)
    got = torch.vmap(lin.linear)(x, w, b)
    torch.testing.assert_close(got, _reference(x, w, b))
    grads = torch.vmap(torch.func.grad(lambda w, x, b: lin.linear(x, w, b).square().sum()))(w, x, b)
    want = torch.func.grad(lambda w: _reference(x, w, b).square().sum())(w)
    torch.testing.assert_close(grads, want)


@pytest.mark.slow
@pytest.mark.parametrize("p", [1, 2])
def test_compiled_agents_take_onednn_outside_a_vmap_only(onednn: None, p: int) -> None:
    """``per_agent`` runs one agent's row directly (its layers may take oneDNN) and traces P
    agents under a vmap with torch's matmul (dynamo cannot trace oneDNN's layer there)."""
    x, w, b = _layers(p)
    loss = per_agent(lambda w, x, b: lin.linear(x, w, b).square().sum())

    def step(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return grad(lambda w: (loss(w, x, b).sum(), b))(w)[0]

    graphs = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]):
        graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(w, x, b), step(w, x, b))
    assert ("onednn_linear" in graphs[0]) == (p == 1)
    assert not lin.traced_under_vmap


def test_the_costs_are_kept_in_the_compile_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A process on the same compile cache reads the costs the first one measured, so its
    traces make the same choices and load the first one's graphs; a corrupt or foreign file
    is measured again and replaced."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(lin, "_MEASURED", {})
    first = lin.costs()
    assert lin._MEASURED["smallest"] >= 0.0
    kept = tmp_path / lin.COSTS_FILE
    assert json.loads(kept.read_text())["torch"] == torch.__version__
    mine = ((1e-6, 1e-11, 2e-6), (3e-6, 5e-12, 9e-6))
    dispatch = lin._dispatch()
    kept.write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "mkl_dispatch": dispatch,
                "mkl": mine[0],
                "onednn": mine[1],
            }
        )
    )
    monkeypatch.setattr(lin, "_MEASURED", {})
    assert lin.costs() == mine
    # Measured where MKL chose its kernels the other way (services/pod/mkl_dispatch.py): not
    # this process's costs.
    other = "vendor" if dispatch == "features" else "features"
    foreign = {"torch": torch.__version__, "mkl_dispatch": other, "mkl": [0] * 3, "onednn": [0] * 3}
    for bad in ("{", '{"torch": "0.1", "mkl": [0, 0, 0], "onednn": [0, 0, 0]}', "[1]", foreign):
        if isinstance(bad, dict):
            bad = json.dumps(bad)
        kept.write_text(bad)
        monkeypatch.setattr(lin, "_MEASURED", {})
        again = lin.costs()
        assert again is not None and again != mine and len(again[0]) == len(first[0]) == 3
        assert json.loads(kept.read_text())["torch"] == torch.__version__
        assert json.loads(kept.read_text())["mkl_dispatch"] == dispatch
