"""The in-test Kubernetes API server (tests/orchestrator/k8s_server.py) with a kubelet that
runs each Pod the orchestrator creates as Docker containers, the way a node would: one container
per manifest container, from the manifest's image, command, args and env, with its security
context (capabilities dropped, no privilege escalation, a read-only root where it says so), the
pod's memory-backed /dev/shm emptyDir as a tmpfs volume shared by its containers and its other
emptyDirs as world-writable directories of the test. A graceful delete is `docker
stop` with the pod's grace period (SIGTERM, then SIGKILL); a pod whose containers exit on their
own becomes Succeeded or Failed.
"""

from __future__ import annotations

import base64
import copy
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.utils import parse_quantity

from tests.containers.conftest import Docker
from tests.orchestrator.k8s_server import FakeCluster


@dataclass
class RunPod:
    """What the kubelet did with one Pod: its manifest, containers and how each ended."""

    manifest: dict[str, Any]
    containers: dict[str, str] = field(default_factory=dict)  # manifest name → docker name
    stopped: bool = False  # deleted gracefully (SIGTERM)
    exit_codes: dict[str, int] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)  # every container ended


class DockerKubelet(FakeCluster):
    def __init__(self, docker: Docker, prefix: str, disk: Path) -> None:
        """``disk``: where the pods' disk-backed emptyDirs go (a directory of the test's)."""
        super().__init__(exit_delay_s=0.0)
        self.docker, self.prefix, self.disk = docker, prefix, disk
        self.runs: dict[str, RunPod] = {}  # by pod name
        self.errors: list[str] = []

    # Called by the API server with its lock held: start the containers in a thread.
    def _bind(self, pod: dict[str, Any]) -> None:
        super()._bind(pod)
        if pod["status"].get("phase") == "Running":
            run = RunPod(copy.deepcopy(pod))
            self.runs[pod["metadata"]["name"]] = run
            threading.Thread(target=self._run_containers, args=(run,), daemon=True).start()

    def _run_containers(self, run: RunPod) -> None:
        meta, spec = run.manifest["metadata"], run.manifest["spec"]
        name = f"{self.prefix}-{meta['name']}"
        try:
            sources: dict[str, str] = {}  # volume name -> what `docker run --volume` mounts
            for vol in spec.get("volumes", []):
                if "emptyDir" in vol and vol["emptyDir"].get("medium") != "Memory":
                    # A node's disk: a directory every container of the pod may write (0777, as
                    # the kubelet makes an emptyDir), gone with the pod.
                    path = tempfile.mkdtemp(prefix=f"{name}-{vol['name']}-", dir=self.disk)
                    os.chmod(path, 0o777)
                    sources[vol["name"]] = path
                elif vol.get("emptyDir", {}).get("medium") == "Memory":
                    size = int(parse_quantity(vol["emptyDir"].get("sizeLimit", "64Mi")))
                    vname = f"{name}-{vol['name']}"
                    self.docker(
                        "volume", "create", "--label", self.docker.label, "--driver", "local",
                        "--opt", "type=tmpfs", "--opt", "device=tmpfs",
                        "--opt", f"o=size={size},uid=10001,gid=10001,mode=1777", vname,
                    )  # fmt: skip
                    sources[vol["name"]] = vname
            for c in spec["containers"]:
                ns = meta["namespace"]
                env = {e["name"]: self._env_value(ns, e) for e in c.get("env", [])}
                if "PODIUM_METRICS_PORT" in env:
                    # Each Pod of a cluster has its own IP; here they share the host's network.
                    env["PODIUM_METRICS_PORT"] = "0"
                flags = [f"--env={k}={v}" for k, v in env.items()]
                for m in c.get("volumeMounts", []):
                    # nocopy: an empty, world-writable tmpfs like the emptyDir, not the
                    # image's /dev/shm permissions copied onto it.
                    source = sources[m["name"]]
                    nocopy = "" if source.startswith("/") else ":nocopy"
                    flags.append(f"--volume={source}:{m['mountPath']}{nocopy}")
                memory = c.get("resources", {}).get("limits", {}).get("memory")
                if memory:
                    flags.append(f"--memory={int(parse_quantity(memory))}")
                # The container's security context, as the manifest says it (nothing more).
                sc = c.get("securityContext", {})
                assert sc.get("allowPrivilegeEscalation") is False, sc
                assert sc.get("capabilities", {}).get("drop") == ["ALL"], sc
                flags += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
                if sc.get("readOnlyRootFilesystem"):
                    flags.append("--read-only")
                cname = f"{name}-{c['name']}"
                command = c.get("command") or []
                if command:
                    flags.append(f"--entrypoint={command[0]}")
                self.docker.run(
                    cname, c["image"], *command[1:], *c.get("args", []), flags=flags, hardened=False
                )
                run.containers[c["name"]] = cname
        except Exception as exc:  # reported by the test, and the pod fails
            self.errors.append(f"{meta['name']}: {exc}")
            run.done.set()
            self._finished(run, failed=True)
            return
        for cname in run.containers.values():
            self.docker("wait", cname, check=False, timeout=3600)
        self._finished(run)

    def _env_value(self, ns: str, env: dict[str, Any]) -> str:
        """An env entry's value, a Secret's key resolved as a kubelet does (the pods'
        credential comes from their experiment's Secret)."""
        ref = (env.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            return str(env["value"])
        with self.cond:
            data = self.secrets[(ns, ref["name"])]["data"]
        return base64.b64decode(data[ref["key"]]).decode()

    def _collect(self, run: RunPod) -> None:
        for role, cname in run.containers.items():
            state = self.docker.inspect(cname)["State"]
            run.exit_codes[role] = int(state["ExitCode"])
            run.logs[role] = self.docker.logs(cname)

    def _finished(self, run: RunPod, failed: bool = False) -> None:
        """The containers exited on their own: the pod is Succeeded or Failed."""
        name = run.manifest["metadata"]["name"]
        with self.cond:
            pod = self.pods.get((run.manifest["metadata"]["namespace"], name))
            if pod is None or pod["metadata"].get("deletionTimestamp") or run.stopped:
                return  # being deleted: _finish_deletion reports it
        if not failed:
            self._collect(run)
        run.done.set()
        codes = run.exit_codes
        ok = not failed and codes and all(code == 0 for code in codes.values())
        roles = [c["name"] for c in run.manifest["spec"]["containers"]]
        with self.cond:
            pod = self.pods.get((run.manifest["metadata"]["namespace"], name))
            if pod is None:
                return
            pod = copy.deepcopy(pod)
            pod["status"] = {
                "phase": "Succeeded" if ok else "Failed",
                "containerStatuses": [
                    {
                        "name": role,
                        "ready": False,
                        "state": {"terminated": {"exitCode": codes.get(role, 1)}},
                    }
                    for role in roles
                ],
            }
            self._put_pod(run.manifest["metadata"]["namespace"], pod, "MODIFIED")

    def _finish_deletion(self, ns: str, name: str, uid: str) -> None:
        """A graceful delete: SIGTERM every container, SIGKILL after the grace period."""
        run = self.runs.get(name)
        if run is not None and run.containers:
            run.stopped = True
            with self.cond:
                pod = self.pods.get((ns, name))
                grace = (pod or {}).get("metadata", {}).get("deletionGracePeriodSeconds", 30)
            try:
                self.docker("stop", "-t", str(grace), *run.containers.values(), timeout=grace + 60)
                self._collect(run)
            except Exception as exc:
                self.errors.append(f"{name}: stopping: {exc}")
            run.done.set()
        super()._finish_deletion(ns, name, uid)
