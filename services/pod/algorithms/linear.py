"""The networks' linear layers, through the faster of torch's two CPU matmul libraries.

torch runs an fp32 matmul on an x86 CPU through MKL, which picks its kernels by CPU vendor: on
AMD CPUs, where the pod cannot let it choose by instruction sets (services/pod/mkl_dispatch.py),
at about half the rate of oneDNN, the other library inside torch (docs/benchmarks.md). oneDNN
costs more per call: ``linear`` picks per shape by each library's cost per call and per
multiply-add on this CPU (``costs``). Eager and compiled alike: oneDNN's linear is a custom op
with its own backward. Other devices and dtypes: torch's matmul.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.logs import get_logger
from services.pod import mkl_dispatch

log = get_logger(__name__)


@torch.library.custom_op("podium::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x (B, in) @ w (out, in)ᵀ + b`` through oneDNN (any strides)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


class _OneDnnLinear(torch.autograd.Function):
    """oneDNN's linear with its gradients (linear layers too); an autograd.Function, not the
    custom op's own autograd, so that ``torch.func.grad`` (the compiled update) runs it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return onednn_linear(x, w, b)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        return (
            linear(g, w.t()) if need_x else None,
            linear(g.t(), x.t()) if need_w else None,
            g.sum(0) if need_b else None,
        )


@onednn_linear.register_vmap
def _(info, in_dims, x, w, b):
    """Under an eager ``torch.vmap`` (the off-policy agents' acting): one call per agent."""
    rows = [
        [t if d is None else t.select(d, i) for t, d in zip((x, w, b), in_dims, strict=True)]
        for i in range(info.batch_size)
    ]
    return torch.stack([onednn_linear(*row) for row in rows]), 0


#: True while dynamo traces P agents' functions under ``torch.vmap`` (compiled.per_agent):
#: it cannot trace oneDNN's autograd.Function there, so those layers run torch's matmul.
traced_under_vmap = False


def _costs_of(fn, autograd_fn) -> tuple[float, ...]:
    """A library's seconds a call, a multiply-add and (eager, recording the gradient) a call:
    medians on square layers of 16 and 256."""

    def seconds(fn, size: int, grad: bool = False) -> float:
        x, w, b = torch.randn(size, size), torch.randn(size, size), torch.randn(size)
        with torch.set_grad_enabled(grad):
            w.requires_grad_(grad)
            fn(x, w, b)
            runs = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(10):
                    fn(x, w, b)
                runs.append((time.perf_counter() - start) / 10)
        return statistics.median(runs)

    small, large = seconds(fn, 16), seconds(fn, 256)
    per_mac = max(large - small, 1e-9) / (256**3 - 16**3)
    recording = seconds(autograd_fn, 16, grad=True)
    return max(small - 16**3 * per_mac, 0.0), per_mac, max(recording - 16**3 * per_mac, 0.0)


def _dispatch() -> str:
    return "features" if mkl_dispatch.state() == "features" else "vendor"


#: The costs once measured, and the fewest multiply-adds at which oneDNN can be the faster
#: (``smallest``); dynamo reads them as constants.
_MEASURED: dict[str, Any] = {}
#: Where the costs are kept: in the compile cache (services/pod/runtime/compile_cache.py).
COSTS_FILE = "linear-costs.json"


def _read(path: Path) -> tuple[tuple[float, ...], ...] | None:
    """The costs a process on this cache measured (the same torch, MKL choosing its kernels
    the same way), or None."""
    try:
        kept = json.loads(path.read_text())
        pair = tuple(tuple(float(v) for v in kept[lib]) for lib in ("mkl", "onednn"))
        valid = kept["torch"] == torch.__version__ and kept["mkl_dispatch"] == _dispatch()
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return pair if valid and all(len(c) == 3 and min(c) >= 0 for c in pair) else None


