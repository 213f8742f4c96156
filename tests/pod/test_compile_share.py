"""Sharing a compile cache between an experiment's pods (services/pod/runtime/compile_share.py)
against the real leaderboard: the program key, the claim, the wait, the fetch; corrupt and
foreign caches refused and compiled again; an eager pod keeps nobody waiting. The compiles here
are files a "trainer" writes into its cache directory: what moves between pods is files,
whatever they hold (tests/e2e/test_compile_once.py and tests/containers/test_pod_image.py run
the real compiles)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from services.api_client import LeaderboardClient
from services.contracts.artifacts import COMPILE_CACHE_KIND, CompileClaim
from services.contracts.bundles import files_under, pack
from services.contracts.spec import ExperimentSpec
from services.pod.runtime.compile_share import (
    SKIP,
    CompileShare,
    compile_facts,
    program_digest,
)
from services.pod.runtime.rounds import PodRuntime, RuntimeSettings
from services.pod.training.presets import pod_config
from tests.pod.harness import TOKEN, InThread, Leaderboard, client, make_spec, register

HYPER = {"learning_rate": 3e-3, "gamma": 0.99, "clip_coef": 0.2}


def configs(slots: int = 1, seed: int = 1, **over: float) -> list:
    spec = ExperimentSpec.model_validate(make_spec())
    return [pod_config(spec, {**HYPER, **over}, seed + i) for i in range(slots)]


def test_the_program_key_ignores_per_agent_hyperparameters_and_seeds() -> None:
    base = program_digest(configs())
    assert program_digest(configs(seed=99, learning_rate=1e-4, gamma=0.9, ent_coef=0.01)) == base
    # Nor what no program is built from: a later run with another budget or target, or an
    # `auto` run after a warm-up with `compile: on`, loads the same programs.
    spec = ExperimentSpec.model_validate(make_spec())
    other = spec.model_copy(update={"target_return": -100.0})
    other.budget.total_env_steps = 12_345
    pinned = pod_config(other, {**HYPER, "compile": "on"}, 1)
    assert pinned.agent_config.compile == "on" and pinned.total_env_steps == 12_345
    assert program_digest([pinned]) == base
    # What shapes the programs changes the key: the network, the batch, the slot count.
    assert program_digest(configs(num_envs=32)) != base
    assert program_digest(configs(hidden_sizes=[64, 64])) != base  # type: ignore[arg-type]
    assert program_digest(configs(slots=2)) != base
    facts = compile_facts(configs())
    assert facts.device.startswith("cpu-") and facts.torch.startswith("2.")


@pytest.fixture(autouse=True)
def close_shares(monkeypatch: pytest.MonkeyPatch):
    """Every share a test makes stops renewing its claim when the test ends (a pod closes its
    share on exit; here the leaderboard goes before the process does)."""
    made: list[CompileShare] = []
    init = CompileShare.__init__

    def record(self: CompileShare, *args, **kw) -> None:
        init(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(CompileShare, "__init__", record)
    yield
    for share in made:
        share.close()


def compiled(cache: Path, name: str = "kernel.so", data: bytes = b"compiled code") -> None:
    """What a trainer's first compile leaves in its cache directory."""
    (cache / "ab").mkdir(parents=True, exist_ok=True)
    (cache / "ab" / name).write_bytes(data)
    (cache / "locks").mkdir(exist_ok=True)
    (cache / "locks" / "ab.lock").write_bytes(b"")  # never shared


def share(lb: Leaderboard, pod: str, cache: Path, **kw: float) -> CompileShare:
    return CompileShare(client(lb, "exp"), pod, cache, **kw)


