"""An in-test Kubernetes API server: the Pod / Node / ResourceQuota / ConfigMap / Secret
endpoints the orchestrator's Kubernetes backend uses, over real HTTP for the official client.

It behaves like the real thing where the backend depends on it: label selectors, list
resourceVersions, chunked JSON-lines watches from a resourceVersion, graceful deletion
(deletionTimestamp, then DELETED once the pod has "exited"), garbage collection of pods and
Secrets whose owner ConfigMap is deleted, quota usage computed from the pods, and every created
object is validated against the Kubernetes schemas (kubernetes-validate, strict) and refused
with 422 when invalid, as the API server would. A tiny "kubelet" binds pods to nodes and runs
them; a container whose env names a Secret that does not exist waits in
CreateContainerConfigError, as on a real node.
"""

from __future__ import annotations

import base64
import copy
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import kubernetes_validate
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

K8S_VERSION = "1.37.0"
TOKEN = "k8s-test-token"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> JSONResponse:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return JSONResponse(body, status_code=code)


async def _json(request: Request) -> dict[str, Any]:
    # The client's Content-Type varies by version; the API server reads JSON regardless.
    return json.loads(await request.body())


def _matches(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj["metadata"].get("labels") or {}
    for term in selector.split(","):
        if "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.rstrip("=")) != v:
                return False
        elif term not in labels:
            return False
    return True


class FakeCluster:
    """State and behaviour; ``app`` serves it. Thread-safe (handlers run in a thread pool)."""

    def __init__(self, validate: bool = True, exit_delay_s: float = 0.05):
        self.validate = validate
        self.exit_delay_s = exit_delay_s  # how long a pod takes to exit after SIGTERM
        self.cond = threading.Condition()
        self.rv = 0
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.configmaps: dict[tuple[str, str], dict[str, Any]] = {}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.quotas: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []  # rv, ns, type, pod
        self.manifests: list[dict[str, Any]] = []  # every object a client asked to create
        self.rejected: list[str] = []
        self.logs: dict[tuple[str, str, str], str] = {}
        self.requests = 0
        self.closed = False
        self.node_used: dict[str, tuple[float, float]] = {}  # requests bound to each node
        self.min_rv = 0  # watches from before this resourceVersion get 410 Gone
        self.epoch = 0

    # -- state changes (call with self.cond held) -------------------------------------------
    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def _emit(self, ns: str, type_: str, pod: dict[str, Any]) -> None:
        self.events.append((self.rv, ns, type_, copy.deepcopy(pod)))
        self.cond.notify_all()

    def _put_pod(self, ns: str, pod: dict[str, Any], type_: str) -> None:
        self._bump(pod)
        self.pods[(ns, pod["metadata"]["name"])] = pod
        self._emit(ns, type_, pod)

    def _drop_pod(self, ns: str, name: str) -> dict[str, Any] | None:
        pod = self.pods.pop((ns, name), None)
        if pod is not None:
            node = pod["spec"].get("nodeName")
            if node in self.node_used:
                c, m = self._requests(pod)
                used_cpu, used_mem = self.node_used[node]
                self.node_used[node] = (used_cpu - c, used_mem - m)
            self._bump(pod)
            self._emit(ns, "DELETED", pod)
        return pod

    # -- helpers for tests --------------------------------------------------------------------
    def add_node(
        self,
        name: str,
        cpu: str = "4",
        memory: str = "16Gi",
        gpus: int = 0,
        labels: dict[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
    ) -> None:
        alloc = {"cpu": cpu, "memory": memory, "pods": "110"}
        if gpus:
            alloc["nvidia.com/gpu"] = str(gpus)
        with self.cond:
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels or {}, "uid": str(uuid.uuid4())},
                "spec": {"taints": taints or []},
                "status": {
                    "allocatable": alloc,
                    "capacity": alloc,
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }
            self._bump(node)
            self.nodes[name] = node

    def add_foreign_pod(self, ns: str, name: str, cpu: str, memory: str, node: str) -> None:
        """Somebody else's running pod (no Podium labels)."""
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4())},
            "spec": {
                "nodeName": node,
                "containers": [
                    {
                        "name": "c",
                        "image": "x",
                        "resources": {"requests": {"cpu": cpu, "memory": memory}},
                    }
                ],
            },
            "status": {"phase": "Running"},
        }
        with self.cond:
            c, m = self._requests(pod)
            used_cpu, used_mem = self.node_used.get(node, (0.0, 0.0))
            self.node_used[node] = (used_cpu + c, used_mem + m)
            self._put_pod(ns, pod, "ADDED")

    def set_quota(self, ns: str, name: str, hard: dict[str, str]) -> None:
        with self.cond:
            q = {
                "apiVersion": "v1",
                "kind": "ResourceQuota",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"hard": hard},
            }
            self._bump(q)
            self.quotas[(ns, name)] = q

    def fail_container(
        self, ns: str, name: str, container: str, exit_code: int, reason: str, log: str = ""
    ) -> None:
        """A container of a running pod dies (restartPolicy Never: the pod stays Running)."""
        with self.cond:
            pod = copy.deepcopy(self.pods[(ns, name)])
            for cs in pod["status"]["containerStatuses"]:
                if cs["name"] == container:
                    cs["state"] = {"terminated": {"exitCode": exit_code, "reason": reason}}
                    cs["ready"] = False
            self.logs[(ns, name, container)] = self.logs.get((ns, name, container), "") + log
            self._put_pod(ns, pod, "MODIFIED")

    def write_log(self, ns: str, name: str, container: str, text: str) -> None:
        """A running container prints ``text`` (served by ``pods/{name}/log``, as the kubelet
        serves it, until the pod object is gone)."""
        with self.cond:
            key = (ns, name, container)
            self.logs[key] = self.logs.get(key, "") + text

    def evict(self, ns: str, name: str, preemption: bool = False) -> None:
        """A pod stopped from outside, as Kubernetes reports it: evicted by the kubelet under
        node pressure (phase Failed, reason Evicted), or preempted by the scheduler (the
        DisruptionTarget condition); either way its containers were killed (exit code 137)."""
        with self.cond:
            pod = copy.deepcopy(self.pods[(ns, name)])
            status = pod["status"]
            status["phase"] = "Failed"
            if preemption:
                status["conditions"] = [
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "PreemptionByScheduler",
                        "message": "Preempted in order to admit critical pod",
                    }
                ]
            else:
                status["reason"] = "Evicted"
                status["message"] = "The node was low on resource: memory."
            for cs in status.get("containerStatuses") or []:
                cs["state"] = {"terminated": {"exitCode": 137, "reason": "Error"}}
                cs["ready"] = False
            self._put_pod(ns, pod, "MODIFIED")

    def lose_node(self, ns: str, name: str) -> None:
        """The pod's node stops answering: the node controller marks the pod phase Unknown,
        reason NodeLost (its containers' last known state stays running)."""
        with self.cond:
            pod = copy.deepcopy(self.pods[(ns, name)])
            pod["status"]["phase"] = "Unknown"
            pod["status"]["reason"] = "NodeLost"
            pod["status"]["message"] = f"Node {pod['spec'].get('nodeName')} which was running "
            pod["status"]["message"] += f"pod {name} is unresponsive"
            self._put_pod(ns, pod, "MODIFIED")

    def wait_container(self, ns: str, name: str, container: str, reason: str, msg: str) -> None:
        """A container cannot start (kubelet's waiting state, e.g. ImagePullBackOff)."""
        with self.cond:
            pod = copy.deepcopy(self.pods[(ns, name)])
            pod["status"]["phase"] = "Pending"
            for cs in pod["status"]["containerStatuses"]:
                if cs["name"] == container:
                    cs["state"] = {"waiting": {"reason": reason, "message": msg}}
                cs["ready"] = False
            self._put_pod(ns, pod, "MODIFIED")

    def unschedulable(self, ns: str, name: str, msg: str) -> None:
        """The scheduler found no node for the pod."""
        with self.cond:
            pod = copy.deepcopy(self.pods[(ns, name)])
            pod["status"] = {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": msg,
                    }
                ],
            }
            self._put_pod(ns, pod, "MODIFIED")

    def compact_and_create(self, ns: str, pod: dict[str, Any]) -> None:
        """Drop open watches, create a pod, then compact history past it: a watcher that
        reconnects from its last resourceVersion gets 410 Gone and must relist to see it."""
        with self.cond:
            self.epoch += 1
            pod = copy.deepcopy(pod)
            pod["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
            self._bind(pod)
            self._put_pod(ns, pod, "ADDED")
            self.min_rv = self.rv
            self.events.clear()
            self.cond.notify_all()

    def pod_names(self, ns: str, live_only: bool = True) -> list[str]:
        with self.cond:
            return sorted(
                n
                for (pns, n), p in self.pods.items()
                if pns == ns
                and (not live_only or p["metadata"].get("deletionTimestamp") is None)
                and (p["metadata"].get("labels") or {}).get("podium.dev/pod")
            )

    # -- scheduling ---------------------------------------------------------------------------
    def _requests(self, pod: dict[str, Any]) -> tuple[float, int]:
        from kubernetes.utils import parse_quantity

        cpu, mem = 0.0, 0
        for c in pod["spec"]["containers"]:
            req = (c.get("resources") or {}).get("requests") or {}
            cpu += float(parse_quantity(req.get("cpu", "0")))
            mem += int(parse_quantity(req.get("memory", "0")))
        return cpu, mem

    def _bind(self, pod: dict[str, Any]) -> None:
        """The kubelet: bind to the first node with room and start every container."""
        from kubernetes.utils import parse_quantity

        cpu, mem = self._requests(pod)
        for node_name, node in self.nodes.items():
            alloc = node["status"]["allocatable"]
            used_cpu, used_mem = self.node_used.get(node_name, (0.0, 0.0))
            if used_cpu + cpu <= float(
                parse_quantity(alloc["cpu"])
            ) + 1e-9 and used_mem + mem <= float(parse_quantity(alloc["memory"])):
                self.node_used[node_name] = (used_cpu + cpu, used_mem + mem)
                pod["spec"]["nodeName"] = node_name
                pod["status"] = {
                    "phase": "Running",
                    "containerStatuses": [
                        self._container_status(pod["metadata"]["namespace"], c)
                        for c in pod["spec"]["containers"]
                    ],
                }
                return
            pod["status"] = {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
                ],
            }

    def _container_status(self, ns: str, container: dict[str, Any]) -> dict[str, Any]:
        """The kubelet starting a container: its env's Secrets must exist."""
        for e in container.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            secret = ref and self.secrets.get((ns, ref["name"]))
            if ref and (secret is None or ref["key"] not in secret.get("data", {})):
                waiting = {
                    "reason": "CreateContainerConfigError",
                    "message": f'secret "{ref["name"]}" not found',
                }
                return {"name": container["name"], "ready": False, "state": {"waiting": waiting}}
        return {"name": container["name"], "ready": True, "state": {"running": {}}}

    def _finish_deletion(self, ns: str, name: str, uid: str) -> None:
        with self.cond:
            pod = self.pods.get((ns, name))
            if pod is not None and pod["metadata"]["uid"] == uid:
                self._drop_pod(ns, name)

    # -- the app ------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def auth(request: Request, call_next: Any) -> Any:
            self.requests += 1
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return _status(401, "Unauthorized", "Unauthorized")
            return await call_next(request)

        def pod_list(ns: str | None, selector: str | None) -> dict[str, Any]:
            with self.cond:
                items = [
                    copy.deepcopy(p)
                    for (pns, _), p in sorted(self.pods.items())
                    if (ns is None or pns == ns) and _matches(p, selector)
                ]
                rv = str(self.rv)
            return {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": rv},
                "items": items,
            }

        def watch(ns: str, selector: str | None, since: int, timeout: float) -> Iterator[bytes]:
            deadline = time.monotonic() + timeout
            i = 0
            with self.cond:
                epoch = self.epoch
                if since < self.min_rv:  # history compacted: the client must relist
                    gone = {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "message": f"too old resource version: {since} ({self.min_rv})",
                        "reason": "Expired",
                        "code": 410,
                    }
                    yield (json.dumps({"type": "ERROR", "object": gone}) + "\n").encode()
                    return
            while time.monotonic() < deadline and not self.closed:
                with self.cond:
                    if self.epoch != epoch:
                        return  # connection dropped by compact()
                    while i < len(self.events) and self.events[i][0] <= since:
                        i += 1
                    batch = self.events[i:]
                    i = len(self.events)
                    if not batch:
                        self.cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
                        continue
                for _, ens, type_, pod in batch:
                    if ens == ns and _matches(pod, selector):
                        yield (json.dumps({"type": type_, "object": pod}) + "\n").encode()

        @app.get("/api/v1/namespaces/{ns}/pods")
        def list_pods(
            request: Request,
            ns: str,
            labelSelector: str | None = None,  # noqa: N803 - the API's parameter names
            resourceVersion: str | None = None,  # noqa: N803
            timeoutSeconds: int = 60,  # noqa: N803
        ) -> Any:
            if request.query_params.get("watch") in ("true", "1", "True"):
                since = int(resourceVersion or 0)
                return StreamingResponse(
                    watch(ns, labelSelector, since, float(timeoutSeconds)),
                    media_type="application/json",
                )
            return pod_list(ns, labelSelector)

        @app.get("/api/v1/pods")
        def list_all_pods(labelSelector: str | None = None) -> Any:  # noqa: N803
            return pod_list(None, labelSelector)

        def check(body: dict[str, Any], kind: str) -> JSONResponse | None:
            self.manifests.append(copy.deepcopy(body))
            if body.get("kind") != kind:
                return _status(400, "BadRequest", f"expected kind {kind}")
            if self.validate:
                try:
                    kubernetes_validate.validate(body, K8S_VERSION, strict=True)
                except kubernetes_validate.ValidationError as e:
                    self.rejected.append(f"{kind}: {e.message} at {list(e.path)}")
                    return _status(422, "Invalid", e.message)
            return None

        @app.post("/api/v1/namespaces/{ns}/pods", status_code=201)
        async def create_pod(ns: str, request: Request) -> Any:
            body = await _json(request)
            return await run_in_threadpool(create_pod_sync, ns, body)

        def create_pod_sync(ns: str, body: dict[str, Any]) -> Any:
            if (bad := check(body, "Pod")) is not None:
                return bad
            name = body["metadata"]["name"]
            with self.cond:
                if (ns, name) in self.pods:
                    return _status(409, "AlreadyExists", f'pods "{name}" already exists')
                pod = copy.deepcopy(body)
                pod["metadata"].update(
                    namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now()
                )
                self._bind(pod)
                self._put_pod(ns, pod, "ADDED")
                return JSONResponse(copy.deepcopy(pod), status_code=201)

        @app.delete("/api/v1/namespaces/{ns}/pods/{name}")
        def delete_pod(
            ns: str,
            name: str,
            gracePeriodSeconds: int | None = None,  # noqa: N803
        ) -> Any:
            with self.cond:
                pod = self.pods.get((ns, name))
                if pod is None:
                    return _status(404, "NotFound", f'pods "{name}" not found')
                finished = pod["status"].get("phase") in ("Succeeded", "Failed")
                if gracePeriodSeconds == 0 or finished or pod["spec"].get("nodeName") is None:
                    return copy.deepcopy(self._drop_pod(ns, name))
                if pod["metadata"].get("deletionTimestamp") is None:
                    pod = copy.deepcopy(pod)
                    pod["metadata"]["deletionTimestamp"] = _now()
                    pod["metadata"]["deletionGracePeriodSeconds"] = gracePeriodSeconds or 30
                    self._put_pod(ns, pod, "MODIFIED")
                    # SIGTERM: the pod reports and exits after exit_delay_s.
                    t = threading.Timer(
                        self.exit_delay_s, self._finish_deletion, (ns, name, pod["metadata"]["uid"])
                    )
                    t.daemon = True
                    t.start()
                return copy.deepcopy(pod)

        @app.get("/api/v1/namespaces/{ns}/pods/{name}/log")
        def pod_log(ns: str, name: str, container: str = "", tailLines: int = 0) -> Any:  # noqa: N803
            with self.cond:
                if (ns, name) not in self.pods:
                    return _status(404, "NotFound", f'pods "{name}" not found')
                text = self.logs.get((ns, name, container), "")
            lines = text.splitlines()[-tailLines:] if tailLines else text.splitlines()
            return PlainTextResponse("\n".join(lines))

        @app.get("/api/v1/nodes")
        def list_nodes() -> Any:
            with self.cond:
                return {
                    "kind": "NodeList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.rv)},
                    "items": copy.deepcopy(list(self.nodes.values())),
                }

        @app.get("/api/v1/namespaces/{ns}/resourcequotas")
        def list_quotas(ns: str) -> Any:
            from kubernetes.utils import parse_quantity

            with self.cond:
                items = []
                for (qns, _), q in self.quotas.items():
                    if qns != ns:
                        continue
                    q = copy.deepcopy(q)
                    cpu = mem = 0.0
                    gpus = 0
                    for (pns, _), p in self.pods.items():
                        if pns != ns or p["status"].get("phase") in ("Succeeded", "Failed"):
                            continue
                        c, m = self._requests(p)
                        cpu, mem = cpu + c, mem + m
                        for ctr in p["spec"]["containers"]:
                            g = ((ctr.get("resources") or {}).get("requests") or {}).get(
                                "nvidia.com/gpu", "0"
                            )
                            gpus += int(parse_quantity(g))
                    used = {
                        "requests.cpu": f"{round(cpu * 1000)}m",
                        "requests.memory": str(int(mem)),
                        "requests.nvidia.com/gpu": str(gpus),
                    }
                    hard = q["spec"]["hard"]
                    q["status"] = {"hard": hard, "used": {k: used[k] for k in hard if k in used}}
                    items.append(q)
                return {
                    "kind": "ResourceQuotaList",
                    "apiVersion": "v1",
                    "metadata": {},
                    "items": items,
                }

        def create_object(
            ns: str, body: dict[str, Any], kind: str, store: dict, resource: str
        ) -> Any:
            if (bad := check(body, kind)) is not None:
                return bad
            name = body["metadata"]["name"]
            with self.cond:
                if (ns, name) in store:
                    return _status(409, "AlreadyExists", f'{resource} "{name}" already exists')
                obj = copy.deepcopy(body)
                if "stringData" in obj:  # a Secret's, stored base64-encoded in data
                    encoded = {
                        k: base64.b64encode(v.encode()).decode()
                        for k, v in obj.pop("stringData").items()
                    }
                    obj["data"] = {**obj.get("data", {}), **encoded}
                obj["metadata"].update(
                    namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now()
                )
                self._bump(obj)
                store[(ns, name)] = obj
                return JSONResponse(copy.deepcopy(obj), status_code=201)

        def create_route(resource: str, kind: str, store: dict) -> None:
            @app.post(f"/api/v1/namespaces/{{ns}}/{resource}", status_code=201)
            async def create(ns: str, request: Request) -> Any:
                body = await _json(request)
                return await run_in_threadpool(create_object, ns, body, kind, store, resource)

        create_route("configmaps", "ConfigMap", self.configmaps)
        create_route("secrets", "Secret", self.secrets)

        @app.get("/api/v1/namespaces/{ns}/configmaps/{name}")
        def read_configmap(ns: str, name: str) -> Any:
            with self.cond:
                cm = self.configmaps.get((ns, name))
                if cm is None:
                    return _status(404, "NotFound", f'configmaps "{name}" not found')
                return copy.deepcopy(cm)

        @app.delete("/api/v1/namespaces/{ns}/configmaps/{name}")
        def delete_configmap(ns: str, name: str) -> Any:
            with self.cond:
                cm = self.configmaps.pop((ns, name), None)
                if cm is None:
                    return _status(404, "NotFound", f'configmaps "{name}" not found')
                # The garbage collector: dependents of the deleted owner go too.
                uid = cm["metadata"]["uid"]

                def owned(obj: dict[str, Any]) -> bool:
                    owners = obj["metadata"].get("ownerReferences") or []
                    return any(o.get("uid") == uid for o in owners)

                for (pns, pname), p in list(self.pods.items()):
                    if pns == ns and owned(p):
                        self._drop_pod(pns, pname)
                for key, secret in list(self.secrets.items()):
                    if key[0] == ns and owned(secret):
                        del self.secrets[key]
                return {"kind": "Status", "apiVersion": "v1", "status": "Success"}

        @app.delete("/api/v1/namespaces/{ns}/secrets/{name}")
        def delete_secret(ns: str, name: str) -> Any:
            with self.cond:
                if self.secrets.pop((ns, name), None) is None:
                    return _status(404, "NotFound", f'secrets "{name}" not found')
                return {"kind": "Status", "apiVersion": "v1", "status": "Success"}

        return app

    def shutdown(self) -> None:
        """End open watches (they would otherwise run until their timeoutSeconds)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
