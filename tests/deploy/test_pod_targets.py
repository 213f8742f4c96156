"""deploy/prometheus/pod_targets.py lists only live pods as Prometheus targets.

Seconds after an experiment ended, 2 of its 4 pod targets were still listed and
scraped `down`: a pod's record stays until the reconciler's next pass removes it, and the
script listed every pod that still had one. The local backend marks the record `ended` the
moment the process exits; a target must go then. Real local backend, real pod processes, the
script run as compose runs it (a process, its file_sd JSON read back).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from services.orchestrator.backends.base import PodRequest
from services.orchestrator.backends.local import LocalBackend
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import OrchestratorSettings

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "prometheus" / "pod_targets.py"
# A pod as far as metrics discovery goes: it writes its port file as services/pod does, then
# lives for the seconds given (0: ends at once).
# (No braces: the local backend formats the command with the pod's ids.)
POD = (
    "import os, sys, time; d, p = os.environ['PODIUM_POD_DIR'], os.environ['PODIUM_POD_ID']; "
    "open(d + '/' + p + '.metrics_port', 'w').write(sys.argv[1]); time.sleep(float(sys.argv[2]))"
)


def listed(data_dir: Path, out: Path) -> dict[str, str]:
    cmd = [sys.executable, str(SCRIPT), "--data-dir", str(data_dir), "--host", "orchestrator"]
    subprocess.run([*cmd, "--out", str(out), "--once"], check=True, timeout=60)
    return {g["labels"]["pod"]: g["targets"][0] for g in json.loads(out.read_text())}


def wait_for(check, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_an_ended_pod_leaves_the_targets_before_its_record_is_removed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    backends = []
    for port, life in (("9101", "60"), ("9102", "0")):
        settings = OrchestratorSettings(
            _env_file=None,
            data_dir=data,
            backend="local",
            capacity_cpu=4,
            capacity_gpus=0,
            capacity_memory="8Gi",
            pod_command=[sys.executable, "-c", POD, port, life],
        )
        backends.append(LocalBackend(settings))
    live, ended = backends
    try:
        for backend, pod in ((live, "p-live"), (ended, "p-ended")):
            backend.create_pod(PodRequest("e1", pod, '{"name": "e1"}', Res(1, 0, 1 << 30)))
        pods = data / "experiments" / "e1" / "pods"
        wait_for(lambda: all((pods / f"{p}.metrics_port").exists() for p in ("p-live", "p-ended")))

        def phases() -> dict[str, str]:
            return {p.pod_id: p.phase for p in ended.list_pods()}

        wait_for(lambda: phases().get("p-ended") == "Succeeded")
        # Ended, and its record still there: the reconciler has not removed it yet.
        assert phases() == {"p-live": "Running", "p-ended": "Succeeded"}
        assert (pods / "p-ended.json").exists()
        assert listed(data, tmp_path / "pods.json") == {"p-live": "orchestrator:9101"}
    finally:
        live.terminate_pod("e1", "p-live", grace_s=2)
        for backend in backends:
            backend.close()
