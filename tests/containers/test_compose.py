"""docker-compose.yml as shipped, with the offline override (Redis and Prometheus from Debian's
packages): it comes up without a token (open APIs, as its header says), runs a CartPole
experiment to its target through the orchestrator's published port, Prometheus scrapes the
training pod (pod-targets writes its volume), and `stop` ends pod-targets on SIGTERM.

Run with Debian's docker-compose (v1) and with compose v2 where the engine's CLI has it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.containers.conftest import ROOT, Docker
from tests.containers.test_platform import TARGET, spec, wait_for
from tests.leaderboard.conftest import free_port

pytestmark = [pytest.mark.container, pytest.mark.slow]

FILES = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.offline.yml")]
GRAFANA = "grafana/grafana:11.2.0"


def compose_tool(engine: dict[str, str], which: str) -> list[str]:
    cmd = ["docker-compose"] if which == "v1" else ["docker", "compose"]
    try:
        ok = subprocess.run([*cmd, "version"], env=engine, capture_output=True, timeout=30)
    except FileNotFoundError:
        ok = None
    if ok is None or ok.returncode != 0:
        pytest.skip(
            f"compose {which} is not installed here ({' '.join(cmd)}); Debian bookworm packages "
            "only v1 (docker-compose), v2 comes with Docker's own packages"
        )
    return cmd


class Stack:
    def __init__(self, cmd: list[str], engine: dict[str, str], docker: Docker) -> None:
        self.project = f"podium-compose-{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.ports = {
            name: free_port()
            for name in (
                "PODIUM_ORCHESTRATOR_PORT",
                "PODIUM_LEADERBOARD_PORT",
                "PROMETHEUS_PORT",
                "GRAFANA_PORT",
            )
        }
        env = {k: v for k, v in engine.items() if k != "PODIUM_API_TOKEN"}  # as shipped: none
        self.env = {**env, **{k: str(v) for k, v in self.ports.items()}}
        self.cmd = [*cmd, *FILES, "-p", self.project]
        self.docker = docker

    def __call__(self, *args: str, timeout: float = 300) -> str:
        proc = subprocess.run(
            [*self.cmd, *args],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def url(self, port: str) -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def wait_ok(self, url: str, what: str, timeout: float = 180) -> None:
        """Until GET ``url`` answers 200 (the stack's logs in the failure)."""
        wait_for(lambda: httpx.get(url, timeout=2).status_code == 200, timeout, what, self.logs)

    def container(self, service: str) -> str:
        return self("ps", "-q", service).strip()

    def logs(self) -> str:
        proc = subprocess.run(
            [*self.cmd, "logs", "--tail", "20"],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        return proc.stdout[-6000:]


@pytest.fixture(params=["v1", "v2"])
def stack(
    request: pytest.FixtureRequest,
    engine: dict[str, str],
    images: dict[str, str],
    docker: Docker,
) -> Iterator[Stack]:
    s = Stack(compose_tool(engine, request.param), engine, docker)
    try:
        yield s
    finally:
        s("down", "-v", "--timeout", "20", timeout=180)


def test_compose_stack_runs_an_experiment_with_prometheus_scraping_the_pod(stack: Stack) -> None:
    started = time.monotonic()
    stack("up", "-d", timeout=600)
    orch, lb = stack.url("PODIUM_ORCHESTRATOR_PORT"), stack.url("PODIUM_LEADERBOARD_PORT")
    prom = stack.url("PROMETHEUS_PORT")
    stack.wait_ok(f"{orch}/readyz", "the orchestrator ready")
    # No token: the APIs are open, as the compose file's header says. A first experiment has no
    # target, so its pod lives until it is cancelled: long enough to be scraped whatever the
    # machine's speed (CartPole reaches its target within seconds once a pod runs).
    watched = {**spec("cartpole-scraped"), "target_return": None}
    r = httpx.post(f"{orch}/api/v1/experiments", json=watched, timeout=30)
    assert r.status_code == 201, r.text
    watched_id = r.json()["id"]

    def first_entry() -> bool:
        # 404 until the orchestrator's reconcile pass has registered the experiment there.
        r = httpx.get(f"{lb}/api/v1/experiments/{watched_id}", timeout=5)
        return r.status_code == 200 and r.json()["size"] >= 1

    wait_for(
        first_entry,
        600,
        "a first leaderboard entry",
        stack.logs,
    )
    print(f"\n[compose] up to first leaderboard entry: {time.monotonic() - started:.0f}s")

    # Prometheus scrapes the pod at the port pod-targets listed (the file it writes on its volume).
    def pod_target_up() -> Any:
        targets = httpx.get(f"{prom}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        return [t for t in targets if t["labels"].get("job") == "podium-pods"] and all(
            t["health"] == "up" for t in targets if t["labels"].get("job") == "podium-pods"
        )

    wait_for(pod_target_up, 120, "Prometheus scraping the pod", stack.logs)
    query = httpx.get(
        f"{prom}/api/v1/query", params={"query": "up{job='podium-pods'}"}, timeout=5
    ).json()
    assert [s["value"][1] for s in query["data"]["result"]] == ["1"], query
    r = httpx.post(f"{orch}/api/v1/experiments/{watched_id}/cancel", timeout=30)
    assert r.status_code == 202, r.text

    # A second experiment runs to its target.
    r = httpx.post(f"{orch}/api/v1/experiments", json=spec("cartpole-compose"), timeout=30)
    assert r.status_code == 201, r.text
    exp_id = r.json()["id"]
    exp = wait_for(
        lambda: (
            (e := httpx.get(f"{orch}/api/v1/experiments/{exp_id}", timeout=5).json())["state"]
            not in ("pending", "running")
            and e
        ),
        900,
        "the experiment finished",
        stack.logs,
    )
    assert exp["state"] == "succeeded" and exp["best_score"] >= TARGET, exp

    # pod-targets stops on SIGTERM (it used to ignore it and be killed after the timeout).
    pod_targets = stack.container("pod-targets")
    t0 = time.monotonic()
    stack("stop", "--timeout", "30", "pod-targets")
    assert time.monotonic() - t0 < 25
    assert stack.docker.inspect(pod_targets)["State"]["ExitCode"] == 0


def test_compose_grafana_where_its_image_can_be_pulled(
    engine: dict[str, str], images: dict[str, str], docker: Docker
) -> None:
    have = subprocess.run(["docker", "image", "inspect", GRAFANA], env=engine, capture_output=True)
    if have.returncode != 0:
        pulled = subprocess.run(
            ["docker", "pull", "-q", GRAFANA],
            env=engine,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if pulled.returncode != 0:
            pytest.skip(f"Grafana: {GRAFANA} cannot be pulled here ({pulled.stderr.strip()})")
    s = Stack(compose_tool(engine, "v1"), engine, docker)
    try:
        s("--profile", "grafana", "up", "-d", "grafana", timeout=600)
        grafana = s.url("GRAFANA_PORT")
        s.wait_ok(f"{grafana}/api/health", "Grafana healthy")
        r = httpx.get(f"{grafana}/api/search", params={"query": "Podium"}, auth=("admin", "admin"))
        assert any(d["title"] == "Podium" for d in r.json()), r.text
    finally:
        s("down", "-v", "--timeout", "20", timeout=180)
