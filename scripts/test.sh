#!/usr/bin/env bash
# The README's test command (and CI's): set up (first run only), lint, format check, tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
# helm, kubectl, hadolint, checkov, Prometheus: the deploy checks run real tools (idempotent).
"$root/scripts/install-deploy-tools.sh"
cd "$root"
venv="${PODIUM_VENV:-$root/.venv}"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
# The layering (pyproject.toml [tool.importlinter]): contracts, control plane and pod apart.
"$venv/bin/lint-imports"
# Two worker processes (PODIUM_TEST_WORKERS; 0 runs in this one): most tests wait on pods,
# services and compilers in other processes, so one worker leaves a 2-core machine half idle.
# Each test file runs in one worker (tests/conftest.py); pytest arguments of your own come last.
exec "$venv/bin/python" -m pytest -n "${PODIUM_TEST_WORKERS:-2}" "$@"
