"""Plugins registered through the real entry-point mechanism, as an installed package would
register them: a module and a dist-info directory on ``sys.path``."""

from __future__ import annotations

from pathlib import Path

import pytest


def register_plugin(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    module: str,
    source: str | dict[str, str],
    entry_points: dict[str, dict[str, str]],
) -> None:
    """Write ``module`` (its ``source``; a mapping of file names to sources makes it a package
    folder) and a distribution whose entry points are ``{group: {name: "module:attr"}}`` into
    ``tmp_path``, then put it on ``sys.path`` (spawned processes get this sys.path too)."""
    if isinstance(source, str):
        (tmp_path / f"{module}.py").write_text(source)
    else:
        (tmp_path / module).mkdir()
        for name, text in source.items():
            (tmp_path / module / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / module / name).write_text(text)
    dist = tmp_path / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\n")
    lines = []
    for group, names in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in names.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
