"""One compile path and one rule for every compiled program of a pod.

The path: ``Program``, a pure function of tensors (PPO's rollout chunk, batch, minibatch update
and greedy evaluation; an off-policy algorithm's update) compiled whole ahead of its first call
(code dynamo cannot capture whole is an error, never a split graph; static shapes) and saved,
guards and kernels, in the compile cache (services/pod/runtime/compile_cache.py): a later
process loads it without tracing again. On a GPU the trainers capture their calls as one CUDA
graph (``Graphed``); the hyperparameters PBT varies are tensors the graphs read, so an explore
changes values, never graphs.

The rule: ``Decision`` resolves ``compile: auto | on | off`` for one trainer. ``off``: eager.
``on``: compiled, refused (``CompileRefusedError``) where it cannot be (no C++ compiler). ``auto``:
the first calls run eager and are timed here; the compiled side is that time divided by the
path's measured speed-up on this device type (``RULES``, docs/benchmarks.md), plus the compile
(a load where the cache has it), scaled by how fast this machine runs a fixed probe now. It
compiles when what the remaining work saves exceeds the compile. The same functions run eager
and compiled on the same state, so the switch happens between two iterations.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shutil
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.pod_activity import CACHED, DECIDED
from services.logs import get_logger
from services.pod.mkl_dispatch import inductor_cache_dir
from services.startup import import_all

if TYPE_CHECKING:
    from services.pod.config import RunConfig

log = get_logger(__name__)

PROGRAMS = "podium-programs"  # the compile cache's directory of saved graphs and notes
#: What building or loading a program imports first (a launcher's pods have), and its seconds.
COMPILER = ("torch._dynamo", "torch._dynamo.aot_compile", "torch._inductor.compile_fx")
COMPILER_IMPORT_S = 1.5


def compiler_imported() -> bool:
    """Whether this process has the compiler's modules: a load then costs no import."""
    return COMPILER[-1] in sys.modules


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
    """Skip inductor's vector-ISA probe (a test program per candidate ISA built and loaded in
    a new interpreter, twice: seconds of a cold compile) where ``compiler`` (default:
    inductor's) accepts each candidate's flags, which a bare compile of an empty file checks in
    milliseconds; True if it does. Any doubt (another architecture, an operator's
    ``TORCHINDUCTOR_VEC_ISA_OK``, a flag refused, an error) leaves the probe on."""
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
                [*command, "-o", os.devnull], input="int main() { return 0; }\n",
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                log.info("vec_isa.probe_kept", isa=str(isa), error=done.stderr.strip()[:200])
                return False
    except Exception as exc:  # inductor's internals moved: its own probe runs
        log.info("vec_isa.probe_kept", error=f"{type(exc).__name__}: {exc}"[:200])
        return False
    config.cpp.vec_isa_ok = True
    return True


@functools.cache
def prepare_cpu() -> None:
    """Inductor's set-up for CPU kernels, before a build or a load: its ISA probe skipped where
    it can be (``trust_vec_isa``), its other probes run (test programs built, loaded by new
    interpreters: runtime/launcher.py runs them once for the pods it forks), no precompiled
    header (finding it again preprocesses torch's headers in every process, most of a load)."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    config.cpp_cache_precompile_headers = False  # it names a kernel's library: all agree on it
    trust_vec_isa()
    if compiler_missing("cpu") is None:
        pick_vec_isa()


@dataclass(frozen=True)
class CompileWork:
    """What this process compiled so far, or between two readings (their difference): seconds
    spent building or loading graphs, graphs built and graphs loaded from the compile cache."""

    seconds: float = 0.0
    built: int = 0
    loaded: int = 0

    def __sub__(self, other: CompileWork) -> CompileWork:
        return CompileWork(
            self.seconds - other.seconds, self.built - other.built, self.loaded - other.loaded
        )


def compile_work() -> CompileWork:
    """This process's ``CompileWork`` so far (every program's, ``Program._compile``)."""
    return CompileWork(_WORK["seconds"], _WORK["built"], _WORK["loaded"])


def count_compile(trainer: Any, before: CompileWork, program: str) -> bool:
    """Add what was built, loaded or failed since ``before`` to the trainer's; True if any."""
    done = compile_work() - before
    if done.seconds > 0:
        trainer.compile_seconds += done.seconds
        log.info(
            "compile.done", program=program, compile_s=round(done.seconds, 2),
            graphs_built=done.built, graphs_loaded=done.loaded,
            total_compile_s=round(trainer.compile_seconds, 2), agents=trainer.size,
        )  # fmt: skip
    return done.seconds > 0


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


