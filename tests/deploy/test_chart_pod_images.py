"""The chart hands the orchestrator the release's CPU pod image for pods without GPUs,
rendered by the real ``helm template`` and read back as the orchestrator's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from services.orchestrator.backends.base import PodRequest
from services.orchestrator.backends.kubernetes import pod_manifest
from services.orchestrator.scheduler import Res
from services.orchestrator.settings import OrchestratorSettings
from tests.deploy.tools import run, tool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "podium"
RELEASE = ROOT / ".github" / "workflows" / "release.yml"
VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
REPO = "ghcr.io/podium-rl/podium-pod"


def orchestrator_env(*args: str) -> dict[str, str]:
    """The orchestrator Deployment's plain env values, as ``helm template`` renders them."""
    cmd = [tool("helm"), "template", "podium", str(CHART), "--namespace", "podium", *args]
    docs = [d for d in yaml.safe_load_all(run(*cmd).stdout) if d]
    [orch] = [
        d
        for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "podium-orchestrator"
    ]
    env = orch["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if "value" in e}


def published_torch() -> dict[str, str]:
    """Each pod image the release publishes → its torch build."""
    release = yaml.safe_load(RELEASE.read_text())
    return {
        f"{REPO}:{VERSION}{e['suffix']}": e["torch"]
        for e in release["jobs"]["images"]["strategy"]["matrix"]["include"]
        if e["target"] == "pod"
    }


def settings_of(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> OrchestratorSettings:
    for k, v in env.items():
        if k.startswith("PODIUM_POD_IMAGE"):
            monkeypatch.setenv(k, v)
    return OrchestratorSettings(backend="kubernetes")


def images(settings: OrchestratorSettings, gpus: int) -> set[str]:
    req = PodRequest("e1", "p1", "{}", Res(1.0, gpus, 2**30))
    manifest: dict[str, Any] = pod_manifest(settings, "podium", req, owner_uid="u")
    return {c["image"] for c in manifest["spec"]["containers"]}


def test_chart_gives_cpu_pods_the_cpu_build_and_gpu_pods_the_cuda_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch_of = published_torch()
    env = orchestrator_env()  # the defaults: pods may get GPUs
    cuda, cpu = env["PODIUM_POD_IMAGE"], env["PODIUM_POD_IMAGE_CPU"]
    assert (cuda, cpu) == (f"{REPO}:{VERSION}", f"{REPO}:{VERSION}-cpu")
    assert torch_of[cuda].startswith("cu") and torch_of[cpu] == "cpu", torch_of
    settings = settings_of(env, monkeypatch)
    assert images(settings, gpus=0) == {cpu}
    assert images(settings, gpus=1) == {cuda}


@pytest.mark.parametrize(
    "args",
    [
        ("--set", "orchestrator.limits.maxPodGpus=0"),  # every pod is a CPU pod already
        ("--set", "image.pod.tag=mine"),  # one image the user pinned, for every pod
        ("--set", "image.pod.digest=sha256:" + "a" * 64),
    ],
)
def test_chart_passes_no_cpu_image_where_one_image_serves_every_pod(
    args: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = orchestrator_env(*args)
    assert "PODIUM_POD_IMAGE_CPU" not in env
    settings = settings_of(env, monkeypatch)
    assert images(settings, gpus=0) == {env["PODIUM_POD_IMAGE"]}
