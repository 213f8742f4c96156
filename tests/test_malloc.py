"""The pods' malloc (services/malloc.py): finding tcmalloc/jemalloc, the environment that preloads
it, what a process started with it really runs with, the setting, and `podium train`.

Real libraries and real child processes throughout. Where an allocator is needed that a CI
machine lacks, a copy of zlib (on every Linux machine, loaded by no bare interpreter, harmless to
preload) stands in under the allocator's file name: the finder and the dynamic linker see a real
ELF shared object. With a real tcmalloc or jemalloc on this machine (e.g. Debian's
libtcmalloc-minimal4; ``LD_LIBRARY_PATH`` is searched too), more tests run."""

from __future__ import annotations

import ctypes.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from services.malloc import (
    NONE_FOUND,
    AllocatorError,
    describe,
    find_allocator,
    locate,
    mapped_libraries,
    resolve_for,
    with_allocator,
)
from services.orchestrator.settings import OrchestratorSettings

ROOT = Path(__file__).resolve().parents[1]
LIBZ = locate(ctypes.util.find_library("z") or "libz.so.1")
REAL = find_allocator()  # a real tcmalloc/jemalloc on this machine, if any

needs_libz = pytest.mark.skipif(LIBZ is None, reason="no zlib shared library found")
needs_real = pytest.mark.skipif(REAL is None, reason="no tcmalloc or jemalloc on this machine")

# What a child reports: the libraries it maps and the allocator it says it runs with.
REPORT = (
    "import json; from services.malloc import mapped_libraries, running_allocator; "
    "a = running_allocator(); "
    "print(json.dumps({'mapped': [str(p) for p in mapped_libraries()], 'name': a.name, "
    "'library': str(a.library)}))"
)


def stand_in(directory: Path, name: str) -> Path:
    """A real shared library (a copy of zlib) named ``name`` in ``directory``."""
    assert LIBZ is not None
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(LIBZ, directory / name)
    return directory / name


def bare_env() -> dict[str, str]:
    """This process's environment without a preload (the test runner may have one)."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def report(env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", REPORT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(proc.stdout)


def maps(paths: list[str], library: Path) -> bool:
    """Whether ``library`` (maybe a symlink) is among the mapped ``paths`` (real files)."""
    return any(os.path.samefile(p, library) for p in paths if os.path.exists(p))


# -- finding one ---------------------------------------------------------------------------------
@needs_libz
def test_auto_prefers_tcmalloc_minimal_then_tcmalloc_then_jemalloc_wherever_each_is(
    tmp_path: Path,
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    jemalloc = stand_in(first, "libjemalloc.so.2")
    tcmalloc = stand_in(second, "libtcmalloc.so.4")
    minimal = stand_in(second, "libtcmalloc_minimal.so.4")
    dirs = [first, second]
    found = find_allocator(dirs)
    assert found is not None and (found.name, found.library) == ("tcmalloc", minimal)
    assert with_allocator({}, "auto", dirs) == {"LD_PRELOAD": str(minimal)}
    minimal.unlink()
    assert with_allocator({}, "auto", dirs) == {"LD_PRELOAD": str(tcmalloc)}
    tcmalloc.unlink()
    found = find_allocator(dirs)
    assert found is not None and (found.name, found.library) == ("jemalloc", jemalloc)
    jemalloc.unlink()
    assert find_allocator(dirs) is None
    assert with_allocator({"PATH": "/bin"}, "auto", dirs) == {"PATH": "/bin"}  # as it was


@needs_libz
def test_what_pods_run_with_is_named_and_where_auto_found_none_how_to_get_one(
    tmp_path: Path,
) -> None:
    """What `podium up` and `podium run` say of their pods' malloc (services/cli/platform.py)."""
    empty, found = tmp_path / "empty", tmp_path / "found"
    empty.mkdir()
    tcmalloc = stand_in(found, "libtcmalloc_minimal.so.4")
    jemalloc = stand_in(tmp_path / "preloaded", "libjemalloc.so.2")
    none = f"system ({NONE_FOUND})"
    for choice, dirs, env, said in [
        ("auto", [found], {}, "tcmalloc"),
        ("auto", [empty], {}, none),
        ("auto", [empty], {"LD_PRELOAD": f"{jemalloc}:{LIBZ}"}, "jemalloc"),  # inherited
        ("system", [found], {"LD_PRELOAD": str(jemalloc)}, "jemalloc"),
        ("auto", [empty], {"LD_PRELOAD": "/nonexistent/libtcmalloc.so.4"}, none),  # not loaded
        ("system", [found], {}, "system"),
        (str(tcmalloc), [empty], {}, "tcmalloc"),
    ]:
        library = resolve_for(env, choice, dirs)
        assert describe(choice, library, env, dirs) == said, (choice, dirs, env)


