"""MKL's kernels chosen by the CPU's instruction sets, on AMD CPUs too.

torch runs fp32 matmuls through MKL, which picks its kernels by CPU vendor: on a CPU that does
not say "GenuineIntel" it runs its generic kernels, whatever the CPU can do (docs/benchmarks.md,
"How fast is a pod, against PureJaxRL"). MKL asks its own ``mkl_serv_intel_cpu_true`` whether the
CPU is Intel's; a shared library defining it to answer yes, loaded into the global symbol scope
before torch is, makes MKL choose by the instruction sets the CPU reports (CPUID), as on Intel
CPUs: which kernels run changes, never what they compute beyond float rounding.

``use_cpu_features`` does that: ``services/pod/__init__.py`` calls it, so every pod process
(``python -m services.pod``, the local backend's launcher and the pods it forks, ``podium
train``, the benches, which import it first) has it before it imports torch. The library is
four lines of C, built once with the machine's C compiler into the compile cache's directory
(a pod needs a compiler for its compiled paths anyway; the pod image has one); without a
compiler, or where torch was imported first, MKL keeps its own rule and ``state()`` says why.
A malformed ``PODIUM_POD_MKL_DISPATCH`` keeps it too, and the pod and ``podium train`` refuse to
start with it (``setting_error``).

``PODIUM_POD_MKL_DISPATCH``: ``auto`` (default: by instruction sets on non-Intel x86-64 CPUs that
have AVX2) or ``vendor`` (MKL's own rule). Torch-free: it must run before torch is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

SETTING = "PODIUM_POD_MKL_DISPATCH"
CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"  # inductor's cache directory, as the operator may set it
CHOICES = ("auto", "vendor")
SYMBOL = "mkl_serv_intel_cpu_true"
#: The compile cache's subdirectory the library is built in: the pod's own, never published
#: with the cache's graphs (services/pod/runtime/compile_share.py ``SKIP``).
DIRECTORY = "podium-native"
# C, or C++ where the machine has only a C++ compiler (the name unmangled either way).
SOURCE = f'#ifdef __cplusplus\nextern "C"\n#endif\nint {SYMBOL}(void) {{ return 1; }}\n'

#: What this process runs with: "features" (MKL chooses by instruction sets), or why not.
_state = "not asked"
_error: str | None = None


def state() -> str:
    """ "features" where MKL chooses its kernels by the CPU's instruction sets in this process,
    else MKL's own rule with the reason ("vendor: ..."); logged by the pod at start."""
    return _state


def setting_error() -> str | None:
    """Why ``PODIUM_POD_MKL_DISPATCH`` as this process started with it cannot be used, or None:
    the pod and ``podium train`` refuse to start with it (the package's import cannot)."""
    return _error


def choice(environ: dict[str, str] | None = None) -> str:
    """The ``PODIUM_POD_MKL_DISPATCH`` setting; raises ValueError naming it for anything else."""
    value = (os.environ if environ is None else environ).get(SETTING, "auto").strip() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{SETTING} must be one of {', '.join(CHOICES)}; got {value!r}")
    return value


def wanted(cpuinfo: str, machine: str) -> str | None:
    """None where MKL should choose by instruction sets on this CPU (``cpuinfo``: the text of
    /proc/cpuinfo), else why not: Intel CPUs already get that, and MKL's fast kernels need
    AVX2 (x86-64 only)."""
    if machine not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({machine})"
    first = cpuinfo.split("\n\n", 1)[0]  # the first processor's block
    fields = {
        k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())
    }
    vendor = fields.get("vendor_id", "")
    if vendor == "GenuineIntel":
        return "an Intel CPU (MKL chooses by instruction sets there)"
    if "avx2" not in fields.get("flags", "").split():
        return f"a {vendor or 'CPU'} without AVX2"
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang", "c++", "g++"):
        if name and (found := shutil.which(name)):
            return found
    return None


def operator_cache_dir() -> str | None:
    """``TORCHINDUCTOR_CACHE_DIR`` as the operator set it, or None. An empty one is unset here,
    for every reader in the process: inductor would take it for the working directory."""
    if not (root := os.environ.get(CACHE_DIR)):
        os.environ.pop(CACHE_DIR, None)
    return root or None


def compile_root(environ: Mapping[str, str]) -> str | None:
    """The compile cache a pod started with ``environ`` is told to use: the operator's
    ``TORCHINDUCTOR_CACHE_DIR`` (empty: none), else ``PODIUM_COMPILE_CACHE_DIR``; None: none."""
    return environ.get(CACHE_DIR) or environ.get("PODIUM_COMPILE_CACHE_DIR") or None


def inductor_cache_dir() -> Path:
    """Inductor's cache directory: ``TORCHINDUCTOR_CACHE_DIR``, else torch's default as
    ``torch._inductor.runtime.cache_dir_utils`` writes it: importing inductor to ask takes a
    second, which an eager run would pay for a lookup."""
    if root := operator_cache_dir():
        return Path(root)
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _directory() -> Path:
    """A directory of its own in the compile cache (the operator's, the pod's, else inductor's
    default): a pod can write and load libraries there."""
    return Path(compile_root(os.environ) or inductor_cache_dir()) / DIRECTORY


def build(directory: Path, compiler: str) -> Path:
    """The library, built with ``compiler`` into ``directory`` (once: the file's name is the
    source's hash; written to a temporary name and renamed, so a concurrent pod never loads a
    half-written file). Refuses a directory another user could write into: what is loaded
    from it runs in the pod."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = directory.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{directory} is not this user's alone")
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    path = directory / f"podium-mkl-dispatch-{digest}.so"
    if path.is_file():
        return path
    with tempfile.TemporaryDirectory(dir=directory) as work:
        source, out = Path(work) / "dispatch.c", Path(work) / "dispatch.so"
        source.write_text(SOURCE)
        done = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", str(source), "-o", str(out)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-300:]}")
        out.replace(path)
    return path


def use_cpu_features() -> str:
    """Let MKL choose its kernels by the CPU's instruction sets in this process, where this
    CPU and the setting want it and torch is not imported yet; returns ``state()``. Anything
    else leaves MKL's own rule, with the reason (a malformed setting: ``setting_error()``)."""
    global _state, _error
    try:
        wish = choice()
    except ValueError as error:
        _error, wish = str(error), "vendor"
    if _error is not None:
        _state = f"vendor: {_error}"
    elif wish == "vendor":
        _state = f"vendor: {SETTING}=vendor"
    elif "torch" in sys.modules:
        _state = "vendor: torch was imported before the pod's package"
    else:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
        reason = wanted(cpuinfo, platform.machine()) if cpuinfo else "no /proc/cpuinfo"
        compiler = _compiler()
        if reason is None and compiler is None:
            reason = "no C compiler to build its library"
        if reason is not None:
            _state = f"vendor: {reason}"
        else:
            try:
                ctypes.CDLL(str(build(_directory(), compiler)), mode=ctypes.RTLD_GLOBAL)
                _state = "features"
            except (OSError, subprocess.SubprocessError) as error:
                _state = f"vendor: its library could not be built or loaded ({error})"
    return _state
