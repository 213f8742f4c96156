"""The README as a user reads it: its layout table matches the tree, and every command line in it
runs (a smoke run: it parses, starts and, with a small budget, finishes).

Layout: each row's path exists, every package of services/ is a row or named in one (``name/``),
and every module a row names (``name.py``) exists where the row says, and the reverse for the
rows that list their modules: a module missing from its row fails.

Commands: each line of the README's ``bash`` blocks, as written, run from a scratch directory of
its own (``podium backtest`` in that of the ``podium train`` before it, whose output it reads),
with a budget of a few thousand env steps appended to each ``podium train``; the set-up scripts
with arguments that stop them soon after they start. The commands the prose names (``podium
run SPEC``, ``podium up``, ``podium submit ...``) are parsed (``--help``);
tests/test_cli_platform.py runs them for real.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
VENV_BIN = Path(sys.executable).parent


def _layout_rows() -> dict[str, str]:
    section = README.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] not in ("path", "---"):
            rows[cells[0]] = "|".join(cells[1:])
    return rows


ROWS = _layout_rows()


def _named(text: str) -> set[str]:
    return set(re.findall(r"`([\w./<>-]+)`", text))


def test_every_path_of_the_layout_exists() -> None:
    for path in ROWS:
        for part in (p.strip() for p in path.split(",")):
            found = list(ROOT.glob(part.rstrip("/"))) if "*" in part else [ROOT / part]
            assert found and all(p.exists() for p in found), part


def test_every_package_is_in_the_layout() -> None:
    packages = sorted(p.parent for p in (ROOT / "services").rglob("__init__.py"))
    for package in packages:
        rel = package.relative_to(ROOT).as_posix() + "/"
        if rel == "services/" or rel in ROWS:
            continue
        parent = package.parent.relative_to(ROOT).as_posix() + "/"
        assert parent in ROWS and f"{package.name}/" in _named(ROWS[parent]), rel


@pytest.mark.parametrize("row", [r for r in ROWS if r.startswith("services/")])
def test_each_rows_modules_exist_and_none_is_missing(row: str) -> None:
    directory = ROOT / row.replace("*.py", "")
    named = {n for n in _named(ROWS[row]) if n.endswith(".py")}
    here = {p.name for p in directory.glob("*.py")}
    # A row names modules of its own directory, or of a subpackage it names (``backends/``).
    subpackages = {n.rstrip("/") for n in _named(ROWS[row]) if n.endswith("/")}
    below = {p.name for sub in subpackages for p in (directory / sub).glob("*.py")}
    assert named <= here | below, named - here - below
    # Every module is named, but a package's __init__ and __main__; in services/pod/, the
    # layers' own rows name theirs.
    missing = here - named - {"__init__.py", "__main__.py"}
    if row == "services/pod/":
        missing -= {"config.py"} if "`config.py`" in ROWS[row] else set()
    assert not missing, f"{row}: not in the README's layout: {sorted(missing)}"
    for sub in subpackages:
        if f"{row}{sub}/" in ROWS:
            continue  # a row of its own
        missing = {p.name for p in (directory / sub).glob("*.py")} - named - {"__init__.py"}
        if row != "services/contracts/algorithms/":  # the cards' folders: described, not listed
            assert not missing, f"{row}{sub}/: not in the README's layout: {sorted(missing)}"


# -- the command lines ------------------------------------------------------------------------
def _bash_lines() -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command:
                lines.append(command)
    return lines


def _yaml_block() -> str:
    return re.findall(r"```yaml\n(.*?)```", README, re.S)[0]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODIUM_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


SMOKE_STEPS = ["--set", "total_env_steps=4096", "--set", "eval_every_steps=4096"]


def _run(argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def _check_podium(line: str, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (line, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, (line, proc.stderr[-3000:])
    if "--quiet" in line:  # no log line, JSON or other, under --quiet
        assert not re.search(r"^\{.*\"event\"", proc.stderr, re.M), (line, proc.stderr)


@pytest.mark.slow
def test_every_command_line_of_the_readme_runs(tmp_path: Path) -> None:
    """Each command in a directory of its own, two at a time (they are independent), but a
    command that reads what the one before it wrote (``podium backtest runs/train/...``), which
    runs after it, where it ran."""
    lines = _bash_lines()
    assert any(line.startswith("podium train") for line in lines), lines
    jobs: list[tuple[str, list[str], Path]] = []  # (line, argv, cwd)
    after: dict[int, tuple[str, list[str]]] = {}  # job index -> the line that reads its output
    for i, line in enumerate(lines):
        argv = shlex.split(line)
        cwd = tmp_path / f"line{i}"
        cwd.mkdir()
        (cwd / "my.yaml").write_text(_yaml_block())  # what `--config my.yaml` reads
        if argv[0] == ".":  # `. .venv/bin/activate`: what it puts on PATH, this venv's bin
            assert (ROOT / argv[1]).exists() or (VENV_BIN / "activate").exists(), line
        elif argv[0] == "./scripts/quickstart.sh":
            # Set-up (nothing to do: the venv is there), then the tournament, stopped at once.
            argv = [str(ROOT / argv[0]), "--out", str(cwd / "qs"), "--timeout", "1"]
            jobs.append((line, argv, cwd))
        elif argv[0] == "./scripts/test.sh":
            argv = [str(ROOT / argv[0]), "--collect-only", "-q", "tests/test_layers.py"]
            jobs.append((line, argv, ROOT))
        elif argv[:2] == ["podium", "backtest"]:
            assert jobs and jobs[-1][1][:2] == ["podium", "train"], line
            after[len(jobs) - 1] = (line, argv)
        else:
            assert argv[0] == "podium", f"a README command this test does not know: {line}"
            jobs.append((line, argv + SMOKE_STEPS if argv[1] == "train" else argv, cwd))

    def run(k: int) -> None:
        line, argv, cwd = jobs[k]
        proc = _run(argv, cwd)
        if line.startswith("./scripts/quickstart.sh"):
            assert "submitted cartpole-ppo" in proc.stderr, (line, proc.stderr[-3000:])
        elif line.startswith("./scripts/test.sh"):
            assert proc.returncode == 0, (line, proc.stdout[-2000:], proc.stderr[-2000:])
        else:
            _check_podium(line, proc)
        if k in after:
            then, argv = after[k]
            _check_podium(then, _run(argv, cwd))

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(run, k) for k in range(len(jobs))]:
            future.result()


PROSE_COMMANDS = ["run", "up", "submit", "status", "leaderboard", "cancel", "logs", "export"]


@pytest.mark.parametrize("command", PROSE_COMMANDS)
def test_the_commands_the_readme_names_parse(command: str) -> None:
    assert re.search(rf"\b{command}\b", README), command
    proc = subprocess.run(
        [str(VENV_BIN / "podium"), command, "--help"],
        env=_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "Usage" in proc.stdout, proc.stderr
