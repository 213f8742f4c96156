"""The experiment spec: YAML loading, name checks against the registry, clear errors."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from services.spec import ExperimentSpec, SpecError, load_spec, parse_quantity

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cartpole.yaml"


def test_example_loads() -> None:
    spec = load_spec(EXAMPLE)
    assert spec.name == "cartpole-ppo" and spec.env.name == "CartPole-v1"
    assert spec.algorithms == {"ppo": 1.0}
    assert spec.search_space["learning_rate"].type == "log_uniform"
    assert spec.resources.memory_bytes == 2 * 2**30
    assert spec.population.max_pods == 4 and spec.round.env_steps == 4096


def test_json_round_trip() -> None:
    spec = load_spec(EXAMPLE)
    assert ExperimentSpec.model_validate_json(spec.model_dump_json()) == spec


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    return p


def test_errors_name_the_file_and_every_field(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "name: ok\nenv: {name: Nope-v9}\nalgorithms: {a3c: 1}\npopulation: {min_pods: 0}\n",
    )
    with pytest.raises(SpecError) as e:
        load_spec(p)
    msg = str(e.value)
    assert str(p) in msg
    assert "env.name: Value error, unknown env 'Nope-v9'" in msg and "CartPole-v1" in msg
    assert "algorithms: Value error, unknown algorithm 'a3c'; known: " in msg and "ppo" in msg
    assert "population.min_pods:" in msg


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: [unclosed", "not valid YAML"),
        ("- a list", "a mapping.*at the top level"),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(SpecError, match=needle):
        load_spec(_write(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "absent.yaml")


def test_yaml_cannot_construct_python_objects(tmp_path: Path) -> None:
    p = _write(tmp_path, "name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(p)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("CartPole-v1", True),
        ("gym:Acrobot-v1", True),
        ("MountainCar-v0", True),  # a gymnasium id without the prefix
        ("gym:NoSuchEnv-v0", False),
        ("gym:os:system", False),
        ("services.pod.envs.cartpole:CartPoleEnv", False),
    ],
)
def test_env_names(name: str, ok: bool) -> None:
    data = {"name": "x", "env": {"name": name}, "algorithms": {"ppo": 1}}
    if ok:
        assert ExperimentSpec.model_validate(data).env.name == name
    else:
        with pytest.raises(ValidationError, match="unknown env"):
            ExperimentSpec.model_validate(data)


def test_quantities() -> None:
    assert parse_quantity("2Gi") == 2 * 2**30
    assert parse_quantity("500m") == Decimal("0.5")
    assert parse_quantity("1.5G") == Decimal("1.5e9")
    assert parse_quantity(3) == 3
    with pytest.raises(ValueError, match="not a resource quantity"):
        parse_quantity("2 GB")


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        (
            {"generator": {"strategy": "pbt", "options": {"quantile": 7, "bogus": 1}}},
            "generator",
            "bogus: Extra inputs are not permitted",
        ),
        ({"algorithms": {"ppo": float("inf")}}, "algorithms", "finite and > 0"),
        ({"target_reward": float("nan")}, "target_reward", "finite number"),
        (
            {"search_space": {"lr": {"type": "uniform", "low": 0.1, "high": 0.2}}},
            "search_space",  # the pods would refuse it: PPO's field is learning_rate
            "'lr' not hyperparameters of 'ppo'; they are: ",
        ),
    ],
)
def test_values_the_leaderboard_would_refuse_are_refused_here(change, field, message):
    base = yaml.safe_load(EXAMPLE.read_text())
    with pytest.raises(ValidationError) as info:
        ExperimentSpec.model_validate({**base, **change})
    errors = info.value.errors()
    assert errors[0]["loc"][0] == field
    assert message in str(info.value)
