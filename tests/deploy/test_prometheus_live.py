"""A real Prometheus scrapes a live local experiment; every dashboard query returns data.

The set-up is docker compose's, as processes on loopback: the orchestrator (local backend,
``PODIUM_METRICS_PORT=0`` so every pod serves /metrics), the leaderboard, real CartPole pods,
deploy/prometheus/pod_targets.py turning the pods' port files into file_sd targets, and
Prometheus (the Debian package) with deploy/prometheus/prometheus.yml, its targets pointed at
the loopback ports. Then each query of helm/podium/dashboards/podium.json, with Grafana's
variables filled in, must return at least one series.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.test_deploy import dashboard_panels
from tests.deploy.tools import run, tool
from tests.e2e.conftest import LB_TOKEN, Service, kill_pods, wait_for
from tests.leaderboard.conftest import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ORCH_TOKEN = "deploy-live-orchestrator-token"
METRICS_TOKEN = "deploy-live-metrics-token"
# Grafana's variables as a user would leave them; $__rate_interval >= 4 scrape intervals.
VARIABLES = {
    "$__rate_interval": "20s",
    "$__range": "5m",
    "$experiment": ".*",
    "$target": "475",
}


def spec(name: str, cpu: float = 1, pods: int = 2) -> dict[str, Any]:
    return {
        "name": name,
        "env": {"name": "CartPole-v1"},
        "algorithms": {"ppo": 1.0},
        "search_space": {"learning_rate": {"type": "log_uniform", "low": 1e-3, "high": 1e-2}},
        "generator": {"strategy": "pbt"},
        "population": {"min_pods": 1, "max_pods": pods},
        "resources": {"cpu": cpu, "gpus": 0, "memory": "1Gi"},
        "round": {"env_steps": 2048},
        # Not reached in the test's time: the pods keep serving metrics until cancelled.
        "target_return": 1e9,
        "top_k": 2,  # small, so the updater evicts and rejects
        "evaluation": {"episodes": 2},
        "budget": {"wall_time_s": 600},
    }


def prometheus_config(tmp: Path, targets: dict[str, str], sd_file: Path) -> Path:
    """deploy/prometheus/prometheus.yml with compose's host names replaced by loopback ports,
    and the leaderboard scraped with its metrics token, as the chart's ServiceMonitor does."""
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = "1s"
    token_file = tmp / "metrics-token"
    token_file.write_text(METRICS_TOKEN)
    for job in cfg["scrape_configs"]:
        if job["job_name"] == "podium-leaderboard":
            job["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
        for sc in job.get("static_configs", []):
            sc["targets"] = [targets.get(t, t) for t in sc["targets"]]
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(sd_file)]
            sd["refresh_interval"] = "1s"
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def processes() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*cmd: str, log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        started.append(p)
        return p

    yield start
    for p in started:
        p.terminate()
    for p in started:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def test_prometheus_scrapes_a_live_experiment_and_every_panel_has_data(
    tmp_path: Path, processes: Callable[..., subprocess.Popen[bytes]]
) -> None:
    prometheus, promtool = tool("prometheus"), tool("promtool")
    run(promtool, "check", "config", str(ROOT / "deploy" / "prometheus" / "prometheus.yml"))

    lb = Service(
        "services.leaderboard",
        {
            "PODIUM_DATA_DIR": str(tmp_path / "leaderboard"),
            "PODIUM_API_TOKEN": LB_TOKEN,
            "PODIUM_METRICS_TOKEN": METRICS_TOKEN,
        },
        tmp_path / "leaderboard.log",
        LB_TOKEN,
    ).start()
    data = tmp_path / "orchestrator"
    orch = Service(
        "services.orchestrator",
        {
            "PODIUM_DATA_DIR": str(data),
            "PODIUM_API_TOKEN": ORCH_TOKEN,
            "PODIUM_BACKEND": "local",
            "PODIUM_CAPACITY_CPU": "2",
            "PODIUM_CAPACITY_GPUS": "0",
            "PODIUM_CAPACITY_MEMORY": "8Gi",
            "PODIUM_RECONCILE_INTERVAL_S": "0.5",
            "PODIUM_LEADERBOARD_URL": lb.url,
            "PODIUM_LEADERBOARD_TOKEN": LB_TOKEN,
            "PODIUM_METRICS_PORT": "0",  # inherited by the pods, as in docker-compose.yml
        },
        tmp_path / "orchestrator.log",
        ORCH_TOKEN,
    ).start()
    try:
        sd_file = tmp_path / "sd" / "pods.json"
        processes(
            sys.executable,
            str(ROOT / "deploy" / "prometheus" / "pod_targets.py"),
            "--data-dir",
            str(data),
            "--host",
            "127.0.0.1",
            "--out",
            str(sd_file),
            "--interval",
            "0.5",
            log=tmp_path / "pod_targets.log",
        )
        targets = {
            "orchestrator:8000": f"127.0.0.1:{orch.port}",
            "leaderboard:8001": f"127.0.0.1:{lb.port}",
        }
        prom_port = free_port()
        targets["localhost:9090"] = f"127.0.0.1:{prom_port}"
        config = prometheus_config(tmp_path, targets, sd_file)
        run(promtool, "check", "config", str(config))
        processes(
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
            log=tmp_path / "prometheus.log",
        )
        prom = httpx.Client(base_url=f"http://127.0.0.1:{prom_port}/api/v1", timeout=10)

        def prometheus_ready() -> bool:
            # Its listener opens some milliseconds after the process starts: on a quiet
            # machine the first query below could come sooner and be refused.
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"http://127.0.0.1:{prom_port}/-/ready", timeout=2).is_success
            return False

        wait_for(prometheus_ready, timeout=60)

        # A running experiment, and one that cannot fit (3 CPUs per pod, 2 in all): pending.
        ids = []
        for body in (spec("live"), spec("toobig", cpu=3, pods=1)):
            r = orch.http.post("/experiments", json=body)
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        # An error for the errors panel: a request without the token is refused.
        assert httpx.get(f"{lb.url}/api/v1/experiments/{ids[0]}").status_code == 401
        assert httpx.get(f"{lb.url}/metrics").status_code == 401  # Prometheus has the token

        def missing() -> list[str]:
            out = []
            for panel in dashboard_panels():
                for target in panel["targets"]:
                    expr = target["expr"]
                    for var, value in VARIABLES.items():
                        expr = expr.replace(var, value)
                    r = prom.get("/query", params={"query": expr})
                    assert r.status_code == 200, (panel["title"], expr, r.text)
                    if not r.json()["data"]["result"]:
                        out.append(f"{panel['title']}: {expr}")
            return out

        last: list[str] = []

        def all_have_data() -> bool:
            nonlocal last
            last = missing()
            return not last

        try:
            wait_for(all_have_data, timeout=240, interval=3)
        except AssertionError:
            up = prom.get("/query", params={"query": "up"}).json()["data"]["result"]
            pytest.fail(
                "panels without data after 240 s:\n"
                + "\n".join(last)
                + f"\nscrape targets: {[(s['metric'], s['value'][1]) for s in up]}"
            )
        # The pods were scraped through file_sd, each labelled with its experiment and pod.
        pods_up = prom.get("/query", params={"query": 'up{job="podium-pods"} == 1'}).json()
        assert {s["metric"]["experiment"] for s in pods_up["data"]["result"]} == {ids[0]}
        for exp_id in ids:
            orch.http.post(f"/experiments/{exp_id}/cancel")
        wait_for(lambda: not list(data.glob("experiments/*/pods/*.json")), timeout=60)
    finally:
        orch.close()
        lb.close()
        kill_pods(data)  # the fixture then stops prometheus and pod_targets


