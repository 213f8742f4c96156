"""Deployment artefacts checked by the real tools: hadolint, helm, kubernetes-validate, checkov,
kubectl kustomize and the compose-spec JSON schema.

No Docker engine or cluster runs here, so this is what stands between a change and a broken
`docker compose up` or `helm install`. The tools come from scripts/install-deploy-tools.sh; a
missing tool fails its test with that instruction instead of skipping it.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.tools import run, tool, tool_env

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "podium"
HERE = Path(__file__).resolve().parent
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest with schemas.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
# Custom resources: no Kubernetes schema; their structure is asserted below.
CRDS = {"ServiceMonitor", "PodMonitor"}
# Kinds that exist only from some Kubernetes version on (DRA went GA in 1.34).
SINCE = {"ResourceClaimTemplate": (1, 34)}
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))


def helm_template(*args: str, capabilities: bool = True) -> list[dict[str, Any]]:
    cmd = [tool("helm"), "template", "podium", str(CHART), "--namespace", "podium", *args]
    if capabilities:
        for kind in ("ServiceMonitor", "PodMonitor"):
            cmd += ["--api-versions", f"monitoring.coreos.com/v1/{kind}"]
    return [d for d in yaml.safe_load_all(run(*cmd).stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.fixture(scope="module")
def renders() -> dict[str, list[dict[str, Any]]]:
    """The chart rendered with its defaults, each ci/ values file, and without the operator."""
    out = {"default": helm_template()}
    for f in CI_VALUES:
        out[f.name] = helm_template("-f", str(f))
    out["no-operator"] = helm_template(capabilities=False)
    return out


# ---- Dockerfile -----------------------------------------------------------------------------


def test_hadolint_passes_the_dockerfile_and_catches_a_bad_one() -> None:
    hadolint = tool("hadolint")
    images = sorted((ROOT / "deploy" / "images").glob("*.Dockerfile"))
    assert images
    run(hadolint, str(ROOT / "Dockerfile"), *map(str, images))
    # The same tool on a Dockerfile with known faults: proves the check is live.
    bad = run(hadolint, "-", input="FROM python:latest\nRUN cd /x && pip install foo\n", ok=False)
    assert bad.returncode != 0 and "DL3007" in bad.stdout, bad.stdout


def _stages() -> dict[str, list[str]]:
    """Dockerfile stage name → its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if m := re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I):
            current = stages.setdefault(m.group(1), [])
        current.append(line)
    return stages


def test_dockerfile_targets_are_non_root_with_exec_form_entrypoints_and_healthchecks() -> None:
    stages = _stages()
    assert {"control-plane", "pod"} <= set(stages)
    for target in ("control-plane", "pod"):
        lines = stages[target]
        user = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
        assert user and user[-1].split(":")[0] not in ("0", "root"), (target, user)
        for kw in ("ENTRYPOINT", "HEALTHCHECK"):
            found = [ln for ln in lines if ln.startswith(kw + " ")]
            assert found, (target, kw)
        entry = next(ln for ln in lines if ln.startswith("ENTRYPOINT "))
        assert isinstance(json.loads(entry.removeprefix("ENTRYPOINT ")), list)  # exec form
        health = next(ln for ln in lines if ln.startswith("HEALTHCHECK "))
        assert json.loads(health[health.index("CMD ") + 4 :])[0] == "python"
    # The control plane's check finds either service on its default port without PODIUM_PORT
    # (a leaderboard run so was "unhealthy" while it served).
    from services.leaderboard.settings import LeaderboardSettings
    from services.orchestrator.settings import OrchestratorSettings

    health = next(ln for ln in stages["control-plane"] if ln.startswith("HEALTHCHECK "))
    code = json.loads(health[health.index("CMD ") + 4 :])[2]
    for settings in (LeaderboardSettings, OrchestratorSettings):
        assert f"'{settings.model_fields['port'].default}'" in code, settings
    # Training pods run with the pod image's group (a compile-cache claim becomes theirs).
    from services.orchestrator.backends.kubernetes import POD_IMAGE_GID

    user = [ln.split()[1] for ln in stages["pod"] if ln.startswith("USER ")][-1]
    assert user == f"{POD_IMAGE_GID}:{POD_IMAGE_GID}", user
    # The control plane's dependencies leave torch out; only the pod image installs it, pinned
    # to the exact build (a source that has only another build fails instead of installing it).
    deps = " ".join(stages["deps"])
    assert "torch" not in deps
    assert "torch==${TORCH_VERSION}+${TORCH_VARIANT}" in " ".join(stages["pod-deps"])
    assert any("--from=deps " in ln for ln in stages["control-plane"])


def test_dockerfile_builds_without_a_registry_and_control_plane_without_torch() -> None:
    """No frontend directive (BuildKit would fetch it from Docker Hub); the base image
    named once, as a build argument; the classic builder, which builds every stage before the
    target, meets no torch stage on the way to control-plane; no anonymous volumes."""
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    stages = list(_stages())
    assert froms[0] == "${BASE_IMAGE}" and "ARG BASE_IMAGE=" in text
    assert all(f in stages for f in froms[1:]), froms  # every other stage builds on a stage
    before = stages[: stages.index("control-plane") + 1]
    assert not any("torch==" in ln for st in before for ln in _stages()[st]), before
    assert "VOLUME" not in {ln.split()[0] for lines in _stages().values() for ln in lines}
    assert not any("--mount" in ln for lines in _stages().values() for ln in lines)  # classic: none


