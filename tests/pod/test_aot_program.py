"""Programs compiled ahead of time (services/pod/algorithms/aot_program.py): built once into the
cache directory, loaded by every later ``Program`` of the same key, rebuilt from a damaged
file, strict about their inputs; the Anakin programs fall back to ``torch.compile`` where one
cannot be built; inductor's ISA probe is skipped only where the compiler takes every ISA's
flags. Real builds (g++ through AOTInductor), small functions."""

from __future__ import annotations

import os
import platform
import stat
import sys
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from services.pod.algorithms import aot_program
from services.pod.algorithms.aot_program import Program
from services.pod.algorithms.compiled import trust_vec_isa
from services.pod.training import anakin
from services.pod.training.anakin import PUREJAXRL_CARTPOLE, AnakinPPO

SMALL = PUREJAXRL_CARTPOLE.model_copy(update={"num_steps": 16, "update_epochs": 1})


def affine(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.tanh(x @ w)
    return y, y.sum(0)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor" / "podium-aot"


def test_a_program_equals_its_function_and_a_second_one_loads_it(cache: Path) -> None:
    x, w = torch.randn(5, 3), torch.randn(3, 4)
    before = dict(aot_program.COUNTS)
    first = Program("affine", affine, [x, w], "shape 1")
    assert first.path.parent == cache and first.path.exists()
    for got, want in zip(first(x, w), affine(x, w), strict=True):
        torch.testing.assert_close(got, want)
    x2 = torch.randn(5, 3)  # new values, same program
    torch.testing.assert_close(first(x2, w)[0], affine(x2, w)[0])

    second = Program("affine", affine, [x, w], "shape 1")
    assert second.path == first.path
    assert aot_program.COUNTS["built"] == before.get("built", 0) + 1  # loaded, not built
    assert aot_program.COUNTS["loaded"] == before.get("loaded", 0) + 2
    torch.testing.assert_close(second(x, w)[1], affine(x, w)[1])
    # Another description (the caller's shape) or other inputs: another program.
    assert Program("affine", affine, [x, w], "shape 2").path != first.path
    assert Program("affine", affine, [torch.randn(6, 3), w], "shape 1").path != first.path
    assert aot_program.COUNTS["built"] == before.get("built", 0) + 3


def test_a_damaged_package_is_built_again(cache: Path) -> None:
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    path = Program("damaged", affine, [x, w]).path
    path.write_bytes(b"not a package")
    built = aot_program.COUNTS["built"]
    with capture_logs() as logs:
        again = Program("damaged", affine, [x, w])
    assert aot_program.COUNTS["built"] == built + 1
    assert any(e["event"] == "aot.reload_failed" for e in logs)
    torch.testing.assert_close(again(x, w)[0], affine(x, w)[0])


def test_inputs_unlike_the_example_are_refused(cache: Path) -> None:
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    with pytest.raises(ValueError, match="contiguous inputs"):
        Program("strided", affine, [x, w.t().contiguous().t()])
    program = Program("strict", affine, [x, w])
    with pytest.raises(ValueError, match="expected"):
        program(torch.randn(5, 3), w)
    with pytest.raises(ValueError, match="expected"):
        program(x, torch.randn(2, 3).t())  # the right shape, not contiguous


def broken(x: torch.Tensor) -> tuple[torch.Tensor]:
    raise RuntimeError("cannot be traced")


def test_programs_built_at_once_are_the_ones_first_use_loads(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each missing program in a spawned process of its own; a later ``Program`` of the same
    key loads it (a size-1 dimension strided otherwise is the same program). One that fails
    is logged and left to its first use; nothing is built ahead where one process is all
    there may be, or where the cache holds them."""
    x, w, v = torch.randn(5, 3), torch.randn(3, 4), torch.randn(1, 3)
    jobs = [
        aot_program.Job("affine", affine, [x, w], "a"),
        aot_program.Job("affine", affine, [v, w], "a"),
        aot_program.Job("broken", broken, [x], "b"),
    ]
    monkeypatch.setattr(aot_program, "builders", lambda: 1)
    assert aot_program.build_concurrently(jobs) == 0 and not cache.exists()
    monkeypatch.setattr(aot_program, "builders", lambda: 2)
    before = dict(aot_program.COUNTS)
    with capture_logs() as logs:
        assert aot_program.build_concurrently(jobs) == 2
    [failed] = [e for e in logs if e["event"] == "aot.build_ahead_failed"]
    assert failed["program"] == "broken" and "cannot be traced" in failed["error"]
    assert aot_program.COUNTS["built_ahead"] == before.get("built_ahead", 0) + 2
    one_row = torch.randn(3, 1).t()  # (1, 3), contiguous, its size-1 dimension's stride 1
    assert one_row.stride() != v.stride()
    for example in ([x, w], [one_row, w]):
        program = Program("affine", affine, example, "a")
        torch.testing.assert_close(program(*example)[0], affine(*example)[0])
    assert aot_program.COUNTS["built"] == before.get("built", 0) + 2  # both loaded
    assert aot_program.build_concurrently(jobs[:2]) == 0  # in the cache already


def test_where_no_build_process_starts_the_programs_are_left_to_first_use(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(aot_program, "ProcessPoolExecutor", refuse)
    monkeypatch.setattr(aot_program, "builders", lambda: 2)
    w = torch.randn(3, 4)
    jobs = [aot_program.Job("affine", affine, [torch.randn(n, 3), w]) for n in (2, 5)]
    with capture_logs() as logs:
        assert aot_program.build_concurrently(jobs) == 0
    [failed] = [e for e in logs if e["event"] == "aot.build_ahead_failed"]
    assert "Resource temporarily unavailable" in failed["error"]
    assert not any(job.path.exists() for job in jobs)


def test_builders_are_bounded_by_cpus_setting_quota_and_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files: dict[str, str] = {}
    monkeypatch.setattr(aot_program, "_cgroup", files.get)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv(aot_program.BUILDERS, raising=False)
    assert aot_program.builders() == 4  # the default setting
    monkeypatch.setenv(aot_program.BUILDERS, "6")
    assert aot_program.builders() == 6
    monkeypatch.setenv(aot_program.BUILDERS, "16")
    assert aot_program.builders() == 8  # the CPUs this process may use
    monkeypatch.setenv(aot_program.BUILDERS, "several")
    assert aot_program.builders() == 1
    monkeypatch.setenv(aot_program.BUILDERS, "16")
    files["cpu.max"] = "250000 100000"  # a container's quota of 2.5 CPUs
    assert aot_program.builders() == 2
    files["cpu.max"] = "max 100000"
    files["memory.max"], files["memory.current"] = str(3 << 30), str(1 << 30)
    assert aot_program.builders() == 3  # 2 GiB free, 640 MiB a build
    files["memory.current"] = str(3 << 30)
    assert aot_program.builders() == 1
    files["memory.max"] = "max"
    assert aot_program.builders() == 8
    files["cpu.max"] = "unexpected"
    assert aot_program.builders() == 8


def test_the_switch_turns_programs_compiled_ahead_of_time_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert anakin._Programs("cpu").aot and aot_program.used_on("cpu")
    monkeypatch.setenv(aot_program.SWITCH, "0")
    assert not anakin._Programs("cpu").aot and not aot_program.used_on("cpu")
    assert not anakin._Programs("cuda").aot  # CUDA captures the iteration as a CUDA graph


@pytest.mark.slow
def test_an_anakin_program_that_cannot_be_built_falls_back_to_torch_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no AOTInductor here")

    monkeypatch.setattr(aot_program, "Program", refuse)
    monkeypatch.setattr(anakin, "_PROGRAMS", anakin._ProgramsByDevice())
    eager = AnakinPPO(SMALL, [1], total_env_steps=10 * SMALL.batch_size)
    compiled = AnakinPPO(SMALL, [1], total_env_steps=10 * SMALL.batch_size, compile="steps")
    with capture_logs() as logs:
        compiled.step()
    eager.step()
    failed = [e for e in logs if e["event"] == "aot.failed"]
    fallbacks = {e["program"]: e["fallback"] for e in failed}
    assert fallbacks == {
        "rollout_chunk": "torch.compile",
        "minibatch_update": "torch.compile",
        "batch": "eager",  # compiled, it measured no faster
    }
    torch.testing.assert_close(compiled.state["params"], eager.state["params"])


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the check covers inductor's x86 ISAs",
)
def test_the_isa_probe_is_kept_where_the_compiler_refuses_a_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor import config, cpu_vec_isa

    if not cpu_vec_isa.x86_isa_checker():
        pytest.skip("this CPU has no vector ISA inductor compiles for")
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    refusing = tmp_path / "refusing-g++"
    refusing.write_text("#!/bin/sh\necho 'unrecognized command-line option' >&2\nexit 1\n")
    refusing.chmod(refusing.stat().st_mode | stat.S_IEXEC)
    check = trust_vec_isa.__wrapped__  # not the process's cached answer
    assert check(str(refusing)) is False
    assert config.cpp.vec_isa_ok is None  # inductor probes as usual
    # The real compiler takes every flag: inductor takes the CPU's ISAs without its probe.
    assert check(os.environ.get("CXX", "g++")) is True
    assert config.cpp.vec_isa_ok is True
