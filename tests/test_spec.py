"""The experiment spec: YAML loading, name checks against the registry, clear errors."""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from services.contracts.spec import (
    ExperimentSpec,
    SpecError,
    load_spec,
    parse_quantity,
    read_yaml,
)

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
        # PyYAML keeps the last of two equal keys: the first search space would be dropped.
        (
            "name: x\nsearch_space: {gamma: {type: choice, values: [0.9]}}\nsearch_space: {}\n",
            "key 'search_space' given twice in one mapping",
        ),
        ("name: x\nenv: {name: CartPole-v1, name: Acrobot-v1}\n", "key 'name' given twice"),
        # A value where a distribution belongs: what an entry is, and how to pin one.
        (
            "name: x\nenv: {name: CartPole-v1}\nalgorithms: {ppo: 1}\n"
            "search_space: {clip_coef: 0.2, gamma: {low: 0.9, high: 0.99}}\n",
            r"search_space.clip_coef: .*one value pins a setting: \{type: choice, values: \[V\]\}"
            r"(.|\n)*search_space.gamma: .*a search_space entry is \{type: uniform",
        ),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(SpecError, match=needle):
        load_spec(_write(tmp_path, text))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"env": {"name": "CartPole-v1", "kwargs": {"max_episode_step": 100}}},
         "env.kwargs: CartPole-v1 does not take 'max_episode_step' (did you mean "
         "'max_episode_steps'?); it takes check_actions, dtype, max_episode_steps"),
        ({"env": {"name": "StockTrading-v0"}, "evaluation": {"env_kwargs": {"scroe": "sharpe"}}},
         "evaluation.env_kwargs: StockTrading-v0 does not take 'scroe' (did you mean 'score'?)"),
        ({"env": {"name": "Pendulum-v1", "kwargs": {"seed": 3}}},
         "env.kwargs: seed is set by the run, not by env arguments"),
        ({"env": {"name": "gym:Pendulum-v1"}, "evaluation": {"env_kwargs": {"num_envs": 3}}},
         "evaluation.env_kwargs: num_envs is set by the run"),
        ({"env": {"name": "Pendulum-v1", "kwargs": {"g": 9.81, "max_episode_steps": 100}}}, None),
        # Accepted and then every pod failed at its first step (exit 1, replaced 5 times).
        ({"env": {"name": "CartPole-v1", "kwargs": {"max_episode_steps": "abc"}}},
         "env.kwargs.max_episode_steps: 'abc' is not a whole number of steps >= 1"),
        ({"env": {"name": "CartPole-v1"}, "evaluation": {"env_kwargs": {"max_episode_steps": -1}}},
         "evaluation.env_kwargs.max_episode_steps: -1 is not a whole number"),
        ({"env": {"name": "CartPole-v1", "kwargs": {"max_episode_steps": None}}}, None),
        # No card of its arguments (gymnasium's own): its pods decide.
        ({"env": {"name": "gym:MountainCar-v0", "kwargs": {"anything": 1}}}, None),
    ],
)  # fmt: skip
def test_env_arguments_are_those_the_env_takes(env: dict, message: str | None) -> None:
    """A misspelt env argument made every pod exit on start and be replaced until the launch
    budget ended; refused at submission where the env's card lists its arguments."""
    data = {"name": "x", "algorithms": {"ppo": 1}, **env}
    if message is None:
        ExperimentSpec.model_validate(data)
        return
    with pytest.raises(ValidationError, match=re.escape(message)):
        ExperimentSpec.model_validate(data)


