"""What the pod tests share: the real leaderboard app served on loopback (uvicorn thread,
embedded Redis), a small experiment spec, a pod runtime wired to it, and a pod process's
environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.api_client import LeaderboardClient
from services.contracts.leaderboard import Candidate, ManifestCheckpoint
from services.contracts.spec import ExperimentSpec
from services.leaderboard.app import create_app
from services.leaderboard.settings import LeaderboardSettings
from services.pod.config import PPORunConfig
from services.pod.runtime.metrics import PodMetrics
from services.pod.runtime.rounds import PodRuntime, RuntimeSettings, fetch_parent
from services.pod.training.onpolicy import OnPolicyTrainer
from tests.leaderboard.conftest import free_port

TOKEN = "pod-test-token"
ROOT = Path(__file__).resolve().parents[2]


class Leaderboard:
    """The leaderboard app served by uvicorn in a thread; ``restart`` keeps port and data."""

    def __init__(self, data_dir: Path, port: int | None = None, **settings: Any) -> None:
        self.data_dir, self.settings = data_dir, settings
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> Leaderboard:
        settings = LeaderboardSettings(
            data_dir=self.data_dir,
            api_token=TOKEN,
            gc_interval_s=3600,
            redis_url=None,
            **self.settings,
        )
        config = uvicorn.Config(
            create_app(settings),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no leaderboard"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        assert self.server is not None and self.thread is not None
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.url}/api/v1",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )


def make_spec(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "pod-test",
        "env": {"name": "CartPole-v1"},
        "algorithms": {"ppo": 1.0},
        "search_space": {"learning_rate": {"type": "log_uniform", "low": 3e-3, "high": 1e-2}},
        "generator": {"strategy": "pbt"},
        "round": {"env_steps": 1024},
        "evaluation": {"episodes": 4},
        "top_k": 4,
    }
    spec.update(over)
    return spec


def register(lb: Leaderboard, exp: str, spec: dict[str, Any]) -> None:
    with lb.api() as api:
        config = {
            "top_k": spec["top_k"],
            "generator": spec["generator"],
            "algorithms": spec["algorithms"],
            "search_space": spec["search_space"],
        }
        assert api.put(f"/experiments/{exp}", json=config).status_code in (200, 201)


def submit_outside_parent(
    lb_client: LeaderboardClient, directory: Path, algorithm: str, hyperparameters: dict[str, float]
) -> str:
    """Put the training files in ``directory`` on the board as a pod from outside would, with
    a score no slot beats: the parent every slot's next exploit copies. Its candidate id."""
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    answer = lb_client.submit(
        {
            "submission_id": "outside-parent",
            "pod_id": "outside",
            "algorithm": algorithm,
            "hyperparameters": hyperparameters,
            "score": 10_000.0,
            "eval": {"mean": 10_000.0, "episodes": 4},
        },
        files,
    )
    assert answer.accepted and answer.rank == 1
    assert answer.candidate_id is not None
    return answer.candidate_id


def client(lb: Leaderboard, exp: str) -> LeaderboardClient:
    """A pod's client of ``lb``, retrying fast (tests restart the leaderboard)."""
    return LeaderboardClient(lb.url, exp, TOKEN, initial_backoff_s=0.05, max_backoff_s=0.5)


def download(lb: Leaderboard, candidate: dict[str, Any] | Candidate, directory: Path) -> Path:
    """A candidate's training files, fetched and verified as a pod fetches its parent."""
    data = candidate if isinstance(candidate, dict) else candidate.model_dump()
    pod_client = client(lb, data["experiment_id"])
    try:
        return fetch_parent(pod_client, directory, ManifestCheckpoint.model_validate(data))
    finally:
        pod_client.close()


def runtime(
    lb: Leaderboard,
    exp: str,
    spec: dict[str, Any],
    pod: str,
    tmp: Path,
    max_env_steps: int | None = None,
    metrics: PodMetrics | None = None,
    algorithm: str | None = None,
) -> PodRuntime:
    """A pod's runtime (one agent, or the spec's population) wired to ``lb``."""
    model = ExperimentSpec.model_validate(spec)
    settings = RuntimeSettings(
        work_dir=tmp / pod, grace_s=10, max_env_steps=max_env_steps, algorithm=algorithm
    )
    return PodRuntime(exp, pod, model, client(lb, exp), settings, metrics)


