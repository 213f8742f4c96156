"""The layering at run time: what the import-linter contracts (pyproject.toml, run by
scripts/test.sh) cannot see, because it happens by name (an entry point loaded, gymnasium's
registry read) or in a package's ``__init__``."""

from __future__ import annotations

import graphlib
import subprocess
import sys

import grimp
import pytest

SPEC = (
    "{'name': 'x', 'env': {'name': 'Pendulum-v1'}, 'algorithms': {'ppo': 1, 'sac': 1, 'td3': 1}, "
    "'generator': {'strategy': 'pbt', 'options': {'quantile': 0.5, 'ready_reports': 3}}, "
    "'search_space': {'tau': {'type': 'choice', 'values': [0.01]}}}"
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)


def test_the_control_plane_and_the_cli_run_without_torch() -> None:
    """Both services' apps, the CLI with its export path, and a spec validated with every
    name check (env, algorithms, their hyperparameters, the strategy's options) load no torch."""
    proc = _run(
        "import sys; import services.orchestrator.app, services.leaderboard.app, services.cli; "
        "import services.cli.client, services.contracts.training_files; "
        "from services.contracts.spec import ExperimentSpec; "
        f"ExperimentSpec.model_validate({SPEC}); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("module", ["redis", "services.leaderboard", "fastapi", "torch"])
def test_a_spec_is_checked_without_the_services(module: str) -> None:
    """A pod validates its spec with the contracts alone: neither the leaderboard (its Redis
    store) nor a web framework comes with it, even for a strategy's options."""
    proc = _run(
        "import sys; from services.contracts.spec import ExperimentSpec; "
        "from services.contracts.strategies import ready_rule; "
        f"assert ready_rule(ExperimentSpec.model_validate({SPEC})) == (3, 16_384); "
        f"assert {module!r} not in sys.modules, {module!r} + ' imported'"
    )
    assert proc.returncode == 0, proc.stderr


def test_no_import_cycle_in_services() -> None:
    """No module of services/ imports itself through others, also by an import inside a
    function (the kind that hid ppo -> onpolicy -> learner -> ppo): layers have a direction."""
    graph = grimp.build_graph("services", exclude_type_checking_imports=True)
    imports = {
        module: {m for m in graph.find_modules_directly_imported_by(module) if m in graph.modules}
        for module in graph.modules
    }
    try:
        graphlib.TopologicalSorter(imports).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")
