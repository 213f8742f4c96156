"""The Kubernetes backend through the official client against an in-test API server, and every
manifest it generates validated against the Kubernetes schemas."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kubernetes_validate
import pytest
from fastapi.testclient import TestClient
from kubernetes import client as k8s
from pydantic import SecretStr, ValidationError

from services.contracts.credentials import pod_token
from services.orchestrator.app import create_app
from services.orchestrator.backends.base import PodRequest, pod_identity_env
from services.orchestrator.backends.kubernetes import (
    UNCOUNTED_GPUS,
    KubernetesBackend,
    credential_secret_manifest,
    owner_manifest,
    pod_manifest,
)
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import SET_PER_POD, OrchestratorSettings
from tests.orchestrator.conftest import LB_TOKEN, TOKEN, spec, wait_for
from tests.orchestrator.k8s_server import K8S_VERSION, FakeCluster
from tests.orchestrator.k8s_server import TOKEN as K8S_TOKEN
from tests.orchestrator.servers import ServerThread

NS = "podium"
GI = 2**30


def api_client(url: str) -> k8s.ApiClient:
    cfg = k8s.Configuration()
    cfg.host = url
    cfg.api_key = {"authorization": K8S_TOKEN}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    return k8s.ApiClient(cfg)


@pytest.fixture
def cluster() -> Iterator[tuple[FakeCluster, ServerThread]]:
    fc = FakeCluster()
    fc.add_node("node-a", cpu="4", memory="16Gi")
    with ServerThread(fc.app()) as srv:
        yield fc, srv
        fc.shutdown()
    assert fc.rejected == [], fc.rejected


@pytest.fixture
def k8s_settings(make_settings: Callable[..., OrchestratorSettings]) -> OrchestratorSettings:
    return make_settings(
        backend="kubernetes",
        k8s_namespace=NS,
        k8s_capacity_refresh_s=0,
        pod_image="ghcr.io/podium-rl/podium:0.1.0",
    )


@pytest.fixture
def backend(
    cluster: tuple[FakeCluster, ServerThread], k8s_settings: OrchestratorSettings
) -> Iterator[KubernetesBackend]:
    be = KubernetesBackend(k8s_settings, api_client=api_client(cluster[1].url))
    yield be
    be.close()


def request(exp: str = "e1", pod: str = "p1", gpus: int = 0) -> PodRequest:
    env = {"PODIUM_LEADERBOARD_URL": "http://lb:8000", "PODIUM_API_TOKEN": "s3cret"}
    return PodRequest(
        experiment_id=exp,
        pod_id=pod,
        spec_json=json.dumps({"name": "x"}),
        resources=Res(2.0, gpus, 4 * GI),
        env=env,
        grace_s=30,
    )


@contextmanager
def orchestrator(settings: OrchestratorSettings, url: str) -> Iterator[TestClient]:
    """The orchestrator app on a Kubernetes backend for the API server at ``url``."""
    be = KubernetesBackend(settings, api_client=api_client(url))
    try:
        with TestClient(create_app(settings, backend=be)) as c:
            c.headers["Authorization"] = f"Bearer {TOKEN}"
            yield c
    finally:
        be.close()


CREDENTIAL_REF = {
    "name": "PODIUM_API_TOKEN",
    "valueFrom": {"secretKeyRef": {"name": "podium-exp-e1-pod-credential", "key": "token"}},
}


def validate(manifest: dict[str, Any]) -> None:
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


# -- manifests -------------------------------------------------------------------------------
def test_pod_manifest_shape_and_schema(k8s_settings: OrchestratorSettings) -> None:
    m = pod_manifest(k8s_settings, NS, request(gpus=2), owner_uid="uid-1")
    validate(m)
    meta, spec_ = m["metadata"], m["spec"]
    assert meta["name"] == "podium-e1-p1"
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "podium-orchestrator"
    assert meta["labels"]["app.kubernetes.io/part-of"] == "podium"
    assert meta["labels"]["podium.dev/experiment"] == "e1"
    assert meta["labels"]["podium.dev/pod"] == "p1"
    assert meta["ownerReferences"][0] == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "podium-exp-e1",
        "uid": "uid-1",
        "blockOwnerDeletion": False,
    }
    # One container runs the pod (worker, learner and evaluator) with all of its resources.
    assert spec_["volumes"] == [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
        {"name": "compile-cache", "emptyDir": {}},
        {"name": "tensorboard", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    [c] = spec_["containers"]
    assert c["name"] == "pod" and c["image"] == "ghcr.io/podium-rl/podium:0.1.0"
    assert c["command"] == ["python", "-m", "services.pod"]
    assert c["args"] == ["--experiment", "e1", "--pod-id", "p1"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # A read-only root: what the pod writes goes to its volumes, /tmp among them (its work
    # directory; the image's HOME, where Triton keeps its cache).
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    # Its /metrics, on the port the chart's PodMonitor scrapes by name.
    assert c["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PODIUM_METRICS_PORT"] == "9400"
    assert env["PODIUM_EXPERIMENT_ID"] == "e1" and env["PODIUM_POD_ID"] == "p1"
    # The experiment's own credential, from its Secret: never the platform token of req.env.
    assert next(e for e in c["env"] if e["name"] == "PODIUM_API_TOKEN") == CREDENTIAL_REF
    assert "s3cret" not in json.dumps(m)
    assert c["resources"] == {
        "requests": {"cpu": "2000m", "memory": "4096Mi", "nvidia.com/gpu": "2"},
        "limits": {"memory": "4096Mi", "nvidia.com/gpu": "2"},
    }
    assert spec_["restartPolicy"] == "Never"
    assert "nodeSelector" not in spec_ and "priorityClassName" not in spec_


def test_pods_without_gpus_run_the_cpu_image_when_one_is_configured(
    k8s_settings: OrchestratorSettings,
) -> None:
    """A CPU pod pulled the CUDA image (gigabytes of CUDA libraries it never uses)."""
    cuda, cpu = "ghcr.io/podium-rl/podium-pod:0.1.0", "ghcr.io/podium-rl/podium-pod:0.1.0-cpu"
    both = k8s_settings.model_copy(update={"pod_image": cuda, "pod_image_cpu": cpu})
    for claim in (None, "gpu"):
        settings = both.model_copy(update={"k8s_gpu_claim_template": claim})
        for gpus, image in ((0, cpu), (1, cuda)):
            m = pod_manifest(settings, NS, request(gpus=gpus), owner_uid="uid-1")
            validate(m)
            assert {c["image"] for c in m["spec"]["containers"]} == {image}, (claim, gpus)
    # Not configured (the default): one image for every pod.
    assert OrchestratorSettings.model_fields["pod_image_cpu"].default is None
    only = k8s_settings.model_copy(update={"pod_image": cuda})
    for gpus in (0, 1):
        [c] = pod_manifest(only, NS, request(gpus=gpus), owner_uid="uid-1")["spec"]["containers"]
        assert c["image"] == cuda
    # Read from the environment, as the chart passes it.
    env = {"PODIUM_POD_IMAGE": cuda, "PODIUM_POD_IMAGE_CPU": cpu}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        from_env = OrchestratorSettings(backend="kubernetes")
    assert (from_env.pod_image, from_env.pod_image_cpu) == (cuda, cpu)


def test_the_pod_mode_is_fused_and_any_other_is_refused_at_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod runs its worker, learner and evaluator in one process: an operator's
    PODIUM_POD_MODE=processes cannot be honoured, so the orchestrator refuses to start with
    pydantic's error naming the setting, never silently runs its pods some other way."""
    assert OrchestratorSettings(backend="kubernetes").pod_mode == "fused"
    monkeypatch.setenv("PODIUM_POD_MODE", "processes")
    with pytest.raises(ValidationError, match=r"pod_mode\n  Input should be 'fused'"):
        OrchestratorSettings(backend="kubernetes")
    monkeypatch.setenv("PODIUM_POD_MODE", "fused")
    assert OrchestratorSettings(backend="kubernetes").pod_mode == "fused"


