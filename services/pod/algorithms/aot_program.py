"""Programs compiled ahead of time and kept on disk: a function of tensors traced once,
compiled by AOTInductor into a shared library (a ``.pt2`` package), and loaded by every later
process in milliseconds.

Why, on a CPU: ``torch.compile``'s caches keep the kernels, but a new process still runs
dynamo's trace and AOTAutograd again before its first call (seconds per program), and every
call passes through dynamo's frame lookup and inductor's Python wrapper (tens of
microseconds, paid by each of an Anakin iteration's 32 calls). A loaded AOTInductor package is
one C++ call: no trace, no guards (docs/benchmarks.md, "Session 26").

What is traced: ``make_fx`` runs the function once on the example tensors and records its aten
ops (it sees through ``torch.func.grad`` and ``vmap``, which ``torch.export`` refuses here, and
keeps ``while_loop`` as one op); ``torch.export`` turns that graph into the program AOTInductor
compiles. So a program is fixed to its inputs' shapes, dtypes, strides and device, and to the
Python-level choices the function made while traced: it is for pure functions of tensors whose
structure depends only on those (the Anakin iteration's pieces). Callers pass contiguous
tensors of the example's shapes; ``Program.__call__`` checks the shapes on its first calls.

Where: ``<inductor's cache directory>/podium-aot/<name>-<key>.pt2``, so the pod's compile cache
(services/pod/runtime/compile_cache.py) keeps them across restarts and PBT children. The key
hashes the name, the caller's description (the shape), the inputs, the torch and Python
versions, the machine, the thread count and the pod's source code: any of them changing
builds a new program. A package is a shared library this process wrote: never load one from
anywhere else.
"""

from __future__ import annotations

import functools
import getpass
import hashlib
import json
import multiprocessing
import os
import platform
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch

from services.logs import get_logger
from services.pod.algorithms.compiled import trust_vec_isa

log = get_logger(__name__)

#: Programs built (compiled; ``built_ahead``: of them, by ``build_concurrently``) and loaded
#: (from disk, or just after a build) in this process.
COUNTS: Counter[str] = Counter()
#: Seconds this process spent building and loading programs (the trainers' compile clock).
SECONDS = [0.0]
_POD_SOURCES = Path(__file__).resolve().parents[1]  # services/pod
#: Calls of a program whose input shapes are checked against the example's.
_CHECKED_CALLS = 3
#: Set to 0 to compile with ``torch.compile`` instead (an escape hatch, and A/B benches).
SWITCH = "PODIUM_AOT_PROGRAMS"
#: The most processes building programs at once (``builders``).
BUILDERS = "PODIUM_AOT_BUILDERS"


def used_on(device: torch.device | str) -> bool:
    """Whether programs for ``device`` are compiled ahead of time: on a CPU, unless
    ``PODIUM_AOT_PROGRAMS`` is 0 (on CUDA the Anakin iteration replays as one CUDA graph)."""
    return torch.device(device).type == "cpu" and os.environ.get(SWITCH, "1") != "0"


