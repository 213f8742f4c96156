#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and install everything Podium needs.
# Sourced by the README's commands; safe to run again (it only reinstalls when pyproject changes).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PODIUM_VENV:-$root/.venv}"

pick_python() {
  for p in python3.13 python3.12 python3.11 python3; do
    if command -v "$p" >/dev/null 2>&1 &&
      "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  echo "Podium needs Python >= 3.11 (python3 --version says: $(python3 --version 2>&1))" >&2
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  py="$(pick_python)"
  echo "[setup] creating virtualenv $venv with $py" >&2
  "$py" -m venv "$venv"
fi
stamp="$venv/.podium-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "[setup] installing Podium and its dependencies into $venv" >&2
  # A stale *.egg-info in the source tree shadows the installed entry points (envs,
  # algorithms, generators) for anything run from the repo root: drop it, the install rewrites it.
  rm -rf "$root"/*.egg-info
  # torch first, pinned: pyproject keeps a range, and with 2.13.0 present pip adds nothing more
  # (no multi-GB CUDA wheels pulled in by a bare requirement).
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[dev]"
  touch "$stamp"
fi
