"""The compiled on-device loop (Podracer's "Anakin", Hessel et al. 2021): act, env step and
rollout storage fused into one ``torch.compile``d function per vector step, and PPO's
minibatch loss compiled (forward and backward), for torch-native envs.

Whether a run compiles is ``PPOConfig.compile``: ``off``, ``on``, or ``auto`` (the default), which
compiles only where it measured faster (``AUTO_MIN_ENVS``; docs/compiled-loop.md has the reasons,
docs/benchmarks.md the numbers). Every way compiling can fail falls back to eager with one log line,
never a crash: no C++ compiler (inductor's CPU backend builds C++; triton for CUDA), an env that is
not torch-native (gymnasium, Isaac Gym, a plugin's ``VecEnv``), or code dynamo cannot capture whole
(``fullgraph=True`` turns a graph break into an error, caught at the first call).

What the compiled functions see never bakes in a value that PBT changes: they are
module-level (one dynamo cache per process, so a pod that rebuilds its agent from a parent's
weights and new hyperparameters reuses the graphs), modules are arguments (their parameters
are graph inputs, not constants), and the tuned coefficients (clip, entropy, value, γ) enter as
tensors. The learning rate lives in the optimiser, which stays eager.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Hashable
from typing import Any, Literal

import torch

from services.logs import get_logger

log = get_logger(__name__)

CompileMode = Literal["auto", "on", "off"]

#: Where ``auto`` compiles: device type → the smallest env count per worker from which the
#: compiled loop measured faster end to end, compile time included (docs/compiled-loop.md);
#: None: nowhere yet. On this project's CPU the compile (minutes on a loaded 2-core machine)
#: outweighs what it saves; the GPU is unmeasured (issue 15, part 2).
AUTO_MIN_ENVS: dict[str, int | None] = {"cpu": None, "cuda": None}


def compiler_missing(device: torch.device | str) -> str | None:
    """Why inductor cannot build kernels for ``device`` here, or None when it can."""
    device = torch.device(device)
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "triton is not installed (inductor's CUDA backend needs it)"
    # The CPU backend, and the host side of every backend, compile C++. Inductor takes $CXX,
    # else the first of these it finds on PATH.
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    if not any(shutil.which(c) for c in candidates):
        return f"no C++ compiler ({' or '.join(candidates)} not on PATH)"
    return None


def should_compile(mode: CompileMode, device: torch.device | str, num_envs: int) -> bool:
    """Resolve ``mode`` for a run of ``num_envs`` sub-environments on ``device``, logging
    why when a requested compile cannot happen."""
    if mode == "off":
        return False
    if mode == "auto":
        least = AUTO_MIN_ENVS.get(torch.device(device).type)
        if least is None or num_envs < least:
            return False
    if reason := compiler_missing(device):
        log.warning("compile.unavailable", mode=mode, reason=reason, fallback="eager")
        return False
    return True


class Compiled:
    """``fn`` compiled on first call, or ``fn`` itself where compiling it failed (logged).

    ``fullgraph=True``: code dynamo cannot capture whole is an error here (then eager),
    rather than a silently split graph that is slower than eager. Failures are remembered per
    ``key`` (the env's class, say), so one plugin env that cannot be compiled does not turn
    compiling off for the others. On CUDA the graphs are replayed as CUDA graphs
    (``mode="reduce-overhead"``), which removes the launch cost of the many small kernels a
    step of a classic-control env is made of.
    """

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn = fn
        self.name = name
        self._compiled: dict[str, Callable[..., Any]] = {}
        #: key → why compiling failed for it.
        self.failed: dict[Hashable, str] = {}

    def _for_device(self, device: torch.device) -> Callable[..., Any]:
        if device.type not in self._compiled:
            mode = "reduce-overhead" if device.type == "cuda" else None
            self._compiled[device.type] = torch.compile(self.fn, fullgraph=True, mode=mode)
        return self._compiled[device.type]

    def __call__(self, key: Hashable, device: torch.device, *args: Any, **kwargs: Any) -> Any:
        if key not in self.failed:
            try:
                if device.type == "cuda":  # every call a new replay, whose outputs it keeps
                    torch.compiler.cudagraph_mark_step_begin()
                return self._for_device(device)(*args, **kwargs)
            except Exception as exc:  # any compile failure means: run eager
                # Dynamo and inductor raise many types (Unsupported, BackendCompilerFailed,
                # InductorError, a C++ build error), all before the graph ran, so the eager call
                # below starts from the same state.
                self.failed[key] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                log.warning(
                    "compile.failed",
                    function=self.name,
                    key=str(key),
                    error=self.failed[key],
                    fallback="eager",
                )
        return self.fn(*args, **kwargs)


def compile_counters() -> dict[str, int]:
    """Dynamo's frame and graph counts: what a test reads to see that nothing recompiled."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["stats"]["unique_graphs"]), **dict(counters["frames"])}