@functools.cache
def _source_digest() -> str:
    """A digest of the pod's Python sources: a traced program is the code that ran."""
    digest = hashlib.sha256()
    for path in sorted(_POD_SOURCES.rglob("*.py")):
        digest.update(str(path.relative_to(_POD_SOURCES)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _cpu() -> str:
    """This CPU's model and flags: inductor compiles for the CPU it runs on (its vector ISA,
    ``-march=native``), and a cache directory on a shared volume may be read on another."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")  # x86, then arm
    return " ".join(dict.fromkeys(line for line in lines if line.startswith(wanted)))


def cache_root() -> Path:
    """The directory of the packages: under inductor's cache directory (the pod's), found as
    inductor finds it (``torch._inductor.runtime.cache_dir_utils``, whose import would load
    inductor and dynamo: about a second of a new process that only loads programs)."""
    if directory := os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(directory).absolute() / "podium-aot"
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}" / "podium-aot"


def _describe(t: torch.Tensor) -> list:
    # A program takes contiguous inputs, whose strides follow from their shape but for a
    # dimension of size 1, whose stride is never read: two such inputs are the same program's
    # (an agent dimension of 1 comes strided one way from eager code, another from a program).
    return [str(t.dtype), list(t.shape), str(t.device)]


def _key(**facts: object) -> str:
    facts |= {
        "torch": torch.__version__,
        "python": sys.version,
        "machine": platform.machine(),
        "cpu": _cpu(),
        "threads": torch.get_num_threads(),
        "sources": _source_digest(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def program_key(name: str, description: str, example: Sequence[torch.Tensor]) -> str:
    return _key(name=name, description=description, inputs=[_describe(t) for t in example])


def package_path(name: str, description: str, example: Sequence[torch.Tensor]) -> Path:
    """Where the program ``Program(name, fn, example, description)`` is kept."""
    return cache_root() / f"{name}-{program_key(name, description, example)}.pt2"


def mark_ready(signature: str) -> None:
    """Record that every program a caller's ``signature`` (say, a trainer's configuration)
    needs is built here, so that a later process can tell its compile is already paid
    (``ready``) before it builds anything."""
    path = cache_root() / f"ready-{_key(signature=signature)}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as exc:  # a read-only cache: the next process assumes a cold compile
        log.warning("aot.mark_failed", path=str(path), error=str(exc))


def ready(signature: str) -> bool:
    """Whether ``mark_ready(signature)`` ran with this cache, code, torch and CPU."""
    return (cache_root() / f"ready-{_key(signature=signature)}").exists()


def _tally(signature: str) -> Path:
    return cache_root() / f"eager-{_key(signature=signature)}.json"


def eager_seconds(signature: str) -> float:
    """Seconds that earlier runs of a caller's ``signature`` lost here by training without
    these programs, as each estimated it (``add_eager_seconds``); 0 where none did. What a
    compile would have saved them is what it has already cost not to build it: a caller
    weighing a compile counts it (a ski rental: stop renting once the rent paid reaches the
    price)."""
    try:
        return float(json.loads(_tally(signature).read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: none counted
        return 0.0


def add_eager_seconds(signature: str, seconds: float) -> None:
    """Add ``seconds`` to ``eager_seconds(signature)`` (written beside, then renamed: a reader
    never sees half a file; two runs adding at once may lose one's addition, which only
    delays a compile)."""
    path = _tally(signature)
    total = eager_seconds(signature) + seconds
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"seconds": total}, f)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache: later runs count nothing lost
        log.warning("aot.tally_failed", path=str(path), error=str(exc))
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


# -- building several at once ------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """A program a caller is about to ask for (``Programs.get``), to build ahead: its name,
    function, example inputs and description as the caller will pass them. ``fn`` goes to
    another process, so it must pickle: a module-level function, or a ``functools.partial``
    of one."""

    name: str
    fn: Callable[..., Sequence[torch.Tensor]]
    example: Sequence[torch.Tensor]
    description: str = ""

    @property
    def path(self) -> Path:
        return package_path(self.name, self.description, self.example)


#: One build process's peak memory, with room (0.49 GB measured: docs/benchmarks.md).
_BUILD_BYTES = 640 << 20


def _cgroup(name: str) -> str | None:
    """A cgroup v2 file of this process's container (None: not there)."""
    try:
        return Path("/sys/fs/cgroup", name).read_text().strip()
    except OSError:
        return None


