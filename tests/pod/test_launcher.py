"""services/pod/runtime/launcher.py's fork, in this process: the pid it hands out already leads its
own process group, as a Popen with ``start_new_session`` returns only after the child's setsid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.pod.algorithms.compiled import compiler_missing, mark_cached
from services.pod.runtime import launcher


def test_the_pid_is_handed_out_after_the_pod_leads_its_own_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_setsid = os.setsid

    def slow_setsid() -> int:  # a child that is slow to get there (a loaded machine)
        time.sleep(1.0)
        return real_setsid()

    monkeypatch.setattr(os, "setsid", slow_setsid)  # the fork inherits the patch
    request = {
        "argv": ["--experiment", "e1", "--pod-id", "p1"],
        "env": {},
        "log": str(tmp_path / "log"),
    }
    pid = launcher._fork(request, channels=[])
    try:
        # A signal to its group right away (the backend's stop) must find the group.
        assert os.getpgid(pid) == pid
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 2  # the pod ran: no pod environment, bad input


def test_a_pods_start_up_counts_from_its_fork() -> None:
    """A pod's start-up seconds (its log's ``pod.first_env_step``) count from its process's
    start: psutil's create time was up to a second earlier than the fork (boot time in whole
    seconds), so every pod's start-up read that much longer than it was."""
    from services.pod.__main__ import process_start

    read_r, read_w = os.pipe()
    before = time.time()
    pid = os.fork()
    if pid == 0:
        os.write(read_w, repr(process_start()).encode())
        os._exit(0)
    os.close(read_w)
    started = float(os.read(read_r, 64))
    os.close(read_r)
    os.waitpid(pid, 0)
    # The kernel counts a process's start in clock ticks (10 ms) and the uptime in 10 ms.
    assert before - 0.03 <= started <= time.time(), (started - before, started)


HARNESS = """
import json, sys
from services.pod.algorithms.compiled import compiler_missing
from services.pod.runtime import launcher
launcher.preload()
ready = "torch._dynamo" in sys.modules
launcher.serve(0, sys.stdout)  # until stdin closes
isa = sys.modules.get("torch._inductor.cpu_vec_isa")
print(json.dumps({
    "compiler_at_ready": ready,
    "compiler_after": "torch._dynamo" in sys.modules,
    "isa_probed": bool(isa and isa.valid_vec_isa_list.cache_info().currsize),
}))
"""
ROOT = Path(__file__).resolve().parents[2]


def python(
    code: str, *args: str, stdin: str | None = None, cwd: Path = ROOT, **env: str
) -> subprocess.CompletedProcess[str]:
    """``code`` run by a new interpreter of this checkout (in ``cwd``, with ``env`` over this
    process's environment); it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def serve_one(request: dict, harness: str = HARNESS) -> tuple[list[dict], str]:
    """A real launcher's ``serve`` (after ``preload``) given one request: its answer lines
    and its log (stderr). The forked pod has no pod environment and exits 2."""
    done = python(harness, stdin=json.dumps(request) + "\n")
    return [json.loads(line) for line in done.stdout.splitlines()], done.stderr


@pytest.mark.parametrize(
    ("cache_holds", "compile_values", "imported"),
    [
        ((), None, False),  # a cold cache, the default compile setting
        (("podium-share",), ["auto", "off"], False),  # its bookkeeping is not a program
        (("fxgraph", "podium-programs/Pendulum-v1.sac.0a1b"), None, True),  # pods may load it
        (("fxgraph", "podium-programs/CartPole-v1.ppo.0a1b"), None, False),  # another task's
        ((), ["on"], True),  # pods will compile
    ],
)
def test_the_launcher_imports_the_compiler_only_for_pods_that_need_it(
    tmp_path: Path, cache_holds: tuple[str, ...], compile_values: list[str] | None, imported: bool
) -> None:
    """The compiler's modules (torch._dynamo, inductor: seconds) are not imported before the
    launcher is ready: a pod forked for an eager run need not wait for them. Before the fork of
    a pod that may load compiled programs (its compile cache notes programs of its spec's env
    and algorithm; another task's are no reason to wait) or build them (its spec can pick
    ``compile: on``), the launcher imports them, once for every later pod, and
    runs inductor's probes of the CPU (test programs built and loaded in new interpreters), which
    each pod would run again for its first load or build."""
    cache = tmp_path / "compile-cache"
    (cache / "locks").mkdir(parents=True)
    for name in cache_holds:
        (cache / name).mkdir(parents=True)
    space = {"compile": {"type": "choice", "values": compile_values}} if compile_values else {}
    spec = {"name": "s", "env": {"name": "Pendulum-v1"}, "algorithms": {"sac": 1.0}}
    request = {
        "id": 1,
        "argv": ["--experiment", "e1", "--pod-id", "p1"],  # no pod environment: exits 2
        "env": {
            "PODIUM_COMPILE_CACHE_DIR": str(cache),
            "PODIUM_SPEC": json.dumps({**spec, "search_space": space}),
        },
        "log": str(tmp_path / "pod.log"),
    }
    lines, _ = serve_one(request)
    assert lines[0]["id"] == 1 and lines[0]["pid"] > 0, lines
    probed = imported and compiler_missing("cpu") is None
    assert lines[-1] == {
        "compiler_at_ready": False,
        "compiler_after": imported,
        "isa_probed": probed,
    }, lines


def test_the_launcher_finds_the_notes_a_trainer_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What decides the launcher's wait is the note a compiled program leaves in the cache
    (``mark_cached``), named by its env (any characters) and algorithm, not by a hash alone."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    config = SimpleNamespace(env="envpool:HalfCheetah-v5", algorithm="sac")
    mark_cached(config, "sac P=2 [...]", "update")

    def needs(env: str, algorithms: dict[str, float]) -> bool:
        spec = {"env": {"name": env}, "algorithms": algorithms}
        return launcher.needs_compiler(
            {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "PODIUM_SPEC": json.dumps(spec)}
        )

    assert needs("envpool:HalfCheetah-v5", {"ppo": 0.5, "sac": 0.5})
    assert not needs("envpool:HalfCheetah-v5", {"td3": 1.0})
    assert not needs("HalfCheetah-v5", {"sac": 1.0})


EAGER_POD = """
import json, os, sys
os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[1]  # as a pod sets it
from services.pod.training.presets import train_config
from services.pod.training.trainer import build_trainer
config = train_config(sys.argv[2], [{"total_env_steps": 20_000, **json.loads(sys.argv[3])}])
trainer = build_trainer([config], horizon_env_steps=20_000)
while trainer.decision.compiled is None or trainer.updates == 0:
    trainer.step()