@needs_libz
def test_a_file_the_linker_could_not_preload_is_passed_over(tmp_path: Path) -> None:
    """Not ELF, or a library of another machine (a multilib or foreign copy): the linker would
    refuse it on every start of every pod; the next allocator is taken instead."""
    (tmp_path / "a").mkdir()
    linker_script = "INPUT(-ltcmalloc)\n"  # what some distributions install as libfoo.so
    (tmp_path / "a" / "libtcmalloc_minimal.so.4").write_text(linker_script)
    foreign = stand_in(tmp_path / "b", "libtcmalloc.so.4")
    data = bytearray(foreign.read_bytes())
    data[18] ^= 0xFF  # e_machine: another architecture
    foreign.write_bytes(bytes(data))
    jemalloc = stand_in(tmp_path / "c", "libjemalloc.so.2")
    found = find_allocator([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    assert found is not None and found.library == jemalloc


@needs_libz
def test_the_library_goes_first_in_ld_preload_keeping_what_is_there_once(tmp_path: Path) -> None:
    lib = stand_in(tmp_path, "libtcmalloc_minimal.so.4")
    env = {"LD_PRELOAD": "/opt/a.so /opt/b.so", "X": "1"}
    out = with_allocator(env, "auto", [tmp_path])
    assert out == {"LD_PRELOAD": f"{lib}:/opt/a.so /opt/b.so", "X": "1"}
    assert env == {"LD_PRELOAD": "/opt/a.so /opt/b.so", "X": "1"}  # a copy, not changed
    assert with_allocator(out, "auto", [tmp_path]) == out  # not twice
    assert with_allocator(out, str(lib), [tmp_path]) == out
    link = tmp_path / "link.so"
    link.symlink_to(lib)
    assert with_allocator({"LD_PRELOAD": str(link)}, str(lib)) == {"LD_PRELOAD": str(link)}
    # auto leaves an allocator someone preloaded alone; "system" never preloads.
    chosen = {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}
    assert with_allocator(chosen, "auto", [tmp_path]) == chosen
    assert with_allocator({"X": "1"}, "system", [tmp_path]) == {"X": "1"}
    # An explicit path is what was asked, found or not by auto.
    assert with_allocator({}, str(lib), []) == {"LD_PRELOAD": str(lib)}


@pytest.mark.parametrize(
    ("choice", "says"),
    [
        ("tcmalloc", "must be 'auto', 'system' or the absolute path"),
        ("libs/libtcmalloc_minimal.so.4", "must be 'auto', 'system' or the absolute path"),
        ("", "must be 'auto', 'system' or the absolute path"),
        ("/no/such/libtcmalloc_minimal.so.4", "does not exist"),
        ("{text}", "is not a shared library this machine can load"),
    ],
)
def test_a_bad_choice_is_an_error_naming_the_setting(
    tmp_path: Path, choice: str, says: str
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a library")
    with pytest.raises(AllocatorError) as exc:
        with_allocator({}, choice.format(text=text))
    assert "PODIUM_POD_MALLOC" in str(exc.value) and "pod_malloc" in str(exc.value)
    assert says in str(exc.value)


# -- a child started with it ---------------------------------------------------------------------
@needs_libz
def test_a_child_started_with_the_environment_maps_the_library(tmp_path: Path) -> None:
    assert LIBZ is not None
    bare = report(bare_env())
    assert not maps(bare["mapped"], LIBZ), "a bare interpreter maps zlib: pick another library"
    # Without a preloaded allocator the reporter names the system's malloc: glibc's libc.
    assert bare["name"] == "system"
    assert Path(bare["library"]).name.startswith("libc")

    child = report(with_allocator(bare_env(), str(LIBZ)))
    assert maps(child["mapped"], LIBZ)
    # The reporter names the library that provides malloc, not merely what is preloaded: zlib
    # has no malloc.
    assert child["name"] == "system"

    # auto, from a library directory: the stand-in under tcmalloc's name.
    lib = stand_in(tmp_path, "libtcmalloc_minimal.so.4")
    child = report(with_allocator(bare_env(), "auto", [tmp_path]))
    assert maps(child["mapped"], lib)


@needs_real
def test_a_child_started_with_auto_runs_with_the_real_allocator() -> None:
    assert REAL is not None and REAL.library is not None
    child = report(with_allocator(bare_env(), "auto"))
    assert maps(child["mapped"], REAL.library)
    assert child["name"] == REAL.name
    assert os.path.samefile(child["library"], REAL.library)
    assert report(with_allocator(bare_env(), "system"))["name"] == "system"


def test_mapped_libraries_of_this_process_include_libc() -> None:
    assert any(re.match(r"libc[.-]", p.name) for p in mapped_libraries())  # libc-2.31.so too
    assert mapped_libraries(2**22 + 12345) == []  # no such process


# -- the setting ---------------------------------------------------------------------------------
def test_the_orchestrator_setting_takes_auto_system_or_an_absolute_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PODIUM_POD_MALLOC", raising=False)
    assert OrchestratorSettings().pod_malloc == "auto"
    for good in ("auto", "system", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"):
        monkeypatch.setenv("PODIUM_POD_MALLOC", good)
        assert OrchestratorSettings().pod_malloc == good
    for bad in ("tcmalloc", "lib/libtcmalloc.so.4", "AUTO"):
        monkeypatch.setenv("PODIUM_POD_MALLOC", bad)
        with pytest.raises(ValidationError) as exc:
            OrchestratorSettings()
        [error] = exc.value.errors()
        assert error["loc"] == ("pod_malloc",)
        assert "PODIUM_POD_MALLOC" in error["msg"] and repr(bad) in error["msg"]


# -- podium train ----------------------------------------------------------------------------------
@needs_libz
def test_podium_train_restarts_itself_with_the_library_before_importing_torch(
    tmp_path: Path,
) -> None:
    """It trains in its own process: it execs its command line anew (the same pid) with the
    library preloaded. Observed in /proc: once torch is loaded, the library is mapped."""
    lib = stand_in(tmp_path / "lib", "libtcmalloc_minimal.so.4")
    env = {**bare_env(), "PODIUM_POD_MALLOC": str(lib)}
    argv = [sys.executable, "-m", "services.cli", "train", "CartPole-v1", "--quiet"]
    argv += ["--out", str(tmp_path / "run"), "--set", "total_env_steps=100000000"]
    argv += ["--set", "target_return=100000"]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        mapped: list[str] = []
        while time.monotonic() < deadline and proc.poll() is None:
            mapped = [str(p) for p in mapped_libraries(proc.pid)]
            if any("libtorch" in Path(p).name for p in mapped):
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"torch never loaded; exit {proc.poll()}: {proc.stderr.read()}")
        assert maps(mapped, lib)
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            assert f"LD_PRELOAD={lib}".encode() in f.read().split(b"\0")
    finally:
        proc.kill()
        proc.communicate()


@needs_libz
def test_the_pod_restarts_itself_with_the_library_before_its_other_imports(
    tmp_path: Path,
) -> None:
    """`python -m services.pod` re-executes itself first of all: what it imported before the
    exec (twice in all) is its package and services.malloc, not pydantic or the logging."""
    lib = stand_in(tmp_path / "lib", "libtcmalloc_minimal.so.4")
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "services.pod", "--help"],
        env={**bare_env(), "PODIUM_POD_MALLOC": str(lib)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert imported.count("services.malloc") == 2  # before and after the exec
    assert imported.count("pydantic") == 1 and imported.count("structlog") == 1


def test_train_says_which_allocator_it_trains_with(tmp_path: Path) -> None:
    """The allocator sets the speed of compiled and off-policy updates: `podium train` names
    the one it runs with first, and where it found none, how to get one."""
    none = (
        "malloc: system (no tcmalloc or jemalloc on this machine; Debian or Ubuntu: "
        "apt-get install libtcmalloc-minimal4 trains faster)"
    )
    for choice, expected in [
        ("auto", f"malloc: {REAL.name}" if REAL else none),
        ("system", "malloc: system"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "services.cli", "train", "CartPole-v1",
             "--out", str(tmp_path / choice), "--set", "total_env_steps=1024",
             "--set", "ppo.compile=off"],
            env={**bare_env(), "PODIUM_POD_MALLOC": choice}, cwd=ROOT,
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.splitlines()[0] == expected


def test_podium_train_names_a_bad_setting(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", "CartPole-v1"],
        env={**bare_env(), "PODIUM_POD_MALLOC": str(tmp_path / "missing.so")},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert f"PODIUM_POD_MALLOC (pod_malloc): {tmp_path / 'missing.so'} does not exist" in (
        proc.stderr
    )


def test_podium_train_run_inside_another_program_does_not_restart_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The app invoked in this (the test runner's) process: re-executing would restart pytest.
    A bad setting shows whether the allocator was looked at: it must not be."""
    from services.cli.app import app

    monkeypatch.setenv("PODIUM_POD_MALLOC", "/no/such/libtcmalloc_minimal.so.4")
    result = CliRunner().invoke(app, ["train", "NoSuchEnv-v0"])
    assert result.exit_code == 2
    assert "PODIUM_POD_MALLOC" not in result.output
    assert "NoSuchEnv-v0" in result.output


def test_podium_train_run_inside_another_program_leaves_its_log_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The command sets PODIUM_LOG_LEVEL for the processes it starts, for its own run only:
    the calling program's later processes must not all log nothing."""
    from services.cli.app import app

    monkeypatch.delenv("PODIUM_LOG_LEVEL", raising=False)
    assert CliRunner().invoke(app, ["train", "NoSuchEnv-v0"]).exit_code == 2
    assert "PODIUM_LOG_LEVEL" not in os.environ
    monkeypatch.setenv("PODIUM_LOG_LEVEL", "DEBUG")
    assert CliRunner().invoke(app, ["train", "NoSuchEnv-v0"]).exit_code == 2
    assert os.environ["PODIUM_LOG_LEVEL"] == "DEBUG"
