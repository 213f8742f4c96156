"""Kubernetes backend: a training pod is a Pod running the pod image.

- A training pod is one container, ``pod``, running ``python -m services.pod --experiment ID
  --pod-id ID``: the worker, the learner and the evaluator in one process, with all of the
  pod's CPU, memory and GPUs.
- /dev/shm is a memory-backed emptyDir (``k8s_shared_memory``; a container's own is 64 MiB).
- The root filesystem is read-only; /tmp (the pod's work directory, the image's HOME) an emptyDir.
- torch.compile's cache is at ``COMPILE_CACHE_DIR``: an emptyDir of the Pod, or, with
  ``k8s_compile_cache_claim``, a ReadWriteMany PersistentVolumeClaim. Either way the
  experiment's pods share what the first of them compiled through the leaderboard's blob store
  (services/pod/runtime/compile_share.py); the claim also keeps it across experiments.
- The pod serves /metrics on ``k8s_pod_metrics_port`` (container port ``metrics``, scraped by
  the chart's PodMonitor).
- The pod writes its TensorBoard files into an emptyDir at ``TENSORBOARD_DIR`` and uploads
  them, and its last log lines, to the leaderboard's blob store as it runs and before it exits
  (services/pod/runtime/pod_files.py): nothing a user reads is lost with the Pod.
  ``PODIUM_POD_MALLOC`` (``pod_malloc``) is the allocator the pod preloads,
  ``PODIUM_POD_MKL_DISPATCH`` (``pod_mkl_dispatch``) how MKL picks its kernels in it.
- The GPU: ``nvidia.com/gpu`` limits with the NVIDIA device plugin, or, with
  ``k8s_gpu_claim_template`` set, a DRA ResourceClaim from that template that the container
  references.
- Each experiment owns a ConfigMap holding its spec; every pod has an ownerReference to it, so
  deleting the experiment (its ConfigMap) lets the garbage collector take its pods.
- Pods never see the platform token: each experiment has a Secret (owned by that ConfigMap, and
  deleted with the experiment) holding its pods' credential, scoped to the experiment's pod
  routes of the leaderboard (services/contracts/credentials.py), read through a secretKeyRef.
- Pods are found by label (``app.kubernetes.io/managed-by=podium-orchestrator``) through an
  informer: one list, then a watch from its resourceVersion (relist on 410 Gone), so pod changes
  arrive as events instead of polling and wake the reconciler.
- Capacity = sum of allocatable of schedulable nodes (matching nodeSelector, taints tolerated)
  minus requests of non-terminated pods that are not Podium's, capped by the namespace's
  ResourceQuotas (hard - used + what Podium's own pods use).

The API objects are handled as plain dicts (``_preload_content=False``): that is what the API
server sends, and it skips the client's slow model deserialisation.

Why one file of this size: one backend per file, as local.py: its manifests, informer and
per-experiment objects (ConfigMap, Secret) implement the one Backend interface together.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity
from kubernetes.watch import Watch

from services.contracts.credentials import PLATFORM_SECRETS
from services.logs import get_logger
from services.orchestrator.backends.base import (
    EXPERIMENT_LABEL,
    MANAGED_BY,
    MANAGER,
    OUTSIDE_SIGNALS,
    POD_LABEL,
    Backend,
    PodInfo,
    PodRequest,
    pod_credential,
    pod_identity_env,
)
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import OrchestratorSettings

log = get_logger(__name__)

POD_IMAGE_GID = 10001  #: the pod image's group (Dockerfile: USER 10001:10001)
#: GPUs the orchestrator may hand out where it cannot count them (DRA claims): no limit of its own.
UNCOUNTED_GPUS = 1 << 20

#: Container waiting reasons that do not fix themselves: a bad image name or an image that
#: cannot be pulled (after the kubelet's own retries), a missing Secret/ConfigMap, a bad spec.
NEVER_STARTS = frozenset(
    {"ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError"}
)

SELECTOR = f"{MANAGED_BY}={MANAGER}"
RESOURCES_ANNOTATION = "podium.dev/resources"
ALGORITHM_ANNOTATION = "podium.dev/algorithm"
#: The training pod's one container.
CONTAINER = "pod"
#: Where a training pod's compile cache is (an emptyDir, or ``k8s_compile_cache_claim``).
COMPILE_CACHE_DIR = "/var/cache/podium/compile"
#: The name of a training pod's /metrics port (``k8s_pod_metrics_port``): the PodMonitor's.
METRICS_PORT_NAME = "metrics"
#: Where the pod writes its TensorBoard files (an emptyDir; uploaded as they grow).
TENSORBOARD_DIR = "/var/lib/podium/tensorboard"
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def pod_name(experiment_id: str, pod_id: str) -> str:
    return f"podium-{experiment_id}-{pod_id}"


def owner_name(experiment_id: str) -> str:
    return f"podium-exp-{experiment_id}"


def credential_secret_name(experiment_id: str) -> str:
    return f"podium-exp-{experiment_id}-pod-credential"


def labels(experiment_id: str, pod_id: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "podium-pod",
        "app.kubernetes.io/instance": f"podium-{experiment_id}",
        "app.kubernetes.io/component": "training-pod",
        "app.kubernetes.io/part-of": "podium",
        MANAGED_BY: MANAGER,
        EXPERIMENT_LABEL: experiment_id,
    }
    if pod_id is not None:
        out[POD_LABEL] = pod_id
    return out


def _cpu(cores: float) -> str:
    return f"{max(1, round(cores * 1000))}m"


def _mem(n: float) -> str:
    return f"{max(1, int(n) // 2**20)}Mi"


def owner_manifest(namespace: str, experiment_id: str, spec_json: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": owner_name(experiment_id),
            "namespace": namespace,
            "labels": labels(experiment_id),
        },
        "data": {"spec.json": spec_json},
    }


def _owner_reference(experiment_id: str, owner_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": owner_name(experiment_id),
        "uid": owner_uid,
        "blockOwnerDeletion": False,
    }


def credential_secret_manifest(
    namespace: str, experiment_id: str, credential: str, owner_uid: str
) -> dict[str, Any]:
    """The Secret holding the experiment's pod credential (key ``token``)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": credential_secret_name(experiment_id),
            "namespace": namespace,
            "labels": labels(experiment_id),
            "ownerReferences": [_owner_reference(experiment_id, owner_uid)],
        },
        "stringData": {"token": credential},
    }


