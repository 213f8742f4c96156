"""``podium compile SPEC`` (services/cli/precompile.py): the spec's distinct programs, compiled
on the embedded platform with real pods into the cache ``podium run SPEC`` then loads from, so a
run that ``compile: auto`` would train eagerly (too short to pay for a cold compile) trains
compiled from its first updates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from services.cli.errors import CliError
from services.cli.precompile import MAX_COMBINATIONS, programs
from services.contracts.spec import ExperimentSpec

ROOT = Path(__file__).resolve().parents[1]


def dqn_spec(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "dqn-compile",
        "env": {"name": "CartPole-v1"},
        "algorithms": {"dqn": 1.0},
        "search_space": {
            "learning_rate": {"type": "choice", "values": [5e-4, 1e-3]},
            "batch_size": {"type": "choice", "values": [64]},
            "gamma": {"type": "uniform", "low": 0.95, "high": 0.99},
        },
        "population": {"min_pods": 2, "max_pods": 2},
        "resources": {"cpu": 1, "gpus": 0},
        "round": {"env_steps": 2048},
        "budget": {"total_env_steps": 1_000_000, "wall_time_s": 300},
        "evaluation": {"episodes": 4},
    }
    spec.update(over)
    return spec


def test_one_program_per_key_not_per_draw() -> None:
    space = {
        "learning_rate": {"type": "choice", "values": [5e-4, 1e-3, 2e-3]},  # an input
        "batch_size": {"type": "choice", "values": [64, 128]},  # shapes the update
        "buffer_size": {"type": "int_uniform", "low": 1000, "high": 2000},  # shapes the replay
        "gamma": {"type": "uniform", "low": 0.95, "high": 0.99},
    }
    found, ranges = programs(ExperimentSpec.model_validate(dqn_spec(search_space=space)))
    assert sorted(values["batch_size"] for _, values in found) == [64, 128]
    assert {algorithm for algorithm, _ in found} == {"dqn"}
    assert len(ranges) == 1 and "buffer_size is drawn from 1000..2000" in ranges[0]
    # A mix: each algorithm's programs, a name only the other one has changing nothing.
    mix = dqn_spec(
        env={"name": "Pendulum-v1"},
        algorithms={"sac": 0.5, "td3": 0.5},
        search_space={"policy_delay": {"type": "choice", "values": [1, 2]}},
    )
    found, _ = programs(ExperimentSpec.model_validate(mix))
    assert sorted((a, v["policy_delay"]) for a, v in found) == [("sac", 1), ("td3", 1), ("td3", 2)]
    many = {"batch_size": {"type": "choice", "values": list(range(1, MAX_COMBINATIONS + 2))}}
    with pytest.raises(CliError, match="search_space: 257 combinations"):
        programs(ExperimentSpec.model_validate(dqn_spec(search_space=many)))
    # Counted, not enumerated: 10**12 combinations are refused at once.
    names = ("batch_size", "buffer_size", "learning_starts", "num_envs", "exploration_steps",
             "target_update_every", "updates_per_call", "gamma", "tau", "learning_rate",
             "epsilon_end", "max_grad_norm")  # fmt: skip
    # Ten values each that DQN takes (fractions for the rates and discounts).
    tenths = {"gamma", "tau", "learning_rate", "epsilon_end"}
    huge = {
        name: {"type": "choice", "values": [i / 100 if name in tenths else i for i in range(1, 11)]}
        for name in names
    }
    with pytest.raises(CliError, match="search_space: 1000000000000 combinations"):
        programs(ExperimentSpec.model_validate(dqn_spec(search_space=huge)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_spec_is_refused_on_a_machine_without_one(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(dqn_spec(resources={"gpus": 1})))
    made = podium("compile", "spec.yaml", cwd=tmp_path, timeout=120)
    assert made.returncode != 0 and "Traceback" not in made.stderr, made.stderr
    assert "resources.gpus: each pod asks 1, this machine has 0" in made.stderr
    assert not (tmp_path / "runs").exists()  # no platform was started


def podium(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODIUM_")}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, check=False,
    )  # fmt: skip


def compile_records(data: Path, exp_id: str) -> list[dict[str, Any]]:
    lines = []
    for log in (data / "experiments" / exp_id / "pods").glob("*.log"):
        lines += [json.loads(x) for x in log.read_text().splitlines() if '"compile.done"' in x]
    return lines


@pytest.mark.slow
def test_a_compiled_spec_runs_compiled_from_the_start(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(dqn_spec()))
    out = tmp_path / "runs" / "dqn-compile"
    made = podium("compile", "spec.yaml", cwd=tmp_path, timeout=600)
    assert made.returncode == 0, made.stderr
    # Two learning rates, one batch size: one program, compiled once.
    assert "dqn, batch_size=64, learning_rate=0.0005: 1 graphs compiled" in made.stderr
    assert "learning_rate=0.001" not in made.stderr
    assert "`podium run spec.yaml` loads them" in made.stderr
    assert "Traceback" not in made.stderr
    # A long budget, so that auto compiles wherever the cache holds the programs, however
    # busy the machine (a load makes it count a load as dearer); cut short by --timeout.
    ran = podium("run", "spec.yaml", "--quiet", "--timeout", "20", "--port", "0",
                 "--leaderboard-port", "0", cwd=tmp_path, timeout=600)  # fmt: skip
    assert "Traceback" not in ran.stderr, ran.stderr
    exp_id = json.loads((out / "experiment.json").read_text())["id"]
    done = compile_records(out / "data", exp_id)
    # Both pods trained compiled and built nothing: they loaded what `podium compile` left.
    assert done and all(r["graphs_built"] == 0 and r["graphs_loaded"] >= 1 for r in done), done
    pods = list((out / "data" / "experiments" / exp_id / "pods").glob("*.log"))
    assert len(pods) == 2 and all('"compiled": true' in p.read_text() for p in pods)


def test_the_advice_to_compile_reads_the_pods_logs_and_survives_an_unreadable_one(
    tmp_path: Path,
) -> None:
    """``podium run``'s advice to compile (services/cli/results.py ``cold_compile_reason``): the
    first pod log whose ``auto`` declined a cold compile that a load would have turned gives its
    reason; a log that cannot be read (here a directory) or that is not UTF-8 gives none of its
    own, and nothing fails."""
    from services.cli.results import cold_compile_reason

    pods = tmp_path / "experiments" / "e1" / "pods"
    (pods / "a.log").mkdir(parents=True)  # read first (sorted): opening it fails
    decided = {"event": "compile.decided", "compiled": False, "warm": True, "reason": "auto: x"}
    (pods / "b.log").write_text("plain text\n" + json.dumps({**decided, "warm": False}) + "\n")
    assert cold_compile_reason(tmp_path, "e1") is None
    (pods / "c.log").write_bytes(b"\xff\xfe not UTF-8\n" + json.dumps(decided).encode() + b"\n")
    assert cold_compile_reason(tmp_path, "e1") == "auto: x"
    assert cold_compile_reason(tmp_path, "no-such-experiment") is None


def test_the_run_it_suggests_uses_the_compile_cache_it_filled(tmp_path: Path) -> None:
    """`podium compile SPEC --data-dir D` suggested `podium run SPEC --out OUT`, a platform on
    OUT/data, which found nothing compiled."""
    from services.cli.precompile import run_hint

    spec = Path("spec.yaml")
    default = Path("runs") / "x"
    assert run_hint(spec, "x", default, default / "data") == "podium run spec.yaml"
    assert (
        run_hint(spec, "x", tmp_path, tmp_path / "data") == f"podium run spec.yaml --out {tmp_path}"
    )
    hint = run_hint(spec, "x", tmp_path / "o", tmp_path / "d")
    assert hint == f"podium run spec.yaml --data-dir {tmp_path / 'd'}"