CPU_REALIZE_OPCOUNT = 8  #: inductor's ``realize_opcount_threshold`` on the CPU (its own: 50)
#: What this process compiled and loaded so far (``compile_work``).
_WORK = {"seconds": 0.0, "built": 0, "loaded": 0}
_CODE = Path(__file__).resolve().parents[1]  # services/pod: the code that is compiled


@functools.cache
def code_digest(root: Path = _CODE) -> str:
    """The sources under ``root`` (default: the pod's): a program traced from other code is
    another program."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line.strip() for line in text.splitlines() if line.startswith(keep)}))


def device_kind(device: str | torch.device) -> str:
    """The device a compiled program is for, as one string: ``cpu-<arch>-<model and flags>``,
    or ``cuda-<name>-sm<capability>-cu<CUDA version>``."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index or 0
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index).replace(" ", "_")
        return f"cuda-{name}-sm{major}{minor}-cu{torch.version.cuda}"
    model = hashlib.sha256(_cpu_model().encode()).hexdigest()[:16]
    return f"{device.type}-{platform.machine()}-{model}"


def _fingerprint(x: Any, out: list[str], depth: int = 0) -> None:
    """What of a call's argument fixes its graph, as text: a tensor's kind, a constant's value,
    an object's type and its attributes', a function's name, source file and closure."""
    if isinstance(x, torch.Tensor):
        out.append(f"T{tuple(x.shape)}{x.stride()}{x.dtype}{x.device.type}{x.requires_grad}")
    elif x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
        out.append(repr(x))
    elif isinstance(x, (types.ModuleType, types.BuiltinFunctionType, type)) or depth > 16:
        name = getattr(x, "__qualname__", None) or getattr(x, "__name__", type(x).__qualname__)
        out.append(f"{getattr(x, '__module__', '')}.{name}")
    elif isinstance(x, (tuple, list, dict)):
        out.append(f"{type(x).__qualname__}{len(x)}")
        for k, v in x.items() if isinstance(x, dict) else enumerate(x):
            out.append(repr(k))
            _fingerprint(v, out, depth + 1)
    elif isinstance(x, types.FunctionType):
        code, source = x.__code__, Path(x.__code__.co_filename)
        out += [x.__module__, x.__qualname__, code.co_code.hex(), *code.co_names]
        out.append(code_digest(source) if source.is_file() else "")
        _fingerprint([c.cell_contents for c in x.__closure__ or ()], out, depth + 1)
    else:
        out.append(f"{type(x).__module__}.{type(x).__qualname__}")
        slots = [k for k in getattr(type(x), "__slots__", ()) if hasattr(x, k)]
        attrs = dict(vars(x)) if hasattr(x, "__dict__") else {k: getattr(x, k) for k in slots}
        if isinstance(x, types.MethodType):
            attrs = {"f": x.__func__, "self": x.__self__}
        elif isinstance(x, functools.partial):
            attrs = {"f": x.func, "a": x.args, "k": x.keywords}
        _fingerprint(attrs, out, depth + 1)


