"""The pod's roles as separate OS processes, started the way the three containers of a Kubernetes
Pod start them (``--role learner``, ``--role worker``, ``--role evaluator``), meeting only through
a shared directory: they train and report to a real leaderboard, stop together on SIGTERM, fail
clearly when a role dies, and train the same agent as the fused mode for the same seed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.pod.config import PPORunConfig
from services.pod.roles.multiprocess import RemoteRoles
from services.pod.roles.role_process import RoleError, serve_role
from services.pod.roles.transport import (
    SOCKET,
    TOKEN,
    Channel,
    SharedTensors,
    TransportError,
    retire,
)
from services.pod.training.onpolicy import OnPolicyTrainer
from services.pod.training.presets import preset
from tests.pod.harness import ROOT, Leaderboard, make_spec, pod_env, ppo_trainer, register


@pytest.fixture
def roles_dir() -> Iterator[Path]:
    # Short and memory-backed, like the pod's /dev/shm (a Unix socket path holds ~100 bytes).
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    directory = Path(tempfile.mkdtemp(prefix="podium-test-", dir=shm))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


class Pod:
    """The three containers of one training pod, as processes sharing ``roles_dir``."""

    def __init__(self, env: dict[str, str], roles_dir: Path, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        args = ["--experiment", env["PODIUM_EXPERIMENT_ID"], "--pod-id", env["PODIUM_POD_ID"]]
        args += ["--roles-dir", str(roles_dir)]
        for role in ("worker", "learner", "evaluator"):
            with (logs / f"{role}.log").open("wb") as out:
                self.procs[role] = subprocess.Popen(
                    [sys.executable, "-m", "services.pod", "--role", role, *args],
                    cwd=ROOT,
                    env={**env, "PODIUM_ROLE": role},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )

    def lines(self, role: str) -> list[dict]:
        text = (self.logs / f"{role}.log").read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def wait_for(self, condition, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            for role, proc in self.procs.items():
                assert proc.poll() is None, f"{role} exited early:\n{self.tail(role)}"
            assert time.monotonic() < deadline, "condition not reached"
            time.sleep(0.1)

    def tail(self, role: str) -> str:
        return "\n".join((self.logs / f"{role}.log").read_text().splitlines()[-15:])

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def submissions(lb: Leaderboard, exp: str) -> int:
    with lb.api() as api:
        return api.get(f"/experiments/{exp}").json()["submissions"]


def test_three_role_processes_train_report_and_stop_together(
    leaderboard: Leaderboard, roles_dir: Path, tmp_path: Path
) -> None:
    spec = make_spec()
    register(leaderboard, "c1", spec)
    pod = Pod(pod_env(leaderboard, "c1", "p0", spec, tmp_path), roles_dir, tmp_path)
    try:
        pod.wait_for(lambda: submissions(leaderboard, "c1") >= 2)
        # Kubernetes signals every container of a deleted Pod at once.
        for proc in pod.procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {role: proc.wait(timeout=60) for role, proc in pod.procs.items()}
    finally:
        pod.kill()
    assert codes == {"worker": 0, "learner": 0, "evaluator": 0}, {r: pod.tail(r) for r in codes}
    learner = pod.lines("learner")
    assert {(e["event"], e.get("role")) for e in learner} >= {
        ("role connected", "worker"),
        ("role connected", "evaluator"),
    }
    assert next(e for e in learner if e["event"] == "pod started")["mode"] == "containers"
    # The worker and the evaluator really ran their roles: built from the learner's config,
    # served until the learner's stop, which came after the final report.
    for role in ("worker", "evaluator"):
        events = [e["event"] for e in pod.lines(role)]
        assert "role built" in events and events[-1] == "role stopped", events
    reports = [e for e in learner if e["event"] == "reported"]
    assert reports[-1]["final"] is True or any(
        e["event"].startswith("nothing trained") for e in learner
    )
    assert learner[-1]["event"] == "pod stopped"
    with leaderboard.api() as api:
        summary = api.get("/experiments/c1").json()
        board = api.get("/experiments/c1/leaderboard").json()["candidates"]
    assert summary["submissions"] == len(reports) >= 2
    assert summary["env_steps"] >= 2 * 1024
    assert board and all(c["pod_id"] == "p0" for c in board)
    # Socket, token and shared files are gone; only the mark telling late roles not to wait.
    assert sorted(p.name for p in roles_dir.iterdir()) == ["retired"]


def test_a_killed_worker_fails_the_learner_with_a_clear_error(
    leaderboard: Leaderboard, roles_dir: Path, tmp_path: Path
) -> None:
    spec = make_spec()
    register(leaderboard, "c2", spec)
    pod = Pod(pod_env(leaderboard, "c2", "p0", spec, tmp_path), roles_dir, tmp_path)
    try:
        pod.wait_for(lambda: submissions(leaderboard, "c2") >= 1)
        pod.procs["worker"].kill()  # a container OOM-killed, say
        learner_code = pod.procs["learner"].wait(timeout=60)
        evaluator_code = pod.procs["evaluator"].wait(timeout=30)
    finally:
        pod.kill()
    assert learner_code == 1
    last = pod.lines("learner")[-1]
    assert last["event"] == "pod failed"
    assert "RoleError: the worker went away" in last["error"]
    assert "process or container exited" in last["error"]
    assert evaluator_code == 0  # told to stop by the learner on its way out
    assert pod.lines("evaluator")[-1]["event"] == "role stopped"


def config(**over) -> PPORunConfig:
    base = preset("ppo", "CartPole-v1")
    base.update(seed=5, eval_episodes=4, **over)
    base["ppo"] = {**base["ppo"], "compile": "off"}
    return PPORunConfig.model_validate(base)


def test_role_processes_train_the_same_agent_as_fused(roles_dir: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = config()
    fused = OnPolicyTrainer([cfg])
    fused_scores = []
    for i in range(8):
        fused.step()
        if i % 4 == 3:
            fused_scores.append(fused.evaluate()[0].mean)
    fused_state = {k: v.clone() for k, v in fused.agent(0).state_dict().items()}

    remote = RemoteRoles(roles_dir, timeout_s=120)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "services.pod", "--role", role, "--roles-dir", str(roles_dir)],
            cwd=ROOT,
            env={**os.environ, "PODIUM_LOG_JSON": "1"},
            stdout=(tmp_path / f"{role}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for role in ("worker", "evaluator")
    ]
    try:
        trainer = OnPolicyTrainer([cfg], remote)
        scores = []
        for i in range(8):
            trainer.step()
            if i % 4 == 3:
                scores.append(trainer.evaluate()[0].mean)
    finally:
        remote.close()
        codes = [p.wait(timeout=30) for p in procs]
    assert codes == [0, 0]
    assert trainer.env_steps == 8 * cfg.ppo.batch_size
    for name, value in fused_state.items():
        torch.testing.assert_close(trainer.agent(0).state_dict()[name], value, rtol=1e-4, atol=1e-5)
    assert scores == pytest.approx(fused_scores, rel=1e-3)
    fresh = ppo_trainer(cfg).agent(0)  # training moved the weights: not two initialisations
    assert not torch.equal(fresh.state_dict()["critic.0.weight"], fused_state["critic.0.weight"])


def test_the_learner_refuses_strangers_and_names_the_roles_that_never_came(
    roles_dir: Path,
) -> None:
    remote = RemoteRoles(roles_dir, timeout_s=1.5)
    try:
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.connect(str(roles_dir / SOCKET))
        channel = Channel(stranger)
        channel.send({"op": "hello", "role": "worker", "token": "guess", "protocol": 1})
        trainer = OnPolicyTrainer([config()], remote)  # the roles are awaited at its first step
        with pytest.raises(RoleError, match=r"the worker and evaluator did not connect to .*1.5s"):
            trainer.step()
        answer = channel.receive(timeout=5)
        assert answer["op"] == "refused" and "wrong token" in answer["error"]
        channel.close()
    finally:
        remote.close()
    assert not (roles_dir / SOCKET).exists() and not (roles_dir / TOKEN).exists()


def test_a_role_without_a_learner_gives_up_clearly(roles_dir: Path) -> None:
    with pytest.raises(RoleError, match=f"no learner listening at {roles_dir}.* after 0.5s"):
        serve_role("worker", roles_dir, timeout_s=0.5)
    # Asked to stop (SIGTERM) before a learner came: a clean exit.
    assert serve_role("evaluator", roles_dir, timeout_s=30, give_up=lambda: True) == 0


def test_shared_tensors_round_trip_and_bad_layouts(roles_dir: Path) -> None:
    values = {
        "obs": torch.randn(4, 3),
        "done": torch.tensor([True, False, True]),
        "count": torch.tensor(7.0, dtype=torch.float64),
        "none": torch.empty(0, 2),
    }
    writer = SharedTensors.create(roles_dir / "a.shm", values)
    reader = SharedTensors(roles_dir / "a.shm", json.loads(json.dumps(writer.layout)))
    for name, value in values.items():
        assert torch.equal(reader.tensors[name], value), name
    writer.tensors["obs"][0, 0] = 42.0  # the same memory, not a copy
    assert reader.tensors["obs"][0, 0] == 42.0
    bad = {"x": {"dtype": "object", "shape": [2], "offset": 0}}
    with pytest.raises(TransportError, match="bad layout entry 'x'"):
        SharedTensors(roles_dir / "a.shm", bad)
    too_big = {"x": {"dtype": "float32", "shape": [10**6], "offset": 0}}
    with pytest.raises(TransportError, match="shorter than its layout"):
        SharedTensors(roles_dir / "a.shm", too_big)
    with pytest.raises(TransportError, match="bad shared file name"):
        SharedTensors(roles_dir / "..", writer.layout)


@pytest.mark.parametrize(
    ("args", "change", "message"),
    [
        (["--role", "learner", "--mode", "fused"], {}, "--mode applies to --role all"),
        (["--role", "worker"], {"PODIUM_ROLES_TIMEOUT_S": "soon"}, "PODIUM_ROLES_TIMEOUT_S"),
        (["--role", "learner"], {"PODIUM_ROLES_DIR": "/proc/podium"}, "cannot listen in the roles"),
    ],
)
def test_bad_role_input_is_a_clear_error(
    tmp_path: Path, args: list[str], change: dict[str, str], message: str
) -> None:
    env = {**pod_env(Leaderboard(tmp_path), "e", "p", make_spec(), tmp_path), **change}
    done = subprocess.run(
        [sys.executable, "-m", "services.pod", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr.decode()
    last = json.loads(done.stderr.decode().strip().splitlines()[-1])
    assert last["event"] == "bad input" and message in last["error"]


def test_roles_waiting_for_a_learner_that_needs_none_exit_cleanly(roles_dir: Path) -> None:
    """An off-policy pod on Kubernetes trains fused: its learner retires the roles, and the
    worker and evaluator containers exit 0 at once instead of failing the pod on a timeout."""
    remote = RemoteRoles(roles_dir, timeout_s=5)
    remote.close()  # never built: nothing connected
    started = time.monotonic()
    assert serve_role("worker", roles_dir, timeout_s=60) == 0
    assert time.monotonic() - started < 30  # not the 60 s timeout
    # A new learner in the same directory clears the mark: roles wait for it again.
    again = RemoteRoles(roles_dir, timeout_s=5)
    try:
        assert not (roles_dir / "retired").exists()
    finally:
        again.close()


@pytest.mark.parametrize("role", ["worker", "evaluator"])
def test_worker_and_evaluator_containers_use_the_pods_compile_cache(
    roles_dir: Path, tmp_path: Path, role: str
) -> None:
    """A split pod's worker and evaluator containers compile too (a compiled policy, the
    compiled evaluation): they point inductor at the pod's cache (PODIUM_COMPILE_CACHE_DIR,
    services/pod/runtime/compile_cache.py) as the learner does, not at torch's default under
    /tmp that dies with the container."""
    retire(roles_dir)  # no learner will come: the role exits 0 at once
    cache = tmp_path / "compile-cache"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR")},
        "PODIUM_COMPILE_CACHE_DIR": str(cache),
        "PODIUM_LOG_JSON": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.pod", "--role", role, "--roles-dir", str(roles_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    lines = [json.loads(line) for line in done.stderr.decode().strip().splitlines()]
    [line] = [entry for entry in lines if entry["event"] == "compile cache"]
    assert line["dir"] == str(cache) and cache.is_dir()


def test_a_population_pod_as_three_containers_trains_in_the_learner(
    leaderboard: Leaderboard, roles_dir: Path, tmp_path: Path
) -> None:
    """``agents_per_pod > 1`` stacks the agents in the learner's process: it retires the
    roles dir, so the worker and evaluator containers exit 0 instead of waiting, while the
    learner goes on reporting each member until SIGTERM."""
    spec = make_spec(population={"agents_per_pod": 2})
    register(leaderboard, "c-pop", spec)
    pod = Pod(pod_env(leaderboard, "c-pop", "pp", spec, tmp_path), roles_dir, tmp_path)
    try:
        codes = {r: pod.procs[r].wait(timeout=120) for r in ("worker", "evaluator")}
        assert codes == {"worker": 0, "evaluator": 0}, {r: pod.tail(r) for r in codes}
        learner = pod.procs["learner"]
        deadline = time.monotonic() + 120
        while submissions(leaderboard, "c-pop") < 2:
            assert learner.poll() is None, pod.tail("learner")
            assert time.monotonic() < deadline, "no reports"
            time.sleep(0.1)
        learner.send_signal(signal.SIGTERM)
        assert learner.wait(timeout=60) == 0, pod.tail("learner")
    finally:
        pod.kill()
    started = next(e for e in pod.lines("learner") if e["event"] == "pod started")
    assert started["mode"] == "population"
    assert (roles_dir / "retired").exists()
    with leaderboard.api() as api:
        board = api.get("/experiments/c-pop/leaderboard").json()["candidates"]
    assert {c["pod_id"] for c in board} <= {"pp.m0", "pp.m1"} and board
