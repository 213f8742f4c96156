"""The population pod (P agents in one process) against the real leaderboard.

Uvicorn on loopback with an embedded Redis, as tests/pod/test_runtime.py: every member is its
own candidate with its own hyperparameters and lineage, its training files load into a plain
single-agent PPO learner and score what the member scored, PBT's exploit puts a better
parent's weights into a member's slot, and a stop ends with a final report of every member.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from services.api_client import LeaderboardClient
from services.contracts.leaderboard import Manifest
from services.contracts.spec import ExperimentSpec
from services.pod.config import PPORunConfig
from services.pod.runtime.metrics import PodMetrics
from services.pod.runtime.rounds import HyperparameterError, PodRuntime, RuntimeSettings
from services.pod.training.checkpoint import read_files
from services.pod.training.fit import build
from services.pod.training.presets import eval_seed, pod_config
from tests.pod.harness import (
    TOKEN,
    Leaderboard,
    client,
    download,
    register,
    runtime,
    stop_after,
    submit_outside_parent,
)

P = 4


def make_spec(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "population-test",
        "env": {"name": "CartPole-v1"},
        "algorithms": {"ppo": 1.0},
        "search_space": {
            "learning_rate": {"type": "log_uniform", "low": 3e-3, "high": 1e-2},
            "ent_coef": {"type": "uniform", "low": 0.0, "high": 0.01},
        },
        "generator": {"strategy": "pbt"},
        "population": {"agents_per_pod": P},
        "round": {"env_steps": 1024},  # 4 updates of the CartPole preset per member
        "evaluation": {"episodes": 4},
        "top_k": 64,  # nothing evicted: every report stays inspectable
    }
    spec.update(over)
    return spec


def unvalidated(spec: dict[str, Any]) -> ExperimentSpec:
    """``spec`` as a pod could receive it without the API's validation: validated with one
    agent per pod, then given its population size back."""
    size = spec["population"]["agents_per_pod"]
    model = ExperimentSpec.model_validate({**spec, "population": {"agents_per_pod": 1}})
    return model.model_copy(
        update={"population": model.population.model_copy(update={"agents_per_pod": size})}
    )


def test_members_are_candidates_whose_files_load_into_a_single_agent(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    spec = make_spec()
    register(leaderboard, "e1", spec)
    rt = runtime(leaderboard, "e1", spec, "pop-a", tmp_path)
    stop_after(rt, lambda r: len(r.submissions) >= 2 * P)
    rt.close()
    with leaderboard.api() as api:
        summary = api.get("/experiments/e1").json()
        board = api.get("/experiments/e1/leaderboard").json()["candidates"]
    # Every report landed once; each member reported its own env steps.
    assert summary["submissions"] == len(rt.submissions) >= 2 * P
    assert summary["env_steps"] == sum(s["env_steps"] for s in rt.submissions) >= 2 * P * 1024
    members = {f"pop-a.m{i}" for i in range(P)}
    assert {c["pod_id"] for c in board} == members
    by_member = {pod: [c for c in board if c["pod_id"] == pod] for pod in members}
    # Each member its own hyperparameters (sampled per member), kept across its reports...
    first_lrs = set()
    for i, member in enumerate(rt.slots):
        own = by_member[member.pod_id]
        assert len(own) >= 2
        assert all(c["hyperparameters"] == member.hyperparameters for c in own)
        assert set(member.hyperparameters) == {"learning_rate", "ent_coef"}
        lr = rt.trainer.population.hyperparameters(i)["learning_rate"]
        assert lr == pytest.approx(member.hyperparameters["learning_rate"])
        first_lrs.add(lr)
        # ...and its own lineage: each report descends from the member's previous one.
        own.sort(key=lambda c: c["generation"])
        assert own[0]["parent_id"] is None and own[0]["generation"] == 0
        for before, after in itertools.pairwise(own):
            assert after["parent_id"] == before["candidate_id"]
            assert after["generation"] == before["generation"] + 1
    assert len(first_lrs) == P

    # A member's files are a single PPO pod's: they load into a plain learner, which scores
    # on the experiment's evaluation what the member scored.
    for candidate in (by_member["pop-a.m1"][-1], by_member["pop-a.m3"][0]):
        directory = download(leaderboard, candidate, tmp_path / candidate["candidate_id"])
        config = PPORunConfig.model_validate(read_files(directory).documents["hyperparameters"])
        assert config.ppo.learning_rate == pytest.approx(
            candidate["hyperparameters"]["learning_rate"]
        )
        assert config.eval_seed == eval_seed(ExperimentSpec.model_validate(spec))
        single = build(config)  # a single-agent trainer
        single.load(0, directory, config)
        assert single.env_steps >= 1024
        assert single.evaluate()[0].mean == pytest.approx(candidate["score"])

    # The pod's metrics count the members' work together; the best is the best member's.
    def sample(name: str, **labels: str) -> float:
        labels = {"experiment": "e1", "pod": "pop-a", **labels}
        value = rt.metrics.registry.get_sample_value(name, labels)
        assert value is not None, name
        return value

    assert sample("podium_pod_rounds_total") == rt.rounds >= 2
    assert sample("podium_pod_env_steps_total") == P * rt.trainer.env_steps == rt.env_steps
    assert sample("podium_pod_submissions_total") == len(rt.submissions)
    best = sample("podium_pod_best_eval_return", higher_is_better="true")
    assert best == max(c["score"] for c in board)


def test_exploit_puts_a_better_parent_into_a_members_slot(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    # Ready after one report; the parent is always the best candidate (top quantile of one);
    # every member below it restarts (the tournament rule, not PPO's bottom quarter).
    generator = {"strategy": "pbt", "options": {"ready_reports": 1, "ready_env_steps": 0}}
    generator["options"] |= {"quantile": 0.01, "truncation": None}
    spec = make_spec(generator=generator)
    register(leaderboard, "e2", spec)
    rt = runtime(leaderboard, "e2", spec, "pop-b", tmp_path)
    manifests: list[Manifest] = []  # what the generator answered, to check the leases
    generate = rt.client.generate
    rt.client.generate = lambda *a, **k: manifests.append(generate(*a, **k)) or manifests[-1]
    rt.start()
    pop = rt.trainer

    # A parent from elsewhere, trained a little (weights and Adam state of its own), on the
    # board with a score no member will reach.
    config = pod_config(ExperimentSpec.model_validate(spec), {"learning_rate": 5e-3}, 777)
    trainer = build(config)
    for _ in range(3):
        trainer.step()
    trainer.save(0, tmp_path / "parent")
    parent = trainer.agent(0)
    parent_env_steps = trainer.env_steps
    outside_id = submit_outside_parent(
        rt.client, tmp_path / "parent", "ppo", {"learning_rate": 5e-3, "ent_coef": 0.005}
    )

    rt.train_round()
    rt.report()
    assert all(m.rank != 1 for m in rt.slots)
    before = [m.hyperparameters for m in rt.slots]
    rt.maybe_exploit()
    parent_state = parent.state_dict()
    parent_steps = float(parent.optimizer.state_dict()["state"][0]["step"])
    assert parent_steps == 3 * config.ppo.update_epochs * config.ppo.num_minibatches
    for i, member in enumerate(rt.slots):
        assert member.parent_id == outside_id and member.generation == 1
        assert member.reports == 0 and member.unreported_steps == 0
        # The parent's weights, statistics and Adam state, with the explored hyperparameters.
        agent = pop.agent(i)
        for name, value in agent.state_dict().items():
            torch.testing.assert_close(value, parent_state[name], msg=name)
        assert float(pop.population.state["adam_step"][i]) == parent_steps
        for name, value in member.hyperparameters.items():
            assert pop.population.hyperparameters(i)[name] == pytest.approx(value)
        assert member.hyperparameters != before[i]
    # Trained on, the members report as the parent's children, with its counters going on.
    rt.train_round()
    rt.report()
    rt.close()
    with leaderboard.api() as api:
        board = api.get("/experiments/e2/leaderboard").json()["candidates"]
        # Every parent's lease was released once its files were loaded (or not wanted).
        leases = [m.lease_id for m in manifests if m.lease_id]
        assert len(leases) == P
        for lease in leases:
            assert api.delete(f"/experiments/e2/leases/{lease}").status_code == 404
    children = [c for c in board if c["parent_id"] == outside_id]
    assert {c["pod_id"] for c in children} == {m.pod_id for m in rt.slots}
    assert all(c["generation"] == 1 for c in children)
    directory = download(leaderboard, children[0], tmp_path / "child")
    counters = read_files(directory).documents["counters"]
    assert counters["env_steps"] == parent_env_steps + 1024


def test_stop_makes_a_final_report_of_every_member(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """Stopped between reports (as by SIGTERM's handler, in the loop's own thread), the pod
    reports every member once more, with the steps trained since their last report."""
    spec = make_spec(evaluation={"episodes": 4, "every_rounds": 2}, round={"env_steps": 512})
    register(leaderboard, "e3", spec)

    class StopAfterThirdRound(PodMetrics):
        def round_done(self, env_steps: int, updates: int, seconds: float) -> None:
            super().round_done(env_steps, updates, seconds)
            if rt.rounds == 3:
                rt.stop()

    metrics = StopAfterThirdRound("e3", "pop-c")
    rt = runtime(leaderboard, "e3", spec, "pop-c", tmp_path, metrics=metrics)
    thread = threading.Thread(target=rt.run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    rt.close()
    assert rt.rounds == 3
    assert [s["final"] for s in rt.submissions] == [False] * P + [True] * P
    assert [s["env_steps"] for s in rt.submissions] == [1024] * P + [512] * P
    assert {s["member"] for s in rt.submissions[P:]} == set(range(P))
    assert all(m.unreported_steps == 0 for m in rt.slots)
    with leaderboard.api() as api:
        summary = api.get("/experiments/e3").json()
    assert summary["submissions"] == 2 * P and summary["env_steps"] == 3 * 512 * P


def test_a_rounds_seconds_wait_for_its_steps_to_be_done(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """The pod's round seconds (its env steps/s metric, the board's train_seconds) count
    until the trainer's steps are done (``Trainer.wait``), not only their launches on a
    device that runs them asynchronously."""
    spec = make_spec(round={"env_steps": 512})
    register(leaderboard, "e5", spec)
    rt = runtime(leaderboard, "e5", spec, "pop-e", tmp_path)
    rt.start()
    waited: list[float] = []

    def finishing() -> None:  # a device still running the launched steps
        time.sleep(0.3)
        waited.append(0.3)

    rt.trainer.wait = finishing
    rt.train_round()
    assert waited == [0.3] and rt.train_seconds >= 0.3
    rt.close()


def test_a_population_trains_gsde_as_one_agent_does(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """Pendulum's preset explores with gSDE: a population pod trains it (each agent's noise
    matrices are its own rows of the batched state), so the spec is accepted and a round
    trains and reports every member."""
    spec = make_spec(
        name="population-pendulum",
        env={"name": "Pendulum-v1"},
        search_space={"gamma": {"type": "uniform", "low": 0.9, "high": 0.95}},
        population={"agents_per_pod": 2},
        round={"env_steps": 2048},
        evaluation={"episodes": 2},
    )
    ExperimentSpec.model_validate(spec)
    register(leaderboard, "e4", spec)
    settings = RuntimeSettings(work_dir=tmp_path / "pop-d", grace_s=10)
    rt = PodRuntime(
        "e4", "pop-d", ExperimentSpec.model_validate(spec), client(leaderboard, "e4"), settings
    )
    rt.start()
    assert all(c.ppo.sde_sample_freq == 4 for c in rt.trainer.configs)
    rt.train_round()
    rt.report()
    rt.close()
    assert len(rt.submissions) == 2


def test_a_pinned_shared_setting_lets_a_population_train_a_gsde_preset(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """A one-value choice is a setting every agent shares, so a population may pin any PPO
    setting: ``sde_sample_freq: [0]`` trains Pendulum's preset without gSDE, the pinned value
    in every member's config and candidates, the searched one per member."""
    spec = make_spec(
        name="population-pendulum-pinned",
        env={"name": "Pendulum-v1"},
        search_space={
            "gamma": {"type": "uniform", "low": 0.9, "high": 0.95},
            "sde_sample_freq": {"type": "choice", "values": [0]},
        },
        population={"agents_per_pod": 2},
        round={"env_steps": 2048},
        evaluation={"episodes": 2},
    )
    register(leaderboard, "e5", spec)
    rt = runtime(leaderboard, "e5", spec, "pop-e", tmp_path)
    stop_after(rt, lambda r: len(r.submissions) >= 2)
    rt.close()
    configs = [rt.trainer.config(i).ppo for i in range(2)]
    assert [c.sde_sample_freq for c in configs] == [0, 0]
    assert configs[0].gamma != configs[1].gamma
    with leaderboard.api() as api:
        board = api.get("/experiments/e5/leaderboard").json()["candidates"]
    assert {c["pod_id"] for c in board} == {"pop-e.m0", "pop-e.m1"}
    assert all(c["hyperparameters"]["sde_sample_freq"] == 0 for c in board)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"search_space": {"hidden_sizes": {"type": "choice", "values": [[32], [64]]}}},
            "'hidden_sizes' cannot vary within a population.*learning_rate, ent_coef",
        ),
        (
            {"search_space": {"num_envs": {"type": "int_uniform", "low": 8, "high": 16}}},
            "'num_envs' cannot vary",
        ),
    ],
)
def test_what_a_population_cannot_vary_is_refused(change: dict, message: str) -> None:
    # A submitted spec is refused at validation (a 422 naming the field) ...
    with pytest.raises(ValidationError, match=message):
        ExperimentSpec.model_validate(make_spec(**change))
    # ... and the pod refuses it too, should one reach it unvalidated.
    unreachable = LeaderboardClient("http://127.0.0.1:9", "e", TOKEN)
    with pytest.raises(HyperparameterError, match=message):
        PodRuntime("e", "p", unvalidated(make_spec(**change)), unreachable)
    unreachable.close()
