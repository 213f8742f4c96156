"""Single-thread fp32 matmul on this CPU, by the library that runs it: torch's ``mm`` (MKL on
x86), torch's oneDNN linear and XLA's dot, at the shapes of the PureJaxRL recipes' networks
(bench/purejaxrl_peer.py). MKL picks its kernels by CPU vendor, so on an AMD CPU it can run
well below oneDNN and XLA on the same cores: that gap is the PPO rows' machine dependence
(docs/benchmarks.md, "How fast is a pod, against PureJaxRL").

    taskset -c 1 .venv/bin/python bench/cpu_matmul.py
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax
import jax.numpy as jnp
import torch

SHAPES = [(640, 256, 256), (2048, 256, 256), (128, 64, 64), (640, 4, 256)]


def micros(fn: Callable[[], object], n: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    torch.set_num_threads(1)
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "?")
    print(f"{cpu}; torch {torch.__version__}, jax {jax.__version__}; GFLOP/s, one thread")
    print(f"{'m x k x n':>16} {'torch mm':>10} {'oneDNN':>10} {'XLA':>10}")
    dot = jax.jit(lambda x, y: x @ y)
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        dense_a, dense_b = a.to_mkldnn(), b.t().contiguous().to_mkldnn()
        xa, xb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
        times = (
            micros(lambda: torch.mm(a, b)),  # noqa: B023
            micros(lambda: torch._C._nn.mkldnn_linear(dense_a, dense_b)),  # noqa: B023
            micros(lambda: dot(xa, xb).block_until_ready()),  # noqa: B023
        )
        rates = [2 * m * k * n / t / 1e3 for t in times]
        print(f"{f'{m} x {k} x {n}':>16}" + "".join(f"{r:>11.0f}" for r in rates))


if __name__ == "__main__":
    main()
