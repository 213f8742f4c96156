"""One compile path and one rule for every compiled program of a pod.

The path: ``Program`` is a pure function of tensors (PPO's rollout chunk, batch, minibatch
update and greedy evaluation; an off-policy algorithm's update) through ``torch.compile``
(``fullgraph=True``: code dynamo cannot capture whole is an error, never a silently split
graph; static shapes: a new P or batch compiles a new program), with inductor's on-disk caches
in the pod's compile cache (services/pod/runtime/compile_cache.py), so a later process loads
the kernels instead of building them. On a GPU the trainers capture their calls as one CUDA
graph (``Graphed``): every call after is one replay, and since the hyperparameters PBT varies
are tensors the graphs read, an explore changes values, never graphs.

The rule: ``Decision`` resolves ``compile: auto | on | off`` for one trainer. ``off``: eager.
``on``: compiled, refused (``CompileRefusedError``) where it cannot be (no C++ compiler). ``auto``:
the first calls run eager and are timed on this machine, so the eager side of the choice is a
measurement, not a table; the compiled side is the eager time divided by the measured speed-up
of the path on this device type (``RULES``, docs/benchmarks.md), plus the compile, scaled from
the reference machine's by how fast this one runs a fixed probe now (busy or slow machines
compile slower); a compile already in the cache costs its load. It compiles when what the
remaining work saves exceeds the compile. The same functions run eager and compiled on the
same state, so the switch happens between two iterations.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.logs import get_logger

log = get_logger(__name__)

CompileMode = Literal["auto", "on", "off"]


class CompileRefusedError(HyperparameterError):
    """``compile: on`` asked of what cannot compile here (the reason names why)."""


class CompileFailedError(RuntimeError):
    """A program failed to compile (dynamo could not capture it whole, inductor or the C++
    compiler failed): before it ran, so the state it would have written is as it was."""


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
    program per candidate ISA, twice over: seconds of a cold compile. The candidates are
    inductor's own (filtered by this CPU's flags as inductor filters them), and what such a
    probe catches here, a compiler without an ISA's flags, a bare compile of an empty file with
    those flags also catches in milliseconds. Any doubt (another architecture, an operator's
    ``TORCHINDUCTOR_VEC_ISA_OK``, a flag refused, an error) leaves inductor's probe on."""
    import platform
    import subprocess

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


@dataclass(frozen=True)
class CompileWork:
    """What this process compiled so far, or between two readings (their difference): seconds
    (dynamo's own per-frame timing, which includes inductor's), graphs inductor generated code
    for, and graphs it read from the compile cache instead (the FX graph cache's misses and
    hits): a pod that loads builds none."""

    seconds: float = 0.0
    built: int = 0
    loaded: int = 0

    def __sub__(self, other: CompileWork) -> CompileWork:
        return CompileWork(
            self.seconds - other.seconds, self.built - other.built, self.loaded - other.loaded
        )


def compile_work() -> CompileWork:
    """This process's ``CompileWork`` so far. Reading it imports nothing where nothing was
    compiled."""
    if "torch._dynamo.utils" not in sys.modules:
        return CompileWork()
    from torch._dynamo.utils import compilation_time_metrics, counters

    inductor = counters["inductor"]
    return CompileWork(
        float(sum(compilation_time_metrics.get("_compile.compile_inner", ()))),
        int(inductor["fxgraph_cache_miss"]),
        int(inductor["fxgraph_cache_hit"]),
    )


def log_compile(done: CompileWork, program: str, total_s: float, agents: int) -> None:
    """The ``compile.done`` line a trainer writes after a call that compiled."""
    log.info(
        "compile.done", program=program, compile_s=round(done.seconds, 2),
        graphs_built=done.built, graphs_loaded=done.loaded,
        total_compile_s=round(total_s, 2), agents=agents,
    )  # fmt: skip


