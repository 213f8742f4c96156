"""Presets for accelerator-sized batches (docs/presets.md).

A user who sets ``num_envs`` from a preset's ``large_batch.min_num_envs`` on (``podium train
ENV --set ppo.num_envs=4096``, a ``--config`` file, or a spec's search space pinning it) gets
the preset's large-batch section: its fields over the CPU preset's, its budgets per env times
the run's ``num_envs``, and what the user set on top. The selection is tested here on configs;
the learning tests train at 1,024 envs (the threshold, the largest batch this CPU trains in
CI time) exactly as ``podium train`` builds the config, within the env-step budgets documented
in docs/benchmarks.md ("Presets for accelerator-sized batches").
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from services.contracts.algorithms.card import LARGE_BATCH, PER_ENV_FIELDS, card, large_batch_layer
from services.contracts.algorithms.hyperparameters import HyperparameterError, preset_files
from services.contracts.envs import target_return
from services.contracts.spec import ExperimentSpec
from services.pod.config import PPORunConfig
from services.pod.training.fit import train
from services.pod.training.presets import (
    pod_config,
    preset,
    train_config,
)

#: The built-in torch-native envs PPO solves to a threshold: each has a large-batch section.
BUILT_IN = ("CartPole-v1", "Acrobot-v1", "Pendulum-v1", "MountainCarContinuous-v0")
PPO = card("ppo")


def ppo_envs(num_envs: int, **fields: object) -> dict:
    return {"ppo": {"num_envs": num_envs, **fields}}


def test_every_built_in_env_has_a_large_batch_section_from_1024_envs() -> None:
    for env in BUILT_IN:
        assert target_return(env) is not None, env
        assert PPO.large_batch_from(env) == 1024, env


def test_below_the_threshold_the_cpu_preset_trains() -> None:
    small = train_config("CartPole-v1", [])
    assert (small.ppo.num_envs, small.ppo.learning_rate, small.total_env_steps) == (
        16,
        0.008,
        200_000,
    )
    # One env below the threshold: still the CPU preset's fields, the user's env count.
    near = train_config("CartPole-v1", [ppo_envs(1023)])
    assert near.ppo.num_envs == 1023
    assert near.model_dump(exclude={"ppo"}) == small.model_dump(exclude={"ppo"})
    assert near.ppo.model_dump(exclude={"num_envs"}) == small.ppo.model_dump(exclude={"num_envs"})


@pytest.mark.parametrize("num_envs", [1024, 4096])
def test_from_the_threshold_the_large_batch_section_and_budgets_per_env(num_envs: int) -> None:
    config = train_config("CartPole-v1", [ppo_envs(num_envs)])
    ppo = config.ppo
    assert ppo.num_envs == num_envs
    assert (ppo.num_steps, ppo.num_minibatches, ppo.update_epochs) == (16, 4, 4)
    assert (ppo.learning_rate, ppo.hidden_sizes, ppo.norm_obs) == (0.003, [64, 64], True)
    # 60 updates and an evaluation every 2, whatever the env count.
    assert config.total_env_steps == 60 * ppo.batch_size == 960 * num_envs
    assert config.eval_every_steps == 2 * ppo.batch_size
    # What the section does not set stays the CPU preset's (gamma is the section's here).
    assert config.target_return == 475.0 and ppo.gamma == 0.99


def test_what_the_user_sets_wins_over_the_large_batch_section() -> None:
    config = train_config(
        "Pendulum-v1",
        [
            {"total_env_steps": 123_456, **ppo_envs(2048, learning_rate=3e-4)},
            {"ppo": {"num_minibatches": 2}},
        ],
    )
    assert (config.total_env_steps, config.ppo.learning_rate) == (123_456, 3e-4)
    assert config.ppo.num_minibatches == 2
    # The rest is the large-batch preset for 2,048 envs: its cadence per env, its fields.
    assert config.eval_every_steps == 32 * 2048
    assert (config.ppo.num_steps, config.ppo.sde_sample_freq, config.eval_episodes) == (16, 4, 50)


def test_the_last_layer_that_sets_num_envs_picks_the_preset() -> None:
    # A --config file asks for 4,096 envs and a --set after it for 64: the CPU preset.
    config = train_config("Acrobot-v1", [ppo_envs(4096), ppo_envs(64)])
    assert (config.ppo.num_envs, config.ppo.num_steps, config.total_env_steps) == (64, 256, 500_000)
    config = train_config("Acrobot-v1", [ppo_envs(64), ppo_envs(4096)])
    assert (config.ppo.num_steps, config.ppo.num_minibatches) == (32, 8)
    assert config.total_env_steps == 1920 * 4096


def test_num_envs_as_pydantic_reads_it_picks_the_preset() -> None:
    # A YAML file may say 4096.0, a JSON spec "4096": both are 4,096 envs to the run config.
    for written in (4096.0, "4096"):
        config = train_config("CartPole-v1", [ppo_envs(written)])  # type: ignore[arg-type]
        assert (config.ppo.num_envs, config.ppo.num_minibatches) == (4096, 4)


def test_a_bad_num_envs_is_a_named_validation_error_not_a_crash() -> None:
    with pytest.raises(ValidationError, match="ppo.num_envs"):
        train_config("CartPole-v1", [ppo_envs("many")])  # type: ignore[arg-type]


def test_a_pod_pinning_num_envs_gets_the_large_batch_preset() -> None:
    spec = ExperimentSpec.model_validate(
        {
            "name": "pendulum-gpu",
            "env": {"name": "Pendulum-v1"},
            "algorithms": {"ppo": 1},
            "search_space": {
                "num_envs": {"type": "choice", "values": [4096]},
                "learning_rate": {"type": "log_uniform", "low": 3e-4, "high": 3e-3},
            },
        }
    )
    config = pod_config(spec, {"num_envs": 4096, "learning_rate": 2e-3}, seed=3)
    assert isinstance(config, PPORunConfig)
    assert (config.ppo.num_envs, config.ppo.learning_rate, config.ppo.num_steps) == (4096, 2e-3, 16)
    assert config.eval_every_steps == 32 * 4096
    assert config.ppo.anneal_lr is False  # the pod's default still applies
    small = pod_config(spec, {"num_envs": 128, "learning_rate": 2e-3}, seed=3)
    assert (small.eval_every_steps, small.total_env_steps) == (8192, 100_000)


def test_a_population_spec_trains_the_preset_its_num_envs_picks_gsde_included() -> None:
    # Pendulum's large-batch preset keeps gSDE: a population trains it as one agent does (its
    # noise matrices are per agent and env in the batched state), so the spec is accepted.
    spec = {
        "name": "pendulum-pop",
        "env": {"name": "Pendulum-v1"},
        "algorithms": {"ppo": 1},
        "population": {"agents_per_pod": 4},
        "search_space": {"num_envs": {"type": "choice", "values": [4096]}},
    }
    ExperimentSpec.model_validate(spec)
    config = pod_config(ExperimentSpec.model_validate(spec), {"num_envs": 4096}, seed=3)
    assert isinstance(config, PPORunConfig) and config.ppo.sde_sample_freq == 4
    spec["search_space"]["sde_sample_freq"] = {"type": "choice", "values": [0]}
    ExperimentSpec.model_validate(spec)


def test_every_large_batch_section_is_well_formed_and_valid() -> None:
    """Each section: a threshold, no ``num_envs`` of its own (the run's picks the section), only
    run-config fields and the budget rules, and a valid run config at its threshold."""
    sections = 0
    for (algorithm, env), text in sorted(preset_files().items()):
        section = yaml.safe_load(text).get(LARGE_BATCH)
        if section is None:
            assert card(algorithm).large_batch_from(env) is None
            continue
        sections += 1
        threshold = card(algorithm).large_batch_from(env)
        assert isinstance(threshold, int) and threshold >= 2
        assert "num_envs" not in {**section, **section.get(algorithm, {})}, (
            f"{algorithm} {env}: a section may not set num_envs (the run's picks the section)"
        )
        assert LARGE_BATCH not in card(algorithm).preset(env)  # the file without its section
        at = preset(algorithm, env, [ppo_envs(threshold)])
        assert at != preset(algorithm, env), f"{algorithm} {env}: the section changes nothing"
        assert not set(PER_ENV_FIELDS) & set(at)
        config = train_config(env, [{"algorithm": algorithm}, ppo_envs(threshold)])
        assert config.ppo.num_envs == threshold
        assert config.total_env_steps >= 10 * config.ppo.batch_size
    assert sections >= len(BUILT_IN)


def test_per_env_budgets_scale_with_the_env_count() -> None:
    section = {"min_num_envs": 8, "total_env_steps_per_env": 100, "ppo": {"num_steps": 4}}
    assert large_batch_layer(section, 7) == {}
    assert large_batch_layer(section, None) == {}
    # A run of the section is expected to use its budget (compile: auto weighs it).
    assert large_batch_layer(section, 10) == {
        "total_env_steps": 1000,
        "expected_env_steps": 1000,
        "ppo": {"num_steps": 4},
    }


def test_an_unknown_algorithm_is_still_refused_by_name() -> None:
    with pytest.raises(HyperparameterError, match="'nope'"):
        train_config("CartPole-v1", [{"algorithm": "nope"}, ppo_envs(4096)])


#: (env, num_envs) → (seed, env-step budget to the threshold): docs/benchmarks.md, "Presets for
#: accelerator-sized batches" (seeds 0-4 at 1,024 envs, 0-1 at 4,096; seed 0 is CartPole's
#: slowest at 1,024). Each trains as ``podium train ENV --set ppo.num_envs=N`` does: every
#: built-in env at the threshold, and CartPole and Pendulum at 4,096 envs; seconds
#: to tens of seconds each on one core.
LEARNING = {
    ("CartPole-v1", 1024): (0, 655_360),  # measured 524,288
    ("Pendulum-v1", 1024): (0, 327_680),  # measured 229,376
    ("Acrobot-v1", 1024): (0, 393_216),  # measured 327,680
    ("MountainCarContinuous-v0", 1024): (0, 491_520),  # measured 327,680 (seeds 0-4: <= 393,216)
    ("CartPole-v1", 4096): (0, 655_360),  # measured 524,288 (8 updates; seeds 0-4 alike)
    ("Pendulum-v1", 4096): (0, 983_040),  # measured 655,360 (10 updates; seeds 0-3: <= 16)
}


def _learning(env: str, num_envs: int) -> Any:
    # Pendulum at 4,096 envs takes minutes on one core: nightly (1,024 envs stays in CI).
    marks = [pytest.mark.nightly] if (env, num_envs) == ("Pendulum-v1", 4096) else []
    return pytest.param(env, num_envs, id=f"{env}-{num_envs}", marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize(("env", "num_envs"), [_learning(*case) for case in LEARNING])
def test_the_large_batch_preset_solves(env: str, num_envs: int) -> None:
    seed, budget = LEARNING[env, num_envs]
    config = train_config(env, [{"seed": seed}, ppo_envs(num_envs)])
    assert config.ppo.num_envs == num_envs
    assert config.eval_every_steps == 2 * config.ppo.batch_size
    # The preset's own budget (60 updates) stays: PPO anneals its learning rate over it, so a
    # shorter one would train another schedule than the user's. The run stops at the target.
    assert config.total_env_steps >= budget
    result = train(config)
    target = target_return(env)
    assert result.best is not None and target is not None
    assert result.solved_at_env_steps is not None, (
        f"{env} at {num_envs:,} envs: best eval {result.best.mean:.1f} < {target}"
    )
    assert result.solved_at_env_steps <= budget, (
        f"{env} at {num_envs:,} envs: solved after {result.solved_at_env_steps:,} > {budget:,}"
    )
