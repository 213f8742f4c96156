"""services/startup.py: a process's heavy imports with the cyclic collector off, then frozen."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from services.startup import import_all, importing

ROOT = Path(__file__).resolve().parents[1]


def test_the_collector_is_off_inside_and_as_it_was_after() -> None:
    assert gc.isenabled()
    with importing(freeze=False):
        assert not gc.isenabled()
        with importing(freeze=False):  # nested: only the outermost block turns it back on
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a process that runs without it keeps running without it
    try:
        with importing(freeze=False):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_import_all_imports_each_module_and_turns_the_collector_back_on() -> None:
    import_all(["json", "email.mime.text"], freeze=False)
    assert "email.mime.text" in sys.modules and gc.isenabled()
    with pytest.raises(ModuleNotFoundError):
        import_all(["json", "podium_no_such_module"], freeze=False)
    assert gc.isenabled()


def test_a_failed_import_turns_the_collector_back_on() -> None:
    with pytest.raises(ModuleNotFoundError), importing(freeze=False):
        import podium_no_such_module  # noqa: F401
    assert gc.isenabled()


def test_freezing_moves_what_the_imports_made_out_of_later_collections() -> None:
    """In a new interpreter (a frozen object is never collected: not in this test process)."""
    code = (
        "import gc\n"
        "from services.startup import importing\n"
        "before = gc.get_freeze_count()\n"
        "with importing(freeze=True):\n"
        "    import torch\n"
        "print(before, gc.get_freeze_count(), gc.isenabled())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    before, after, enabled = done.stdout.split()
    assert int(before) == 0 and int(after) > 100_000 and enabled == "True"
