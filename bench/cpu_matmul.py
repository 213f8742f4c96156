"""Single-thread fp32 matmul on this CPU, by the library that runs it: torch's ``mm`` (MKL on
x86) with MKL's own choice of kernels and with the pod's (by the CPU's instruction sets,
services/pod/mkl_dispatch.py), torch's oneDNN linear and XLA's dot, at the shapes of the
PureJaxRL recipes' networks (bench/purejaxrl_peer.py). MKL picks its kernels by CPU vendor, so
on an AMD CPU its own choice runs well below oneDNN and XLA on the same cores (docs/benchmarks.md,
"How fast is a pod, against PureJaxRL").

    taskset -c 1 .venv/bin/python bench/cpu_matmul.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Before torch: the pod's package lets MKL choose its kernels by the CPU's instruction sets.
import services.pod

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax
import jax.numpy as jnp
import torch

SHAPES = [(640, 256, 256), (2048, 256, 256), (128, 64, 64), (128, 4, 64), (640, 4, 256)]


def micros(fn: Callable[[], object], n: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def mm_micros() -> list[float]:
    """torch's mm at each shape, µs a call."""
    out = []
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out.append(micros(lambda: torch.mm(a, b)))  # noqa: B023
    return out


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1:] == ["--mm"]:
        print(*mm_micros())
        return
    # MKL's own choice, in a process of its own (the choice is made before torch loads).
    vendor = subprocess.run(
        [sys.executable, __file__, "--mm"],
        env={**os.environ, services.pod.mkl_dispatch.SETTING: "vendor"},
        capture_output=True,
        text=True,
        check=True,
    )
    mkl_own = [float(t) for t in vendor.stdout.split()]
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "?")
    print(f"{cpu}; torch {torch.__version__}, jax {jax.__version__}; GFLOP/s, one thread")
    print(f"MKL here: {services.pod.mkl_dispatch.state()}")
    print(f"{'m x k x n':>16} {'MKL own':>10} {'MKL here':>10} {'oneDNN':>10} {'XLA':>10}")
    dot = jax.jit(lambda x, y: x @ y)
    for (m, k, n), own, here in zip(SHAPES, mkl_own, mm_micros(), strict=True):
        a, b = torch.randn(m, k), torch.randn(k, n)
        dense_a, dense_b = a.to_mkldnn(), b.t().contiguous().to_mkldnn()
        xa, xb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
        times = (
            own,
            here,
            micros(lambda: torch._C._nn.mkldnn_linear(dense_a, dense_b)),  # noqa: B023
            micros(lambda: dot(xa, xb).block_until_ready()),  # noqa: B023
        )
        rates = [2 * m * k * n / t / 1e3 for t in times]
        print(f"{f'{m} x {k} x {n}':>16}" + "".join(f"{r:>11.0f}" for r in rates))


if __name__ == "__main__":
    main()