def pod_manifest(
    settings: OrchestratorSettings,
    namespace: str,
    req: PodRequest,
    owner_uid: str,
) -> dict[str, Any]:
    """The Pod for one training pod (pure; validated against the Kubernetes schemas in tests)."""
    r = req.resources
    own = pod_identity_env(req, settings, COMPILE_CACHE_DIR, TENSORBOARD_DIR)
    env = [{"name": k, "value": v} for k, v in own.items()]
    for k, v in sorted(req.pod_env().items()):
        if k not in PLATFORM_SECRETS:
            env.append({"name": k, "value": v})
    port = settings.k8s_pod_metrics_port
    if port:
        env.append({"name": "PODIUM_METRICS_PORT", "value": str(port)})
    if settings.leaderboard_token_value():
        secret = credential_secret_name(req.experiment_id)
        env.append(
            {
                "name": "PODIUM_API_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}},
            }
        )
    mounts = [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR},
    ]
    cache: dict[str, Any] = (  # services/pod/runtime/compile_cache.py
        {"persistentVolumeClaim": {"claimName": settings.k8s_compile_cache_claim}}
        if settings.k8s_compile_cache_claim
        else {"emptyDir": {}}
    )
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.k8s_shared_memory}},
        {"name": "compile-cache", **cache},
        {"name": "tensorboard", "emptyDir": {}},
        # The root is read-only: the pod's work directory and HOME (Triton's cache) are here.
        {"name": "tmp", "emptyDir": {}},
    ]
    claim = bool(r.gpus and settings.k8s_gpu_claim_template)
    resources: dict[str, Any] = {
        "requests": {"cpu": _cpu(r.cpu), "memory": _mem(r.memory)},
        "limits": {"memory": _mem(r.memory)},
    }
    if claim:
        resources["claims"] = [{"name": "gpu"}]
    elif r.gpus:
        resources["limits"]["nvidia.com/gpu"] = str(r.gpus)
        resources["requests"]["nvidia.com/gpu"] = str(r.gpus)
    # A pod without GPUs has no use for CUDA torch: the CPU build, where one is configured.
    image = settings.pod_image_cpu if not r.gpus and settings.pod_image_cpu else settings.pod_image
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": settings.pod_image_pull_policy,
        "command": ["python", "-m", "services.pod"],
        "args": ["--experiment", req.experiment_id, "--pod-id", req.pod_id],
        "env": env,
        "resources": resources,
        "volumeMounts": [
            *mounts,
            {"name": "tensorboard", "mountPath": TENSORBOARD_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": {
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if port:  # scraped by the chart's PodMonitor (helm/podium/templates/servicemonitor.yaml)
        container["ports"] = [{"name": METRICS_PORT_NAME, "containerPort": port, "protocol": "TCP"}]
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the reconciler replaces failed pods, with backoff
        "terminationGracePeriodSeconds": max(1, round(req.grace_s)),
        "containers": [container],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
            # The pod image's user and group (Dockerfile): a compile-cache claim becomes theirs.
            "fsGroup": POD_IMAGE_GID,
        },
        "enableServiceLinks": False,
    }
    if settings.k8s_node_selector:
        spec["nodeSelector"] = dict(settings.k8s_node_selector)
    if settings.k8s_tolerations:
        spec["tolerations"] = [dict(t) for t in settings.k8s_tolerations]
    if settings.k8s_priority_class:
        spec["priorityClassName"] = settings.k8s_priority_class
    if settings.k8s_pod_service_account:
        spec["serviceAccountName"] = settings.k8s_pod_service_account
    spec["automountServiceAccountToken"] = False
    if claim:
        spec["resourceClaims"] = [
            {"name": "gpu", "resourceClaimTemplateName": settings.k8s_gpu_claim_template}
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(req.experiment_id, req.pod_id),
            "namespace": namespace,
            "labels": labels(req.experiment_id, req.pod_id),
            "annotations": {
                RESOURCES_ANNOTATION: json.dumps(
                    {"cpu": r.cpu, "gpus": r.gpus, "memory": r.memory}
                ),
                **({ALGORITHM_ANNOTATION: req.algorithm} if req.algorithm else {}),
            },
            "ownerReferences": [_owner_reference(req.experiment_id, owner_uid)],
        },
        "spec": spec,
    }