def _saved_guards(entries: Sequence[Any]) -> list[bool]:
    """The guards a saved graph keeps: not what ``Program._key`` fixes instead."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (g.is_global or {g.guard_type, *g.derived_guard_types} & unsaved) for g in entries]


def _options(device: torch.device) -> dict[str, Any]:
    if device.type != "cpu":
        return {"guard_filter_fn": _saved_guards}
    # Inductor fuses a pointwise chain into its reader up to this many ops: the counter-based
    # hash (counter_random.py) made chains of hundreds, slow to generate C++ for; shorter ones
    # run as fast here and compile in a fraction of the time (docs/benchmarks.md).
    cpu = {"cpp_wrapper": True, "realize_opcount_threshold": CPU_REALIZE_OPCOUNT}
    return {"guard_filter_fn": _saved_guards, **cpu}


class Program:
    """``fn`` compiled ahead of its first call with each kind of arguments (``aot_compile``:
    traced whole, static shapes; on a CPU with inductor's C++ wrapper), one graph per kind (a
    trainer's shape, env, modules, tensor shapes), each saved in the compile cache under a
    digest of what fixes it (torch, the device, the pod's code, the arguments'
    ``_fingerprint``): a later process loads the guards and kernels without tracing again. A
    saved graph that does not load, or whose guards refuse the call, is built again. A closure's
    values are saved with it. Module-level programs are shared (a PBT child's agent reuses them)."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn, self.name = fn, name
        self._graphs: dict[str, Any] = {}  #: by ``_key``

    def _key(self, args: tuple[Any, ...]) -> str:
        """What fixes the graph for ``args`` that its saved guards do not check: objects'
        identities (a trainer's env, its functions), global state (the grad mode)."""
        facts = [str(torch.is_grad_enabled()), str(torch.get_default_dtype()), self.name]
        _fingerprint((self.fn, args), facts)
        return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:32]

    def _graph_for(self, args: tuple[Any, ...]) -> Callable[..., Any] | None:
        """The graph for ``args``, as a function of them, or None."""
        graph = self._graphs.get(self._key(args))
        return graph.fn if graph is not None and graph.guard_check(*args) else None

    def __call__(self, device: torch.device, *args: Any) -> Any:
        run = self._graph_for(args)
        return run(*args) if run is not None else self._compile(device, args)

    def _compile(self, device: torch.device, args: tuple[Any, ...]) -> Any:
        """Load or build the graph for ``args``, then run it."""
        from torch._guards import TracingContext, tracing

        start, graph = time.perf_counter(), None
        try:
            import_all(COMPILER, freeze=False)  # one import (services/startup.py)
            if device.type == "cpu":
                prepare_cpu()
            key = self._key(args)
            path = _cache_file(device_kind(device), key, name=f"{self.name}-").with_suffix(".graph")
            if path.exists():
                try:  # an imported module's guard needs a trace's context to be rebuilt in
                    with path.open("rb") as f, tracing(TracingContext(None)):
                        graph = torch.compiler.load_compiled_function(
                            f, f_globals=self.fn.__globals__
                        )
                    if not graph.guard_check(*args):
                        graph = None
                except Exception as exc:  # a file another torch or a torn write left
                    log.warning("compile.load_failed", program=self.name, error=str(exc)[:200])
                    graph = None
            if graph is None:
                options = _options(device)
                compiler = torch.compile(self.fn, fullgraph=True, dynamic=False, options=options)
                graph = compiler.aot_compile((args, {}))
                _WORK["built"] += 1
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    graph.save_compiled_function(str(path))
                except Exception as exc:  # a full disk, an object torch cannot save: runs
                    log.warning("compile.save_failed", program=self.name, error=str(exc)[:200])
            else:
                _WORK["loaded"] += 1
        except Exception as exc:  # dynamo's, inductor's and the C++ compiler's many types
            reason = f"{self.name}: {type(exc).__name__}: {str(exc).strip()[:300]}"
            raise CompileFailedError(reason) from exc
        finally:
            _WORK["seconds"] += time.perf_counter() - start
        self._graphs[key] = graph
        return graph.fn(*args)

    def bind(self, device: torch.device) -> BoundProgram:
        return BoundProgram(self, device)


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and type(a) in (int, float, str) and a == b)


class BoundProgram:
    """A ``Program`` for one caller whose calls differ only in tensor values (the same objects
    for every argument that is neither a tensor nor a container, tensors of the same kinds, the
    same grad mode): the first call compiles (or loads) the graph, the second checks its guards
    once more and keeps it, and every later call runs it without the guards, which for a
    trainer's programs cost a tenth of a small program's call (docs/benchmarks.md). Other
    objects or grad mode go through the guards again; the compiled code checks shapes."""

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


class Graphed:
    """A call replayed as one CUDA graph: the first call runs on a side stream (programs
    compile, cuBLAS makes its handles), the second is captured, every later one replays it.
    ``fn`` reads and writes only tensors that outlive the graph (a trainer's state, in place)
    and returns the graph's outputs, overwritten by the next replay. A failed capture runs
    ``fn`` as usual from then on (one log line)."""

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