def test_dockerignore_sends_only_what_the_images_copy() -> None:
    lines = [
        ln
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln and not ln.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = {
        part.rstrip("/")
        for ln in (ROOT / "Dockerfile").read_text().splitlines()
        if ln.startswith("COPY ") and "--from=" not in ln
        for part in ln.split()[1:-1]
    }
    assert copied == allowed, (copied, allowed)


def test_dockerfile_install_steps_work_on_the_build_context(tmp_path: Path) -> None:
    """The deps stage's own commands, run on exactly what .dockerignore lets through: the
    requirement list is pyproject's dependencies (no torch), and the package builds with its
    services, `python -m` entry points and registered envs (tests/containers/ runs the build)."""
    context = tmp_path / "context"
    context.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (context / name).write_bytes((ROOT / name).read_bytes())
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "services", context / "services", ignore=skip)
    script = ROOT / "deploy" / "images" / "venv-install.sh"
    assert any("venv-install.sh requirements" in ln for ln in _stages()["deps"])
    out = run("sh", str(script), "list", cwd=context).stdout.splitlines()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert out == project["dependencies"] and out
    # torch, safetensors and matplotlib stay out of the control plane (extras pod / plots).
    assert not any(re.match(r"(torch|safetensors|matplotlib)\b", r) for r in out), out
    assert any(r.startswith("torch") for r in project["optional-dependencies"]["pod"])
    pod = run("sh", str(script), "list", "pod", cwd=context).stdout.splitlines()
    assert pod == out + project["optional-dependencies"]["pod"]
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp_path / "dist"),
        str(context),
    )
    (wheel,) = (tmp_path / "dist").glob("podium-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("orchestrator", "leaderboard", "pod"):
        assert f"services/{module}/__main__.py" in names, module
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "[podium.envs]" in zipfile.ZipFile(wheel).read(entry_points).decode()


# ---- docker compose ---------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_matches_the_compose_spec_schema() -> None:
    """compose-spec.json is the Compose Specification schema vendored from the PyPI wheel
    docker-compose 1.29.2 (compose/config/compose_spec.json, Apache-2.0)."""
    schema = json.loads((HERE / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    compose = _compose()
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, errors
    bad = copy.deepcopy(compose)
    bad["services"]["redis"]["restart_policy"] = "always"  # not a compose key
    assert not validator.is_valid(bad)
    offline = yaml.safe_load((ROOT / "docker-compose.offline.yml").read_text())
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(offline)]
    assert not errors, errors
    assert set(offline["services"]) <= set(compose["services"])


def test_compose_passes_the_token_only_when_set() -> None:
    """`${PODIUM_API_TOKEN:-}` handed the services an empty token, which they refuse
    (the leaderboard restarted in a loop). A bare name passes the variable only when it is set."""
    for name in ("leaderboard", "orchestrator"):
        env = _compose()["services"][name]["environment"]
        assert "PODIUM_API_TOKEN" in env and env["PODIUM_API_TOKEN"] is None, (name, env)


def test_compose_services_fit_together() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"redis", "leaderboard", "orchestrator", "prometheus", "grafana"} <= set(services)
    declared = set(compose.get("volumes", {}))
    stages = _stages()
    for name, svc in services.items():
        for dep in svc.get("depends_on", []):
            assert dep in services, (name, dep)
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), (name, source)
            else:
                assert source in declared, (name, source)
        if isinstance(svc.get("build"), dict):
            assert svc["build"]["target"] in stages, name
        assert "healthcheck" in svc, name
    # Redis persists; the orchestrator runs pods locally and tells them to serve metrics.
    assert "--appendonly" in services["redis"]["command"]
    orch = services["orchestrator"]["environment"]
    assert orch["PODIUM_BACKEND"] == "local" and orch["PODIUM_METRICS_PORT"] == "0"
    assert orch["PODIUM_LEADERBOARD_URL"] == "http://leaderboard:8001"
    # Prometheus scrapes each service where it listens.
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t
        for job in prom["scrape_configs"]
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    }
    for name in ("orchestrator", "leaderboard"):
        port = services[name]["environment"]["PODIUM_PORT"]
        assert f"{name}:{port}" in targets
        (published,) = services[name]["ports"]
        assert re.fullmatch(rf"\$\{{PODIUM_{name.upper()}_PORT:-{port}\}}:{port}", published)


def test_compose_service_env_names_are_real_settings() -> None:
    from services.leaderboard.settings import LeaderboardSettings
    from services.orchestrator.settings import OrchestratorSettings

    services = _compose()["services"]
    _assert_settings(services["orchestrator"]["environment"], OrchestratorSettings)
    _assert_settings(services["leaderboard"]["environment"], LeaderboardSettings)


def _assert_settings(env: dict[str, Any], settings_cls: type) -> None:
    """Every PODIUM_* name is a field of the service's settings (a typo would be ignored)."""
    fields = {f"PODIUM_{n.upper()}" for n in settings_cls.model_fields} | {"REDIS_URL"}
    # Read by the pods the local backend starts (they inherit the orchestrator's environment).
    pod_env = {"PODIUM_METRICS_PORT"}
    unknown = {k for k in env if k.startswith("PODIUM_") or k == "REDIS_URL"} - fields - pod_env
    assert not unknown, f"{settings_cls.__name__} has no fields for {sorted(unknown)}"