def _ts(value: str | None) -> float:
    if not value:
        return time.time()
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _requests(pod: dict[str, Any]) -> Res:
    cpu, gpus, mem = 0.0, 0, 0
    for c in pod.get("spec", {}).get("containers", []):
        res = c.get("resources") or {}
        req = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        if "cpu" in req:
            cpu += float(parse_quantity(req["cpu"]))
        if "memory" in req:
            mem += int(parse_quantity(req["memory"]))
        if "nvidia.com/gpu" in req:
            gpus += int(parse_quantity(req["nvidia.com/gpu"]))
    return Res(cpu, gpus, mem)


#: Pod status reasons of a pod stopped from outside (the kubelet's eviction under node
#: pressure, a node shutting down): not the pod's fault, so never counted as a crash.
DISRUPTION_REASONS = frozenset({"Evicted", "Preempting", "Shutdown", "NodeShutdown", "Terminated"})


#: Container exit codes of a process killed by a signal it does not send itself when it
#: crashes (128 + SIGHUP, SIGINT, SIGKILL, SIGTERM): killed from outside, unless the
#: container's reason says its memory limit did it (OOMKilled: the pod's own doing).
#: A container killed by signal s exits with 128 + s.
OUTSIDE_KILLS = {128 + s: s.name for s in OUTSIDE_SIGNALS}


def _disruption(status: dict[str, Any], killed: dict[str, Any] | None = None) -> str | None:
    """Why a failed pod was stopped from outside, or None: the pod status reason, or the
    ``DisruptionTarget`` condition (preemption, API eviction, taint manager, pod GC), or its node
    lost (phase Unknown), or ``killed``, the terminated state of its failed container, says a signal
    from outside ended it."""
    for cond in status.get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            why = cond.get("reason") or "disrupted"
            return f"{why}: {cond['message']}" if cond.get("message") else why
    if status.get("reason") in DISRUPTION_REASONS:
        why = status["reason"]
        return f"{why}: {status['message']}" if status.get("message") else why
    if status.get("phase") == "Unknown":
        return f"node lost ({status.get('reason') or 'phase Unknown'})"
    if killed and killed.get("reason") != "OOMKilled":
        sig = OUTSIDE_KILLS.get(killed.get("exitCode", 0))
        if sig is not None:
            return f"killed by {sig} from outside"
    return None


def _tolerated(taint: dict[str, Any], tolerations: list[dict[str, Any]]) -> bool:
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value") == taint.get("value"):
            return True
    return False