def _map(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``fn`` on every tensor of ``tree`` (tensors in dicts, tuples and named tuples): a
    pytree map without the registry's per-node cost, paid on every eager update."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        items = [_map(fn, v) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    if isinstance(tree, list):
        return [_map(fn, v) for v in tree]
    return tree


def _first(tree: Any) -> torch.Tensor | None:
    if isinstance(tree, torch.Tensor):
        return tree
    values = tree.values() if isinstance(tree, dict) else tree
    if isinstance(values, (tuple, list)) or isinstance(tree, dict):
        for v in values:
            if (found := _first(v)) is not None:
                return found
    return None


def grad(
    fn: Callable[..., tuple[torch.Tensor, Any]], argnums: int | tuple[int, ...] = 0
) -> Callable[..., tuple[Any, Any]]:
    """``torch.func.grad(fn, argnums, has_aux=True)``: the gradient of ``fn``'s first output
    with respect to the arguments ``argnums`` (tensors, or trees of them), and its second.
    Compiled (dynamo captures ``torch.func.grad`` whole) it is that; eager it is autograd on
    detached leaves, the same numbers without a functorch transform's per-op cost."""

    def run(*args: Any) -> tuple[Any, Any]:
        if torch.compiler.is_compiling():
            return torch.func.grad(fn, argnums=argnums, has_aux=True)(*args)
        many = isinstance(argnums, tuple)
        nums = argnums if isinstance(argnums, tuple) else (argnums,)
        args = list(args)
        leaves: list[torch.Tensor] = []
        for i in nums:
            tree = _map(lambda t: t.detach().requires_grad_(), args[i])
            args[i] = tree
            _map(leaves.append, tree)
        with torch.enable_grad():
            value, aux = fn(*args)
            grads = iter(torch.autograd.grad(value, leaves, materialize_grads=True))
        out = [_map(lambda _: next(grads), args[i]) for i in nums]
        return (tuple(out) if many else out[0]), _map(torch.Tensor.detach, aux)

    return run


def per_agent(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.vmap(fn)``: one agent's function for every agent (the leading axis of every
    tensor argument and output). A single agent eager runs ``fn`` on its row directly: a
    vmap's batching costs several times the maths per op at these sizes."""
    mapped = torch.vmap(fn)

    def run(*args: Any) -> Any:
        first = _first(args)
        if torch.compiler.is_compiling() or first is None or first.shape[0] != 1:
            return mapped(*args)
        out = fn(*_map(lambda t: t[0], args))
        return _map(lambda t: t.unsqueeze(0), out)

    return run


#: Graphs one program may hold in a process (one per env, shape and device).
RECOMPILE_LIMIT = 64
CPU_REALIZE_OPCOUNT = 8  #: inductor's ``realize_opcount_threshold`` on the CPU (its own: 50)


class Program:
    """``fn`` compiled on first call, one per process and device type (module-level programs
    are shared: a pod that rebuilds its agent, a PBT child, reuses them).

    On a CPU, inductor's C++ wrapper (less host time per call than its Python one). Once a
    graph is compiled, calls run dynamo's cached code for it directly: each call checks the
    graph's guards (microseconds, in C++) and skips dynamo's frame evaluation around them,
    which cost several times the guards on every call of a small program. Where no graph's
    guards pass (another trainer's shape, env or modules), the call goes through dynamo, which
    compiles or finds that graph."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn, self.name = fn, name
        self._compiled: dict[str, Callable[..., Any]] = {}
        code = fn.__code__
        self._names = code.co_varnames[: code.co_argcount]
        defaults = fn.__defaults__ or ()
        tail = self._names[len(self._names) - len(defaults) :]
        #: The frame's locals no call passes: defaults, and the closure's cells (dynamo's
        #: guards read both as locals).
        self._unpassed = dict(zip(tail, defaults, strict=True))
        if fn.__closure__:
            cells = zip(code.co_freevars, fn.__closure__, strict=True)
            self._unpassed |= {name: cell.cell_contents for name, cell in cells}
        #: The code dynamo runs for each graph of ``fn`` it built, as a function.
        self._runs: dict[types.CodeType, Callable[..., Any]] = {}

    def _for(self, device: torch.device) -> Callable[..., Any]:
        if device.type not in self._compiled:
            # One graph per env and shape a process trains (a test session, an in-process
            # tournament, a plugin's envs): more than dynamo's default of 8 is no error.
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
            options: dict[str, Any] = {}
            if device.type == "cpu":
                trust_vec_isa()
                # Inductor fuses a pointwise chain into its reader up to this many ops: the
                # counter-based hash (counter_random.py) made chains hundreds of ops long and
                # the C++ code generation slow; shorter, the kernels run as fast (small
                # tensors) and compile in a fraction of the time (docs/benchmarks.md).
                options = {"cpp_wrapper": True, "realize_opcount_threshold": CPU_REALIZE_OPCOUNT}
            self._compiled[device.type] = torch.compile(
                self.fn, fullgraph=True, dynamic=False, options=options
            )
        return self._compiled[device.type]

    def _graph_for(self, args: tuple[Any, ...]) -> Callable[..., Any] | None:
        """The code dynamo runs for the compiled graph whose guards ``args`` pass, or None."""
        frame = {**self._unpassed, **dict(zip(self._names, args, strict=False))}
        # Dynamo's cache as it is now (a ``torch._dynamo.reset`` empties it: compile anew).
        entries = _cache_entries()(self.fn.__code__)
        for entry in entries:
            if entry.guard_manager.check(frame):
                run = self._runs.get(entry.code)
                if run is None:
                    fn = self.fn
                    run = types.FunctionType(
                        entry.code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
                    )
                    self._runs[entry.code] = run
                return run
        if not entries:
            self._runs.clear()  # the code of graphs a reset dropped
        return None

    def __call__(self, device: torch.device, *args: Any) -> Any:
        run = self._graph_for(args)
        return run(*args) if run is not None else self._compile(device, args)

    def _compile(self, device: torch.device, args: tuple[Any, ...]) -> Any:
        """Call through dynamo, which compiles (or finds) the graph for ``args``."""
        try:
            return self._for(device)(*args)
        except Exception as exc:  # dynamo's, inductor's and the C++ compiler's many types
            reason = f"{self.name}: {type(exc).__name__}: {str(exc).strip()[:300]}"
            raise CompileFailedError(reason) from exc

    def bind(self, device: torch.device) -> BoundProgram:
        """This program for one caller that passes the same kind of arguments on every call
        (``BoundProgram``)."""
        return BoundProgram(self, device)


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and type(a) in (int, float, str) and a == b)


class BoundProgram:
    """A ``Program`` for one caller whose calls differ only in tensor values: the same
    objects for every argument that is neither a tensor nor a container (a trainer's shape,
    env, counts) and tensors of the same shapes, strides, dtypes and devices inside the
    containers (a trainer's state, updated in place or replaced by its like), in the same
    grad mode. The first call compiles (or finds) the graph, the second checks the guards
    once more and keeps that graph; every later call runs it without checking guards, which
    for a trainer's programs (hundreds of guards over its shape's fields and tens of
    tensors) cost a tenth of a small program's call (docs/benchmarks.md). A call with other
    objects or in the other grad mode goes through the guards again. Shapes and strides stay
    checked by the compiled code itself."""

    def __init__(self, program: Program, device: torch.device) -> None:
        self.program, self.device = program, device
        self._run: Callable[..., Any] | None = None
        #: The arguments' count and, by position, the objects the graph was bound with.
        self._count = -1
        self._grad = True
        self._objects: tuple[tuple[int, Any], ...] = ()

    def __call__(self, *args: Any) -> Any:
        run = self._run
        if (
            run is not None
            and len(args) == self._count
            and torch.is_grad_enabled() is self._grad
            and all(_same(args[i], obj) for i, obj in self._objects)
        ):
            return run(*args)
        run = self._run = self.program._graph_for(args)
        if run is None:
            return self.program._compile(self.device, args)
        self._count, self._grad = len(args), torch.is_grad_enabled()
        self._objects = tuple(
            (i, a)
            for i, a in enumerate(args)
            if not isinstance(a, (torch.Tensor, dict, list, tuple))
        )
        return run(*args)


@functools.cache
def _cache_entries() -> Callable[[types.CodeType], Sequence[Any]]:
    """Dynamo's cache entries of a code object (each graph's guards and the code dynamo runs
    when they pass), or none where this torch keeps them elsewhere: every call then goes
    through dynamo, slower but the same. Imported on first use: dynamo takes a second to
    import, and an eager pod never needs it."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError as exc:
        log.warning("compile.cache_entries_unreadable", error=str(exc)[:200])
        return lambda code: ()
    return _debug_get_cache_entry_list