def costs() -> tuple[tuple[float, ...], ...] | None:
    """(MKL's, oneDNN's) seconds a call (as a compiled program or a no-grad call makes it), a
    multiply-add, and an eager call recording its gradient, on this CPU as torch runs now;
    None where torch has no oneDNN. Measured once and kept in the compile cache: a graph
    holds the choices of the process that traced it, so every process on that cache (a warm
    start, another pod of the experiment, which fetches the cache) makes the same choices
    and loads the graphs instead of compiling other ones. ``Program`` calls it before it
    compiles (a trace reads it)."""
    if "costs" in _MEASURED:
        return _MEASURED["costs"]
    measured, smallest = None, math.inf
    if torch.backends.mkldnn.is_available():
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        path = Path(cache) / COSTS_FILE if cache else None
        measured = _read(path) if path else None
        if measured is None:
            # On real tensors in a thread of its own, whatever this thread has active (a
            # grad transform, fake tensors: all thread-local).
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                mkl = pool.submit(_costs_of, *[functools.partial(_call, "mkl")] * 2)
                onednn = pool.submit(_costs_of, onednn_linear, _OneDnnLinear.apply)
                try:
                    measured = mkl.result(), onednn.result()
                except RuntimeError as exc:  # a build whose oneDNN lacks the op: MKL only
                    log.warning("linear.onednn_unavailable", error=str(exc)[:200])
                    _MEASURED.update(costs=None, smallest=math.inf)
                    return None
            if path is not None:
                keep = {
                    "torch": torch.__version__,
                    "mkl_dispatch": _dispatch(),
                    "mkl": measured[0],
                    "onednn": measured[1],
                }
                part = path.with_suffix(f".{os.getpid()}.part")
                with contextlib.suppress(OSError):  # a read-only cache: measured again later
                    part.write_text(json.dumps(keep))
                    part.replace(path)
        (call_m, mac_m, _), (call_d, mac_d, _) = measured
        if mac_d < mac_m:
            smallest = max(call_d - call_m, 0.0) / (mac_m - mac_d)
    _MEASURED.update(costs=measured, smallest=smallest)
    return measured


def prefer_onednn(p: int, m: int, k: int, n: int, autograd: bool = False) -> bool:
    """Whether P agents' (m, k) x (k, n) layers run clearly (10%) faster as one oneDNN call
    each than as one batched MKL call, by the measured costs (``autograd``: eager calls
    recording their gradient)."""
    measured = costs()
    if measured is None:
        return False
    (call_m, mac_m, grad_m), (call_d, mac_d, grad_d) = measured
    if autograd:
        call_m, call_d = grad_m, grad_d
    macs = m * k * n
    return p * (call_d + macs * mac_d) < 0.9 * (call_m + p * macs * mac_m)


def _library(x: torch.Tensor, w: torch.Tensor) -> str:
    """Which call runs the layer of ``x`` and its weights: ``mkl``, or oneDNN (``autograd``:
    with its gradient; ``onednn``: none is recorded). A compiled program's constant (torch's
    matmul where nothing was measured before the trace). Below the fewest multiply-adds at
    which oneDNN can be the faster, MKL without weighing (eager trainers call small layers
    often)."""
    compiling = torch.compiler.is_compiling()
    if x.device.type != "cpu" or x.dtype != torch.float32 or (compiling and not _MEASURED):
        return "mkl"
    costs()
    p = int(x.shape[0]) if x.dim() == 3 else 1
    m, k, n = (int(d) for d in (x.shape[-2], x.shape[-1], w.shape[-2]))
    if m * k * n < _MEASURED["smallest"]:
        return "mkl"
    if compiling:
        return "autograd" if not traced_under_vmap and prefer_onednn(p, m, k, n) else "mkl"
    # Whether a gradient is recorded is read from the mode, not the tensors: under an eager
    # vmap they are wrappers whose requires_grad says nothing.
    grads = torch.is_grad_enabled()
    if not prefer_onednn(p, m, k, n, grads):
        return "mkl"
    return "autograd" if grads else "onednn"


def _call(library: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if library == "autograd":
        return _OneDnnLinear.apply(x, w, b)
    if library == "onednn":
        return onednn_linear(x, w, b)
    return x @ w.t() if b is None else torch.addmm(b, x, w.t())


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x (B, in) @ w (out, in)ᵀ + b``."""
    return _call(_library(x, w), x, w, b)


class Linear(nn.Linear):
    """``nn.Linear`` (its weights, init and state dict) computed by ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return linear(x, self.weight, self.bias)
        out = linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def batched_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """P layers at once: ``x (P, B, in)``, ``w (P, out, in)``, ``b (P, out)`` -> (P, B, out);
    one batched matmul, or one oneDNN call per agent where that is faster."""
    library = _library(x, w)
    if library != "mkl":
        if x.shape[0] == 1:
            return _call(library, x[0], w[0], b[0]).unsqueeze(0)
        return torch.stack([_call(library, *agent) for agent in zip(x, w, b, strict=True)])
    return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))
