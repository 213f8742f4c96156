"""The compiled on-device loop (Podracer's "Anakin", Hessel et al. 2021): act, env step and
rollout storage fused into one ``torch.compile``d function per vector step, and PPO's
minibatch loss compiled (forward and backward), for torch-native envs.

Whether a run compiles is ``PPOConfig.compile``: ``off``, ``on``, or ``auto`` (the default), which
compiles only where it measured faster (``AUTO_MIN_ENVS``; docs/compiled-loop.md has the reasons,
docs/benchmarks.md the numbers). For PPO, ``compile`` also picks the trainer: the Anakin trainer
(services/pod/training/anakin_trainer.py) where ``ANAKIN_AUTO``'s measured rules say it wins
(``anakin_auto``), the eager trainers otherwise.

Every way compiling can fail falls back to eager with one log line, never a crash: no C++
compiler (inductor's CPU backend builds C++; triton for CUDA), an env that is not torch-native
(gymnasium, Isaac Gym, a plugin's ``VecEnv``), or code dynamo cannot capture whole
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
from dataclasses import dataclass
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


# -- the Anakin trainer's auto rule -------------------------------------------------------------
@dataclass(frozen=True)
class AnakinRule:
    """One measured row (docs/benchmarks.md, "Anakin trainer: when `compile: auto` picks it"): PPO
    with the Anakin trainer (services/pod/training/anakin_trainer.py, two compiled programs
    per iteration) against the eager trainer a pod uses otherwise, on one device type, for
    ``agents`` and ``batch`` (env steps per agent per iteration) in the inclusive ranges
    given.
    """

    device: str
    agents: tuple[int, int]
    batch: tuple[int, int]
    #: env steps/s of all agents together: the Anakin trainer, and the eager trainer.
    anakin_rate: float
    eager_rate: float
    #: seconds of compiling, cold inductor cache: the iteration's programs and the evaluation's.
    compile_s: float

    def covers(self, device: str, agents: int, batch: int) -> bool:
        return (
            device == self.device
            and self.agents[0] <= agents <= self.agents[1]
            and self.batch[0] <= batch <= self.batch[1]
        )

    def saved_s(self, agents: int, env_steps: int) -> float:
        """Training seconds the Anakin trainer saves over ``env_steps`` per agent."""
        return agents * env_steps * (1.0 / self.eager_rate - 1.0 / self.anakin_rate)


#: Where ``compile: auto`` uses the Anakin trainer: a row covering the device, P and batch, whose
#: saved seconds over the run's horizon exceed its compile. Measured on this project's 2-core
#: CPU, one thread, bench/anakin_iteration.py (``--recipe purejaxrl``: 4 x 128 = 512 env steps
#: per iteration; ``--recipe cartpole-pod``: 16 x 16 = 256), the eager side being
#: ``OnPolicyTrainer`` at P = 1 and ``PopulationTrainer`` above; each row covers the sizes
#: nearer to its measurement than to another's. The CUDA rows are H200 runs of the trainer with
#: its CUDA graph, the pod's shape and PureJaxRL's recipe at P = 1 and 64, and the recipe at
#: P = 1,024 (docs/benchmarks.md, "Anakin on a GPU again"). Other batch sizes and other GPUs
#: are unmeasured, so ``auto`` leaves them to the eager trainers.
ANAKIN_AUTO: tuple[AnakinRule, ...] = (
    # 16 envs x 16 steps (a CartPole pod): first iteration (compile) + first evaluation.
    AnakinRule("cpu", (1, 1), (1, 383), 119_300, 29_700, 17.9 + 2.6),
    AnakinRule("cpu", (2, 16), (1, 383), 198_500, 157_700, 13.5 + 2.5),
    # P = 64 at 256: the update is compute-bound, PopulationTrainer's hand-written backward wins.
    AnakinRule("cpu", (17, 128), (1, 383), 161_200, 234_200, 13.8 + 2.6),
    # 4 envs x 128 steps (PureJaxRL's recipe).
    AnakinRule("cpu", (1, 1), (384, 1024), 95_700, 15_600, 18.6 + 3.3),
    AnakinRule("cpu", (2, 16), (384, 1024), 157_400, 80_000, 14.2 + 4.0),
    # P = 64 on the recipe: a tie (152.7k against 152.9k), so the eager trainer, no compile.
    AnakinRule("cpu", (17, 128), (384, 1024), 152_700, 152_900, 15.5 + 4.1),
    # One H200 (torch 2.11, CUDA 13): the trainer as a pod runs it (the iteration replayed as
    # one CUDA graph) against the eager trainer in the same process, bench/anakin_trainer_rows.py;
    # compile_s: the trainer's own count, iteration and evaluation programs together.
    AnakinRule("cuda", (1, 1), (1, 383), 152_700, 4_800, 17.3),
    AnakinRule("cuda", (2, 128), (1, 383), 8_389_200, 372_300, 18.0),
    AnakinRule("cuda", (1, 1), (384, 1024), 114_700, 2_100, 19.7),
    AnakinRule("cuda", (2, 128), (384, 1024), 5_369_800, 108_100, 20.5),
    # P = 1,024 on the recipe: bench/gpu_rows.py's AnakinPPO with the graph (start-up: compile
    # and capture); eager: the population trainer's rate in issue 33's table.
    AnakinRule("cuda", (129, 1024), (384, 1024), 25_497_900, 1_770_000, 19.5),
)


def anakin_auto(
    device: torch.device | str, agents: int, batch: int, horizon_env_steps: int
) -> str | None:
    """None where ``compile: auto`` should train with the Anakin trainer (``ANAKIN_AUTO``), else
    why not: no measured row, slower, or a compile longer than what it saves over
    ``horizon_env_steps`` per agent."""
    kind = torch.device(device).type
    rule = next((r for r in ANAKIN_AUTO if r.covers(kind, agents, batch)), None)
    where = f"{kind}, {agents} agent(s), {batch} env steps per iteration"
    if rule is None:
        return f"auto: unmeasured ({where})"
    if rule.anakin_rate <= rule.eager_rate:
        return f"auto: the eager trainer measured faster ({where})"
    saved = rule.saved_s(agents, horizon_env_steps)
    if saved <= rule.compile_s:
        return (
            f"auto: compiling ({rule.compile_s:.0f} s cold) costs more than it saves over "
            f"{horizon_env_steps} env steps per agent ({saved:.0f} s; {where})"
        )
    return None
