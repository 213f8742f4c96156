"""Where a command writes: checked before it starts, so an unusable path is one line naming
the option (not a traceback minutes in), and a path holding the user's own files is never
replaced."""

from __future__ import annotations

import os
from pathlib import Path

from services.cli.errors import CliError

#: What ``podium export`` writes beside the training files: a directory holding it is an
#: earlier export, which a new one may replace.
EXPORT_MARK = "candidate.json"


def output_dir(path: Path, option: str) -> Path:
    """``path`` as a directory this process can write, made if missing."""
    if path.exists() and not path.is_dir():
        raise CliError(f"{option} {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"{option} {path}: cannot create it ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CliError(f"{option} {path}: not writable")
    return path


def export_dir(path: Path, option: str) -> Path:
    """``path`` as the directory an export puts in place: new, empty or an earlier export's
    (replaced whole), where it can be made. Checked only: nothing is made before the export."""
    if path.exists() and not path.is_dir():
        raise CliError(f"{option} {path}: exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / EXPORT_MARK).is_file():
        raise CliError(
            f"{option} {path}: holds other files (an export replaces its directory whole): "
            "name a new or empty directory, or an earlier export's"
        )
    above = path.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir() or not os.access(above, os.W_OK | os.X_OK):
        raise CliError(f"{option} {path}: cannot create it ({above} is not a writable directory)")
    return path
