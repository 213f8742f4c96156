"""Finding and running the deploy tools (installed by scripts/install-deploy-tools.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """Path of a deploy tool: the virtualenv's bin first (where the install script puts it).

    A missing tool fails the test: a skipped check would read as a pass.
    """
    beside = BIN / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run scripts/install-deploy-tools.sh")
    return found


def tool_env(**extra: str) -> dict[str, str]:
    """The environment with the virtualenv's bin first on PATH (checkov runs helm from it)."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra}


def run(*cmd: str, ok: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=tool_env(), timeout=300, **kw)
    if ok and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc
