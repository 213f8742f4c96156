"""A faster malloc for training pods: find tcmalloc or jemalloc, preload it into a child's
environment, and tell which allocator a process runs with.

Why: a compiled training step (torch.compile, inductor) allocates every intermediate and every
output anew on each call, and on a CPU glibc's malloc and free took a good part of a compiled
PPO iteration; tcmalloc preloaded (``LD_PRELOAD``) cut it more than jemalloc did, and glibc's
own tunables did nothing (docs/benchmarks.md, "The pods' allocator"). PyTorch's own CPU
launcher (``torch.backends.xeon.run_cpu --enable-tcmalloc``) does the same. A process cannot
change its allocator once it runs: the library has to be named in the environment of the
process that is about to start, so this module builds that environment (``with_allocator``),
and a process that must switch (``podium train``) re-executes itself
(``reexec_with_allocator``).

The choice is a setting (the orchestrator's ``pod_malloc``, ``PODIUM_POD_MALLOC``):

- ``auto`` (default): the first of ``ALLOCATORS`` this machine has, else the system's malloc;
- ``system``: never preload anything;
- an absolute path: that shared library (it must exist and be an ELF shared object of this
  machine's architecture).

Torch-free and Linux-minded: elsewhere ``auto`` finds nothing and leaves the environment alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The environment variable (and orchestrator setting) that picks the pods' allocator.
SETTING = "PODIUM_POD_MALLOC"
AUTO = "auto"
SYSTEM = "system"

#: What ``auto`` looks for, best first: (allocator, file name). tcmalloc's minimal build (no heap
#: profiler; Debian's libtcmalloc-minimal4) measured fastest; jemalloc (libjemalloc2) next.
ALLOCATORS: tuple[tuple[str, str], ...] = (
    ("tcmalloc", "libtcmalloc_minimal.so.4"),
    ("tcmalloc", "libtcmalloc.so.4"),
    ("jemalloc", "libjemalloc.so.2"),
)

#: Where ``auto`` finds none on this machine (the set-up installs none), what to do about it.
NONE_FOUND = (
    "no tcmalloc or jemalloc on this machine; Debian or Ubuntu: apt-get install "
    "libtcmalloc-minimal4 trains faster"
)

#: Library file name prefixes -> allocator, to name what a process runs with.
_KNOWN = (("libtcmalloc", "tcmalloc"), ("libjemalloc", "jemalloc"), ("libmimalloc", "mimalloc"))
#: Set in the environment of a process ``reexec_with_allocator`` started: it must not re-exec.
_REEXEC_MARK = "PODIUM_MALLOC_REEXEC"
_ELF_MAGIC = b"\x7fELF"
_ET_DYN = 3


class AllocatorError(ValueError):
    """A ``pod_malloc`` / ``PODIUM_POD_MALLOC`` value that cannot be used."""


@dataclass(frozen=True)
class Allocator:
    """An allocator: its name ("tcmalloc", "jemalloc", "system", ...) and its library."""

    name: str
    library: Path | None = None


def check_choice(value: str) -> str:
    """``value`` if it is a valid choice ("auto", "system" or an absolute path), else raise
    ``AllocatorError`` naming the setting. Checks the form only (the settings validator runs
    it wherever the orchestrator starts, also where the library cannot be, e.g. on Kubernetes);
    ``resolve`` checks the file."""
    if value in (AUTO, SYSTEM) or (value and Path(value).is_absolute()):
        return value
    raise AllocatorError(
        f"{SETTING} (pod_malloc) must be {AUTO!r}, {SYSTEM!r} or the absolute path of a shared "
        f"library such as /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4; got {value!r}"
    )


def _elf_header(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(20)
    except OSError:
        return b""


def _loadable(path: Path) -> bool:
    """Whether the dynamic linker of this process could preload ``path``: an ELF shared object
    of this interpreter's class, byte order and machine. (A library of another architecture is
    skipped by the linker with an error on every start of every child; better not named.)"""
    head = _elf_header(path)
    if len(head) < 20 or head[:4] != _ELF_MAGIC:
        return False
    order = "little" if head[5] == 1 else "big"
    if int.from_bytes(head[16:18], order) != _ET_DYN:
        return False
    own = _own_header()
    if len(own) < 20 or own[:4] != _ELF_MAGIC:
        return True  # nothing to compare with
    return head[4:6] == own[4:6] and head[18:20] == own[18:20]


@functools.cache
def _own_header() -> bytes:
    """This interpreter's ELF header (read once: it does not change while the process runs)."""
    return _elf_header(Path("/proc/self/exe")) or _elf_header(Path(sys.executable))


def library_dirs() -> list[Path]:
    """Where ``auto`` looks besides the dynamic linker's cache, in order: ``LD_LIBRARY_PATH``
    (searched by the linker before its cache), the interpreter's prefix (a conda environment's
    lib/), and the usual system directories of this machine's architecture."""
    arch = f"{platform.machine()}-linux-gnu"
    dirs = [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    dirs += [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    dirs += [Path("/usr/lib") / arch, Path("/lib") / arch]
    dirs += [Path("/usr/lib64"), Path("/lib64"), Path("/usr/local/lib"), Path("/usr/lib")]
    return list(dict.fromkeys(dirs))


def _linker_cache(names: Iterable[str]) -> dict[str, Path]:
    """File name -> path for ``names``, from the dynamic linker's cache (``ldconfig -p``); {}
    without one. Libraries of other architectures (multilib) are in it too: ``_loadable``
    drops them."""
    # Not shutil.which: importing shutil maps zlib, bz2 and lzma; this module stays light.
    path = [*os.environ.get("PATH", "").split(os.pathsep), "/sbin", "/usr/sbin"]
    ldconfig = next(
        (c for d in path if d and os.access(c := os.path.join(d, "ldconfig"), os.X_OK)), None
    )
    if ldconfig is None:
        return {}
    try:
        out = subprocess.run(
            [ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    wanted, found = set(names), {}
    for match in re.finditer(r"^\s*(\S+) \(([^)]*)\) => (\S+)\s*$", out, re.MULTILINE):
        name, path = match.group(1), Path(match.group(3))
        if name in wanted and name not in found and _loadable(path):
            found[name] = path
    return found


def locate(name: str, dirs: Sequence[str | Path] | None = None) -> Path | None:
    """The path of shared library file ``name`` (e.g. "libz.so.1") that this process could
    preload: in ``dirs`` if given (only there), else in ``library_dirs()`` and the linker's
    cache; None if there is none."""
    return _locate([name], dirs).get(name)


def _locate(names: Iterable[str], dirs: Sequence[str | Path] | None) -> dict[str, Path]:
    found: dict[str, Path] = {}
    missing = []
    search = library_dirs() if dirs is None else dirs
    for name in names:
        for d in search:
            if _loadable(Path(d) / name):
                found[name] = Path(d) / name
                break
        else:
            missing.append(name)
    if missing and dirs is None:  # the cache only for what the directories lack (a subprocess)
        found.update(_linker_cache(missing))
    return found


def find_allocator(dirs: Sequence[str | Path] | None = None) -> Allocator | None:
    """The best allocator of ``ALLOCATORS`` this machine has (tcmalloc before jemalloc,
    wherever each is), or None. ``dirs``: look only there (tests point it at a directory
    of their own); default: ``library_dirs()`` and the dynamic linker's cache."""
    found = _locate((file for _, file in ALLOCATORS), dirs)
    for name, file in ALLOCATORS:
        if file in found:
            return Allocator(name, found[file])
    return None


def setting() -> str:
    """This process's ``PODIUM_POD_MALLOC`` (``auto`` unset)."""
    return os.environ.get(SETTING, AUTO)


def resolve(choice: str, dirs: Sequence[str | Path] | None = None) -> Path | None:
    """The library ``choice`` asks to preload, or None for the system's malloc. Raises
    ``AllocatorError`` (naming the setting) for a malformed choice or a path that is not a
    loadable shared library: a typo must not silently train on the slower allocator."""
    check_choice(choice)
    if choice == SYSTEM:
        return None
    if choice == AUTO:
        found = find_allocator(dirs)
        return found.library if found else None
    path = Path(choice)
    if not path.is_file():
        raise AllocatorError(f"{SETTING} (pod_malloc): {choice} does not exist")
    if not _loadable(path):
        raise AllocatorError(
            f"{SETTING} (pod_malloc): {choice} is not a shared library this machine can load "
            "(an ELF shared object of its architecture)"
        )
    return path


def _preloaded(env: Mapping[str, str]) -> list[str]:
    # ld.so splits LD_PRELOAD on spaces and colons.
    return [p for p in re.split(r"[:\s]+", env.get("LD_PRELOAD", "")) if p]


def _preloaded_allocators(env: Mapping[str, str]) -> list[Path]:
    """The allocators ``env``'s ``LD_PRELOAD`` names (someone chose one)."""
    return [Path(p) for p in _preloaded(env) if _allocator_name(Path(p))]


def _same(a: str, b: Path) -> bool:
    if a == str(b):
        return True
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return False


def with_allocator(
    env: Mapping[str, str], choice: str, dirs: Sequence[str | Path] | None = None
) -> dict[str, str]:
    """A copy of ``env`` for a child process that runs with the allocator ``choice`` picks:
    its library first in ``LD_PRELOAD`` (what was there is kept, after it; a library already
    there is not added twice). ``auto`` leaves an ``LD_PRELOAD`` that already names an
    allocator alone (someone chose one); with nothing found, ``env`` as it is. Raises
    ``AllocatorError`` like ``resolve``."""
    return preload(env, resolve_for(env, choice, dirs))


def resolve_for(
    env: Mapping[str, str], choice: str, dirs: Sequence[str | Path] | None = None
) -> Path | None:
    """``resolve`` for processes started with ``env``: None for ``auto`` where its
    ``LD_PRELOAD`` already names an allocator (someone chose one: it is not to be put behind
    another)."""
    if choice == AUTO and _preloaded_allocators(env):
        return None
    return resolve(choice, dirs)


def preload(env: Mapping[str, str], library: Path | None) -> dict[str, str]:
    """A copy of ``env`` with ``library`` first in ``LD_PRELOAD`` (what was there kept after
    it; not added twice); ``env`` as it is for None (the system's malloc)."""
    out = dict(env)
    if library is None or any(_same(p, library) for p in _preloaded(env)):
        return out
    rest = env.get("LD_PRELOAD", "").strip()
    out["LD_PRELOAD"] = f"{library}:{rest}" if rest else str(library)
    return out


def describe(
    choice: str,
    library: Path | None,
    env: Mapping[str, str] = os.environ,
    dirs: Sequence[str | Path] | None = None,
) -> str:
    """In a user's words, the allocator of processes started with ``env`` and ``library``
    preloaded (``resolve_for`` of ``choice``): its name (else the one ``env``'s ``LD_PRELOAD``
    names, which they inherit), or ``system``, with ``NONE_FOUND`` where ``auto`` finds none."""
    if library is None:
        library = next((p for p in _preloaded_allocators(env) if _loadable(p)), None)
    if library is not None:
        return _allocator_name(library) or library.name
    return f"{SYSTEM} ({NONE_FOUND})" if choice == AUTO and not find_allocator(dirs) else SYSTEM


def _allocator_name(library: Path) -> str | None:
    for prefix, name in _KNOWN:
        if library.name.startswith(prefix):
            return name
    return None


def _maps(pid: int | str = "self") -> list[tuple[int, int, Path]]:
    """(start, end, file) of each file-backed mapping of process ``pid`` (its
    ``/proc/<pid>/maps``), in address order; [] where there is no /proc."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, _, end = fields[0].partition("-")
            out.append((int(start, 16), int(end, 16), Path(fields[5])))
    return out


def mapped_libraries(pid: int | str = "self") -> list[Path]:
    """The shared objects mapped into process ``pid``, in address order, each once; [] where
    there is no /proc. A preloaded library that the dynamic linker refused (missing, wrong
    architecture) is not among them."""
    return list(dict.fromkeys(path for _, _, path in _maps(pid) if ".so" in path.name))


def running_allocator() -> Allocator:
    """The allocator this process runs with: the library that provides the ``malloc`` its
    code calls (the symbol's address, looked up in ``/proc/self/maps``), so that a pod can log
    it. That is the truth even where several are mapped (the first preloaded one wins).
    ``system`` with libc as its library without a preloaded allocator; ``system`` with no
    library where this cannot be read (no /proc)."""
    import ctypes  # here: the control plane imports this module and never needs it

    try:
        address = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return Allocator(SYSTEM)
    for start, end, library in _maps():
        if address is not None and start <= address < end:
            if ".so" not in library.name:  # a non-PIE interpreter's own address for malloc
                return _first_defining(ctypes)
            return Allocator(_allocator_name(library) or _system_or(library), library)
    return Allocator(SYSTEM)


def _first_defining(ctypes: Any) -> Allocator:
    """Where the symbol's address is the executable's (a non-PIE program that calls malloc
    has it at its own PLT: Debian's python3.11), the dynamic linker's order decides: the first
    ``LD_PRELOAD`` library mapped here that defines ``malloc``, else the system's."""
    mapped = mapped_libraries()
    for entry in _preloaded(os.environ):
        for library in mapped:
            if _same(entry, library):
                try:
                    ctypes.CDLL(str(library)).malloc  # noqa: B018 (defines it?)
                except (OSError, AttributeError):
                    continue
                return Allocator(_allocator_name(library) or library.name, library)
    libc = next((lib for lib in mapped if _system_or(lib) == SYSTEM), None)
    return Allocator(SYSTEM, libc)


def _system_or(library: Path) -> str:
    # glibc's libc.so.6, musl's libc.musl-*.so.1 / ld-musl-*.so.1: the system's malloc.
    return SYSTEM if re.match(r"(libc[.-]|ld-musl)", library.name) else library.name


def reexec_with_allocator(choice: str | None = None) -> None:
    """Re-execute this process's command line with the allocator ``choice`` picks preloaded
    (default: ``PODIUM_POD_MALLOC``, else ``auto``), for a command that trains in its own
    process (``podium train``) and so cannot be given an allocator by a parent. Returns
    (nothing to do) when the choice preloads nothing, when the library is already mapped, and
    in the re-executed process itself (an environment marker: a library the dynamic linker
    refused must not loop). Call it before torch is imported: everything before is done twice.
    Raises ``AllocatorError`` like ``resolve``."""
    if os.environ.pop(_REEXEC_MARK, None) is not None:
        return
    choice = setting() if choice is None else choice
    env = with_allocator(os.environ, choice)
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        return
    library = _preloaded(env)[0]
    if any(_same(str(p), Path(library)) for p in mapped_libraries()):
        return
    env[_REEXEC_MARK] = library
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
