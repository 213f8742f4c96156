#!/usr/bin/env bash
# The README's main command: set up (first run only), then train an agent on the embedded defaults.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/podium" train CartPole-v1 --out runs/quickstart "$@"
