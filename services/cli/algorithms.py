"""``podium algorithms``: what a pod can train, read from the algorithm cards (torch-free).

One row per registered card (services/contracts/algorithms/; plugins' cards too): its family
(which trainer trains it), the action kinds and envs it takes, what a population pod may vary
and the envs it has presets for; with ``--names``, then each one's hyperparameter names (what
a spec's ``search_space`` may name), as wrapped text under the table: a table column would cut
them at a terminal's width (or a pipe's 80 columns). Nothing is ever cut: a cell too narrow
folds."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from services.contracts.algorithms.card import AlgorithmCard, card, card_names


def rows() -> list[AlgorithmCard]:
    return [card(name) for name in card_names()]


def _preset_name(found: AlgorithmCard, env: str) -> str:
    threshold = found.large_batch_from(env)
    return env if threshold is None else f"{env} (≥ {threshold:,} envs)"


def show(names: bool = False) -> None:
    table = Table(
        title="Algorithms a pod trains (podium.algorithm_cards)",
        caption="presets: env (≥ N envs: the preset's large-batch section from N envs on, "
        "docs/presets.md)",
    )
    for column in ("algorithm", "family", "actions", "population may vary", "presets"):
        table.add_column(column, overflow="fold")
    cards = rows()
    for found in cards:
        kinds = " or ".join(found.action_kinds)
        if found.envs is not None:
            kinds += f" ({', '.join(found.envs)} only)"
        population = (
            ", ".join(found.population.hyperparameters) if found.population else "one agent a pod"
        )
        table.add_row(
            found.name,
            found.family,
            kinds,
            population,
            ", ".join(_preset_name(found, env) for env in sorted(found.preset_files())),
        )
    console = Console()
    console.print(table)
    if not names:
        return
    console.print("\nhyperparameters (search_space names):")
    for found in cards:
        line = Text.assemble(
            (f"{found.name}: ", "bold"), ", ".join(sorted(found.hyperparameter_names))
        )
        console.print(line, overflow="fold")