# ---- Helm chart ------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "default")
def test_helm_lint_strict(values: Path | None) -> None:
    args = ["-f", str(values)] if values else []
    out = run(tool("helm"), "lint", "--strict", str(CHART), *args)
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "default")
def test_notes_tell_how_to_get_the_token_and_reach_the_api(values: Path | None) -> None:
    args = ["-f", str(values)] if values else []
    cmd = [tool("helm"), "install", "podium", str(CHART), "-n", "ns1", "--dry-run=client", *args]
    notes = run(*cmd).stdout.split("NOTES:", 1)[1]
    secret = "podium-token" if values and values.name == "gpu-values.yaml" else "podium-api-token"
    assert f"kubectl get secret --namespace ns1 {secret} " in notes
    assert "port-forward --namespace ns1 svc/podium-orchestrator 8000:8000" in notes
    assert "helm test podium --namespace ns1" in notes


def test_values_schema_rejects_unknown_and_invalid_values() -> None:
    helm = tool("helm")
    typo = run(helm, "template", "x", str(CHART), "--set", "redis.persistance.size=1Gi", ok=False)
    assert typo.returncode != 0 and "persistance" in typo.stderr
    bad = run(helm, "template", "x", str(CHART), "--set", "storage.type=nfs", ok=False)
    assert bad.returncode != 0 and "/storage/type" in bad.stderr
    # Several leaderboard replicas cannot share a ReadWriteOnce checkpoint volume.
    rwo = [
        "--set",
        "leaderboard.replicas=2",
        "--set",
        "storage.persistence.accessModes={ReadWriteOnce}",
    ]
    shared = run(helm, "template", "x", str(CHART), *rwo, ok=False)
    assert shared.returncode != 0 and "ReadWriteMany" in shared.stderr
    run(helm, "template", "x", str(CHART), *rwo, "--set", "storage.type=s3")
    # Nor may each keep its own: without a volume every replica's files are an emptyDir.
    apart = ["--set", "leaderboard.replicas=3", "--set", "storage.persistence.enabled=false"]
    alone = run(helm, "template", "x", str(CHART), *apart, ok=False)
    assert alone.returncode != 0 and "storage.persistence.enabled" in alone.stderr


def test_large_numbers_in_a_values_file_render_as_the_settings_read_them(tmp_path: Path) -> None:
    """A values file's numbers are floats to Helm: a million printed as 1e+06 would stop the
    orchestrator at start (not an integer), 64 GiB in bytes as 6.8719476736e+10 (not a
    quantity)."""
    from services.contracts.spec import parse_quantity
    from services.orchestrator.settings import OrchestratorSettings

    values = tmp_path / "big.yaml"
    values.write_text(
        "orchestrator:\n  limits:\n    maxPodsPerExperiment: 1000000\n"
        "    maxPodMemory: 68719476736\n    maxPodGpus: 8\npod:\n  sharedMemory: 4294967296\n"
    )
    docs = helm_template("-f", str(values))
    orch = by_kind(docs, "Deployment")["podium-orchestrator"]["spec"]["template"]["spec"]
    env = env_of(orch["containers"][0])
    assert env["PODIUM_MAX_PODS_PER_EXPERIMENT"] == "1000000"
    assert env["PODIUM_MAX_POD_MEMORY"] == "68719476736"
    assert env["PODIUM_K8S_SHARED_MEMORY"] == "4294967296"
    assert parse_quantity(env["PODIUM_MAX_POD_MEMORY"]) == 64 << 30
    settings = OrchestratorSettings(_env_file=None, max_pods_per_experiment=env[
        "PODIUM_MAX_PODS_PER_EXPERIMENT"], max_pod_gpus=env["PODIUM_MAX_POD_GPUS"])  # fmt: skip
    assert settings.max_pods_per_experiment == 1_000_000 and settings.max_pod_gpus == 8
    # Fractional bytes are not a quantity the chart writes: refused by the schema.
    values.write_text("orchestrator:\n  limits:\n    maxPodMemory: 1.5\n")
    bad = run(tool("helm"), "template", "x", str(CHART), "-f", str(values), ok=False)
    assert bad.returncode != 0 and "maxPodMemory" in bad.stderr


