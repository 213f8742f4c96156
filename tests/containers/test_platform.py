"""Podium as deployed: every part a container from the images scripts/build-images.sh builds,
run with the chart's security settings (read-only root, all capabilities dropped, no privilege
escalation, the images' non-root user).

Redis, the leaderboard and the orchestrator are containers; the orchestrator runs its
Kubernetes backend against the in-test API server, whose kubelet (tests/containers/kubelet.py)
runs every Pod the orchestrator creates as a container of the pod image (its worker, learner
and evaluator in one process, /dev/shm a tmpfs). A CartPole experiment reaches its target, the
pods' reports reach the leaderboard, the reconciler's graceful delete (SIGTERM) ends every pod
with exit code 0 after its final report, and `podium export` run from the control-plane image
verifies the best agent's files.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.containers.conftest import Docker
from tests.containers.kubelet import DockerKubelet
from tests.leaderboard.conftest import free_port
from tests.orchestrator.k8s_server import TOKEN as K8S_TOKEN
from tests.orchestrator.servers import ServerThread

pytestmark = [pytest.mark.container, pytest.mark.slow]

TOKEN = "container-test-token"
TARGET = 475.0  # CartPole's preset gets there in ~12k env steps
NS = "podium"


def spec(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "env": {"name": "CartPole-v1"},
        "algorithms": {"ppo": 1.0},
        "search_space": {"learning_rate": {"type": "log_uniform", "low": 4e-3, "high": 1.2e-2}},
        "generator": {"strategy": "pbt"},
        "population": {"min_pods": 1, "max_pods": 1},
        "resources": {"cpu": 1, "gpus": 0, "memory": "2Gi"},
        "round": {"env_steps": 4096},
        "target_return": TARGET,
        "evaluation": {"episodes": 5},
        "budget": {"wall_time_s": 900},
    }


def wait_for(fn: Callable[[], Any], timeout: float, what: str, logs: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if out := fn():
                return out
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout}s\n{logs()}")


@dataclass
class Service:
    name: str
    url: str
    docker: Docker

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        )

    def logs(self) -> str:
        return f"--- {self.name}:\n" + "\n".join(self.docker.logs(self.name).splitlines()[-25:])

    def ready(self) -> None:
        wait_for(
            lambda: httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200,
            90,
            f"{self.name} ready",
            self.logs,
        )


def volume(docker: Docker, name: str) -> str:
    docker("volume", "create", "--label", docker.label, name)
    return name


def service(
    docker: Docker,
    image: str,
    name: str,
    module: str,
    env: dict[str, str],
    mounts: tuple[str, ...] = (),
) -> Service:
    """A Podium service container (`python -m MODULE`) on 127.0.0.1:<free port>, its /data a
    named volume (which takes the owner of the image's /data: the non-root user)."""
    port = free_port()
    env = {**env, "PODIUM_PORT": str(port), "PODIUM_HOST": "127.0.0.1", "PODIUM_LOG_JSON": "1"}
    flags = [f"--env={k}={v}" for k, v in env.items()]
    data = volume(docker, f"{name}-data")
    flags += [f"--volume={data}:/data", *(f"--volume={m}" for m in mounts)]
    docker.run(name, image, module, flags=flags)
    svc = Service(name, f"http://127.0.0.1:{port}", docker)
    svc.ready()
    return svc


@pytest.fixture
def stack(images: dict[str, str], docker: Docker) -> dict[str, Any]:
    """Redis (Debian's package) and the leaderboard, shared by the experiments below."""
    return start_stack(images, docker)


def start_stack(images: dict[str, str], docker: Docker) -> dict[str, Any]:
    """Redis and the leaderboard as containers (removed with ``docker``'s containers)."""
    prefix = f"podium-ct-{os.getpid()}"
    redis_port = free_port()
    docker.run(
        f"{prefix}-redis",
        images["redis"],
        "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
        "--protected-mode", "no", "--save", "", "--appendonly", "no",
    )  # fmt: skip
    lb = service(
        docker,
        images["control-plane"],
        f"{prefix}-leaderboard",
        "services.leaderboard",
        {
            "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
            "PODIUM_API_TOKEN": TOKEN,
            "PODIUM_STORAGE": "fs",
            "PODIUM_BLOB_DIR": "/data/blobs",
        },
    )
    return {"prefix": prefix, "redis": f"redis://127.0.0.1:{redis_port}", "leaderboard": lb}


def run_experiment(
    docker: Docker,
    images: dict[str, str],
    stack: dict[str, Any],
    tmp_path: Path,
    body: dict[str, Any] | None = None,
    db: int = 1,
    then: Callable[[str, Service], None] | None = None,
) -> tuple[str, DockerKubelet]:
    """One orchestrator (Redis database ``db``) runs one experiment (``body``, default a
    CartPole one) to its target (without one: to its budget); ``then(experiment id,
    orchestrator)`` once its pods are gone, while the orchestrator still runs."""
    prefix = f"{stack['prefix']}-k8s{db}"
    cluster = DockerKubelet(docker, prefix, tmp_path)
    cluster.add_node("node-a", cpu="2", memory="8Gi")
    with ServerThread(cluster.app()) as api:
        kube = tmp_path / f"k8s{db}" / "kubeconfig"
        kube.parent.mkdir(parents=True)
        kube.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": api.url}}],
                    "users": [{"name": "u", "user": {"token": K8S_TOKEN}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        kube.chmod(0o644)
        orch = service(
            docker,
            images["control-plane"],
            f"{prefix}-orchestrator",
            "services.orchestrator",
            {
                "PODIUM_BACKEND": "kubernetes",
                "PODIUM_K8S_NAMESPACE": NS,
                "PODIUM_K8S_CAPACITY_REFRESH_S": "0",
                "PODIUM_K8S_SHARED_MEMORY": "256Mi",
                "PODIUM_POD_IMAGE": images["pod"],
                "KUBECONFIG": "/kube/config",
                # One Redis database per orchestrator: each starts with no experiments.
                "REDIS_URL": f"{stack['redis']}/{db}",
                "PODIUM_API_TOKEN": TOKEN,
                "PODIUM_LEADERBOARD_URL": stack["leaderboard"].url,
            },
            mounts=(f"{kube}:/kube/config:ro",),
        )
        try:
            with orch.http() as http:
                r = http.post("/api/v1/experiments", json=body or spec("cartpole"))
                assert r.status_code == 201, r.text
                exp_id = r.json()["id"]

                def pod_logs() -> str:
                    return orch.logs() + "".join(
                        f"\n--- {c}:\n" + "\n".join(docker.logs(c).splitlines()[-15:])
                        for run in cluster.runs.values()
                        for c in run.containers.values()
                    )

                exp = wait_for(
                    lambda: (
                        (e := http.get(f"/api/v1/experiments/{exp_id}").json())["state"]
                        not in ("pending", "running")
                        and e
                    ),
                    900,
                    f"experiment {exp_id} finished",
                    pod_logs,
                )
                if body is None or body.get("target_return") is not None:
                    assert exp["state"] == "succeeded", (exp, pod_logs())
                    assert exp["best_score"] >= TARGET
                else:
                    assert exp["state"] == "budget_exhausted", (exp, pod_logs())
                # The reconciler deletes the pods; the kubelet stops their containers.
                wait_for(
                    lambda: (
                        not cluster.pod_names(NS, live_only=False)
                        and all(run.done.is_set() for run in cluster.runs.values())
                    ),
                    120,
                    "pods deleted and their containers ended",
                    pod_logs,
                )
                if then is not None:
                    then(exp_id, orch)
        finally:
            # The orchestrator stops on SIGTERM like every Podium service: exit code 0.
            docker("stop", "-t", "20", orch.name, timeout=60)
            code = docker.inspect(orch.name)["State"]["ExitCode"]
            assert code == 0, orch.logs()
        cluster.shutdown()
    assert cluster.errors == [] and cluster.rejected == [], (cluster.errors, cluster.rejected)
    return exp_id, cluster


def test_experiments_run_with_every_part_a_container(
    images: dict[str, str], docker: Docker, stack: dict[str, Any], tmp_path: Path
) -> None:
    # The images run as the non-root user the chart expects (runAsNonRoot).
    for image in (images["control-plane"], images["pod"]):
        assert docker.inspect(image)["Config"]["User"] == "10001:10001", image
    lb: Service = stack["leaderboard"]
    exp_id, cluster = run_experiment(docker, images, stack, tmp_path)
    runs = list(cluster.runs.values())
    assert runs, "the orchestrator created no pod"
    for run in runs:
        # The Pod's one container ran from the pod image, was stopped gracefully by the
        # reconciler's delete (SIGTERM) and exited 0 after its final report.
        assert set(run.containers) == {"pod"}, run.containers
        assert run.stopped, "the pod was not stopped by a graceful delete"
        assert run.exit_codes == {"pod": 0}, (run.exit_codes, run.logs)
        log = run.logs["pod"]
        assert '"pod stopped"' in log and "final report failed" not in log, log
    with lb.http() as http:
        summary = http.get(f"/api/v1/experiments/{exp_id}").json()
        assert summary["submissions"] >= 1 and summary["size"] >= 1, summary
        best = http.get(f"/api/v1/experiments/{exp_id}/best").json()
    assert best["score"] >= TARGET, best

    # `podium export` from the control-plane image: downloads the best agent, verifying sha256.
    out = tmp_path / "export"
    out.mkdir()
    out.chmod(0o777)
    proc_out = docker(
        "run", "--rm", "--network", "host", "--label", docker.label,
        "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--tmpfs", "/tmp", f"--volume={out}:/out", f"--env=PODIUM_API_TOKEN={TOKEN}",
        "--entrypoint", "podium", images["control-plane"],
        "export", exp_id, "--out", "/out/best", "--leaderboard-url", lb.url,
        timeout=300, stderr=True,
    )  # fmt: skip
    assert "verified into /out/best" in proc_out, proc_out
    files = sorted(p.name for p in (out / "best").iterdir())
    assert files, proc_out
