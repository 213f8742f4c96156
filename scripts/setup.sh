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

# Two commands started together (the README's quickstart and tests) must not build or install
# into one virtualenv at once (pip's two installs trip over each other's files): the second
# waits here, then finds the work done. The lock is on this script (util-linux's flock).
if command -v flock >/dev/null 2>&1; then
  exec 9<"${BASH_SOURCE[0]}"
  flock 9
fi

if [ ! -x "$venv/bin/python" ]; then
  py="$(pick_python)"
  echo "[setup] creating virtualenv $venv with $py" >&2
  "$py" -m venv "$venv"
fi
stamp="$venv/.podium-installed"
# pip's output cut to one line per package it fetches (with the seconds since the start and
# the size of large downloads) and one for the install step: the first run takes minutes, and
# pip -q said nothing all that time.
progress() {
  local n=0 line what
  while IFS= read -r line; do
    case "$line" in
      Collecting\ * | Processing\ *)  # from an index, or a wheel file of a local one
        n=$((n + 1))
        what="${line#* }"
        printf '[setup] %4ds  %3d  %s\n' "$((SECONDS - start))" "$n" "${what##*/}" >&2
        ;;
      *Downloading*\ MB\)*)  # only the large ones: torch, its libraries, scipy...
        what="${line#*Downloading }"
        printf '[setup] %4ds       downloading %s\n' "$((SECONDS - start))" "${what##*/}" >&2
        ;;
      "Installing collected packages:"*)
        printf '[setup] %4ds  installing %d packages (unpacking into %s)\n' \
          "$((SECONDS - start))" "$n" "$venv" >&2
        ;;
    esac
  done
}
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  start=$SECONDS
  echo "[setup] installing Podium and its dependencies into $venv: torch 2.13.0 first, then" \
    "about 150 packages; on a first run about 3 GB and 4 minutes (233 s measured on 2 cores)" >&2
  # A stale *.egg-info in the source tree shadows the installed entry points (envs,
  # algorithms, generators) for anything run from the repo root: drop it, the install rewrites it.
  rm -rf "$root"/*.egg-info
  # torch first, pinned: pyproject keeps a range, and with 2.13.0 present pip adds nothing more
  # (no multi-GB CUDA wheels pulled in by a bare requirement). pip's errors go to stderr, whole.
  "$venv/bin/python" -m pip install --progress-bar off --disable-pip-version-check \
    "torch==2.13.0" | progress
  "$venv/bin/python" -m pip install --progress-bar off --disable-pip-version-check \
    -e "$root[dev]" | progress
  touch "$stamp"
  echo "[setup] done in $((SECONDS - start)) s: $venv is $(du -sh "$venv" | cut -f1)" >&2
fi