class Graphed:
    """A call replayed as one CUDA graph: the first call runs as usual on a side stream (the
    programs compile, cuBLAS makes its handles), the second is captured, and every later call
    is one replay of it. ``fn`` must read and write only tensors that live for the graph's
    life (a trainer's state, updated in place); what it returns is the graph's own output
    tensors, overwritten by the next replay. A capture that fails runs ``fn`` as usual from
    then on (one log line)."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.fn, self.name = fn, name
        self.calls = 0
        self.failed: str | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: Any = None

    def __call__(self) -> Any:
        self.calls += 1
        if self.failed is not None:
            return self.fn()
        if self._graph is not None:
            self._graph.replay()
            return self._out
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        if self.calls == 1:
            with torch.cuda.stream(side):
                out = self.fn()
            torch.cuda.current_stream().wait_stream(side)
            return out
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._out = self.fn()
        except Exception as exc:  # any capture failure means: run the calls uncaptured
            self.failed = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            log.warning("compile.cuda_graph_failed", program=self.name, error=self.failed)
            torch.cuda.synchronize()
            return self.fn()
        self._graph = graph
        graph.replay()  # capturing recorded the work; replaying runs it
        return self._out


def _marker(key: str, program: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    facts = f"{torch.__version__} {CPU_REALIZE_OPCOUNT} {key} {program}".encode()
    return Path(cache_dir()) / "podium-programs" / hashlib.sha256(facts).hexdigest()[:32]


def cached(key: str, programs: Sequence[str]) -> bool:
    """Whether every one of ``programs`` of ``key`` (what fixes them; compiled with today's
    options) is noted in the compile cache (``mark_cached``): their compile is a load. Each is
    noted on its own: a short run may build only its evaluation."""
    try:
        return all(_marker(key, program).exists() for program in programs)
    except OSError:
        return False


def mark_cached(key: str, program: str) -> None:
    """Note in the compile cache that ``program`` of ``key`` is in it (a best effort)."""
    try:
        path = _marker(key, program)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{key} {program}")
    except OSError as exc:
        log.info("compile.mark_failed", error=str(exc))


# -- the rule ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """One compiled path on one device type, measured (docs/benchmarks.md): the speed-up over
    eager, the cold compile on the reference machine, and a load from the compile cache."""

    speedup: float
    compile_s: float
    warm_s: float


#: Path and device type → its rule, per env step on-policy and per update off-policy: the CPU
#: rows from this project's 2-core machine, one thread (bench/compiled_rows.py); CUDA, an H200.
RULES: dict[tuple[str, str], Rule] = {
    ("onpolicy", "cpu"): Rule(speedup=3.2, compile_s=45.0, warm_s=5.0),
    ("onpolicy", "cuda"): Rule(speedup=20.0, compile_s=20.0, warm_s=6.0),
    ("offpolicy", "cpu"): Rule(speedup=3.2, compile_s=30.0, warm_s=5.0),
    ("offpolicy", "cuda"): Rule(speedup=18.0, compile_s=21.0, warm_s=6.0),
}
#: Seconds the probe takes on the reference machine (``machine_factor``).
PROBE_REFERENCE_S = 0.0015


@functools.cache
def _probe_s() -> float:
    """Seconds a fixed mix of Python and small-tensor work takes here, now: what a compile
    (Python-bound tracing and lowering, then a C++ compiler) scales with."""
    x = torch.zeros(64)
    start = time.perf_counter()
    total = 0
    for i in range(3000):
        total += i * i % 7
        if i % 10 == 0:
            x = x + 1.0
    return time.perf_counter() - start


def machine_factor() -> float:
    """How much slower than the reference machine this one compiles now (at least 1 where it
    is busier: the load average per CPU of the machine, which is what the load average
    counts, however few CPUs this process may use)."""
    try:
        load = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
    except (AttributeError, OSError):
        load = 0.0
    return max(_probe_s() / PROBE_REFERENCE_S, 1.0) * max(1.0, load)


@dataclass
class Decision:
    """Whether a trainer's programs compile (``compiled``; None while ``auto`` is still timing
    the eager calls) and why (``reason``, one line a user reads).

    ``units``: the work the run is expected to do (env steps per agent for PPO, updates for
    off-policy), what the saving is counted over; ``cached``: the programs are already in the
    compile cache (a restarted pod, a PBT child, a second run of the same config)."""

    mode: CompileMode
    path: str
    device: torch.device
    units: float
    cached: bool = False
    #: Eager calls timed before ``auto`` decides (the first is a warm-up and not counted).
    timed_calls: int = 3
    compiled: bool | None = None
    reason: str = ""
    _times: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        missing = compiler_missing(self.device)
        if self.mode == "off":
            self.compiled, self.reason = False, "compile: off"
        elif self.mode == "on":
            if missing:
                raise CompileRefusedError(f"compile: on cannot be honoured here: {missing}")
            self.compiled, self.reason = True, "compile: on"
        elif missing:
            self.compiled, self.reason = False, f"auto: {missing}"
        elif (self.path, self.device.type) not in RULES:
            self.compiled = False
            self.reason = f"auto: {self.path} on {self.device.type} is unmeasured"

    def failed(self, error: CompileFailedError) -> None:
        """A program failed to compile: ``on`` is refused, ``auto`` trains eager (a log line)."""
        if self.mode == "on":
            raise CompileRefusedError(f"compile: on cannot be honoured here: {error}") from error
        self.compiled, self.reason = False, f"auto: compiling failed ({error})"
        log.warning("compile.failed", path=self.path, error=str(error), fallback="eager")

    def eager_call(self, seconds: float, units: float) -> bool:
        """Record an eager call of ``seconds`` doing ``units`` of work; True once decided."""
        if self.compiled is not None:
            return True
        self._times.append((seconds, units))
        if len(self._times) <= self.timed_calls:
            return False
        timed = self._times[1:]  # the first call pays one-off costs
        per_unit = sum(s for s, _ in timed) / sum(u for _, u in timed)
        done = sum(u for _, u in self._times)
        self.decide(per_unit, max(0.0, self.units - done))
        return True

    def decide(self, eager_s_per_unit: float, units_left: float) -> None:
        rule = RULES[self.path, self.device.type]
        saved = units_left * eager_s_per_unit * (1.0 - 1.0 / rule.speedup)
        cost = (rule.warm_s if self.cached else rule.compile_s) * machine_factor()
        self.compiled = saved > cost
        self.reason = (
            f"auto: {'compiling' if self.compiled else 'eager'}: the compiled programs save "
            f"about {saved:.0f} s over the {units_left:.0f} "
            f"{'env steps' if self.path == 'onpolicy' else 'updates'} left "
            f"(eager {eager_s_per_unit * 1e6:.1f} us each here, about {rule.speedup:g}x "
            f"compiled), compiling costs about {cost:.0f} s"
            + (" (in the compile cache)" if self.cached else "")
        )
        log.info("compile.decided", path=self.path, compiled=self.compiled, reason=self.reason)
