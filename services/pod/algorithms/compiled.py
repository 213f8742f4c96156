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

import functools
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


@functools.cache
def trust_vec_isa(compiler: str | None = None) -> bool:
    """Let inductor take the CPU's vector ISAs without its build-and-load probe, where
    ``compiler`` (default: inductor's) accepts each candidate ISA's flags; True if it does.

    Before its first CPU kernel inductor compiles and loads (in a new interpreter) a test
    program per candidate ISA, twice over: seconds of a cold compile (the first on a machine,
    or with a new cache directory), more than either Anakin program's own C++
    (docs/benchmarks.md, "Session 26"). The candidates are inductor's own (its list, filtered
    by this CPU's flags as inductor filters it), and what such a probe catches here, a
    compiler without an ISA's flags, a bare compile of an empty file with those flags also
    catches in milliseconds. Any doubt (another architecture, an operator's
    ``TORCHINDUCTOR_VEC_ISA_OK``, a flag refused, an error) leaves inductor's probe on."""
    import platform
    import subprocess
    import sys

    from torch._inductor import config

    if config.cpp.vec_isa_ok is not None:
        return bool(config.cpp.vec_isa_ok)
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = compiler or get_cpp_compiler()
        cpu = cpu_vec_isa.x86_isa_checker()
        for isa in cpu_vec_isa.supported_vec_isa_list:
            if not all(flag in cpu for flag in str(isa).split()):
                continue  # inductor drops it too
            command = [compiler, *isa.build_arch_flags().split(), "-x", "c++", "-c", "-"]
            done = subprocess.run(
                [*command, "-o", os.devnull],
                input="int main() { return 0; }\n",
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if done.returncode != 0:
                log.info("vec_isa.probe_kept", isa=str(isa), error=done.stderr.strip()[:200])
                return False
    except Exception as exc:  # inductor's internals moved: its own probe runs
        log.info("vec_isa.probe_kept", error=f"{type(exc).__name__}: {exc}"[:200])
        return False
    config.cpp.vec_isa_ok = True
    return True


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
            if device.type == "cpu":
                trust_vec_isa()
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
    #: seconds one evaluation of all agents (10 episodes each, agents at the top return) takes
    #: less compiled than eager; 0 where unmeasured.
    eval_saved_s: float = 0.0

    def covers(self, device: str, agents: int, batch: int) -> bool:
        return (
            device == self.device
            and self.agents[0] <= agents <= self.agents[1]
            and self.batch[0] <= batch <= self.batch[1]
        )

    def saved_s(self, agents: int, env_steps: int, evaluations: float = 0) -> float:
        """Seconds the Anakin trainer saves over ``env_steps`` per agent of training and
        ``evaluations`` evaluations (a share of one counts its share)."""
        training = agents * env_steps * (1.0 / self.eager_rate - 1.0 / self.anakin_rate)
        return training + evaluations * self.eval_saved_s


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
    # CPU: session 27 (four programs compiled ahead of time: the rollout chunk drawing its own
    # noise, the batch between rollout and updates, the update, the evaluation), the eager
    # rates session 25's (that code is unchanged). compile_s: the first iteration (session
    # 27) + the first evaluation (session 26's: its program did not change), both cold;
    # eval_saved_s: `--evaluation 400` (agents trained 400 iterations), P = 1, 8, 64.
    # 16 envs x 16 steps (a CartPole pod).
    AnakinRule("cpu", (1, 1), (1, 383), 219_800, 29_700, 32.7 + 6.5, 0.033),
    AnakinRule("cpu", (2, 16), (1, 383), 294_100, 157_700, 33.2 + 5.3, 0.039),
    AnakinRule("cpu", (17, 128), (1, 383), 287_400, 234_200, 32.6 + 5.7, 0.051),
    # 4 envs x 128 steps (PureJaxRL's recipe).
    AnakinRule("cpu", (1, 1), (384, 1024), 145_900, 15_600, 36.5 + 5.8, 0.041),
    AnakinRule("cpu", (2, 16), (384, 1024), 208_100, 80_000, 38.8 + 6.2, 0.047),
    AnakinRule("cpu", (17, 128), (384, 1024), 196_200, 152_900, 39.4 + 6.4, 0.059),
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


def anakin_rule(device: torch.device | str, agents: int, batch: int) -> AnakinRule | None:
    """The ``ANAKIN_AUTO`` row covering ``device``'s type, ``agents`` and ``batch`` (None: none
    does)."""
    kind = torch.device(device).type
    return next((r for r in ANAKIN_AUTO if r.covers(kind, agents, batch)), None)


def anakin_auto(
    device: torch.device | str,
    agents: int,
    batch: int,
    horizon_env_steps: int,
    compiled: bool = False,
    evaluations: int = 0,
    lost_s: float = 0.0,
) -> str | None:
    """None where ``compile: auto`` should train with the Anakin trainer (``ANAKIN_AUTO``), else
    why not: no measured row, slower, or a compile longer than what it saves over
    ``horizon_env_steps`` per agent and ``evaluations`` evaluations, plus ``lost_s``.
    ``compiled``: the programs are already built in the compile cache (programs compiled
    ahead of time load in milliseconds), so no compile is to be paid. ``lost_s``: what earlier
    runs of the same programs lost training eagerly because their compile did not pay within
    them alone (the cache's tally, ``aot_program.eager_seconds``): once that and this run's
    saving reach the compile, it compiles, so a shape trained again and again is compiled
    once it has cost as much as its compile (at most twice the best choice in hindsight)."""
    kind = torch.device(device).type
    rule = anakin_rule(device, agents, batch)
    where = f"{kind}, {agents} agent(s), {batch} env steps per iteration"
    if rule is None:
        return f"auto: unmeasured ({where})"
    if rule.anakin_rate <= rule.eager_rate:
        return f"auto: the eager trainer measured faster ({where})"
    saved = rule.saved_s(agents, horizon_env_steps, evaluations)
    if not compiled and saved + lost_s <= rule.compile_s:
        earlier = f", {lost_s:.0f} s lost eager by earlier runs" if lost_s else ""
        return (
            f"auto: compiling ({rule.compile_s:.0f} s cold) costs more than it saves over "
            f"{horizon_env_steps} env steps per agent ({saved:.0f} s{earlier}; {where})"
        )
    return None