def test_training_pods_pull_with_the_charts_secrets_and_have_their_account() -> None:
    """Training pods are made by the orchestrator with the `-pod` service account: its
    imagePullSecrets are how they pull from a private registry; with serviceAccount.create=false
    (your own orchestrator account) that account must still exist."""
    docs = helm_template("--set", "image.pullSecrets[0].name=regcred")
    pod_sa = by_kind(docs, "ServiceAccount")["podium-pod"]
    assert pod_sa["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod_sa["automountServiceAccountToken"] is False
    assert "imagePullSecrets" not in by_kind(helm_template(), "ServiceAccount")["podium-pod"]
    own = helm_template("--set", "serviceAccount.create=false", "--set", "serviceAccount.name=mine")
    accounts = by_kind(own, "ServiceAccount")
    assert list(accounts) == ["podium-pod"]
    orch = by_kind(own, "Deployment")["podium-orchestrator"]["spec"]["template"]["spec"]
    assert orch["serviceAccountName"] == "mine"
    for name in ("podium-leaderboard",):
        spec = by_kind(own, "Deployment")[name]["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] in accounts
    assert env_of(orch["containers"][0])["PODIUM_K8S_POD_SERVICE_ACCOUNT"] in accounts


def test_every_rendered_object_is_valid_kubernetes(renders: dict[str, list[dict]]) -> None:
    problems = []
    for name, docs in renders.items():
        for doc in docs:
            if doc["kind"] in CRDS:
                continue
            for version in K8S_VERSIONS:
                since = SINCE.get(doc["kind"])
                if since and tuple(map(int, version.split(".")[:2])) < since:
                    continue
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except Exception as e:  # ValidationError, SchemaNotFoundError
                    obj = f"{doc['kind']}/{doc['metadata']['name']}"
                    problems.append(f"{name} {obj} {version}: {e}")
    assert not problems, "\n".join(problems)


def _workloads(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out.append((f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"]))
        elif d["kind"] == "Pod":
            out.append((f"Pod/{d['metadata']['name']}", d["spec"]))
    return out


def test_workloads_are_hardened_with_resources_and_probes(renders: dict[str, list[dict]]) -> None:
    for docs in renders.values():
        for name, spec in _workloads(docs):
            assert spec["securityContext"]["runAsNonRoot"] is True, name
            assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
            for c in spec["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, name
                assert sc["capabilities"]["drop"] == ["ALL"], name
                assert sc["readOnlyRootFilesystem"] is True, name
                assert c["resources"]["requests"] and c["resources"]["limits"], name
                if not name.startswith("Pod/"):  # the helm test pod runs to completion
                    for probe in ("livenessProbe", "readinessProbe"):
                        assert probe in c, (name, probe)


def test_orchestrator_and_leaderboard_env_names_are_real_settings(
    renders: dict[str, list[dict]],
) -> None:
    from services.leaderboard.settings import LeaderboardSettings
    from services.orchestrator.settings import OrchestratorSettings

    for docs in renders.values():
        deps = by_kind(docs, "Deployment")
        orch = env_of(deps["podium-orchestrator"]["spec"]["template"]["spec"]["containers"][0])
        board = env_of(deps["podium-leaderboard"]["spec"]["template"]["spec"]["containers"][0])
        _assert_settings(orch, OrchestratorSettings)
        _assert_settings(board, LeaderboardSettings)
        assert orch["PODIUM_BACKEND"] == "kubernetes"
        assert orch["PODIUM_LEADERBOARD_URL"].startswith("http://podium-leaderboard:")
    # storage.s3.createBucket: the leaderboard may make a missing bucket (a fresh MinIO).
    deps = by_kind(renders["gpu-values.yaml"], "Deployment")
    board = env_of(deps["podium-leaderboard"]["spec"]["template"]["spec"]["containers"][0])
    assert LeaderboardSettings(s3_create_bucket=board["PODIUM_S3_CREATE_BUCKET"]).s3_create_bucket


def _training_pod(docs: list[dict[str, Any]], gpus: int = 1) -> tuple[Any, dict[str, Any]]:
    """The orchestrator's settings as the chart's render gives them, and the training Pod the
    real Kubernetes backend makes with them (the seam between the chart and the backend)."""
    from services.orchestrator.backends.base import PodRequest
    from services.orchestrator.backends.kubernetes import pod_manifest
    from services.orchestrator.scheduler import Res
    from services.orchestrator.settings import OrchestratorSettings

    container = by_kind(docs, "Deployment")["podium-orchestrator"]["spec"]["template"]["spec"]
    env = {
        k: v
        for k, v in env_of(container["containers"][0]).items()
        if isinstance(v, str) and (k.startswith("PODIUM_") or k == "REDIS_URL")
    }
    env.pop("PODIUM_API_TOKEN_FILE")  # a file only the running pod has: its token instead
    settings = OrchestratorSettings(_env_file=None, api_token="from-the-file", **_as_kwargs(env))
    req = PodRequest("exp1", "p0", '{"name": "exp1"}', Res(cpu=4, gpus=gpus, memory=8 << 30))
    return settings, pod_manifest(settings, "podium", req, owner_uid="0000")


def test_gpu_values_reach_the_training_pod_manifest(renders: dict[str, list[dict]]) -> None:
    """The chart's pod settings, read by the real OrchestratorSettings and pod_manifest, give a
    valid training Pod on GPU nodes (the seam between the chart and the Kubernetes backend)."""
    docs = renders["gpu-values.yaml"]
    settings, pod = _training_pod(docs)
    for version in K8S_VERSIONS[-1:]:  # DRA claims: Kubernetes >= 1.34
        kubernetes_validate.validate(pod, version, strict=True)
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["priorityClassName"] == "podium-training"
    assert spec["serviceAccountName"] == "podium-pod"
    claim_templates = by_kind(docs, "ResourceClaimTemplate")
    assert [c["resourceClaimTemplateName"] for c in spec["resourceClaims"]] == list(claim_templates)
    assert all(c["resources"]["claims"] == [{"name": "gpu"}] for c in spec["containers"])
    token = env_of(spec["containers"][0])["PODIUM_API_TOKEN"]  # the experiment's credential
    assert token == {"secretKeyRef": {"name": "podium-exp-exp1-pod-credential", "key": "token"}}
    assert "from-the-file" not in json.dumps(pod)
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "training-pod"
    # pod.env: the pods' own settings (the reconciler puts them in each pod's request).
    assert settings.pod_env == {"PODIUM_COMPILE_WAIT_S": "300"}
    assert spec["containers"][0]["imagePullPolicy"] == "Always"  # image.pullPolicy


def test_training_pods_metrics_are_scraped_and_nothing_else_reaches_them(
    renders: dict[str, list[dict]],
) -> None:
    """The dashboard's pod panels need the training pods' own /metrics: the chart's PodMonitor
    selects the Pods the backend makes and scrapes the port they declare and serve on; the
    training pods' NetworkPolicy lets only that port in. With pod.metricsPort 0, none of it."""
    docs = renders["gpu-values.yaml"]
    _, pod = _training_pod(docs, gpus=0)
    labels, [container] = pod["metadata"]["labels"], pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    (monitor,) = by_kind(docs, "PodMonitor").values()
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    assert env_of(container)["PODIUM_METRICS_PORT"] == str(ports[endpoint["port"]])
    policy = by_kind(docs, "NetworkPolicy")["podium-training-pods"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == [
        endpoint["port"]
    ]
    assert not by_kind(renders["no-operator"], "PodMonitor")

    off = helm_template("--set", "pod.metricsPort=0")
    assert not by_kind(off, "PodMonitor")
    assert "ingress" not in by_kind(off, "NetworkPolicy")["podium-training-pods"]["spec"]
    _, pod = _training_pod(off, gpus=0)
    assert "ports" not in pod["spec"]["containers"][0]
    assert "PODIUM_METRICS_PORT" not in env_of(pod["spec"]["containers"][0])


def _as_kwargs(env: dict[str, str]) -> dict[str, Any]:
    """Environment → settings kwargs, parsing JSON the way pydantic-settings does from env."""
    out: dict[str, Any] = {}
    for k, v in env.items():
        key = "redis_url" if k == "REDIS_URL" else k.removeprefix("PODIUM_").lower()
        out[key] = json.loads(v) if v[:1] in "[{" else v
    return out


def test_rbac_grants_what_the_orchestrator_uses(renders: dict[str, list[dict]]) -> None:
    docs = renders["default"]
    role = by_kind(docs, "Role")["podium-orchestrator"]
    rules = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    for want in [
        ("pods", "create"),
        ("pods", "delete"),
        ("pods", "watch"),
        ("pods/log", "get"),
        ("configmaps", "create"),
        ("secrets", "create"),
        ("secrets", "delete"),
        ("resourcequotas", "list"),
    ]:
        assert want in rules
    # It can make its pods' credentials, not read the API token.
    assert not {("secrets", v) for v in ("get", "list", "watch")} & rules
    assert not any(v in ("*", "update", "patch") for _, v in rules)
    # Nothing it does not call (the backend reads no events, lists nodes and quotas only).
    assert not {r for r, _ in rules} & {"events"}
    assert {v for r, v in rules if r == "resourcequotas"} == {"list"}
    (cluster_role,) = by_kind(docs, "ClusterRole").values()
    assert cluster_role["rules"][0]["verbs"] == ["list"]
    assert cluster_role["rules"][0]["resources"] == ["nodes"]
    sa = by_kind(docs, "ServiceAccount")
    binding = by_kind(docs, "RoleBinding")["podium-orchestrator"]
    assert binding["subjects"][0]["name"] in sa
    orch = by_kind(docs, "Deployment")["podium-orchestrator"]["spec"]["template"]["spec"]
    assert orch["serviceAccountName"] == binding["subjects"][0]["name"]
    assert sa["podium-pod"]["automountServiceAccountToken"] is False
    assert "ClusterRole" not in {d["kind"] for d in renders["external-redis-values.yaml"]}


def test_token_secret_is_mounted_and_handed_to_pods(renders: dict[str, list[dict]]) -> None:
    secret = by_kind(renders["default"], "Secret")["podium-api-token"]
    assert len(base64.b64decode(secret["data"]["token"])) == 40
    fixed = by_kind(renders["external-redis-values.yaml"], "Secret")["podium-api-token"]
    assert base64.b64decode(fixed["data"]["token"]) == b"ci-token-not-a-secret"
    # existingSecret: no API token Secret created (only the generated metrics token's).
    assert list(by_kind(renders["gpu-values.yaml"], "Secret")) == ["podium-metrics-token"]
    for name, docs in renders.items():
        expected = "podium-token" if name == "gpu-values.yaml" else "podium-api-token"
        for d in by_kind(docs, "Deployment").values():
            spec = d["spec"]["template"]["spec"]
            vols = {v["name"]: v for v in spec["volumes"]}
            assert vols["token"]["secret"]["secretName"] == expected
            env = env_of(spec["containers"][0])
            assert env["PODIUM_API_TOKEN_FILE"] == "/var/run/secrets/podium/token"
            assert "PODIUM_API_TOKEN" not in env  # never a plain env value
            # Pods get their experiment's credential, never the platform token's Secret.
            assert "PODIUM_K8S_TOKEN_SECRET" not in env


def test_servicemonitor_only_with_the_operator_and_matching_the_services(
    renders: dict[str, list[dict]],
) -> None:
    assert not by_kind(renders["no-operator"], "ServiceMonitor")
    docs = renders["gpu-values.yaml"]
    (sm,) = by_kind(docs, "ServiceMonitor").values()
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = sm["spec"]["selector"]
    selected = []
    for svc in by_kind(docs, "Service").values():
        labels = svc["metadata"]["labels"]
        if all(labels.get(k) == v for k, v in selector["matchLabels"].items()) and all(
            labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"]
        ):
            selected.append(svc["metadata"]["name"])
            assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert sorted(selected) == ["podium-leaderboard", "podium-orchestrator"]
    # The leaderboard's /metrics needs a token: the ServiceMonitor sends
    # the one the leaderboard reads, from a Secret the chart generated.
    auth = sm["spec"]["endpoints"][0]["authorization"]
    assert auth["type"] == "Bearer" and auth["credentials"]["key"] == "token"
    secret = auth["credentials"]["name"]
    assert secret in by_kind(docs, "Secret")
    board = by_kind(docs, "Deployment")["podium-leaderboard"]["spec"]["template"]["spec"]
    mount = next(v for v in board["volumes"] if v.get("secret", {}).get("secretName") == secret)
    path = next(m for m in board["containers"][0]["volumeMounts"] if m["name"] == mount["name"])
    token_file = env_of(board["containers"][0])["PODIUM_METRICS_TOKEN_FILE"]
    assert token_file == f"{path['mountPath']}/token"


def test_dashboard_configmap_carries_the_dashboard_for_the_sidecar(
    renders: dict[str, list[dict]],
) -> None:
    cm = by_kind(renders["default"], "ConfigMap")["podium-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "podium.json").read_text())
    assert json.loads(cm["data"]["podium.json"]) == shipped
    assert not by_kind(renders["external-redis-values.yaml"], "ConfigMap")


def test_redis_persists_to_a_volume_claim(renders: dict[str, list[dict]]) -> None:
    sts = by_kind(renders["default"], "StatefulSet")["podium-redis"]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert "--appendonly" in sts["spec"]["template"]["spec"]["containers"][0]["args"]
    pvc = by_kind(renders["default"], "PersistentVolumeClaim")["podium-checkpoints"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    external = renders["external-redis-values.yaml"]
    assert not by_kind(external, "StatefulSet")
    orch = by_kind(external, "Deployment")["podium-orchestrator"]["spec"]["template"]["spec"]
    assert env_of(orch["containers"][0])["REDIS_URL"] == "redis://redis.example:6379/2"


# ---- k8s/ (plain manifests) ----------------------------------------------------------------------


def test_k8s_base_is_the_rendered_chart() -> None:
    proc = run(sys.executable, str(ROOT / "scripts" / "render_k8s.py"), "--check", ok=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", ["base", "overlays/gpu"])
def test_k8s_kustomizations_build_into_valid_objects(path: str) -> None:
    out = run(tool("kubectl"), "kustomize", str(ROOT / "k8s" / path)).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "Deployment", "StatefulSet", "Role", "ClusterRole"} <= kinds
    for doc in docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == "podium"
    orch = by_kind(docs, "Deployment")["podium-orchestrator"]["spec"]["template"]["spec"]
    env = env_of(orch["containers"][0])
    from services.orchestrator.settings import OrchestratorSettings

    _assert_settings(env, OrchestratorSettings)
    if path == "overlays/gpu":  # the patch merged into the generated env, not beside it
        assert json.loads(env["PODIUM_K8S_NODE_SELECTOR"]) == {"nvidia.com/gpu.present": "true"}
        assert len(orch["containers"][0]["env"]) == len(env)
        # Every image from your registry: the workloads' and both of the training pods'.
        images = [c["image"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                  for c in d["spec"]["template"]["spec"]["containers"]]  # fmt: skip
        pods = [env["PODIUM_POD_IMAGE"], env["PODIUM_POD_IMAGE_CPU"]]
        assert all(i.startswith("registry.example.com/") for i in images + pods), images + pods


# ---- checkov -----------------------------------------------------------------------------------


def _checkov(*args: str) -> list[dict[str, Any]]:
    # Offline: no guideline download, no platform mapping (the run must not need a network).
    proc = subprocess.run(
        [tool("checkov"), *args, "--quiet", "--compact", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=tool_env(BC_SKIP_MAPPING="TRUE"),
    )
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        pytest.fail(f"checkov failed to run ({proc.returncode}):\n{proc.stderr[-3000:]}")
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    for r in reports:
        assert r["summary"]["parsing_errors"] == 0, r["summary"]
        assert r["summary"]["passed"] > 0, r["summary"]  # it really looked at something
    return [f for r in reports for f in r["results"]["failed_checks"]]


def test_checkov_finds_nothing_beyond_the_justified_skips() -> None:
    skips = yaml.safe_load((HERE / "checkov-skips.yaml").read_text())
    for check, entry in skips.items():
        assert entry["why"].strip() and entry["resources"], check
    failed = _checkov("-d", "helm/podium", "--framework", "helm")
    failed += _checkov("-f", "Dockerfile", "--framework", "dockerfile")
    used: set[tuple[str, str]] = set()
    unjustified = []
    for f in failed:
        kind, _, rest = f["resource"].partition(".")
        name = rest.split(".", 1)[1] if "." in rest else rest  # drop the namespace
        resource = f"{kind}/{name.removeprefix('release-name-')}"
        allowed = skips.get(f["check_id"], {}).get("resources", [])
        if "*" in allowed:
            used.add((f["check_id"], "*"))
        elif resource in allowed:
            used.add((f["check_id"], resource))
        else:
            unjustified.append(f"{f['check_id']} {f['check_name']}: {resource} ({f['file_path']})")
    assert not unjustified, "checkov findings not in checkov-skips.yaml:\n" + "\n".join(unjustified)
    listed = {(c, r) for c, e in skips.items() for r in e["resources"]}
    assert listed == used, f"skips that no longer fire (remove them): {sorted(listed - used)}"


# ---- Grafana dashboard ---------------------------------------------------------------------------


def _exported_series() -> set[str]:
    """Every series name the services can export, from their real metric definitions."""
    from prometheus_client.metrics import MetricWrapperBase

    from services.leaderboard.metrics import LeaderboardMetrics
    from services.orchestrator import metrics as orchestrator_metrics
    from services.pod.runtime.metrics import PodMetrics

    families = [*LeaderboardMetrics().registry.collect(), *PodMetrics("e", "p").registry.collect()]
    for m in vars(orchestrator_metrics).values():
        if isinstance(m, MetricWrapperBase):
            families += m.describe()
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}
    return {f.name + s for f in families for s in suffixes[f.type]}


def dashboard_panels() -> list[dict[str, Any]]:
    dash = json.loads((CHART / "dashboards" / "podium.json").read_text())
    return [p for p in dash["panels"] if p["type"] != "row"]


def test_dashboard_queries_only_series_the_services_export() -> None:
    exported = _exported_series()
    panels = dashboard_panels()
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = set(re.findall(r"\bpodium_[a-z_]+", t["expr"]))
            assert names, (p["title"], t["expr"])
            assert names <= exported, (p["title"], names - exported)
    # The panels the issue asks for are there.
    titles = " | ".join(p["title"] for p in panels).lower()
    for want in [
        "top-k score",
        "best score vs target",
        "pods running / pending / failed",
        "env steps/s",
        "eval return distribution",
        "updater inserts / rejections",
        "generator decisions",
        "best score by algorithm",
        "api latency",
        "api errors",
        "pod start-up",
        "compile seconds",
    ]:
        assert want in titles, want


# ---- CI/CD retraining --------------------------------------------------------------------------

PIPELINES = {
    ROOT / ".github" / "workflows" / "retrain.yml": "vendor.github-workflows",
    ROOT / "deploy" / "ci" / "gitlab-retrain.yml": "vendor.gitlab-ci",
}


@pytest.mark.parametrize("path", list(PIPELINES), ids=lambda p: p.name)
def test_retrain_pipeline_is_valid_and_gates_with_the_real_cli(path: Path) -> None:
    checker = tool("check-jsonschema")
    run(checker, "--builtin-schema", PIPELINES[path], str(path))
    text = path.read_text()
    assert re.search(r"podium submit \S+ --wait .*--min-reward", text), path
    assert "podium export" in text
    # The options the pipeline passes are the CLI's (a renamed option would break it silently).
    from typer.testing import CliRunner

    from services.cli import app

    for command in ("submit", "export"):
        usage = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        line = next(ln for ln in text.splitlines() if f"podium {command} " in ln and "#" not in ln)
        for opt in re.findall(r"(--[a-z-]+)", line):
            assert opt in usage, (command, opt)


# ---- release and kind end-to-end workflows ------------------------------------------------------

WORKFLOWS = ROOT / ".github" / "workflows"


@pytest.mark.parametrize("name", ["release.yml", "e2e-kind.yml", "nightly.yml"])
def test_image_workflows_match_the_github_workflow_schema(name: str) -> None:
    schema = "vendor.github-workflows"
    run(tool("check-jsonschema"), "--builtin-schema", schema, str(WORKFLOWS / name))


def test_published_images_are_the_ones_the_chart_k8s_and_orchestrator_name() -> None:
    """The defaults named images nothing published. The release workflow publishes
    ghcr.io/<owner>/podium-<target>:<tag without v>, refusing a tag other than the chart's
    appVersion; the chart, k8s/ and the orchestrator's default pod image name exactly those."""
    from services.orchestrator.settings import OrchestratorSettings

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    version = chart["appVersion"]
    owner = re.fullmatch(r"https://github.com/([^/]+)/podium", chart["home"]).group(1)
    release = yaml.safe_load((WORKFLOWS / "release.yml").read_text())
    job = release["jobs"]["images"]
    assert release[True]["push"]["tags"] == ["v*"]  # YAML 1.1 reads the key `on` as True
    entries = job["strategy"]["matrix"]["include"]
    assert {e["target"] for e in entries} == {"control-plane", "pod"} <= set(_stages())
    steps = job["steps"]
    meta = next(s for s in steps if s.get("id") == "meta")["run"]
    assert "image=ghcr.io/$owner/podium-${{ matrix.target }}:$version${{ matrix.suffix }}" in meta
    assert "appVersion" in meta and "exit 1" in meta
    push = next(s for s in steps if str(s.get("uses", "")).startswith("docker/build-push-action"))
    assert push["with"]["target"] == "${{ matrix.target }}" and push["with"]["push"] is True
    # The pod image was built without build arguments, so torch +cpu under the name
    # the GPU docs and the chart use. Each entry's torch build reaches the Dockerfile.
    assert push["with"]["build-args"].splitlines() == ["TORCH_VARIANT=${{ matrix.torch }}"]
    published = {
        f"{e['target']}{e['suffix']}": (
            f"ghcr.io/{owner}/podium-{e['target']}:{version}{e['suffix']}"
        )
        for e in entries
    }
    torch_of = {f"{e['target']}{e['suffix']}": e["torch"] for e in entries}
    assert torch_of["pod"].startswith("cu") and torch_of["pod-cpu"] == "cpu", torch_of

    named = {
        "control-plane": values["image"]["controlPlane"],
        "pod": values["image"]["pod"],
    }
    assert all(not img["tag"] and not img["digest"] for img in named.values())  # appVersion
    assert {t: f"{img['repository']}:{version}" for t, img in named.items()} == {
        t: published[t] for t in named
    }
    assert OrchestratorSettings.model_fields["pod_image"].default == published["pod"]
    k8s_images = set()
    for path in (ROOT / "k8s" / "base").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            pod_spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in pod_spec.get("containers", []):
                if "podium-rl" in c["image"]:
                    k8s_images.add(c["image"])
                env = c.get("env", [])
                k8s_images |= {e["value"] for e in env if e["name"] == "PODIUM_POD_IMAGE"}
    assert k8s_images == {published["control-plane"], published["pod"]}  # k8s/base: GPUs allowed
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == version


def _pod_image(*args: str) -> str:
    docs = helm_template(*args)
    orch = by_kind(docs, "Deployment")["podium-orchestrator"]["spec"]["template"]["spec"]
    return env_of(orch["containers"][0])["PODIUM_POD_IMAGE"]


def test_chart_runs_pods_on_the_cuda_image_where_they_may_get_gpus_else_the_cpu_one() -> None:
    """GPU pods must not run a CPU build of torch. The chart's default pod image is
    the release's CUDA build where pods may get GPUs (orchestrator.limits.maxPodGpus > 0) and
    its -cpu build where they may not; an explicit tag or digest wins."""
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    release = yaml.safe_load((WORKFLOWS / "release.yml").read_text())
    torch_of = {
        f"ghcr.io/podium-rl/podium-pod:{version}{e['suffix']}": e["torch"]
        for e in release["jobs"]["images"]["strategy"]["matrix"]["include"]
        if e["target"] == "pod"
    }
    gpus = _pod_image()
    assert torch_of[gpus].startswith("cu"), (gpus, torch_of)
    assert _pod_image("-f", str(CHART / "ci" / "gpu-values.yaml")) == gpus
    cpu_only = _pod_image("--set", "orchestrator.limits.maxPodGpus=0")
    assert cpu_only == f"{gpus}-cpu" and torch_of[cpu_only] == "cpu"
    for limit in ("0", "8"):
        limits = ("--set", f"orchestrator.limits.maxPodGpus={limit}")
        mine = _pod_image(*limits, "--set", "image.pod.tag=mine")
        assert mine == "ghcr.io/podium-rl/podium-pod:mine"
        digest = "sha256:" + "a" * 64
        pinned = _pod_image(*limits, "--set", f"image.pod.digest={digest}")
        assert pinned == f"ghcr.io/podium-rl/podium-pod@{digest}"


def test_nightly_checks_are_left_out_by_default_and_run_with_m_nightly(tmp_path: Path) -> None:
    """CI runs the tests without the `nightly` ones (pyproject's addopts); `-m nightly`
    (what .github/workflows/nightly.yml runs through scripts/test.sh) runs exactly them."""
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\n\n@pytest.mark.nightly\n@pytest.mark.slow\ndef test_long():\n    pass"
        "\n\n\n@pytest.mark.slow\ndef test_learning():\n    pass\n\n\ndef test_unit():\n    pass\n"
    )

    def collected(*args: str) -> set[str]:
        cmd = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")]
        cmd += ["--rootdir", str(tmp_path), "-p", "no:cacheprovider", "--collect-only", "-q"]
        out = run(*cmd, *args, str(tmp_path / "test_marked.py"), cwd=tmp_path).stdout
        return {ln.split("::")[-1] for ln in out.splitlines() if "::" in ln}

    assert collected() == {"test_learning", "test_unit"}
    assert collected("-m", "nightly") == {"test_long"}
    assert collected("-m", "not slow") == {"test_unit"}  # nightly checks are slow ones too
    nightly = yaml.safe_load((WORKFLOWS / "nightly.yml").read_text())
    assert "schedule" in nightly[True]
    steps = [s.get("run", "") for job in nightly["jobs"].values() for s in job["steps"]]
    assert any(s.startswith("./scripts/test.sh -m nightly") for s in steps), steps


def test_kind_workflow_installs_the_chart_and_gates_with_the_real_cli() -> None:
    text = (WORKFLOWS / "e2e-kind.yml").read_text()
    assert "helm/kind-action" in text and "helm install podium ./helm/podium" in text
    assert "kind load docker-image" in text
    line = next(ln for ln in text.splitlines() if "podium submit " in ln)
    assert "--min-reward" in line and "--wait" in line
    from typer.testing import CliRunner

    from services.cli import app

    usage = CliRunner().invoke(app, ["submit", "--help"], env={"COLUMNS": "200"}).output
    for opt in re.findall(r"(--[a-z-]+)", line):
        assert opt in usage, opt