@pytest.mark.parametrize(
    ("env", "target", "message"),
    [
        ("Pendulum-v1", 200.0, "target_return 200 is above the best return an episode of "
         "Pendulum-v1 can have (0), so it would never be reached (did you mean -200?)"),
        ("gym:Acrobot-v1", 5.0, "best return an episode of gym:Acrobot-v1 can have (0)"),
        ("MountainCarContinuous-v0", 190.0, "can have (100), so it would never be reached;"),
        ("Pendulum-v1", -200.0, None),
        ("Pendulum-v1", 0.0, None),
        ("CartPole-v1", 1e9, None),  # its best grows with its time limit: not checked
        ("StockTrading-v0", 5.0, None),
    ],
)  # fmt: skip
def test_a_target_no_episode_can_reach_is_refused(env: str, target: float, message: str | None):
    """The experiment stops at its target: one above every return the env can give never
    stops it (without a budget it ran for ever)."""
    algorithm = "ppo"
    data = {
        "name": "x",
        "env": {"name": env},
        "algorithms": {algorithm: 1},
        "target_return": target,
    }
    if message is None:
        ExperimentSpec.model_validate(data)
        return
    with pytest.raises(ValidationError, match=re.escape(message)):
        ExperimentSpec.model_validate(data)
    lower = {**data, "evaluation": {"higher_is_better": False}}
    ExperimentSpec.model_validate(lower)  # a cost to get under: not a return


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"top_k": 2, "generator": {"strategy": "cem", "options": {"min_elite": 5}}},
         "generator.options.min_elite (5) > top_k (2): the board never holds that many"),
        ({"top_k": 2, "generator": {"strategy": "pbt", "options": {"min_candidates": 5}}},
         "generator.options.min_candidates (5) > top_k (2)"),
        ({"top_k": 3, "generator": {"strategy": "cem", "options": {"elite": 4}}},
         "generator.options.elite (4) > top_k (3)"),
        ({"population": {"min_pods": 4, "max_pods": 4}, "budget": {"pods_launched": 2}},
         "budget.pods_launched (2) < population.min_pods (4)"),
        ({"population": {"max_pods": 4, "agents_per_pod": 4,
                         "exploit": {"every_env_steps": 1_000_000}},
          "budget": {"total_env_steps": 100_000}},
         "population.exploit.every_env_steps (1,000,000): an agent trains at most 25,000"),
        ({"resources": {"gpus": 2}}, "less than or equal to 1"),
        # Annealed over the budget by agents that each train an unknown share of it.
        ({"population": {"max_pods": 2},
          "search_space": {"anneal_lr": {"type": "choice", "values": [False, True]}}},
         "search_space.anneal_lr: true cannot be honoured by a tournament of 2 agents"),
        ({"population": {"max_pods": 1},
          "search_space": {"anneal_lr": {"type": "choice", "values": [True]}}}, None),
        # What can act, accepted.
        ({"top_k": 8, "generator": {"strategy": "cem", "options": {"elite": 4}}}, None),
        ({"population": {"max_pods": 4, "agents_per_pod": 4,
                         "exploit": {"every_env_steps": 8192}},
          "budget": {"total_env_steps": 100_000}}, None),
        ({"population": {"min_pods": 2, "max_pods": 4}, "budget": {"pods_launched": 2}}, None),
    ],
)  # fmt: skip
def test_settings_the_rest_of_the_spec_makes_dead_are_refused(
    extra: dict, message: str | None
) -> None:
    """Each was accepted and never acted: a strategy waiting for more candidates than the
    board keeps (CEM sampling at random for ever, PBT never exploiting), fewer launches than
    the pods the experiment needs at once, an in-pod PBT whose first decision comes after
    the budget, a second GPU a pod never uses."""
    data = {"name": "x", "env": {"name": "CartPole-v1"}, "algorithms": {"ppo": 1}, **extra}
    if message is None:
        ExperimentSpec.model_validate(data)
        return
    with pytest.raises(ValidationError, match=re.escape(message)):
        ExperimentSpec.model_validate(data)