def in_thread(fn, *args) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def test_the_first_pod_compiles_and_the_others_load_what_it_published(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    register(leaderboard, "exp", make_spec())
    first = share(leaderboard, "p0", tmp_path / "c0")
    first.before_build(configs())
    assert first.outcome["state"] == "claimed" and first.pending
    # Two more pods start meanwhile: they wait for p0's compile, then load it.
    others = [share(leaderboard, f"p{i}", tmp_path / f"c{i}") for i in (1, 2)]
    threads = [in_thread(o.before_build, configs(seed=10 + i)) for i, o in enumerate(others)]
    time.sleep(1.5)
    assert all(t.is_alive() for t in threads), "a pod did not wait for the compile"
    compiled(tmp_path / "c0")
    first.stepped(compile_seconds=12.0)  # compiled: it publishes at its first report
    assert first.pending
    first.reported()
    assert first.outcome["state"] == "published" and first.outcome["files"] == 1
    for t in threads:
        t.join(timeout=30)
    for i, other in enumerate(others, 1):
        assert other.outcome["state"] == "loaded" and other.outcome["holder"] == "p0"
        assert other.outcome["waited_s"] >= 1.0
        assert (tmp_path / f"c{i}" / "ab" / "kernel.so").read_bytes() == b"compiled code"
        assert set(files_under(tmp_path / f"c{i}", SKIP)) == {"ab/kernel.so"}
    # A pod started later (a PBT child's, a replacement) loads at once.
    late = share(leaderboard, "p9", tmp_path / "c9")
    late.before_build(configs(seed=77, learning_rate=1e-4))
    assert late.outcome["state"] == "loaded" and late.outcome["waited_s"] < 1.0


def claimed_from_cache(leaderboard: Leaderboard, tmp_path: Path) -> CompileShare:
    """p5's claim in a second experiment, on the cache c0 that compiled and published the key
    in the first (a second run on the same volume): its cache's index lists the key's files."""
    register(leaderboard, "exp", make_spec())
    first = share(leaderboard, "p0", tmp_path / "c0")
    first.before_build(configs())
    compiled(tmp_path / "c0")
    first.reported()
    register(leaderboard, "exp2", make_spec())
    again = CompileShare(client(leaderboard, "exp2"), "p5", tmp_path / "c0")
    again.before_build(configs())
    assert again.indexed == ["ab/kernel.so"], again.outcome
    return again


def test_a_pod_whose_cache_holds_the_key_publishes_it_at_once(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """A cache that fetched (or published) a key before, claimed again for it in another
    experiment (a second run on the same volume): its files go out after its first step, and
    the experiment's other pods load them; a marker file touched again is not new."""
    again = claimed_from_cache(leaderboard, tmp_path)
    again.stepped(compile_seconds=0.01)  # it loaded: its first step publishes them
    assert again.outcome["state"] == "published" and again.outcome["from_cache"], again.outcome
    assert not again.pending
    other = CompileShare(client(leaderboard, "exp2"), "p6", tmp_path / "c6")
    other.before_build(configs())
    assert other.outcome["state"] == "loaded" and other.outcome["holder"] == "p5"
    assert (tmp_path / "c6" / "ab" / "kernel.so").read_bytes() == b"compiled code"
    # A claimant whose cache lacks one of the files compiles (and publishes what it builds).
    (tmp_path / "c6" / "ab" / "kernel.so").unlink()
    marker = tmp_path / "c6" / "ready-abc"
    marker.write_bytes(b"")
    register(leaderboard, "exp3", make_spec())
    third = CompileShare(client(leaderboard, "exp3"), "p7", tmp_path / "c6")
    third.before_build(configs())
    assert third.outcome["state"] == "claimed"
    later = time.time() + 60
    os.utime(marker, (later, later))  # touched again by the trainer: not new
    third.reported()
    assert third.outcome["state"] == "published" and third.outcome["files"] == 0


def test_a_pod_whose_cache_holds_the_key_does_not_wait_for_the_holder(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """Pods sharing one cache directory (the embedded platform's) that already holds the key:
    while the experiment's first pod holds the claim, the others load from the directory at
    once instead of waiting for its publish (on a warm platform, a second and more a pod)."""
    holder = claimed_from_cache(leaderboard, tmp_path)
    assert holder.pending  # it publishes after its first step
    other = CompileShare(client(leaderboard, "exp2"), "p6", tmp_path / "c0")
    thread = in_thread(other.before_build, configs(seed=5))
    thread.join(timeout=5)
    assert not thread.is_alive(), "a pod with the files at hand waited for the holder"
    assert other.outcome["state"] == "local" and other.outcome["holder"] == "p5"
    # A pod with another directory still waits for the holder's files, then loads them.
    elsewhere = CompileShare(client(leaderboard, "exp2"), "p7", tmp_path / "c7")
    thread = in_thread(elsewhere.before_build, configs(seed=6))
    time.sleep(1.0)
    assert thread.is_alive()
    holder.stepped(compile_seconds=0.01)
    thread.join(timeout=30)
    assert elsewhere.outcome["state"] == "loaded"
    assert (tmp_path / "c7" / "ab" / "kernel.so").read_bytes() == b"compiled code"


def test_a_pod_whose_programs_come_later_publishes_them_once_they_ran(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """An off-policy pod's first step fills its replay (no update, nothing compiled yet), and
    ``auto`` times eager calls before it compiles: the claim holds through that step and any
    report before the programs ran, then the compile is published; the others load it."""
    register(leaderboard, "exp", make_spec())
    first = share(leaderboard, "p0", tmp_path / "c0")
    first.before_build(configs())
    first.stepped(compile_seconds=0.0, compiles_later=True)
    first.reported(compiles_later=True)
    assert first.pending
    other = share(leaderboard, "p1", tmp_path / "c1")
    thread = in_thread(other.before_build, configs(seed=3))
    time.sleep(1.0)
    assert thread.is_alive(), "a pod went on before the compile it should load"
    compiled(tmp_path / "c0")
    first.reported(compiles_later=False)
    assert first.outcome["state"] == "published" and first.outcome["files"] == 1
    thread.join(timeout=30)
    assert other.outcome["state"] == "loaded"
    # A final report publishes whatever there is: nobody waits for a pod that ended.
    register(leaderboard, "exp2", make_spec())
    ended = CompileShare(client(leaderboard, "exp2"), "p2", tmp_path / "c2")
    ended.before_build(configs())
    ended.reported(compiles_later=False)
    assert ended.outcome["state"] == "published" and ended.outcome["files"] == 0


def test_an_eager_pod_keeps_nobody_waiting(leaderboard: Leaderboard, tmp_path: Path) -> None:
    register(leaderboard, "exp", make_spec())
    first = share(leaderboard, "p0", tmp_path / "c0")
    first.before_build(configs())
    waiting = share(leaderboard, "p1", tmp_path / "c1")
    thread = in_thread(waiting.before_build, configs())
    first.stepped(compile_seconds=0.0)  # its first step compiled nothing
    assert not first.pending and first.outcome["state"] == "published"
    thread.join(timeout=30)
    assert waiting.outcome["state"] == "nothing_to_fetch"


def test_an_auto_pod_that_chooses_eager_releases_the_others_before_its_first_report(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """A real pod's trainer with ``compile: auto`` times a few eager iterations, then trains
    eager (a short budget): the pods waiting on its key go on then, not a round later (its
    first report: on a cold Pendulum SAC tournament, 3 s lost by half its pods)."""
    spec = make_spec(round={"env_steps": 16_384}, budget={"total_env_steps": 16_384})
    register(leaderboard, "exp", spec)
    settings = RuntimeSettings(work_dir=tmp_path / "p0", compile_cache_dir=tmp_path / "cache")
    model = ExperimentSpec.model_validate(spec)
    rt = PodRuntime("exp", "p0", model, client(leaderboard, "exp"), settings)
    running = InThread(rt)
    assert rt.compile_share is not None
    running.wait_until(lambda rt: rt.compile_share.outcome.get("state") == "published")
    assert rt.rounds == 0, "published only at the first report"
    assert rt.trainer is not None and rt.trainer.decision.compiled is False
    assert rt.compile_share.outcome["files"] == 0
    running.stop()


def publish_raw(lb: Leaderboard, tmp_path: Path, meta: dict, data: bytes = b"x") -> None:
    """A bundle published under the key of ``configs()`` as another pod would."""
    facts = compile_facts(configs())
    src = tmp_path / "raw"
    compiled(src, data=data)
    out = io.BytesIO()
    pack(src, files_under(src, ("locks",)), meta, out)
    with client(lb, "exp") as c:
        c.compile_claim(CompileClaim(pod_id="other", facts=facts))
        c.compile_publish(CompileClaim(pod_id="other", facts=facts), out.getvalue())


def test_a_corrupt_cache_is_refused_and_compiled_again(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    register(leaderboard, "exp", make_spec())
    facts = compile_facts(configs())
    publish_raw(leaderboard, tmp_path, {"kind": COMPILE_CACHE_KIND, **facts.model_dump()})
    # The stored blob rots on disk: its bytes no longer match the record's sha256.
    [blob] = [p for p in (tmp_path / "lb" / "blobs").rglob("*") if len(p.name) == 64]
    blob.write_bytes(blob.read_bytes()[:-10] + b"0123456789")
    pod = share(leaderboard, "p1", tmp_path / "c1")
    pod.before_build(configs())
    assert pod.outcome["state"] == "claimed", pod.outcome  # refused, so it compiles
    assert files_under(tmp_path / "c1", SKIP) == {}  # nothing of the corrupt cache kept
    compiled(tmp_path / "c1", data=b"good code")
    pod.reported()
    later = share(leaderboard, "p2", tmp_path / "c2")
    later.before_build(configs())
    assert later.outcome["state"] == "loaded" and later.outcome["holder"] == "p1"
    assert (tmp_path / "c2" / "ab" / "kernel.so").read_bytes() == b"good code"


def test_a_cache_for_other_facts_is_refused(leaderboard: Leaderboard, tmp_path: Path) -> None:
    register(leaderboard, "exp", make_spec())
    facts = compile_facts(configs())
    foreign = {"kind": COMPILE_CACHE_KIND, **facts.model_dump(), "device": "cuda-H200-sm90-cu12.8"}
    publish_raw(leaderboard, tmp_path, foreign)
    pod = share(leaderboard, "p1", tmp_path / "c1")
    pod.before_build(configs())
    assert pod.outcome["state"] == "claimed"
    assert files_under(tmp_path / "c1", SKIP) == {}


def test_a_pod_compiles_itself_after_waiting_its_limit(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    register(leaderboard, "exp", make_spec())
    share(leaderboard, "p0", tmp_path / "c0").before_build(configs())  # and never publishes
    waiting = share(leaderboard, "p1", tmp_path / "c1", wait_s=1.0)
    begin = time.monotonic()
    waiting.before_build(configs())
    assert waiting.outcome["state"] == "wait_expired" and time.monotonic() - begin < 10
    compiled(tmp_path / "c1")  # it compiles, and publishes since nobody has
    waiting.reported()
    assert waiting.outcome["state"] == "published"


def test_without_a_leaderboard_the_pod_compiles_itself(tmp_path: Path) -> None:
    lb = Leaderboard(tmp_path / "lb")  # never started: nothing listens on its port
    pod = CompileShare(
        client(lb, "exp").__class__(lb.url, "exp", retry_for_s=0), "p0", tmp_path / "c0"
    )
    pod.before_build(configs())
    assert pod.outcome["state"] == "failed" and not pod.pending


NOEXEC_PROBE = """
import os, sys, tempfile
from pathlib import Path
from services.pod.runtime.compile_cache import use_compile_cache
use_compile_cache(Path(sys.argv[1]))
print(tempfile.gettempdir())
"""


def test_where_tmp_is_noexec_temporary_files_go_to_the_compile_cache(tmp_path: Path) -> None:
    """A library built or unpacked in the temporary directory is loaded from there: on a
    noexec /tmp (Docker's --tmpfs, compose's hardening) that fails. A private mount
    namespace with such a /tmp, as root (skipped elsewhere)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private noexec /tmp")
    if Path(sys.executable).is_relative_to("/tmp"):
        pytest.skip("the interpreter lies under /tmp, which the namespace's own /tmp hides")
    # Outside /tmp: the namespace's own /tmp hides the test's directories there.
    outside = Path(tempfile.mkdtemp(dir="/var/tmp"))
    cache = outside / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    script = f'mount -t tmpfs -o noexec tmpfs /tmp && exec {sys.executable} -c "$0" "$1"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, NOEXEC_PROBE, str(cache)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    shutil.rmtree(outside, ignore_errors=True)
    if "mount" in proc.stderr and proc.returncode != 0:
        pytest.skip(f"cannot mount here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(cache / "tmp"), proc.stdout
    # On an exec-capable /tmp nothing moves.
    plain = subprocess.run(
        [sys.executable, "-c", NOEXEC_PROBE, str(tmp_path / "c2")],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    )
    assert plain.stdout.strip() != str(tmp_path / "c2" / "tmp")


class StallingProxy:
    """A TCP proxy to a local ``port`` that forwards every connection but the ``stall``-th,
    which it accepts and never answers: a request lost on the way, the leaderboard healthy."""

    def __init__(self, port: int, stall: int) -> None:
        self.port, self.stall, self.count = port, stall, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.held: list[socket.socket] = []
        in_thread(self._serve)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.count += 1
            if self.count == self.stall:
                self.held.append(conn)
                continue
            upstream = socket.create_connection(("127.0.0.1", self.port))
            in_thread(_pump, conn, upstream)
            in_thread(_pump, upstream, conn)

    def close(self) -> None:
        self.server.close()
        for conn in self.held:
            conn.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for end in (src, dst):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


def test_a_renewal_lost_on_the_way_does_not_lose_the_claim(tmp_path: Path) -> None:
    lb = Leaderboard(tmp_path / "lb", compile_claim_ttl_s=3.0).start()
    proxy = StallingProxy(lb.port, stall=2)  # 1: the pod's claim; 2: its first renewal
    try:
        register(lb, "exp", make_spec())
        pod = LeaderboardClient(proxy.url, "exp", TOKEN, initial_backoff_s=0.05)
        first = CompileShare(pod, "p0", tmp_path / "c0")
        first.before_build(configs())
        assert first.outcome["state"] == "claimed"
        time.sleep(3 * 3.0)  # three TTLs of compiling, the first renewal never answered
        other = share(lb, "p1", tmp_path / "c1", wait_s=0.5)
        other.before_build(configs())
        # p0 still holds the key: p1 waited (its limit here is short), it did not claim.
        assert other.outcome["state"] == "wait_expired", other.outcome
        assert other.outcome["holder"] == "p0", other.outcome
        assert proxy.count >= 3  # p0 renewed on a new connection
        first.close()
    finally:
        proxy.close()
        lb.stop()
