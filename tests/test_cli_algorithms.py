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
    assert "learning_rate, l2" in rows["portfolio_gradient"]  # what its population may vary
    assert "learning_rate, gamma, tau" in rows["dqn"] and "CartPole-v1" in rows["dqn"]
    assert "learning_rate, gamma, tau" in rows["td3"]  # what a TD3 population may vary


def test_every_hyperparameter_name_is_shown_whole_at_80_columns_and_piped() -> None:
    """--names cut names (``learning_r…``) at 80 and 120 columns and when piped."""
    from services.contracts.algorithms.card import card, card_names

    for columns in ("80", "120"):
        proc = subprocess.run(
            [sys.executable, "-m", "services.cli", "algorithms", "--names"],
            capture_output=True,
            text=True,
            env={"COLUMNS": columns, "PATH": "/usr/bin:/bin"},
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert "…" not in proc.stdout
        listed = proc.stdout.split("hyperparameters (search_space names):")[1]
        # Each algorithm's names: from "name:" to the next algorithm's (lines joined).
        text = " ".join(listed.split())
        for name in card_names():
            start = text.index(f"{name}: ") + len(name) + 2
            rest = text[start:]
            following = [rest.find(f" {other}: ") for other in card_names() if other != name]
            end = min([i for i in following if i >= 0] or [len(rest)])
            shown = {n.strip() for n in rest[:end].split(",")}
            assert shown == set(card(name).hyperparameter_names), (columns, name, shown)


def test_a_gym_id_trains_with_the_preset_of_the_env_it_names() -> None:
    """`podium train gym:HalfCheetah-v5` trained untuned defaults: the preset lookup knew the
    ``envpool:`` prefix only."""
    from services.contracts.algorithms.card import card, card_names

    for name in card_names():
        found = card(name)
        for env in found.preset_files():
            assert found.preset(f"gym:{env}") == found.preset(env) != {}, (name, env)
