#!/bin/sh
# The venv steps the Dockerfile's two Python stages share (deps: the control plane; pod-deps:
# the same plus torch and the `pod` extra), run from the build context in /src:
#   venv-install.sh list [EXTRA...]          print pyproject's dependencies (+ those extras)
#   venv-install.sh requirements [EXTRA...]  install them into /opt/venv (created if missing)
#   venv-install.sh project                  install Podium itself, then drop pip (and setuptools
#                                            unless KEEP_SETUPTOOLS=1: the pod's torch.compile
#                                            imports it, through torch.utils.cpp_extension)
# PIP_OFFLINE=1: only ./wheelhouse (pip --no-index); wheelhouse/ca.pem: a proxy's CA to trust.
# Extra requirements (the exact torch build) come in as $PIN. NO_COMPILE=1 leaves out the byte
# code (the control plane: a third of its venv; it compiles at start instead).
set -eu
if [ "${PIP_OFFLINE:-0}" = 1 ]; then export PIP_NO_INDEX=1; fi
if [ -f /wheelhouse/ca.pem ]; then export PIP_CERT=/wheelhouse/ca.pem; fi
mode="$1"
shift
strip_bytecode() {
  if [ "${NO_COMPILE:-0}" = 1 ]; then
    find /opt/venv -name __pycache__ -type d -prune -exec rm -rf {} +
  fi
}
case "$mode" in
  list)
    # tomllib is stdlib: the list stays pyproject's.
    python3 -c 'import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + [r for e in sys.argv[1:] for r in p["optional-dependencies"][e]]))' "$@"
    ;;
  requirements)
    "$0" list "$@" >requirements.txt
    [ -x /opt/venv/bin/python ] || python3 -m venv /opt/venv
    # shellcheck disable=SC2086
    /opt/venv/bin/pip install -r requirements.txt "setuptools>=69" ${PIN:-}
    # Never imported, and large: the asyncio copy of the Kubernetes client (half of its size)
    # and numpy's tests.
    rm -rf /opt/venv/lib/python3*/site-packages/kubernetes/aio \
      /opt/venv/lib/python3*/site-packages/numpy/*/tests
    strip_bytecode
    ;;
  project)
    /opt/venv/bin/pip install --no-deps --no-build-isolation .
    if [ "${KEEP_SETUPTOOLS:-0}" = 1 ]; then
      /opt/venv/bin/pip uninstall -y -q pip
    else
      /opt/venv/bin/pip uninstall -y -q pip setuptools
    fi
    strip_bytecode
    ;;
  *)
    echo "usage: $0 list|requirements|project [EXTRA...]" >&2
    exit 2
    ;;
esac