def _cache_file(*facts: str, name: str = "") -> Path:
    """The compile cache's file for ``facts`` under this build (torch, the CPU compile option,
    the pod's code): a saved graph or a note; another build's are not found."""
    text = " ".join([torch.__version__, str(CPU_REALIZE_OPCOUNT), code_digest(), *facts])
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    return inductor_cache_dir() / PROGRAMS / f"{name}{digest}"


def note_prefix(env: str, algorithm: str) -> str:
    """How an env's and algorithm's notes are named first: read by a pod's launcher."""
    return re.sub(r"[^\w.-]", "_", f"{env}.{algorithm}.")


def cached(config: RunConfig, key: str, programs: Sequence[str]) -> bool:
    """Whether each of ``programs`` of ``key`` (what fixes them) is noted in the compile cache
    (``mark_cached``; a short run may build only its evaluation): their compile is a load."""
    name = note_prefix(config.env, config.algorithm)
    try:
        return all(_cache_file(key, program, name=name).exists() for program in programs)
    except OSError:
        return False


def mark_cached(config: RunConfig, key: str, program: str) -> None:
    """Note in the compile cache that ``program`` of ``key`` (``config``'s) is in it."""
    try:
        path = _cache_file(key, program, name=note_prefix(config.env, config.algorithm))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{key} {program}")
    except OSError as exc:  # a best effort
        log.info("compile.mark_failed", error=str(exc))


# -- the rule ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """One compiled path on one device type, measured (docs/benchmarks.md): the speed-up over
    eager, a cold compile on the reference machine, a load with ``COMPILER`` imported."""

    speedup: float
    compile_s: float
    warm_s: float


#: Path and device type → its rule, per env step on-policy and per update off-policy: the CPU
#: rows from this project's 2-core machine, one thread (bench/compiled_rows.py); CUDA, an H200.
RULES: dict[tuple[str, str], Rule] = {
    ("onpolicy", "cpu"): Rule(speedup=3.2, compile_s=45.0, warm_s=0.5),
    ("onpolicy", "cuda"): Rule(speedup=20.0, compile_s=20.0, warm_s=4.5),
    ("offpolicy", "cpu"): Rule(speedup=3.2, compile_s=30.0, warm_s=0.5),
    ("offpolicy", "cuda"): Rule(speedup=18.0, compile_s=21.0, warm_s=4.5),
}
#: Seconds the probe takes on the reference machine (``machine_factor``).
PROBE_REFERENCE_S = 0.0015


@functools.cache
def _probe_s() -> float:
    """Seconds a fixed mix of Python and small-tensor work takes here, now: what a compile
    (Python-bound tracing and lowering, then a C++ compiler) scales with."""
    x, total, start = torch.zeros(64), 0, time.perf_counter()
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
        elif self.cached and compiler_imported():  # a load costs less than timing would
            self.compiled, self.reason = True, f"auto: compiling: a load {CACHED}"

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
        self.decide(per_unit, max(0.0, self.units - sum(u for _, u in self._times)))
        return True

    def decide(self, eager_s_per_unit: float, units_left: float) -> None:
        rule, factor = RULES[self.path, self.device.type], machine_factor()
        saved = units_left * eager_s_per_unit * (1.0 - 1.0 / rule.speedup)
        warm_s = rule.warm_s + (0.0 if compiler_imported() else COMPILER_IMPORT_S)
        cost = (warm_s if self.cached else rule.compile_s) * factor
        self.compiled = saved > cost
        self.reason = (
            f"auto: {'compiling' if self.compiled else 'eager'}: the compiled programs save "
            f"about {saved:.0f} s over the {units_left:.0f} "
            f"{'env steps' if self.path == 'onpolicy' else 'updates'} left "
            f"(eager {eager_s_per_unit * 1e6:.1f} us each here, about {rule.speedup:g}x "
            f"compiled), compiling costs about {cost:.1f} s" + (f" {CACHED}" if self.cached else "")
        )
        warm = saved > 2 * warm_s * factor  # a load would clearly pay: `podium compile`
        log.info(DECIDED, path=self.path, compiled=self.compiled, reason=self.reason, warm=warm)