print(trainer.decision.compiled, trainer.updates, "torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize(
    ("env", "layer"),
    [
        ("CartPole-v1", {"ppo": {"compile": "auto"}}),  # decides eager on a short run
        ("Pendulum-v1", {"algorithm": "sac", "compile": "off", "learning_starts": 64}),
    ],
)
def test_an_eager_pod_never_imports_the_compiler(tmp_path: Path, env: str, layer: dict) -> None:
    """What the launcher leaves out must stay out of an eager pod, on-policy or off-policy:
    neither ``auto``'s decision, the compile cache's lookup (which reads the pod's cache
    directory, not inductor's module for it) nor an agent's Adam state (kept without
    ``torch.optim``, whose first optimiser imports it) imports torch._dynamo."""
    done = python(EAGER_POD, str(tmp_path / "cache"), env, json.dumps(layer))
    compiled, updates, imported = done.stdout.split()[-3:]
    assert compiled == "False" and int(updates) > 0
    assert imported == "False"


def test_the_launchers_imports_are_frozen_out_of_its_pods_collections() -> None:
    """The launcher imports with the cyclic collector off (services/startup.py: a quarter of
    the import time was its passes) and freezes what it imported: the pods it forks collect with
    the collector on, without walking those objects again or writing to their shared pages."""
    code = (
        "import gc, json\n"
        "from services.pod.runtime import launcher\n"
        "launcher.preload()\n"
        "print(json.dumps({'enabled': gc.isenabled(), 'frozen': gc.get_freeze_count()}))\n"
    )
    done = json.loads(python(code).stdout.splitlines()[-1])
    assert done["enabled"] and done["frozen"] > 100_000, done


def test_a_compiler_that_cannot_be_imported_still_lets_the_pod_start(tmp_path: Path) -> None:
    """A failed compiler import (a broken install) is logged, and the pod is forked: it meets
    the same error itself, where its log says so, rather than the launcher dying."""
    harness = HARNESS.replace(
        "launcher.preload()\n",
        "launcher.preload()\nfrom services.pod.algorithms import compiled\n"
        "compiled.COMPILER = ('podium_no_such',)\n",
    )
    spec = {"name": "s", "search_space": {"compile": {"type": "choice", "values": ["on"]}}}
    request = {
        "id": 1,
        "argv": ["--experiment", "e1", "--pod-id", "p1"],
        "env": {"PODIUM_SPEC": json.dumps(spec)},
        "log": str(tmp_path / "pod.log"),
    }
    lines, log = serve_one(request, harness)
    assert lines[0]["id"] == 1 and lines[0]["pid"] > 0, lines
    assert "cannot import the compiler" in log


def test_the_launchers_probes_write_nothing_where_it_runs(tmp_path: Path) -> None:
    """An empty ``TORCHINDUCTOR_CACHE_DIR`` (a test's way to give each pod a cache of its own)
    names no directory: the test programs of inductor's CPU probes, which the launcher builds
    before forking a compiling pod, go to inductor's default, not the working directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = {"name": "s", "search_space": {"compile": {"type": "choice", "values": ["on"]}}}
    request = {
        "id": 1,
        "argv": ["--experiment", "e1", "--pod-id", "p1"],  # no pod environment: exits 2
        "env": {"PODIUM_SPEC": json.dumps(spec)},
        "log": str(tmp_path / "pod.log"),
    }
    done = python(HARNESS, stdin=json.dumps(request) + "\n", cwd=cwd, TORCHINDUCTOR_CACHE_DIR="")
    assert json.loads(done.stdout.splitlines()[-1])["compiler_after"]
    assert sorted(p.name for p in cwd.iterdir()) == []
