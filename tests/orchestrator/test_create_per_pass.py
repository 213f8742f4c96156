"""A reconcile pass creates a bounded number of pods: scaling 50
experiments of 20 pods from zero was one pass of 4.9 s (1,000 creates against the API server),
during which nothing else was reconciled: a pod failure or a deletion in another experiment
waited for it. The rest are created by the next passes, which run at once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.contracts.spec import ExperimentSpec
from services.orchestrator.backends.kubernetes import KubernetesBackend
from services.orchestrator.leaderboard_client import NoLeaderboard
from services.orchestrator.reconciler import Reconciler
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.store import Store
from tests.orchestrator.conftest import spec, wait_for
from tests.orchestrator.k8s_server import FakeCluster
from tests.orchestrator.servers import ServerThread
from tests.orchestrator.test_kubernetes import api_client

PODS = 24
PER_PASS = 5


@pytest.fixture
def setup(
    tmp_path: Path, redis_url: str, flush_redis: None
) -> Iterator[tuple[Reconciler, KubernetesBackend, Store, str]]:
    fc = FakeCluster(validate=False)
    fc.add_node("node-a", cpu="64", memory="64Gi")
    settings = OrchestratorSettings(
        data_dir=tmp_path,
        redis_url=redis_url,
        backend="kubernetes",
        k8s_namespace="podium",
        k8s_capacity_refresh_s=0,
        pod_image="ghcr.io/podium-rl/podium:0.1.0",
        # Long: the passes after a bounded one must not wait for the timer.
        reconcile_interval_s=30,
        create_per_pass=PER_PASS,
    )
    r = redis.Redis.from_url(redis_url)
    store = Store(r)
    exp_id, _ = store.create(
        "many",
        ExperimentSpec.model_validate(
            spec(
                population={"min_pods": PODS, "max_pods": PODS},
                resources={"cpu": 1, "gpus": 0, "memory": "1Gi"},
            )
        ),
    )
    with ServerThread(fc.app()) as srv:
        be = KubernetesBackend(settings, api_client=api_client(srv.url))
        rec = Reconciler(settings, store, be, NoLeaderboard())
        try:
            yield rec, be, store, exp_id
        finally:
            rec.stop()
            be.close()
            fc.shutdown()
    r.close()


def live(be: KubernetesBackend, exp_id: str) -> int:
    return sum(1 for p in be.list_pods() if p.experiment_id == exp_id and p.live)


def test_one_pass_creates_at_most_create_per_pass_pods(
    setup: tuple[Reconciler, KubernetesBackend, Store, str],
) -> None:
    rec, be, store, exp_id = setup
    deadline = time.monotonic() + 10
    while not live(be, exp_id):  # the first passes register the experiment (asynchronously)
        assert time.monotonic() < deadline, rec.last_error
        rec.reconcile_once()
        time.sleep(0.05)
    # A pass waits for its creates: the pass that created pods has created all it will.
    assert live(be, exp_id) == PER_PASS, f"one pass created {live(be, exp_id)} pods"
    status = store.get(exp_id).status  # type: ignore[union-attr]
    assert status.state == "running" and status.pods_launched == PER_PASS
    assert status.reason == f"{PER_PASS}/{PODS} pods; creating the rest", status.reason
    # The loop runs the next passes at once (the interval is 30 s), not on the timer.
    t0 = time.monotonic()
    rec.start()
    wait_for(lambda: live(be, exp_id) == PODS, timeout=10)
    assert time.monotonic() - t0 < 10
    wait_for(lambda: store.get(exp_id).status.reason is None, timeout=5)  # type: ignore[union-attr]
    assert store.get(exp_id).status.pods_launched == PODS  # type: ignore[union-attr]