def builders() -> int:
    """How many processes ``build_concurrently`` may run: no more than the CPUs this process
    may use (its affinity, its container's CPU quota), than its container's free memory holds
    builds, and than ``PODIUM_AOT_BUILDERS`` (default 4; a pod sets its CPU share; 1: none
    ahead, one program after another on first use)."""
    try:
        bounds = [len(os.sched_getaffinity(0))]
    except AttributeError:  # not on Linux
        bounds = [os.cpu_count() or 1]
    try:
        bounds.append(int(os.environ.get(BUILDERS, "4")))
    except ValueError:
        log.warning("aot.builders_invalid", value=os.environ[BUILDERS], using=1)
        bounds.append(1)
    try:
        quota = (_cgroup("cpu.max") or "max").split()
        if quota[0] != "max":
            bounds.append(int(quota[0]) // int(quota[1]))
        limit, used = _cgroup("memory.max"), _cgroup("memory.current")
        if limit is not None and limit != "max" and used is not None:
            bounds.append((int(limit) - int(used)) // _BUILD_BYTES)
    except (ValueError, IndexError):  # an unexpected cgroup file: no bound from it
        pass
    return max(1, min(bounds))


def _start_builder(threads: int) -> None:
    # The program's key holds the thread count, and inductor's C++ is generated for it.
    torch.set_num_threads(threads)


def build_concurrently(jobs: Sequence[Job]) -> int:
    """Build the programs of ``jobs`` that the cache does not hold yet, each in a process of
    its own (spawned), up to ``builders()`` at once, in the order given (give the longest
    first); returns how many were built. A compile is one core's work of tens of seconds
    per program, most of it Python, so programs built one after another on first use wait
    for each other where cores are idle. Nothing is built where fewer than two programs are
    missing or one process is all there may be. A program that fails here is left to its
    first use, which builds it again and falls back as ever; the seconds count in
    ``SECONDS``, the programs in ``COUNTS["built"]``."""
    missing = [job for job in jobs if not job.path.exists()]
    processes = min(len(missing), builders())
    if processes < 2:
        return 0
    start, built = time.perf_counter(), 0
    context = multiprocessing.get_context("spawn")  # no fork of a process with torch threads
    try:
        with ProcessPoolExecutor(
            processes,
            mp_context=context,
            initializer=_start_builder,
            initargs=(torch.get_num_threads(),),
        ) as pool:
            futures = {
                pool.submit(_build, job.fn, [t.contiguous() for t in job.example], job.path): job
                for job in missing
            }
            for future in as_completed(futures):
                try:
                    future.result()
                    built += 1
                except Exception as exc:  # the first use builds it again, or falls back
                    log.warning(
                        "aot.build_ahead_failed",
                        program=futures[future].name,
                        error=f"{type(exc).__name__}: {str(exc).strip()[:300]}",
                    )
    except OSError as exc:  # no process could start (limits, memory): first use builds
        log.warning("aot.build_ahead_failed", program=None, error=f"OSError: {exc}")
    spent = time.perf_counter() - start
    SECONDS[0] += spent
    COUNTS["built"] += built
    COUNTS["built_ahead"] += built
    log.info("aot.built_ahead", programs=built, processes=processes, seconds=round(spent, 2))
    return built


class _Traced(torch.nn.Module):
    def __init__(self, graph: torch.fx.GraphModule) -> None:
        super().__init__()
        self.graph_module = graph

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.graph_module(*args))


def _build(
    fn: Callable[..., Sequence[torch.Tensor]], example: Sequence[torch.Tensor], path: Path
) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    if all(t.device.type == "cpu" for t in example):
        trust_vec_isa()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside, then renamed: pods sharing the cache never load a half-written package.
    fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
    os.close(fd)
    try:
        with warnings.catch_warnings():
            # torch's own pytree use in export and AOTInductor (torch 2.13): not ours to fix.
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            warnings.filterwarnings(
                "ignore", message=".*script_method.*", category=DeprecationWarning
            )
            graph = make_fx(fn, tracing_mode="real")(*example)
            exported = torch.export.export(_Traced(graph), tuple(example), strict=False)
            torch._inductor.aoti_compile_and_package(exported, package_path=tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_or_none(
    name: str,
    fn: Callable[..., Sequence[torch.Tensor]],
    example: Sequence[torch.Tensor],
    description: str = "",
    fallback: str = "torch.compile",
) -> Program | None:
    """``Program(...)``, or None where it cannot be traced or built: logged (``aot.failed``) and
    counted (``COUNTS["failed"]``); the caller then runs ``fn`` another way, ``fallback``
    (what the log says)."""
    try:
        return Program(name, fn, example, description)
    except Exception as exc:  # a trace or build failure of any kind
        COUNTS["failed"] += 1
        log.warning(
            "aot.failed",
            program=name,
            error=f"{type(exc).__name__}: {str(exc).strip()[:300]}",
            fallback=fallback,
        )
        return None


class Programs:
    """The programs of one caller in this process, each built (or loaded) on its first use:
    keyed by name, the shape object's id and a variant (what else sets the inputs' shapes).
    The id, not the shape: a frozen dataclass hashes all its fields on every lookup, and a
    lookup runs on every call of a program; the entry keeps the shape alive, so the id stays
    its own. None for a program that could not be built (``build_or_none``)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[object, Program | None]] = {}

    def get(
        self,
        name: str,
        shape: object,
        variant: object,
        args: Sequence[torch.Tensor],
        make_fn: Callable[[], Callable[..., Sequence[torch.Tensor]]],
        fallback: str = "torch.compile",
    ) -> Program | None:
        key = (name, id(shape), variant)
        entry = self._entries.get(key)
        if entry is None:
            program = build_or_none(name, make_fn(), args, repr(shape), fallback)
            entry = self._entries[key] = (shape, program)
        return entry[1]

    def clear(self) -> None:
        self._entries.clear()


def _load(path: Path) -> torch._C._aoti.AOTIModelPackageLoader:
    """The package's runner, through the C++ loader that ``torch._inductor.aoti_load_package``
    wraps: importing inductor (and dynamo with it) would cost a new process about a second,
    and its only other step, a warning where the CPU differs from the one that built the
    package, is the key's job here. One runner, called from one thread (the trainer's):
    ``run_single_threaded`` skips the runner pool's locking."""
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, -1)


class Program:
    """``fn`` (tensors in, a sequence of tensors out) compiled ahead of time for inputs like
    ``example``: loaded from the cache when there, else built and saved. Raises what the
    trace or the compile raised (the caller falls back)."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., Sequence[torch.Tensor]],
        example: Sequence[torch.Tensor],
        description: str = "",
    ) -> None:
        if not all(t.is_contiguous() for t in example):
            raise ValueError(f"{name}: a program is built for contiguous inputs")
        self.name = name
        self.shapes = [t.shape for t in example]
        self.path = package_path(name, description, example)
        start = time.perf_counter()
        built = not self.path.exists()
        if built:
            _build(fn, example, self.path)
            COUNTS["built"] += 1
        try:
            self._runner = _load(self.path)
        except Exception:
            if built:
                raise
            # A damaged file: build it again.
            log.warning("aot.reload_failed", program=name, path=str(self.path))
            _build(fn, example, self.path)
            COUNTS["built"] += 1
            built = True
            self._runner = _load(self.path)
        COUNTS["loaded"] += 1
        spent = time.perf_counter() - start
        SECONDS[0] += spent
        log.info("aot.ready", program=name, built=built, seconds=round(spent, 3))
        self._calls = 0

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        if self._calls < _CHECKED_CALLS:
            self._calls += 1
            got = [t.shape for t in args]
            if got != self.shapes or not all(t.is_contiguous() for t in args):
                raise ValueError(f"{self.name}: inputs {got} (contiguous) expected {self.shapes}")
        return self._runner.run(list(args))