def test_the_best_of_an_experiments_pods_follows_its_direction(
    tmp_path: Path, processes: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """The "Eval return by pod" panel's best of pods is the pods' max where higher is better
    and their min where lower is: real pods' metrics servers, scraped by a real Prometheus."""
    from services.pod.runtime.metrics import PodMetrics

    served: list[PodMetrics] = []
    targets = []
    # Each pod's evaluations in order: its own best is the last where lower is better.
    for experiment, higher in (("up", True), ("down", False)):
        for pod, means in (("a", (300.0, 100.0)), ("b", (250.0, 200.0))):
            metrics = PodMetrics(experiment, f"{experiment}-{pod}", higher_is_better=higher)
            for mean in means:
                metrics.evaluated(mean)
            served.append(metrics)
            targets.append(f"127.0.0.1:{metrics.serve(0, None, f'{experiment}-{pod}')}")
    try:
        sd_file = tmp_path / "sd" / "pods.json"
        sd_file.parent.mkdir()
        sd_file.write_text(json.dumps([{"targets": targets, "labels": {}}]))
        port = free_port()
        config = prometheus_config(tmp_path, {"localhost:9090": f"127.0.0.1:{port}"}, sd_file)
        processes(
            tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
            log=tmp_path / "prometheus.log",
        )
        [panel] = [p for p in dashboard_panels() if p["title"] == "Eval return by pod"]
        [query] = [t["expr"] for t in panel["targets"] if "best of pods" in t["legendFormat"]]
        query = query.replace("$experiment", ".*")
        best: dict[str, float] = {}

        def answered() -> bool:
            with contextlib.suppress(httpx.TransportError):
                r = httpx.get(
                    f"http://127.0.0.1:{port}/api/v1/query", params={"query": query}, timeout=5
                )
                if r.is_success:
                    for s in r.json()["data"]["result"]:
                        best[s["metric"]["experiment"]] = float(s["value"][1])
            return len(best) == 2

        wait_for(answered, timeout=60, interval=1)
        assert best == {"up": 300.0, "down": 100.0}
    finally:
        for metrics in served:
            metrics.close()