def test_scheduling_settings_dra_and_token_secret(
    make_settings: Callable[..., OrchestratorSettings],
) -> None:
    s = make_settings(
        backend="kubernetes",
        k8s_node_selector={"nvidia.com/gpu.product": "A100"},
        k8s_tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        k8s_priority_class="podium-training",
        k8s_gpu_claim_template="single-gpu",
    )
    m = pod_manifest(s, NS, request(gpus=1), owner_uid="u")
    validate(m)
    spec_ = m["spec"]
    assert spec_["nodeSelector"] == {"nvidia.com/gpu.product": "A100"}
    assert spec_["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec_["priorityClassName"] == "podium-training"
    assert spec_["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}]
    [c] = spec_["containers"]  # the fused container holds the claim
    assert c["resources"]["claims"] == [{"name": "gpu"}]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    token = next(e for e in c["env"] if e["name"] == "PODIUM_API_TOKEN")
    assert token == CREDENTIAL_REF
    validate(owner_manifest(NS, "e1", "{}"))
    validate(credential_secret_manifest(NS, "e1", pod_token(LB_TOKEN, "e1"), "u"))


def test_the_compile_cache_claim_is_the_pods_cache(
    k8s_settings: OrchestratorSettings,
) -> None:
    """``k8s_compile_cache_claim``: the claim mounted in the pod's container, where its
    PODIUM_COMPILE_CACHE_DIR points (services/pod/runtime/compile_cache.py); unset, an emptyDir
    of the Pod (the experiment's pods share through the leaderboard). The pod writes
    TensorBoard files into an emptyDir of its own, and is told the allocator to preload
    (``pod_malloc``) and how MKL picks its kernels (``pod_mkl_dispatch``)."""
    for claim in (None, "podium-compile-cache"):
        s = k8s_settings.model_copy(
            update={
                "k8s_compile_cache_claim": claim,
                "pod_malloc": "system",
                "pod_mkl_dispatch": "vendor",
            }
        )
        m = pod_manifest(s, NS, request(), owner_uid="u")
        validate(m)
        [volume] = [v for v in m["spec"]["volumes"] if v["name"] == "compile-cache"]
        if claim:
            assert volume["persistentVolumeClaim"] == {"claimName": claim}
            # A claim's files belong to root unless the pod names a group: the pod image's
            # user (uid and gid 10001) must write there, else it falls back to a cache of its
            # own without a word.
            assert m["spec"]["securityContext"]["fsGroup"] == 10001
        else:
            assert volume["emptyDir"] == {}
        [c] = m["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {v["name"]: v["mountPath"] for v in c["volumeMounts"]}
        assert env["PODIUM_COMPILE_CACHE_DIR"] == mounts["compile-cache"]
        assert env["PODIUM_POD_MALLOC"] == "system"
        assert env["PODIUM_POD_MKL_DISPATCH"] == "vendor"
        assert env["PODIUM_TENSORBOARD_DIR"] == mounts["tensorboard"]


def test_schema_validation_catches_a_broken_manifest(k8s_settings: OrchestratorSettings) -> None:
    m = pod_manifest(k8s_settings, NS, request(), owner_uid="u")
    m["spec"]["containers"][0]["resources"]["requests"]["cpu"] = {"cores": 2}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(m)


# -- the backend against the API server ------------------------------------------------------
def test_create_list_watch_terminate(
    backend: KubernetesBackend, cluster: tuple[FakeCluster, ServerThread]
) -> None:
    fc, _ = cluster
    backend.create_pod(request("e1", "p1"))
    backend.create_pod(request("e1", "p2"))
    assert {p.pod_id for p in backend.list_pods()} == {"p1", "p2"}  # seen before the watch
    assert fc.pod_names(NS) == ["podium-e1-p1", "podium-e1-p2"]
    wait_for(lambda: all(p.phase == "Running" for p in backend.list_pods()))

    backend.changed.clear()
    backend.terminate_pod("e1", "p1", grace_s=10)
    wait_for(lambda: {p.pod_id for p in backend.list_pods()} == {"p2"})  # DELETED via the watch
    assert backend.changed.is_set()

    fc.fail_container(NS, "podium-e1-p2", "pod", 137, "OOMKilled", log="a\nb\nCUDA OOM")
    pod = wait_for(lambda: (ps := backend.list_pods()) and ps[0].phase == "Failed" and ps[0])
    assert pod.reason == "container pod: exit code 137 (OOMKilled)"
    assert pod.exit_code == 137 and not pod.live
    assert backend.pod_log_tail("e1", "p2", lines=2) == "b\nCUDA OOM"
    backend.remove_pod("e1", "p2")
    assert backend.list_pods() == [] and fc.pod_names(NS) == []
    assert [m["kind"] for m in fc.manifests] == ["ConfigMap", "Secret", "Pod", "Pod"]  # one owner


def test_an_ensemble_pods_algorithm_is_kept_on_the_pod(
    backend: KubernetesBackend, cluster: tuple[FakeCluster, ServerThread]
) -> None:
    """The orchestrator reads a pod's algorithm off the pod (an annotation), so a restarted
    one counts each algorithm's pods; the pod itself gets it as PODIUM_ALGORITHM."""
    fc, _ = cluster
    backend.create_pod(dataclasses.replace(request("e1", "p1"), algorithm="sac"))
    backend.create_pod(request("e1", "p2"))
    [pod] = [m for m in fc.manifests if m["kind"] == "Pod" and m["metadata"]["name"].endswith("p1")]
    validate(pod)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["PODIUM_ALGORITHM"] == "sac"
    assert {p.pod_id: p.algorithm for p in backend.list_pods()} == {"p1": "sac", "p2": None}


def test_an_operators_pod_env_and_pull_policy_reach_the_training_pods(
    cluster: tuple[FakeCluster, ServerThread],
    make_settings: Callable[..., OrchestratorSettings],
    flush_redis: None,
) -> None:
    """``pod_env`` (the chart's pod.env: the pods' own settings, which the orchestrator's
    environment never reaches on Kubernetes) and ``pod_image_pull_policy`` (image.pullPolicy)
    are in every pod the orchestrator creates."""
    settings = make_settings(
        backend="kubernetes", k8s_namespace=NS, k8s_capacity_refresh_s=0,
        pod_env={"PODIUM_POD_LOG_LINES": "500", "HF_HOME": "/cache/hf"},
        pod_image_pull_policy="Always",
    )  # fmt: skip
    with orchestrator(settings, cluster[1].url) as c:
        fc = cluster[0]
        body = spec(population={"min_pods": 1, "max_pods": 1})
        assert c.post("/api/v1/experiments", json=body).status_code == 201
        wait_for(lambda: fc.pod_names(NS))
        [pod] = [m for m in fc.manifests if m["kind"] == "Pod"]
    validate(pod)
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PODIUM_POD_LOG_LINES"] == "500" and env["HF_HOME"] == "/cache/hf"
    assert container["imagePullPolicy"] == "Always"


@pytest.mark.parametrize("name", ["PODIUM_SPEC", "PODIUM_TERMINATION_GRACE_S", "LD_PRELOAD",
                                  "PODIUM_API_TOKEN", "REDIS_URL"])  # fmt: skip
def test_pod_env_may_not_set_what_the_platform_sets_for_each_pod(name: str) -> None:
    with pytest.raises(ValidationError, match=f"pod_env may not set {name}"):
        OrchestratorSettings(pod_env={name: "x"})


def test_every_name_a_backend_sets_for_a_pod_is_one_pod_env_may_not_set(
    k8s_settings: OrchestratorSettings,
) -> None:
    """SET_PER_POD (what the settings refuse in pod_env) covers what the backends set: the
    identity both give a pod, the local backend's own and what the reconciler adds."""
    own = pod_identity_env(request(), k8s_settings, "/cache", "/tb")
    local = {"PODIUM_POD_DIR", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD"}
    reconciler = {"PODIUM_TERMINATION_GRACE_S", "PODIUM_LEADERBOARD_URL", "PODIUM_ALGORITHM"}
    assert {*own, *local, *reconciler, "PODIUM_MAX_ENV_STEPS"} <= SET_PER_POD
    m = pod_manifest(k8s_settings, NS, request(), owner_uid="u")
    assert {e["name"] for e in m["spec"]["containers"][0]["env"]} <= SET_PER_POD | {
        "PODIUM_API_TOKEN"
    }


def test_pods_that_can_never_start_are_failed_and_unschedulable_ones_say_why(
    backend: KubernetesBackend, cluster: tuple[FakeCluster, ServerThread]
) -> None:
    fc, _ = cluster
    backend.create_pod(request("e2", "p1"))
    backend.create_pod(request("e2", "p2"))
    wait_for(lambda: len(backend.list_pods()) == 2)
    fc.wait_container(NS, "podium-e2-p1", "pod", "ImagePullBackOff", "no such image")
    pod = wait_for(lambda: next((p for p in backend.list_pods() if p.phase == "Failed"), None))
    assert pod.pod_id == "p1" and not pod.live
    assert pod.reason == "container pod: ImagePullBackOff: no such image"
    fc.unschedulable(NS, "podium-e2-p2", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu")
    pod = wait_for(
        lambda: next((p for p in backend.list_pods() if p.pod_id == "p2" and p.reason), None)
    )
    assert pod.phase == "Pending" and pod.live
    assert pod.reason == (
        "not scheduled: Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu"
    )


def test_capacity_nodes_taints_selector_foreign_pods_and_quota(
    backend: KubernetesBackend, cluster: tuple[FakeCluster, ServerThread]
) -> None:
    fc, _ = cluster
    assert backend.capacity() == Res(4.0, 0, 16 * GI)
    fc.add_node("node-b", cpu="8", memory="32Gi", gpus=2)
    fc.add_node("tainted", cpu="64", memory="64Gi", taints=[{"key": "x", "effect": "NoSchedule"}])
    fc.add_foreign_pod("other", "db", cpu="1500m", memory="1Gi", node="node-b")
    assert backend.capacity() == Res(10.5, 2, 47 * GI)
    # Podium's own pods do not reduce what Podium may use: the reconciler counts them.
    backend.create_pod(request("e1", "p1"))
    assert backend.capacity() == Res(10.5, 2, 47 * GI)
    # A quota caps it: hard - used + what Podium's own pods hold.
    fc.set_quota(NS, "compute", {"requests.cpu": "3", "requests.memory": "100Gi"})
    assert backend.capacity() == Res(3.0, 2, 47 * GI)
    backend.settings.k8s_node_selector = {"pool": "gpu"}
    assert backend.capacity() == Res(0.0, 0, 0)


def test_with_dra_claims_gpus_are_the_operators_count_else_what_pods_ask_for(
    backend: KubernetesBackend,
) -> None:
    """Nodes of a DRA-only cluster advertise no nvidia.com/gpu (GPU experiments waited for
    capacity for ever): with a claim template the orchestrator's GPUs are capacity_gpus, else
    as many as pods ask for (the scheduler allocates the devices)."""
    assert backend.capacity().gpus == 0  # counted from the nodes: none advertised
    backend.settings.k8s_gpu_claim_template = "one-gpu"
    backend.settings.capacity_gpus, backend._capacity = None, None
    assert backend.capacity().gpus == UNCOUNTED_GPUS
    backend.settings.capacity_gpus, backend._capacity = 6, None
    assert backend.capacity().gpus == 6


# -- the whole orchestrator on Kubernetes ----------------------------------------------------
def test_orchestrator_on_kubernetes_scales_replaces_adopts_and_deletes(
    cluster: tuple[FakeCluster, ServerThread],
    k8s_settings: OrchestratorSettings,
    flush_redis: None,
) -> None:
    fc, srv = cluster
    with orchestrator(k8s_settings, srv.url) as c:
        body = spec(population={"min_pods": 2, "max_pods": 6})
        exp_id = c.post("/api/v1/experiments", json=body).json()["id"]
        wait_for(lambda: len(fc.pod_names(NS)) == 4)  # one 4-CPU node, 1 CPU per pod
        assert c.get(f"/api/v1/experiments/{exp_id}").json()["desired_pods"] == 4

        fc.add_node("node-b", cpu="4", memory="16Gi")  # capacity grows: scale out to max
        wait_for(lambda: len(fc.pod_names(NS)) == 6)
        first = fc.pod_names(NS)

        victim = first[0]
        fc.fail_container(NS, victim, "pod", 1, "Error", log="Traceback: boom")
        wait_for(lambda: len(n := fc.pod_names(NS)) == 6 and victim not in n)
        events = c.get(f"/api/v1/experiments/{exp_id}/events").json()
        failed = [e for e in events if e["type"] == "pod_failed"]
        assert len(failed) == 1 and "container pod: exit code 1 (Error)" in failed[0]["message"]
        exp = c.get(f"/api/v1/experiments/{exp_id}").json()
        assert exp["last_failure"]["log_tail"] == "Traceback: boom"
        before = fc.pod_names(NS)

    # A new orchestrator (new backend, new reconciler) adopts the pods it finds by label.
    be2 = KubernetesBackend(k8s_settings, api_client=api_client(srv.url))
    with TestClient(create_app(k8s_settings, backend=be2)) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        first_pass = c.app.state.reconciler.passes
        wait_for(lambda: c.app.state.reconciler.passes >= first_pass + 10)
        assert fc.pod_names(NS) == before
        assert sum(m["kind"] == "Pod" for m in fc.manifests) == 7  # 6 + 1 replacement
        assert c.delete(f"/api/v1/experiments/{exp_id}").status_code == 204
        wait_for(lambda: fc.pod_names(NS, live_only=False) == [])
        wait_for(lambda: not fc.configmaps and not fc.secrets)
    be2.close()
    for m in fc.manifests:
        validate(m)


def test_deleting_the_owner_collects_the_pods(
    backend: KubernetesBackend, cluster: tuple[FakeCluster, ServerThread]
) -> None:
    fc, _ = cluster
    for i in range(3):
        backend.create_pod(request("e9", f"p{i}"))
    backend.create_pod(request("e8", "q"))
    backend.delete_experiment("e9")
    assert fc.pod_names(NS) == ["podium-e8-q"]
    wait_for(lambda: [p.pod_id for p in backend.list_pods()] == ["q"])


def test_informer_relists_after_410_gone(
    backend: KubernetesBackend,
    cluster: tuple[FakeCluster, ServerThread],
    k8s_settings: OrchestratorSettings,
) -> None:
    fc, _ = cluster
    backend.create_pod(request("e1", "p1"))
    wait_for(lambda: fc.events and backend.list_pods())
    assert backend.relists == 1
    # While the watch is down, a pod appears and the history it would resume from is gone.
    fc.compact_and_create(NS, pod_manifest(k8s_settings, NS, request("e1", "p2"), "uid"))
    wait_for(lambda: {p.pod_id for p in backend.list_pods()} == {"p1", "p2"}, timeout=5)
    assert backend.relists == 2


# -- faults --------------------------------------------------------
def test_on_kubernetes_exit_2_fails_at_once_and_evictions_are_not_crashes(
    cluster: tuple[FakeCluster, ServerThread],
    k8s_settings: OrchestratorSettings,
    flush_redis: None,
) -> None:
    limit = k8s_settings.crash_loop_limit
    with orchestrator(k8s_settings, cluster[1].url) as c:
        fc = cluster[0]
        body = spec(population={"min_pods": 1, "max_pods": 1}, budget={"total_env_steps": 9000})
        exp_id = c.post("/api/v1/experiments", json=body).json()["id"]
        # Evicted and preempted pods, more of them than the crash-loop limit: replaced, not
        # counted (these pods never reported: only the disruption makes them not crashes).
        for i in range(limit + 1):
            (name,) = wait_for(lambda: len(n := fc.pod_names(NS)) == 1 and n)
            fc.evict(NS, name, preemption=i % 2 == 1)
            wait_for(lambda: fc.pod_names(NS) != [name] and len(fc.pod_names(NS)) == 1)  # noqa: B023
        exp = wait_for(
            lambda: (
                (e := c.get(f"/api/v1/experiments/{exp_id}").json())["progress"]["pods_launched"]
                == limit + 2
                and e
            )
        )
        assert exp["state"] == "running", exp["reason"]
        failed = [
            e
            for e in c.get(f"/api/v1/experiments/{exp_id}/events").json()
            if e["type"] == "pod_failed"
        ]
        assert len(failed) == limit + 1
        assert all("not counted as a crash" in e["message"] for e in failed)
        assert "Evicted: The node was low on resource: memory." in failed[0]["message"]
        assert "PreemptionByScheduler" in failed[1]["message"]
        # Every pod was told the env steps it may take (the budget over the one target pod).
        pods = [m for m in fc.manifests if m["kind"] == "Pod"]
        env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
        assert env["PODIUM_MAX_ENV_STEPS"] == "9000"

        # A container that exits 2 (bad input) fails the experiment at once, with its message.
        (name,) = fc.pod_names(NS)
        line = '{"event": "bad input", "level": "error", "error": "cannot train dqn on X"}'
        fc.fail_container(NS, name, "pod", 2, "Error", log=line)
        exp = wait_for(
            lambda: (e := c.get(f"/api/v1/experiments/{exp_id}").json())["state"] == "failed" and e
        )
        assert (
            exp["reason"]
            == "a pod refused its input (exit code 2): bad input: cannot train dqn on X"
        )
        assert exp["progress"]["pods_launched"] == limit + 2  # not retried


def test_on_kubernetes_pods_killed_or_lost_with_their_node_are_not_crashes(
    cluster: tuple[FakeCluster, ServerThread],
    k8s_settings: OrchestratorSettings,
    flush_redis: None,
) -> None:
    # Pods that never reported, ended from outside more times than the
    # crash-loop limit: a container killed by SIGKILL or SIGTERM (exit code 137 / 143, not
    # OOMKilled) and a node lost. How they ended says they did not crash; an OOM kill did.
    limit = k8s_settings.crash_loop_limit
    fc = cluster[0]
    with orchestrator(k8s_settings, cluster[1].url) as c:
        body = spec(population={"min_pods": 1, "max_pods": 1})
        exp_id = c.post("/api/v1/experiments", json=body).json()["id"]
        for i in range(limit + 1):
            (name,) = wait_for(lambda: len(n := fc.pod_names(NS)) == 1 and n)
            if i % 3 == 0:
                fc.lose_node(NS, name)
            else:
                fc.fail_container(NS, name, "pod", 137 if i % 3 == 1 else 143, "Error")
            wait_for(lambda: fc.pod_names(NS) != [name] and len(fc.pod_names(NS)) == 1)  # noqa: B023
        exp = wait_for(
            lambda: (
                (e := c.get(f"/api/v1/experiments/{exp_id}").json())["progress"]["pods_launched"]
                == limit + 2
                and e
            )
        )
        assert exp["state"] == "running", exp["reason"]
        events = c.get(f"/api/v1/experiments/{exp_id}/events").json()
        failed = [e["message"] for e in events if e["type"] == "pod_failed"]
        assert len(failed) == limit + 1
        assert all("not counted as a crash" in m for m in failed), failed
        assert "NodeLost" in failed[0] and "killed by SIGKILL" in failed[1], failed
        assert "killed by SIGTERM" in failed[2], failed
        # The container's own memory ran out: a crash, counted (replaced after a backoff).
        (name,) = fc.pod_names(NS)
        fc.fail_container(NS, name, "pod", 137, "OOMKilled")
        wait_for(
            lambda: any(
                "OOMKilled" in e["message"] and "1 consecutive failures" in e["message"]
                for e in c.get(f"/api/v1/experiments/{exp_id}/events").json()
            )
        )


def test_pods_get_their_experiments_credential_from_a_secret_the_orchestrator_owns(
    cluster: tuple[FakeCluster, ServerThread],
    k8s_settings: OrchestratorSettings,
) -> None:
    """Every pod got the platform token (which also works on the
    orchestrator). Now each experiment has a Secret, owned by its ConfigMap and deleted with
    it, holding a credential that works for that experiment's pod routes only."""
    fc, srv = cluster
    fc.add_node("node-b", cpu="8", memory="32Gi")  # room for every pod below
    be = KubernetesBackend(k8s_settings, api_client=api_client(srv.url))
    try:
        for exp, pod in (("e1", "p1"), ("e1", "p2"), ("e2", "q")):
            be.create_pod(request(exp, pod))
        # The kubelet found the Secret each pod's env names: every container runs.
        wait_for(lambda: len(ps := be.list_pods()) == 3 and all(p.phase == "Running" for p in ps))
        assert sorted(name for _, name in fc.secrets) == [
            "podium-exp-e1-pod-credential",
            "podium-exp-e2-pod-credential",
        ]
        secret = fc.secrets[(NS, "podium-exp-e1-pod-credential")]
        assert base64.b64decode(secret["data"]["token"]).decode() == pod_token(LB_TOKEN, "e1")
        owner = fc.configmaps[(NS, "podium-exp-e1")]["metadata"]
        assert secret["metadata"]["ownerReferences"][0]["uid"] == owner["uid"]
        assert secret["metadata"]["labels"]["podium.dev/experiment"] == "e1"
        # The platform tokens reach no object (req.env carried one: "s3cret").
        for m in fc.manifests:
            assert not {"s3cret", LB_TOKEN, TOKEN} & set(_strings(m)), m["kind"]
        be.delete_experiment("e1")
        assert sorted(name for _, name in fc.secrets) == ["podium-exp-e2-pod-credential"]
    finally:
        be.close()

    # A restarted orchestrator with a rotated token makes the Secret again (it may create and
    # delete Secrets, not read or update them).
    rotated = k8s_settings.model_copy(update={"leaderboard_token": SecretStr("rotated")})
    be = KubernetesBackend(rotated, api_client=api_client(srv.url))
    try:
        be.create_pod(request("e2", "q2"))
        secret = fc.secrets[(NS, "podium-exp-e2-pod-credential")]
        assert base64.b64decode(secret["data"]["token"]).decode() == pod_token("rotated", "e2")
        wait_for(lambda: all(p.phase == "Running" for p in be.list_pods()))
    finally:
        be.close()


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return [obj] if isinstance(obj, str) else []


def test_on_kubernetes_ended_pods_last_lines_outlive_their_pod_objects(
    cluster: tuple[FakeCluster, ServerThread],
    k8s_settings: OrchestratorSettings,
    flush_redis: None,
) -> None:
    """A pod's log goes with its object, which the orchestrator deletes once
    the pod has failed (and Kubernetes deletes once a stopped pod has exited): read through
    the API before, and kept with the experiment."""
    fc, srv = cluster
    with orchestrator(k8s_settings, srv.url) as c:
        body = spec(population={"min_pods": 1, "max_pods": 1})
        exp_id = c.post("/api/v1/experiments", json=body).json()["id"]
        base = f"/api/v1/experiments/{exp_id}"
        (crashed,) = wait_for(lambda: len(n := fc.pod_names(NS)) == 1 and n)
        fc.write_log(NS, crashed, "pod", "".join(f"round {i} done\n" for i in range(300)))
        fc.fail_container(NS, crashed, "pod", 3, "Error", log="CUDA error: out of memory\n")
        (stopped,) = wait_for(lambda: (n := fc.pod_names(NS)) and n != [crashed] and n)
        assert crashed not in fc.pod_names(NS, live_only=False)  # its object (and log) is gone
        fc.write_log(NS, stopped, "pod", "round 0 done\nround 1 done\n")
        assert c.post(f"{base}/cancel").status_code == 202
        wait_for(lambda: not fc.pod_names(NS, live_only=False))

        kept = c.get(f"{base}/ended-pods", params={"tail": 1000}).json()
        by_pod = {p["pod_id"]: p for p in kept}
        assert [p["pod_id"] for p in kept] == [
            crashed.removeprefix(f"podium-{exp_id}-"),
            stopped.removeprefix(f"podium-{exp_id}-"),
        ]
        first, second = (by_pod[p["pod_id"]] for p in kept)
        assert first["phase"] == "Failed" and not first["stopped"]
        assert first["reason"] == "container pod: exit code 3 (Error)"
        lines = first["log"].splitlines()
        assert len(lines) == k8s_settings.ended_pod_log_lines  # the last 200 of 301
        assert lines[-2:] == ["round 299 done", "CUDA error: out of memory"]
        assert second["stopped"] and second["log"] == "round 0 done\nround 1 done"
        one = c.get(f"{base}/pods/{first['pod_id']}/logs", params={"tail": 1})
        assert one.status_code == 200 and one.text == "CUDA error: out of memory\n"
