#!/usr/bin/env bash
# The README's main command: set up (first run only), then run the CartPole PPO tournament on
# the embedded platform (Redis, leaderboard, orchestrator, local pods) until it reaches its target.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/podium" run examples/cartpole.yaml --out runs/quickstart "$@"
