"""Local backend: each training pod is a process group on this machine.

Each pod has a record ``<data_dir>/experiments/<id>/pods/<pod>.json`` (pid, process start time,
labels, resources; written atomically) and a log ``<pod>.log`` next to it. The records are the
"labels" a restarted orchestrator lists to adopt running pods; the process start time guards
against a recycled pid. Pods run in their own session (``start_new_session``), so a signal to
the group reaches everything a pod started and an orchestrator crash leaves them running.

Exits are noticed at once: a thread waits on every pod (``Popen.wait`` for our children,
``psutil.wait`` polling for adopted ones) and wakes the reconciler. An adopted pod's exit
status cannot be read (it is not our child), so it is reported as unknown.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import psutil

from services.contracts.credentials import PLATFORM_SECRETS
from services.logs import get_logger
from services.malloc import preload, resolve_for
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
from services.orchestrator.backends.memory import pod_memory
from services.orchestrator.backends.pod_launcher import (
    LaunchedPod,
    LauncherUnavailableError,
    PodLauncher,
)
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import OrchestratorSettings

log = get_logger(__name__)


def default_pod_command() -> list[str]:
    return [
        sys.executable,
        "-m",
        "services.pod",
        "--experiment",
        "{experiment_id}",
        "--pod-id",
        "{pod_id}",
    ]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


#: Signals a process does not send itself when it crashes: a pod that died of one was stopped
#: from outside (a kill, a shutdown, a closed terminal), not by its own fault. A crash is an
#: exit code or a signal such as SIGSEGV or SIGABRT, or a kill for going over its memory limit
#: (``oom``, told by services/orchestrator/backends/memory.py: the kernel's OOM killer and a
#: person both send SIGKILL).
def _disruption(code: int | None, terminating: bool, oom: bool = False) -> str | None:
    """Why a pod that was not asked to stop was stopped from outside, or None."""
    if code is None or code >= 0 or terminating or oom or -code not in OUTSIDE_SIGNALS:
        return None
    return f"killed by {signal.Signals(-code).name} from outside"


def _tail(path: Path, lines: int, block: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a file, reading it from the end: a pod's log grows for as
    long as it trains, and its end is read each time a pod ends or its logs are asked for."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = size
        data = b""
        # One line more than asked: the first one read may be cut (unless the file starts it).
        while start > 0 and data.count(b"\n") <= lines:
            start = max(0, start - block)
            f.seek(start)
            data = f.read(size - start)
            block *= 2
    text = data.decode(errors="replace")
    return "".join(deque(text.splitlines(keepends=True), maxlen=lines))


class LocalBackend(Backend):
    def __init__(self, settings: OrchestratorSettings):
        super().__init__()
        self.settings = settings
        self.root = Path(settings.data_dir) / "experiments"
        self.root.mkdir(parents=True, exist_ok=True)
        self.command = settings.pod_command or default_pod_command()
        # The pods' malloc (services/malloc.py), looked for once: every pod and the launcher
        # start with it preloaded. A bad path fails the orchestrator's start, naming the setting.
        # The pods inherit this process's environment: with auto, an allocator its LD_PRELOAD
        # names is the one they run with.
        self.malloc_library = resolve_for(os.environ, settings.pod_malloc)
        library = self.malloc_library
        log.info("pod malloc", pod_malloc=settings.pod_malloc, preload=library and str(library))
        # Started now, so that it has imported torch by the time the first pods are asked for.
        # Linux only: forking a process that loaded torch is not safe everywhere (macOS).
        launcher = settings.pod_launcher and settings.pod_command is None
        self.launcher = (
            PodLauncher(malloc_library=library, mkl_dispatch=settings.pod_mkl_dispatch)
            if launcher and sys.platform == "linux"
            else None
        )
        # Each pod held to its spec's memory (raises where pod_memory_limit cannot be had).
        self.memory = pod_memory(settings.pod_memory_limit)
        log.info("pod memory limits", mode=settings.pod_memory_limit, by=self.memory.name)
        cpu, gpus, mem = settings.local_capacity()
        self._capacity = Res(cpu, gpus, mem)
        self._lock = threading.RLock()
        self._children: dict[tuple[str, str], subprocess.Popen[bytes] | LaunchedPod] = {}
        self._watched: set[tuple[str, str]] = set()
        self._reserved: dict[tuple[str, str], list[int]] = {}  # GPUs of pods being started
        self._closed = False

    # -- records ---------------------------------------------------------------------------
    def _dir(self, experiment_id: str) -> Path:
        return self.root / experiment_id / "pods"

    def _record_path(self, experiment_id: str, pod_id: str) -> Path:
        return self._dir(experiment_id) / f"{pod_id}.json"

    def log_path(self, experiment_id: str, pod_id: str) -> Path:
        return self._dir(experiment_id) / f"{pod_id}.log"

    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if rec.get("labels", {}).get(MANAGED_BY) != MANAGER:
            return None
        return rec

    def _update(self, experiment_id: str, pod_id: str, **fields: Any) -> None:
        with self._lock:
            path = self._record_path(experiment_id, pod_id)
            rec = self._read(path)
            if rec is None:
                return
            rec.update(fields)
            _write_json(path, rec)

    # -- interface -------------------------------------------------------------------------
    def capacity(self) -> Res:
        return self._capacity

    def create_pod(self, req: PodRequest) -> None:
        d = self._dir(req.experiment_id)
        d.mkdir(parents=True, exist_ok=True)
        spec_path = d.parent / "spec.json"
        if not spec_path.exists():
            _write_json(spec_path, json.loads(req.spec_json))
        subst = {
            "experiment_id": req.experiment_id,
            "pod_id": req.pod_id,
            "spec_path": str(spec_path),
        }
        argv = [part.format(**subst) for part in self.command]
        key = (req.experiment_id, req.pod_id)
        with self._lock:
            gpu_ids = self._free_gpus(req.resources.gpus)
            self._reserved[key] = gpu_ids  # held until the record (which lists them) is written
        inherited = {**os.environ, **req.pod_env()}
        env = {
            **{k: v for k, v in inherited.items() if k not in PLATFORM_SECRETS},
            # Its malloc is preloaded below already; said too, so that the pod keeps it. Its
            # TensorBoard files beside the experiments (`tensorboard --logdir <data
            # dir>/tensorboard` shows them all), and torch.compile's cache: every pod's
            # restart and PBT child loads what an earlier pod compiled (compile_cache.py).
            **pod_identity_env(
                req,
                self.settings,
                compile_cache=str(self.root.parent / "compile-cache"),
                tensorboard=str(self.root.parent / "tensorboard" / req.experiment_id / req.pod_id),
            ),
            "PODIUM_POD_DIR": str(d),
            # Each pod sees only its own GPUs (none for a CPU pod).
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids)),
        }
        if credential := pod_credential(self.settings, req.experiment_id):
            env["PODIUM_API_TOKEN"] = credential
        # A new interpreter runs with it; a forked pod already does (its launcher's), and its
        # environment says so to what it starts in turn.
        env = preload(env, self.malloc_library)
        try:
            proc = self._start(argv, env, self.log_path(req.experiment_id, req.pod_id), gpu_ids)
        except BaseException:
            with self._lock:
                self._reserved.pop(key, None)
            raise
        self.memory.attach(key, proc.pid, req.resources.memory)
        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:
            started = time.time()
        rec = {
            "labels": {
                MANAGED_BY: MANAGER,
                EXPERIMENT_LABEL: req.experiment_id,
                POD_LABEL: req.pod_id,
            },
            "pid": proc.pid,
            "process_start": started,
            "created_at": time.time(),
            "resources": {
                "cpu": req.resources.cpu,
                "gpus": req.resources.gpus,
                "memory": req.resources.memory,
            },
            "gpu_ids": gpu_ids,
            "terminating": False,
            "kill_at": None,
            "exit_code": None,
            "reason": None,
            "algorithm": req.algorithm,
        }
        with self._lock:
            _write_json(self._record_path(req.experiment_id, req.pod_id), rec)
            self._reserved.pop(key, None)
            self._children[(req.experiment_id, req.pod_id)] = proc
            self._watched.add((req.experiment_id, req.pod_id))
        threading.Thread(
            target=self._reap_child,
            args=(req.experiment_id, req.pod_id, proc),
            name=f"reap-{req.pod_id}",
            daemon=True,
        ).start()
        log.info("pod started", experiment=req.experiment_id, pod=req.pod_id, pid=proc.pid)

    def _start(
        self, argv: list[str], env: dict[str, str], log_path: Path, gpu_ids: list[int]
    ) -> subprocess.Popen[bytes] | LaunchedPod:
        """A CPU pod of the default command from the launcher; any other as a new process."""
        if self.launcher is not None and not gpu_ids:
            try:
                # argv is [python, -m, services.pod, ...]: the launcher runs the module itself.
                return self.launcher.launch(argv[3:], env, str(log_path))
            except LauncherUnavailableError as exc:
                log.warning("pod launcher unavailable: starting a new interpreter", error=str(exc))
        with open(log_path, "ab") as logf:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def _free_gpus(self, n: int) -> list[int]:
        """The first ``n`` GPU indices no live pod holds (call with the lock held)."""
        if n == 0:
            return []
        held = {i for ids in self._reserved.values() for i in ids}
        for path in self.root.glob("*/pods/*.json"):
            rec = self._read(path)
            if rec and rec.get("ended") is None and rec.get("exit_code") is None:
                held.update(rec.get("gpu_ids") or [])
        free = [i for i in range(self._capacity.gpus) if i not in held]
        if len(free) < n:
            raise RuntimeError(f"needs {n} GPUs; free: {free}")
        return free[:n]

    def _reap_child(self, exp: str, pod: str, proc: subprocess.Popen[bytes] | LaunchedPod) -> None:
        code = proc.wait()
        with self._lock:
            self._children.pop((exp, pod), None)
            self._watched.discard((exp, pod))
            if self._closed:
                return  # a newer orchestrator owns the records now
            # None: its launcher died before it ended, and nobody can read its status.
            status: dict[str, Any] = (
                {"exit_code": code, "reason": _exit_reason(code)}
                if code is not None
                else {"reason": "exited (its pod launcher stopped first; status unknown)"}
            )
            if self.memory.ended((exp, pod)):
                status["oom_killed"] = True
                status["reason"] = f"{status['reason']} (OOMKilled: over its memory limit)"
            self._update(exp, pod, ended=time.time(), **status)
        self.changed.set()

    def _watch_adopted(self, exp: str, pod: str, p: psutil.Process) -> None:
        with contextlib.suppress(psutil.Error, ChildProcessError):
            while not self._closed:
                try:
                    p.wait(timeout=1.0)
                    break
                except psutil.TimeoutExpired:
                    if p.status() == psutil.STATUS_ZOMBIE:
                        break
        with self._lock:
            self._watched.discard((exp, pod))
        if not self._closed:
            self.changed.set()

    def _alive(self, rec: dict[str, Any]) -> psutil.Process | None:
        try:
            p = psutil.Process(rec["pid"])
            if abs(p.create_time() - rec["process_start"]) > 1.0:
                return None  # the pid was recycled by an unrelated process
            if p.status() == psutil.STATUS_ZOMBIE:
                return None
            return p
        except (psutil.Error, KeyError, TypeError):
            return None

    def list_pods(self) -> list[PodInfo]:
        out: list[PodInfo] = []
        now = time.time()
        for path in sorted(self.root.glob("*/pods/*.json")):
            rec = self._read(path)
            if rec is None:
                continue
            exp = rec["labels"][EXPERIMENT_LABEL]
            pod = rec["labels"][POD_LABEL]
            key = (exp, pod)
            if rec.get("exit_code") is None and rec.get("ended") is None:
                with self._lock:
                    child = key in self._children
                    if not child:
                        # Read again under the lock the reaper holds while it forgets a child
                        # and records its exit: a child that just exited is not "adopted".
                        rec = self._read(path) or rec
                if not child and rec.get("exit_code") is None and rec.get("ended") is None:
                    p = self._alive(rec)
                    if p is None:
                        # Adopted and gone: the status is unknowable for a non-child, but its
                        # memory cgroup (if it had one) says whether its limit killed it.
                        reason = "exited (adopted after an orchestrator restart; status unknown)"
                        oom = self.memory.ended(key)
                        if oom:
                            reason = "OOMKilled: over its memory limit (adopted; exit unknown)"
                        rec.update(ended=now, reason=reason, oom_killed=oom)
                        self._update(exp, pod, ended=now, reason=reason, oom_killed=oom)
                    else:
                        with self._lock:
                            watch = key not in self._watched
                            self._watched.add(key)
                        if watch:
                            self.memory.attach(key, p.pid, int(rec["resources"]["memory"]))
                            threading.Thread(
                                target=self._watch_adopted, args=(exp, pod, p), daemon=True
                            ).start()
                if rec.get("ended") is None and rec.get("kill_at") and now >= rec["kill_at"]:
                    self._signal(rec, signal.SIGKILL)
            res = rec["resources"]
            code = rec.get("exit_code")
            terminating = bool(rec.get("terminating"))
            if rec.get("ended") is None and code is None:
                phase = "Running"
            elif code == 0:
                phase = "Succeeded"
            else:
                phase = "Failed"
            out.append(
                PodInfo(
                    experiment_id=exp,
                    pod_id=pod,
                    phase=phase,
                    created_at=rec["created_at"],
                    resources=Res(res["cpu"], res["gpus"], res["memory"]),
                    terminating=terminating,
                    exit_code=code,
                    reason=rec.get("reason"),
                    algorithm=rec.get("algorithm"),
                    disruption=_disruption(code, terminating, bool(rec.get("oom_killed"))),
                )
            )
        return out

    def _signal(self, rec: dict[str, Any], sig: signal.Signals) -> None:
        if self._alive(rec) is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec["pid"], sig)  # the pod's session leader: its pgid is its pid

    def terminate_pod(self, experiment_id: str, pod_id: str, grace_s: float) -> None:
        path = self._record_path(experiment_id, pod_id)
        with self._lock:
            rec = self._read(path)
            if rec is None or rec.get("ended") is not None or rec.get("exit_code") is not None:
                return
            if not rec.get("terminating"):
                rec.update(terminating=True, kill_at=time.time() + grace_s)
                _write_json(path, rec)
        self._signal(rec, signal.SIGTERM)
        timer = threading.Timer(grace_s, self._enforce_grace, args=(experiment_id, pod_id))
        timer.daemon = True
        timer.start()

    def _enforce_grace(self, experiment_id: str, pod_id: str) -> None:
        rec = self._read(self._record_path(experiment_id, pod_id))
        if rec is not None and rec.get("ended") is None and rec.get("exit_code") is None:
            self._signal(rec, signal.SIGKILL)

    def remove_pod(self, experiment_id: str, pod_id: str) -> None:
        with self._lock:
            self._record_path(experiment_id, pod_id).unlink(missing_ok=True)

    def pod_log_tail(self, experiment_id: str, pod_id: str, lines: int = 20) -> str:
        try:
            return _tail(self.log_path(experiment_id, pod_id), lines).strip()
        except OSError:
            return ""

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if self.launcher is not None:
            self.launcher.close()  # the pods it started run on, for the next orchestrator
