"""`podium algorithms`: what a pod trains, read from the algorithm cards, without torch."""

from __future__ import annotations

import subprocess
import sys


def test_algorithms_lists_every_card_without_importing_torch() -> None:
    code = (
        "import sys; from services.cli import app; "
        "app(['algorithms', '--names'], standalone_mode=False); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if "│" in line}
    assert {"ppo", "sac", "td3", "ddpg", "dqn", "portfolio_gradient"} <= set(rows)
    assert "on_policy" in rows["ppo"] and "discrete or continuous" in rows["ppo"]
    assert "StockTrading-v0 only" in rows["portfolio_gradient"]
    assert "one agent a pod" in rows["portfolio_gradient"]  # a card without a population
    assert "learning_rate, gamma, tau" in rows["dqn"] and "CartPole-v1" in rows["dqn"]
    assert "learning_rate, gamma, tau" in rows["td3"]  # what a TD3 population may vary
    assert "clip_coef" in rows["ppo"]  # --names: what a search space may name
