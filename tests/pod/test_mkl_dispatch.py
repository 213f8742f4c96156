"""MKL's kernels chosen by the CPU's instruction sets (services/pod/mkl_dispatch.py)."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from services.pod import mkl_dispatch

ROOT = Path(__file__).resolve().parents[2]

AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma avx512f\n"
INTEL = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 fma\n"
OLD_AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx\n"


def test_which_cpus_want_it() -> None:
    """Non-Intel x86-64 CPUs with AVX2 only: Intel's get MKL's own choice by instruction sets
    already, and without AVX2 there is no faster kernel to choose."""
    assert mkl_dispatch.wanted(AMD, "x86_64") is None
    assert mkl_dispatch.wanted(AMD + "\n" + OLD_AMD, "x86_64") is None  # the first block
    assert "Intel" in mkl_dispatch.wanted(INTEL, "x86_64")
    assert "AVX2" in mkl_dispatch.wanted(OLD_AMD, "x86_64")
    assert "x86-64" in mkl_dispatch.wanted(AMD, "aarch64")


def test_the_setting_is_checked() -> None:
    assert mkl_dispatch.choice({}) == "auto"
    assert mkl_dispatch.choice({mkl_dispatch.SETTING: "vendor"}) == "vendor"
    with pytest.raises(ValueError, match=mkl_dispatch.SETTING):
        mkl_dispatch.choice({mkl_dispatch.SETTING: "fast"})


def test_a_malformed_setting_is_refused_at_start(tmp_path: Path) -> None:
    """The pod and ``podium train`` exit with a message naming the setting, not a traceback
    (the package's import, where it is read, keeps MKL's own rule)."""
    env = {**os.environ, mkl_dispatch.SETTING: "fast", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for command in (
        ["-m", "services.pod", "--experiment", "e", "--pod-id", "p"],
        ["-m", "services.cli", "train", "CartPole-v1", "--out", str(tmp_path / "run")],
    ):
        done = subprocess.run(
            [sys.executable, *command],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 2, output[-2000:]
        assert f"{mkl_dispatch.SETTING} must be one of auto, vendor; got 'fast'" in output
        assert "Traceback" not in output
    assert not (tmp_path / "run").exists()


def _compiler() -> str:
    compiler = mkl_dispatch._compiler()
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    return compiler


def test_the_library_answers_yes_and_is_built_once(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    path = mkl_dispatch.build(directory, _compiler())
    assert getattr(ctypes.CDLL(str(path)), mkl_dispatch.SYMBOL)() == 1
    built = path.stat().st_mtime_ns
    assert mkl_dispatch.build(directory, _compiler()) == path
    assert path.stat().st_mtime_ns == built
    assert [p.name for p in directory.iterdir()] == [path.name]  # no temporary files left


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    """What is built there is loaded into the pod: a directory another user could write
    into could hand it any library."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(OSError, match="not this user's alone"):
        mkl_dispatch.build(shared, _compiler())
    assert list(shared.iterdir()) == []


#: MKL's code branches (mkl_cbwr.h): what it runs on "any x86-64" and on AVX2.
COMPATIBLE, AVX2 = 2, 10


def _mkl_branch(tmp_path: Path, setting: str) -> tuple[int, str]:
    """The code branch MKL chooses for this CPU (its ``cbwr_get_auto_branch``, in torch's
    library) and the pod's state, in a fresh process that imports the pod's package, then
    torch."""
    code = (
        "import ctypes, os, services.pod, torch\n"
        "from services.pod import mkl_dispatch\n"
        "lib = os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_cpu.so')\n"
        "print(ctypes.CDLL(lib).mkl_serv_cbwr_get_auto_branch(), mkl_dispatch.state())\n"
    )
    env = {**os.environ, mkl_dispatch.SETTING: setting, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    branch, state = done.stdout.strip().splitlines()[-1].split(" ", 1)
    return int(branch), state


def _this_cpu_wants_it() -> str | None:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "no /proc/cpuinfo"
    return mkl_dispatch.wanted(cpuinfo, platform.machine())


@pytest.mark.skipif(
    _this_cpu_wants_it() is not None, reason=f"MKL's own rule fits this CPU: {_this_cpu_wants_it()}"
)
def test_mkl_runs_the_kernels_of_the_cpus_instruction_sets(tmp_path: Path) -> None:
    """On a non-Intel CPU MKL runs its generic kernels (the "compatible" branch) unless the
    pod's package told it otherwise; then it runs the AVX2 or AVX-512 branch the CPU can.
    ``vendor`` keeps MKL's own rule."""
    _compiler()
    branch, state = _mkl_branch(tmp_path, "auto")
    assert state == "features"
    assert branch >= AVX2
    branch, state = _mkl_branch(tmp_path, "vendor")
    assert state.startswith("vendor")
    assert branch == COMPATIBLE