class InThread:
    """``rt.run()`` in a daemon thread, keeping what it raises."""

    def __init__(self, rt: Any, timeout: float = 120.0) -> None:
        self.rt, self.errors = rt, []
        self.deadline = time.monotonic() + timeout
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.rt.run()
        except BaseException as exc:
            self.errors.append(exc)

    def wait_until(self, condition) -> None:
        while not condition(self.rt):
            assert not self.errors, self.errors
            assert self.thread.is_alive(), "the runtime returned before it was stopped"
            assert time.monotonic() < self.deadline, "condition not reached"
            time.sleep(0.05)

    def stop(self) -> None:
        self.rt.stop()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive() and not self.errors, self.errors


def stop_after(rt: Any, condition, timeout: float = 120.0) -> threading.Thread:
    """Run ``rt`` in a thread and stop it once ``condition(rt)`` holds."""
    running = InThread(rt, timeout)
    running.wait_until(condition)
    running.stop()
    return running.thread


def pod_env(lb: Leaderboard, exp: str, pod: str, spec: dict, pod_dir: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "PODIUM_EXPERIMENT_ID": exp,
        "PODIUM_POD_ID": pod,
        "PODIUM_SPEC": json.dumps(spec),
        "PODIUM_POD_DIR": str(pod_dir),
        "PODIUM_CPU": "1",
        "PODIUM_GPUS": "0",
        "PODIUM_LEADERBOARD_URL": lb.url,
        "PODIUM_API_TOKEN": TOKEN,
        "PODIUM_METRICS_PORT": "0",
        "PODIUM_LOG_JSON": "1",
    }
    return env


def start_pod(
    lb: Leaderboard, exp: str, pod: str, spec: dict, pod_dir: Path, log: Path, **env: str
) -> subprocess.Popen[bytes]:
    """``python -m services.pod`` as the orchestrator starts it, its output into ``log``."""
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "services.pod", "--experiment", exp, "--pod-id", pod],
            cwd=ROOT,
            env={**pod_env(lb, exp, pod, spec, pod_dir), **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def sigterm_pod_when(
    proc: subprocess.Popen[bytes], log: Path, ready: Callable[[], bool], timeout: float = 90.0
) -> list[dict[str, Any]]:
    """Wait while the pod runs until ``ready()``, then SIGTERM it and check that it exits 0
    (killed instead if anything fails on the way); return its JSON log lines."""
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"not ready after {timeout:g} s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def ppo_trainer(config: PPORunConfig) -> OnPolicyTrainer:
    """PPO's trainer of one agent for ``config``, eager (its programs are what other tests
    compile): its learner (``trainer.population``) holds the worker's rollout, the update and
    the evaluation."""
    return OnPolicyTrainer(
        [config.model_copy(update={"ppo": config.ppo.model_copy(update={"compile": "off"})})]
    )


def run_fresh_python(code: str, timeout: float = 120.0) -> None:
    """Run ``code`` in a new interpreter (what a process imports is then its own) and fail
    with its stderr unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def eval_returns(directory: Path) -> list[float]:
    """The ``eval/return`` curve of the TensorBoard files in ``directory`` ([] if none)."""
    acc = EventAccumulator(str(directory))
    acc.Reload()
    if "eval/return" not in acc.Tags()["scalars"]:
        return []
    return [e.value for e in acc.Scalars("eval/return")]


def compile_work(lines: list[dict[str, Any]]) -> dict[str, float]:
    """A pod's compile seconds and the graphs it built and loaded, from its JSON log lines
    (its ``compile.done`` lines)."""
    done = [line for line in lines if line.get("event") == "compile.done"]
    return {
        "seconds": sum(x["compile_s"] for x in done),
        "built": sum(x["graphs_built"] for x in done),
        "loaded": sum(x["graphs_loaded"] for x in done),
    }


def compile_trail(pods: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Every pod's compile-sharing log lines (claims, waits, fetches, refusals, renewals,
    publishes), without their timestamps: what a failed compile-once check shows."""
    return {
        pod: [
            {k: v for k, v in x.items() if k not in ("timestamp", "level")}
            for x in lines
            if str(x.get("event", "")).startswith("compile_cache.")
        ]
        for pod, lines in pods.items()
    }


def compile_counters() -> dict[str, int]:
    """The graphs built and loaded, and dynamo's frame and graph counts: what a test reads to
    see that nothing recompiled."""
    from torch._dynamo.utils import counters

    from services.pod.algorithms.compiled import compile_work

    work = compile_work()
    return {
        "built": work.built,
        "loaded": work.loaded,
        "graphs": int(counters["stats"]["unique_graphs"]),
        **dict(counters["frames"]),
    }