class KubernetesBackend(Backend):
    #: A pod deleted with a grace period is gone once it exits: no ``Succeeded`` object is left.
    forgets_stopped_pods = True

    def __init__(
        self,
        settings: OrchestratorSettings,
        api_client: client.ApiClient | None = None,
    ):
        super().__init__()
        self.settings = settings
        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            cfg = client.Configuration.get_default_copy()
            # One connection per concurrent create, plus the watch and capacity reads.
            cfg.connection_pool_maxsize = settings.create_concurrency + 4
            api_client = client.ApiClient(cfg)
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.namespace = settings.k8s_namespace or (
            SA_NAMESPACE.read_text().strip() if SA_NAMESPACE.exists() else "default"
        )
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, Any]] = {}  # name → pod, kept by the informer
        self._owners: dict[str, str] = {}  # experiment → ConfigMap uid
        self._owner_lock = threading.Lock()
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._watch: Watch | None = None
        self._capacity: tuple[float, Res] | None = None
        self._cluster_wide_pods = True
        self.relists = 0  # full lists of pods (start-up, then after a watch expired)
        self._thread = threading.Thread(target=self._inform, name="k8s-pods", daemon=True)
        self._thread.start()
        if not self._synced.wait(30):
            raise RuntimeError("could not list pods from the Kubernetes API")

    # -- informer ----------------------------------------------------------------------------
    def _list(self, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        resp = fn(*args, _preload_content=False, **kwargs)
        return json.loads(resp.data)

    def _relist(self) -> str:
        self.relists += 1
        data = self._list(self.core.list_namespaced_pod, self.namespace, label_selector=SELECTOR)
        with self._lock:
            self._pods = {p["metadata"]["name"]: p for p in data.get("items", [])}
        self._synced.set()
        self.changed.set()
        return data["metadata"].get("resourceVersion", "")

    def _inform(self) -> None:
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                self._watch = Watch()
                for ev in self._watch.stream(
                    self.core.list_namespaced_pod,
                    self.namespace,
                    label_selector=SELECTOR,
                    resource_version=rv,
                    timeout_seconds=300,
                    allow_watch_bookmarks=True,
                    deserialize=False,
                ):
                    if self._stop.is_set():
                        break
                    obj = ev.get("object") or ev.get("raw_object") or {}
                    if ev["type"] == "ERROR":
                        rv = None  # 410 Gone or another watch error: start over from a list
                        break
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if ev["type"] == "BOOKMARK":
                        continue
                    name = obj["metadata"]["name"]
                    with self._lock:
                        if ev["type"] == "DELETED":
                            self._pods.pop(name, None)
                        else:
                            self._pods[name] = obj
                    self.changed.set()
            except ApiException as e:
                if e.status == 410:
                    rv = None
                    continue
                log.warning("pod watch failed; retrying", status=e.status, reason=e.reason)
                self._stop.wait(1.0)
            except KeyError:
                # The client reads an ERROR event's raw_object, which it only sets when it
                # deserialises; here it means the watch expired (410 Gone): relist at once.
                rv = None
            except Exception as e:
                if self._stop.is_set():
                    return
                log.warning("pod watch failed; relisting", error=f"{type(e).__name__}: {e}")
                rv = None
                self._stop.wait(1.0)

    # -- interface ---------------------------------------------------------------------------
    def list_pods(self) -> list[PodInfo]:
        with self._lock:
            pods = list(self._pods.values())
        return [self._info(p) for p in pods if p["metadata"].get("labels", {}).get(POD_LABEL)]

    def _info(self, pod: dict[str, Any]) -> PodInfo:
        meta, status = pod["metadata"], pod.get("status") or {}
        lab = meta.get("labels", {})
        try:
            res = json.loads(meta.get("annotations", {})[RESOURCES_ANNOTATION])
            resources = Res(float(res["cpu"]), int(res["gpus"]), int(res["memory"]))
        except (KeyError, ValueError, TypeError):
            resources = _requests(pod)
        phase = status.get("phase") or "Pending"
        exit_code, reason = None, status.get("reason")
        killed = None  # the failed container's terminated state
        # A training pod is useless once its container has failed.
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated")
            if term and term.get("exitCode", 0) != 0:
                phase, exit_code, killed = "Failed", term["exitCode"], term
                why = term.get("reason") or "Error"
                reason = f"container {cs['name']}: exit code {exit_code} ({why})"
                break
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in NEVER_STARTS:
                # The kubelet keeps retrying these forever; for the reconciler the pod has
                # failed (so it is replaced with backoff, and a crash loop ends the experiment
                # with this reason instead of the experiment showing "running" for ever).
                phase = "Failed"
                reason = (
                    f"container {cs['name']}: {waiting['reason']}: {waiting.get('message', '')}"
                )
                break
        if phase == "Pending" and reason is None:
            for cond in status.get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                    reason = f"not scheduled: {cond.get('reason')}: {cond.get('message', '')}"
        if phase == "Unknown":
            phase, reason = "Failed", reason or "node lost (phase Unknown)"
        if phase == "Failed" and reason is None:
            reason = status.get("message") or "pod failed"
        disruption = _disruption(status, killed) if phase == "Failed" else None
        if disruption:  # e.g. a container killed by an eviction: say both
            plain = reason in (None, status.get("reason"), status.get("message"))
            reason = disruption if plain else f"{reason} ({disruption})"
        return PodInfo(
            experiment_id=lab.get(EXPERIMENT_LABEL, ""),
            pod_id=lab.get(POD_LABEL, ""),
            phase=phase,  # type: ignore[arg-type]
            created_at=_ts(meta.get("creationTimestamp")),
            resources=resources,
            terminating=meta.get("deletionTimestamp") is not None,
            exit_code=exit_code,
            reason=reason,
            disruption=disruption,
            algorithm=(meta.get("annotations") or {}).get(ALGORITHM_ANNOTATION),
        )

    def _owner_uid(self, experiment_id: str, spec_json: str) -> str:
        uid = self._owners.get(experiment_id)
        if uid is not None:
            return uid
        # Pods are created in parallel: the first makes the owner and its Secret, the others
        # wait for it (a pod must not start while its credential is being made again).
        with self._owner_lock:
            return self._owners.get(experiment_id) or self._create_owner(experiment_id, spec_json)

    def _create_owner(self, experiment_id: str, spec_json: str) -> str:
        name = owner_name(experiment_id)
        try:
            resp = self.core.create_namespaced_config_map(
                self.namespace,
                owner_manifest(self.namespace, experiment_id, spec_json),
                _preload_content=False,
            )
            uid = json.loads(resp.data)["metadata"]["uid"]
        except ApiException as e:
            if e.status != 409:
                raise
            resp = self.core.read_namespaced_config_map(
                name, self.namespace, _preload_content=False
            )
            uid = json.loads(resp.data)["metadata"]["uid"]
        self._put_credential(experiment_id, uid)
        self._owners[experiment_id] = uid
        return uid

    def _put_credential(self, experiment_id: str, owner_uid: str) -> None:
        """Create the pods' credential Secret, once per experiment and process: one left by an
        earlier orchestrator is made again (the platform token may have been rotated). The
        orchestrator may create and delete Secrets, never read or update one."""
        credential = pod_credential(self.settings, experiment_id)
        if credential is None:
            return
        body = credential_secret_manifest(self.namespace, experiment_id, credential, owner_uid)
        for attempt in range(2):
            try:
                self.core.create_namespaced_secret(self.namespace, body, _preload_content=False)
                return
            except ApiException as e:
                if e.status != 409 or attempt:
                    raise
            with contextlib.suppress(ApiException):  # gone meanwhile: create it
                self.core.delete_namespaced_secret(
                    credential_secret_name(experiment_id), self.namespace, _preload_content=False
                )

    def create_pod(self, req: PodRequest) -> None:
        manifest = pod_manifest(
            self.settings, self.namespace, req, self._owner_uid(req.experiment_id, req.spec_json)
        )
        resp = self.core.create_namespaced_pod(self.namespace, manifest, _preload_content=False)
        created = json.loads(resp.data)
        with self._lock:
            # Seen at once, before the watch delivers ADDED: the next pass must not re-create it.
            self._pods.setdefault(created["metadata"]["name"], created)

    def terminate_pod(self, experiment_id: str, pod_id: str, grace_s: float) -> None:
        name = pod_name(experiment_id, pod_id)
        try:
            resp = self.core.delete_namespaced_pod(
                name,
                self.namespace,
                grace_period_seconds=max(1, round(grace_s)),
                _preload_content=False,
            )
        except ApiException as e:
            if e.status == 404:
                with self._lock:
                    self._pods.pop(name, None)
                return
            raise
        obj = json.loads(resp.data)
        if obj.get("kind") == "Pod":
            with self._lock:
                if name in self._pods:
                    self._pods[name] = obj

    def remove_pod(self, experiment_id: str, pod_id: str) -> None:
        name = pod_name(experiment_id, pod_id)
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(
                name, self.namespace, grace_period_seconds=0, _preload_content=False
            )
        with self._lock:
            self._pods.pop(name, None)

    def pod_log_tail(self, experiment_id: str, pod_id: str, lines: int = 20) -> str:
        name = pod_name(experiment_id, pod_id)
        try:
            resp = self.core.read_namespaced_pod_log(
                name, self.namespace, container=CONTAINER, tail_lines=lines, _preload_content=False
            )
        except ApiException:
            return ""
        return resp.data.decode(errors="replace").strip()

    def delete_experiment(self, experiment_id: str) -> None:
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_config_map(
                owner_name(experiment_id),
                self.namespace,
                propagation_policy="Background",
                _preload_content=False,
            )
        # Also collected with its owner; deleted here so the credential ends with the call.
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_secret(
                credential_secret_name(experiment_id), self.namespace, _preload_content=False
            )
        self._owners.pop(experiment_id, None)

    # -- capacity ----------------------------------------------------------------------------
    def capacity(self) -> Res:
        now = time.monotonic()
        if self._capacity and now - self._capacity[0] < self.settings.k8s_capacity_refresh_s:
            return self._capacity[1]
        cap = self._compute_capacity()
        self._capacity = (now, cap)
        return cap

    def _compute_capacity(self) -> Res:
        s = self.settings
        nodes = self._list(self.core.list_node).get("items", [])
        usable: set[str] = set()
        total = Res()
        for n in nodes:
            spec, meta = n.get("spec") or {}, n["metadata"]
            if spec.get("unschedulable"):
                continue
            node_labels = meta.get("labels") or {}
            if any(node_labels.get(k) != v for k, v in s.k8s_node_selector.items()):
                continue
            if not all(_tolerated(t, s.k8s_tolerations) for t in spec.get("taints") or []):
                continue
            ready = [
                c for c in (n.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"
            ]
            if ready and ready[0].get("status") != "True":
                continue
            alloc = (n.get("status") or {}).get("allocatable") or {}
            usable.add(meta["name"])
            total = total + Res(
                float(parse_quantity(alloc.get("cpu", "0"))),
                int(parse_quantity(alloc.get("nvidia.com/gpu", "0"))),
                int(parse_quantity(alloc.get("memory", "0"))),
            )
        for pod in self._all_pods():
            if (pod["metadata"].get("labels") or {}).get(MANAGED_BY) == MANAGER:
                continue  # ours: the reconciler accounts for them itself
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            node = (pod.get("spec") or {}).get("nodeName")
            if node is None or node in usable:
                total = total - _requests(pod)
        return self._quota_cap(total)

    def _all_pods(self) -> list[dict[str, Any]]:
        if self._cluster_wide_pods:
            try:
                return self._list(self.core.list_pod_for_all_namespaces).get("items", [])
            except ApiException as e:
                if e.status != 403:
                    raise
                self._cluster_wide_pods = False
                log.warning(
                    "cannot list pods cluster-wide; capacity counts this namespace's pods only"
                )
        return self._list(self.core.list_namespaced_pod, self.namespace).get("items", [])

    def _quota_cap(self, cap: Res) -> Res:
        quotas = self._list(self.core.list_namespaced_resource_quota, self.namespace)
        ours = Res()
        for p in self.list_pods():
            if p.live:
                ours = ours + p.resources
        cpu, gpus, mem = cap.cpu, cap.gpus, cap.memory
        for q in quotas.get("items", []):
            st = q.get("status") or {}
            hard, used = st.get("hard") or q.get("spec", {}).get("hard") or {}, st.get("used") or {}

            def room(*keys: str, hard: dict = hard, used: dict = used) -> float | None:
                for k in keys:
                    if k in hard:
                        return float(parse_quantity(hard[k])) - float(
                            parse_quantity(used.get(k, "0"))
                        )
                return None

            if (r := room("requests.cpu", "cpu")) is not None:
                cpu = min(cpu, r + ours.cpu)
            if (r := room("requests.memory", "memory")) is not None:
                mem = min(mem, int(r) + ours.memory)
            if (r := room("requests.nvidia.com/gpu")) is not None:
                gpus = min(gpus, int(r) + ours.gpus)
        if self.settings.k8s_gpu_claim_template:
            # Claimed GPUs (DRA) are no node's nvidia.com/gpu to count: the operator's count of
            # them, else as many as pods ask for (the scheduler allocates the devices; a pod
            # that gets none waits Pending, reported as unschedulable with the scheduler's why).
            counted = self.settings.capacity_gpus
            gpus = counted if counted is not None else UNCOUNTED_GPUS
        return Res(max(cpu, 0.0), max(gpus, 0), max(mem, 0))

    def close(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(timeout=2)