def test_yaml_merge_keys_still_merge(tmp_path: Path) -> None:
    """A key after a ``<<`` merge overrides the merged one: that is not a key given twice."""
    p = _write(tmp_path, "a: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n")
    assert read_yaml(p) == {"a": {"x": 1, "y": 2}, "c": {"x": 3, "y": 2}}


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
        ({"algorithms": {"ppo": float("inf")}}, "algorithms", "finite number"),
        ({"target_return": float("nan")}, "target_return", "finite number"),
        (
            {"search_space": {"lr": {"type": "uniform", "low": 0.1, "high": 0.2}}},
            "search_space",  # the pods would refuse it: PPO's field is learning_rate
            "'lr' not hyperparameters of 'ppo'; `podium algorithms --names` lists them: ppo: ",
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


@pytest.mark.parametrize("path", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_a_valid_spec(path: Path) -> None:
    spec = load_spec(path)
    assert spec.name == yaml.safe_load(path.read_text())["name"]
    assert spec.algorithms and spec.search_space
    # The orchestrator stores it as JSON and gives a pod that JSON: it reads back as it was.
    assert ExperimentSpec.model_validate_json(spec.model_dump_json()) == spec


def test_sac_example_is_an_offpolicy_tournament() -> None:
    spec = load_spec(EXAMPLE.parent / "pendulum-sac.yaml")
    assert spec.algorithms == {"sac": 1.0} and spec.env.name == "Pendulum-v1"
    assert {"tau", "batch_size", "learning_rate"} <= set(spec.search_space)


def _space(*names: str) -> dict:
    return {n: {"type": "choice", "values": [1]} for n in names}


@pytest.mark.parametrize(
    ("algorithms", "names", "message"),
    [
        ({"ppo": 1, "sac": 1}, ("tau", "gae_lambda", "learning_rate"), None),  # each has one
        ({"sac": 1}, ("tau", "batch_size", "updates_per_step", "init_alpha"), None),
        ({"dqn": 1}, ("double", "dueling", "epsilon_end", "buffer_size"), None),
        ({"td3": 1, "ddpg": 1}, ("policy_delay", "exploration_noise"), None),
        ({"sac": 1}, ("gae_lambda",), "'gae_lambda' not hyperparameters of 'sac'; `podium"),
        ({"ppo": 1}, ("tau",), "'tau' not hyperparameters of 'ppo'; `podium"),
        ({"ppo": 1, "sac": 1}, ("lr", "tau"), "'lr' not hyperparameters of 'ppo' or 'sac'; "),
        ({"dqn": 1, "td3": 1}, ("init_alpha",), "'init_alpha' not hyperparameters of 'dqn' or"),
    ],
)
def test_search_space_names_are_those_of_the_listed_algorithms(
    algorithms: dict, names: tuple[str, ...], message: str | None
) -> None:
    """A name is valid when at least one listed algorithm takes it; none: refused, named."""
    # An env whose actions the algorithms take (DQN's are discrete; the action-space check).
    env = "CartPole-v1" if set(algorithms) <= {"ppo", "dqn"} else "Pendulum-v1"
    data = {"name": "x", "env": {"name": env}, "algorithms": algorithms}
    data["search_space"] = _space(*names)
    if message is None:
        assert set(ExperimentSpec.model_validate(data).search_space) == set(names)
        return
    with pytest.raises(ValidationError) as info:
        ExperimentSpec.model_validate(data)
    assert info.value.errors()[0]["loc"][0] == "search_space"
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("algorithms", "space", "message"),
    [
        ({"ppo": 1}, {"clip_coef": {"type": "choice", "values": [0.1, "abc"]}}, "may draw 'abc'"),
        ({"ppo": 1}, {"gamma": {"type": "uniform", "low": 0.95, "high": 1.5}}, "may draw 1.5"),
        ({"ppo": 1}, {"learning_rate": {"type": "uniform", "low": -0.01, "high": 0.01}}, "-0.01"),
        ({"ppo": 1}, {"hidden_sizes": {"type": "choice", "values": ["big"]}}, "a valid list"),
        ({"ppo": 1}, {"num_envs": {"type": "uniform", "low": 2, "high": 10}}, "int_uniform"),
        ({"sac": 1, "td3": 1}, {"batch_size": {"type": "choice", "values": [0]}}, "sac refuses"),
        ({"sac": 1}, {"compile": {"type": "choice", "values": ["fast"]}}, "may draw 'fast'"),
        # What the pods take, taken: YAML's `on` is a boolean the compile switch reads.
        ({"sac": 1}, {"compile": {"type": "choice", "values": [True, "off"]}}, None),
        ({"ppo": 1}, {"num_envs": {"type": "int_uniform", "low": 2, "high": 10}}, None),
        ({"ppo": 1}, {"hidden_sizes": {"type": "choice", "values": [[64, 64], [128]]}}, None),
        ({"ppo": 1, "sac": 1}, {"tau": {"type": "uniform", "low": 0.001, "high": 0.1}}, None),
    ],
)
def test_search_space_values_are_those_the_pods_take(
    algorithms: dict, space: dict, message: str | None
) -> None:
    """A draw a pod's config would refuse (every pod of the experiment exiting on start, or
    some of them: a choice) is refused at submission, naming the name and the value."""
    env = "CartPole-v1" if set(algorithms) <= {"ppo", "dqn"} else "Pendulum-v1"
    data = {"name": "x", "env": {"name": env}, "algorithms": algorithms, "search_space": space}
    if message is None:
        ExperimentSpec.model_validate(data)
        return
    with pytest.raises(ValidationError) as info:
        ExperimentSpec.model_validate(data)
    assert info.value.errors()[0]["loc"][0] == "search_space"
    assert f"search_space.{next(iter(space))} may draw" in str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"search_space": {"num_envs": {"type": "choice", "values": [8, 16]}}},
            "search_space 'num_envs' cannot vary within a population",
        ),
        (
            # Pinned (a one-value choice) is shared, so allowed, but not a second name that
            # varies.
            {
                "search_space": {
                    "sde_sample_freq": {"type": "choice", "values": [0]},
                    "num_minibatches": {"type": "int_uniform", "low": 4, "high": 8},
                }
            },
            "search_space 'num_minibatches' cannot vary within a population",
        ),
    ],
)
def test_population_pods_refuse_what_their_agents_cannot_vary(change, message) -> None:
    base = {
        "name": "pop",
        # Continuous actions (the portfolio gradient trains only StockTrading-v0, but the
        # population rule is checked first).
        "env": {"name": "Pendulum-v1"},
        "algorithms": {"ppo": 1.0},
        "population": {"agents_per_pod": 8},
        # Any PPO setting may be pinned: every agent of the pod gets the one value (here gSDE
        # off, which Pendulum's preset turns on and populations lack).
        "search_space": {
            "learning_rate": {"type": "log_uniform", "low": 1e-4, "high": 1e-2},
            "sde_sample_freq": {"type": "choice", "values": [0]},
        },
    }
    assert ExperimentSpec.model_validate(base).population.agents_per_pod == 8
    with pytest.raises(ValidationError, match=message):
        ExperimentSpec.model_validate({**base, **change})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"name: \xff\xfe\n", "not UTF-8 text (byte 6"),
        (b"name: x\nevaluation: {episodes: .nan}\n", "evaluation.episodes: must be a finite"),
        (b"name: x\nbudget: {wall_time_s: .inf}\n", "budget.wall_time_s: must be a finite"),
        (b"name: x\nenv: {kwargs: {when: 2024-01-01}}\n", "env.kwargs.when: date is not a JSON"),
        (b"name: x\nenv: {kwargs: {1: a}}\n", "env.kwargs: keys must be strings"),
    ],
)
def test_spec_files_hold_only_what_json_carries(tmp_path: Path, content: bytes, message: str):
    """The spec file is sent as JSON and stored: what JSON cannot carry is refused when the
    file is read, with the file and the field named (the CLI exits 2 on it)."""
    path = tmp_path / "spec.yaml"
    path.write_bytes(content)
    with pytest.raises(SpecError, match=re.escape(message)) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: ")


def test_the_target_has_one_name_and_the_old_one_is_still_accepted() -> None:
    """``target_return``, as in a run config and the presets; specs written with the older
    ``target_reward`` still load (stored experiments, CI pipelines), to the same field."""
    base = {"name": "t", "env": {"name": "CartPole-v1"}, "algorithms": {"ppo": 1}}
    new = ExperimentSpec.model_validate({**base, "target_return": 475})
    old = ExperimentSpec.model_validate({**base, "target_reward": 475})
    assert new.target_return == old.target_return == 475
    assert "target_return" in old.model_dump() and "target_reward" not in old.model_dump()
