"""PBT inside a population pod (``population.exploit``): the pod ranks its agents and copies
the winners into the losers' slots in place, with explored hyperparameters, and reports each
copy as a child of its source's last candidate. Against the real leaderboard, as
tests/pod/test_population_runtime.py."""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from services.contracts.search_space import SearchSpace, sample_space
from services.contracts.spec import ExperimentSpec
from services.contracts.strategies import PopulationExploit
from services.pod.runtime.in_pod_pbt import InPodPBT
from services.pod.runtime.metrics import PodMetrics
from services.pod.training.presets import pod_config
from services.pod.training.trainer import build_trainer
from tests.pod.harness import Leaderboard, register, runtime

P = 4
SPACE = {
    # Wide enough that the agents differ after a few updates.
    "learning_rate": {"type": "log_uniform", "low": 1e-4, "high": 3e-2},
    "ent_coef": {"type": "uniform", "low": 0.0, "high": 0.02},
}


def make_spec(exploit: dict[str, Any] | None, **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "pbt-in-pod",
        "env": {"name": "CartPole-v1"},
        "algorithms": {"ppo": 1.0},
        "search_space": SPACE,
        "generator": {"strategy": "random"},  # no PBT across pods: only the pod's own
        "population": {"agents_per_pod": P, "exploit": exploit},
        "round": {"env_steps": 1024},
        "evaluation": {"episodes": 4},
        "top_k": 64,
    }
    spec.update(over)
    return spec


# -- the spec ---------------------------------------------------------------------------------
def test_the_spec_takes_the_leaderboards_pbt_options_with_in_pod_defaults() -> None:
    spec = ExperimentSpec.model_validate(
        make_spec({"every_env_steps": 4096, "pbt": {"quantile": 0.5, "perturb_factors": [0.5]}})
    )
    rule = spec.population.exploit
    assert rule is not None and rule.by == "train_return"
    assert rule.pbt.quantile == 0.5 and rule.pbt.perturb_factors == (0.5,)
    # Unset: a quarter replaced at each decision, every agent judged from the first one.
    assert rule.pbt.truncation == 0.25 and rule.pbt.ready_env_steps == 0
    assert ExperimentSpec.model_validate(make_spec(None)).population.exploit is None


def test_a_spec_with_pbt_in_the_pod_reads_back_as_it_was_written() -> None:
    """The orchestrator stores a spec as JSON and hands a pod its JSON: what is dumped must
    validate again (the options a pod cannot use are refused when given, never dumped)."""
    pbt = {"quantile": 0.5, "perturb_factors": [0.5]}
    spec = ExperimentSpec.model_validate(make_spec({"every_env_steps": 4096, "pbt": pbt}))
    again = ExperimentSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert ExperimentSpec.model_validate(spec.model_dump(mode="json")) == spec


@pytest.mark.parametrize(
    ("population", "words"),
    [
        ({"agents_per_pod": 1, "exploit": {"every_env_steps": 10}}, "agents_per_pod >= 2"),
        ({"agents_per_pod": 4, "exploit": {}}, "every_env_steps"),
        ({"agents_per_pod": 4, "exploit": {"every_env_steps": 0}}, "every_env_steps"),
        ({"agents_per_pod": 4, "exploit": {"every_env_steps": 8, "growth": 0.5}}, "growth"),
        (
            {"agents_per_pod": 4, "exploit": {"every_env_steps": 10, "by": "luck"}},
            "train_return",
        ),
        (
            {"agents_per_pod": 4, "exploit": {"every_env_steps": 10, "pbt": {"ready_reports": 2}}},
            "ready_reports does not apply here",
        ),
        (
            {"agents_per_pod": 4, "exploit": {"every_env_steps": 10, "pbt": {"quantile": 2}}},
            "quantile",
        ),
    ],
)
def test_an_exploit_that_cannot_be_honoured_is_refused_naming_the_field(
    population: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        ExperimentSpec.model_validate({**make_spec(None), "population": population})
    assert words in str(caught.value) and "population" in str(caught.value)


# -- the trainers' copy -----------------------------------------------------------------------
def _trainer(env: str, algorithm: str, space: dict[str, dict[str, Any]], p: int = 3) -> Any:
    spec = ExperimentSpec.model_validate(
        {
            "name": "copy",
            "env": {"name": env},
            "algorithms": {algorithm: 1.0},
            "search_space": space,
            "population": {"agents_per_pod": p},
        }
    )

    def config(values: dict[str, Any], seed: int) -> Any:
        # Eager: these tests are about what a copy moves, not about compiling.
        eager = {"compile": "off"} if algorithm != "portfolio_gradient" else {}
        return pod_config(spec, {**values, **eager}, seed, "cpu", 1)

    configs = [config({k: (i + 1) * d["high"] / p for k, d in space.items()}, i) for i in range(p)]
    return build_trainer(configs), config


def test_a_ppo_population_copies_an_agent_in_place_with_new_hyperparameters() -> None:
    trainer, config = _trainer("CartPole-v1", "ppo", {"learning_rate": SPACE["learning_rate"]})
    for _ in range(2):
        trainer.step()
    state, hp = trainer.population.state, trainer.population.hp
    tensors = {k: v for k, v in state.items() if k in ("params", "exp_avg", "obs_mean")}
    before = {k: v.clone() for k, v in tensors.items()}
    objects = {k: v.data_ptr() for k, v in state.items()}
    assert not torch.equal(before["params"][0], before["params"][2])
    trainer.copy(0, 2, config({"learning_rate": 0.0123}, 0))
    for k in tensors:
        assert torch.equal(state[k][0], before[k][2]), k  # agent 2's weights, moments, statistics
        assert torch.equal(state[k][1:], before[k][1:]), k  # the others untouched
    assert float(hp["learning_rate"][0]) == pytest.approx(0.0123)
    assert float(hp["learning_rate"][2]) == pytest.approx(trainer.config(2).ppo.learning_rate)
    assert trainer.config(0).ppo.learning_rate == 0.0123
    # In place: the programs' tensors are the same objects (nothing to compile again).
    assert {k: v.data_ptr() for k, v in state.items()} == objects
    trainer.step()  # and it trains on
    trainer.close()


@pytest.mark.parametrize(("env", "algorithm"), [("Pendulum-v1", "sac"), ("CartPole-v1", "dqn")])
def test_an_off_policy_population_copies_weights_moments_and_replay(
    env: str, algorithm: str
) -> None:
    trainer, config = _trainer(env, algorithm, {"learning_rate": SPACE["learning_rate"]})
    first = trainer.config(0)
    for _ in range(first.learning_starts // first.num_envs + 8):
        trainer.step()
    stack, replay = trainer.population, trainer.replay
    flats = {g: f.clone() for g, f in stack.flats.items()}
    moments = {g: a.moments.clone() for g, a in stack.adams.items()}
    obs = replay.obs.clone()
    assert not torch.equal(obs[1], obs[2])
    trainer.copy(1, 2, config({"learning_rate": 0.0042}, 1))
    for g in flats:
        assert torch.equal(stack.flats[g][1], flats[g][2]), g
        assert torch.equal(stack.flats[g][0], flats[g][0]), g
    for g in moments:
        assert torch.equal(stack.adams[g].moments[:, 1], moments[g][:, 2]) or torch.equal(
            stack.adams[g].moments[1], moments[g][2]
        ), g
    assert torch.equal(replay.obs[1], obs[2]) and int(replay.filled[1]) == int(replay.filled[2])
    assert float(stack.hp["learning_rate"][1]) == pytest.approx(0.0042)
    assert trainer.config(1).agent_config.learning_rate == 0.0042
    trainer.step()
    trainer.close()


def test_a_portfolio_gradient_population_copies_scorer_and_moments_in_place() -> None:
    space = {
        "learning_rate": {"type": "log_uniform", "low": 0.02, "high": 0.1},
        "l2": {"type": "uniform", "low": 0.0, "high": 1e-2},
    }
    trainer, config = _trainer("StockTrading-v0", "portfolio_gradient", space)
    for _ in range(3):
        trainer.step()
    adam, learner = trainer.learner.adam, trainer.learner
    params, moments = trainer.policy.params.clone(), adam.moments.clone()
    objects = (trainer.policy.params.data_ptr(), adam.moments.data_ptr(), adam.lr.data_ptr())
    assert not torch.equal(params[0], params[2])
    recent = trainer.recent_returns()  # each agent's train Sharpe: what PBT ranks by default
    assert len(recent) == 3 and len(set(recent)) == 3
    trainer.copy(0, 2, config({"learning_rate": 0.0321, "l2": 0.004}, 0))
    assert torch.equal(trainer.policy.params[0], params[2])
    assert torch.equal(adam.moments[:, 0], moments[:, 2]) and adam.steps[0] == adam.steps[2]
    assert torch.equal(trainer.policy.params[1:], params[1:])  # the others untouched
    assert float(adam.lr[0]) == pytest.approx(0.0321) and float(learner.l2[0]) == 0.004
    assert trainer.config(0).portfolio_gradient.learning_rate == 0.0321
    assert (trainer.policy.params.data_ptr(), adam.moments.data_ptr(), adam.lr.data_ptr()) == (
        objects
    )
    # Slot 0 now evaluates as slot 2 did, and trains on.
    scores = [r.mean for r in trainer.evaluate()]
    assert scores[0] == pytest.approx(scores[2])
    trainer.step()
    trainer.close()


def test_a_decision_takes_the_scores_its_caller_just_took() -> None:
    """``select(..., scores)`` ranks by the caller's scores (a round's evaluation, not taken
    again): the slot they put last becomes a copy of one they put first."""
    space = {"learning_rate": {"type": "log_uniform", "low": 0.02, "high": 0.1}}
    trainer, config = _trainer("StockTrading-v0", "portfolio_gradient", space, p=4)
    trainer.step()
    rule = PopulationExploit(every_env_steps=1, by="evaluation")
    pbt = InPodPBT(rule, TypeAdapter(SearchSpace).validate_python(space), 4, "s")
    hps = [{"learning_rate": trainer.config(i).portfolio_gradient.learning_rate} for i in range(4)]
    given = [5.0, -5.0, 1.0, 0.0]  # not what an evaluation would say
    copies = pbt.select(trainer, hps, [0] * 4, lambda h, src, dst: config(h, dst), given)
    assert [(c.dst, c.src, c.scores) for c in copies] == [(1, 0, given)]
    assert torch.equal(trainer.policy.params[1], trainer.policy.params[0])
    trainer.close()


def test_a_copys_config_reads_its_preset_from_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each copy's config is built from the preset again: parsing the preset's YAML for
    every copy took over 90% of a decision (10% of a 32-agent CartPole pod deciding every
    1,024 env steps). It is parsed once per process, and a config never changes the next."""
    import yaml

    from services.contracts.algorithms import card as cards

    spec = ExperimentSpec.model_validate(make_spec(None))
    first = pod_config(spec, {"learning_rate": 1e-3}, 1, "cpu", 1)
    parsed: list[str] = []
    real = yaml.safe_load
    monkeypatch.setattr(cards.yaml, "safe_load", lambda text: parsed.append(text) or real(text))
    for seed in range(5):
        again = pod_config(spec, {"learning_rate": 1e-3}, 1, "cpu", 1)
        assert again == first, seed
        preset = cards.card("ppo").preset("CartPole-v1")
        preset["ppo"]["num_envs"] = -1  # the caller's copy: the next read is as shipped
    assert not parsed
    assert cards.card("ppo").preset("CartPole-v1")["ppo"]["num_envs"] > 0


def test_recent_returns_are_each_agents_own_episodes_since_the_last_read() -> None:
    trainer, _ = _trainer("CartPole-v1", "ppo", {"learning_rate": SPACE["learning_rate"]})
    assert trainer.recent_returns() == [None, None, None]
    for _ in range(3):
        trainer.step()
    first = trainer.recent_returns()
    assert all(r is not None and r > 0 for r in first)
    assert len(set(first)) == 3  # each its own, not the population's mean
    # The curves read the same episodes apart: their reading takes nothing from PBT's.
    trainer.step()
    assert trainer.progress()["train_return"] > 0
    assert all(r is not None for r in trainer.recent_returns())
    trainer.close()


# -- the pod ----------------------------------------------------------------------------------
def test_the_pod_copies_its_best_agent_into_its_worst_and_reports_it_as_a_child(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    exploit = {
        "every_env_steps": 10**9,  # decided here, by the test's call, not by the pod's clock
        "by": "evaluation",
        "pbt": {"quantile": 0.25, "truncation": 0.25, "resample_probability": 0.0},
    }
    spec = make_spec(exploit)
    register(leaderboard, "e1", spec)
    metrics = PodMetrics("e1", "pod-a")
    rt = runtime(leaderboard, "e1", spec, "pod-a", tmp_path, metrics=metrics)
    rt.start()
    rt.train_round()  # four updates: the agents' scores differ
    rt.report()  # every slot a candidate: a copy descends from its source's
    trainer = rt.trainer
    assert trainer is not None
    scores = [r.mean for r in trainer.evaluate()]
    best, worst = scores.index(max(scores)), scores.index(min(scores))
    assert scores[best] > scores[worst], scores
    weights = trainer.population.state["params"].clone()
    source = rt.slots[best]
    rt.select()
    assert metrics.exploits._value.get() == 1
    assert torch.equal(trainer.population.state["params"][worst], weights[best])
    others = [i for i in range(P) if i != worst]
    assert torch.equal(trainer.population.state["params"][others], weights[others])
    child = rt.slots[worst]
    assert child.pod_id == f"pod-a.m{worst}"
    assert (child.parent_id, child.generation) == (source.parent_id, source.generation)
    assert child.parent_id == source.candidate_id is not None
    parent_candidate = source.candidate_id  # the source's next report moves its lineage on
    # Explored over the search space: within its bounds, and what the agent trains with.
    lr = child.hyperparameters["learning_rate"]
    assert SPACE["learning_rate"]["low"] <= lr <= SPACE["learning_rate"]["high"]
    assert lr != source.hyperparameters["learning_rate"]
    assert float(trainer.population.hp["learning_rate"][worst]) == pytest.approx(lr)
    # Its next report is a child of the source's candidate, with its own hyperparameters.
    rt.train_round()
    rt.report()
    mine = [s for s in rt.submissions if s["member"] == worst][-1]
    with leaderboard.api() as api:
        board = api.get("/experiments/e1/leaderboard").json()["candidates"]
    entry = next(c for c in board if c["candidate_id"] == mine["candidate_id"])
    assert entry["parent_id"] == parent_candidate
    assert entry["hyperparameters"]["learning_rate"] == pytest.approx(lr)
    rt.close()


def test_the_pod_decides_on_its_own_clock_while_it_trains(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    spec = make_spec({"every_env_steps": 512}, round={"env_steps": 4096})
    register(leaderboard, "e2", spec)
    metrics = PodMetrics("e2", "pod-b")
    rt = runtime(leaderboard, "e2", spec, "pod-b", tmp_path, metrics=metrics)
    rt.start()
    rt.train_round()
    # Decisions at 512-step intervals inside one round of 4,096: the worst quarter (one of
    # four) replaced at each once every agent has ended an episode.
    assert metrics.exploits._value.get() >= 3
    rt.close()


# -- learning ---------------------------------------------------------------------------------
def _population_after(budget: int, rule: PopulationExploit | None, seed: int) -> list[float]:
    """Eight PPO agents on CartPole from the same eight draws of a wide search space (``seed``),
    trained ``budget`` env steps each, with the pod's PBT (``rule``) or apart: every agent's
    evaluation at the end, sorted."""
    space = {
        "learning_rate": {"type": "log_uniform", "low": 1e-5, "high": 5e-2},
        "ent_coef": {"type": "uniform", "low": 0.0, "high": 0.05},
        "gamma": {"type": "uniform", "low": 0.8, "high": 0.999},
        "clip_coef": {"type": "uniform", "low": 0.02, "high": 0.5},
    }
    p = 8
    spec = ExperimentSpec.model_validate(
        {
            "name": "learning",
            "env": {"name": "CartPole-v1"},
            "algorithms": {"ppo": 1.0},
            "search_space": space,
            "population": {"agents_per_pod": p},
        }
    )
    draws = random.Random(seed)
    hyperparameters = [sample_space(spec.search_space, draws) for _ in range(p)]

    def config(values: dict[str, Any], seed: int) -> Any:
        return pod_config(spec, {**values, "compile": "off"}, seed, "cpu", 1)

    torch.manual_seed(seed)
    trainer = build_trainer([config(h, 100 * seed + i) for i, h in enumerate(hyperparameters)])
    pbt = InPodPBT(rule, spec.search_space, p, "learning") if rule is not None else None
    built_at = [0] * p
    while trainer.env_steps < budget:
        trainer.step()
        if pbt is not None and pbt.due(trainer.env_steps):
            for c in pbt.select(trainer, hyperparameters, built_at, lambda h, s, d: config(h, d)):
                hyperparameters[c.dst], built_at[c.dst] = c.hyperparameters, trainer.env_steps
    scores = sorted(r.mean for r in trainer.evaluate())
    trainer.close()
    return scores


def test_pbt_in_the_pod_lifts_the_population_over_the_same_draws_trained_apart() -> None:
    # Three draws of the search space: one run of eight agents is chaotic (its numbers move
    # with the CPU's floating-point paths), PBT's lift over the same draws is not.
    lifts = []
    for seed in range(3):
        together = _population_after(16_384, PopulationExploit(every_env_steps=4096), seed)
        apart = _population_after(16_384, None, seed)
        # The draws that learn spread through the population: its median agent improves...
        assert statistics.median(together) > statistics.median(apart), (seed, together, apart)
        lifts.append(statistics.median(together) - statistics.median(apart))
        # ...and the best agent is not lost to a copy (an evaluation's noise aside).
        assert together[-1] >= apart[-1] - 50, (seed, together, apart)
    assert statistics.mean(lifts) >= 50, lifts


def test_growing_intervals_make_the_decisions_rungs_of_successive_halving() -> None:
    """``growth: 2`` with the halving options: decisions at 1, 3, 7 x the first interval, and at
    each the worse half of the agents becomes copies of the better half, unexplored."""
    rule = PopulationExploit(
        every_env_steps=1024,
        growth=2.0,
        by="evaluation",
        pbt={"truncation": 0.5, "quantile": 0.5, "explore": False},
    )
    trainer, _ = _trainer("CartPole-v1", "ppo", {"learning_rate": SPACE["learning_rate"]}, 4)
    pbt = InPodPBT(rule, {}, 4, "halving")
    hyperparameters = [trainer.config(i).ppo.model_dump() for i in range(4)]
    decided, copied = [], 0
    while trainer.env_steps < 8 * 1024:
        trainer.step()
        if pbt.due(trainer.env_steps):
            decided.append(trainer.env_steps)
            done = pbt.select(trainer, hyperparameters, [0] * 4, lambda h, s, d: trainer.config(s))
            for c in done:
                assert c.hyperparameters == hyperparameters[c.src] and c.how == {}
                ranked = sorted(range(4), key=lambda i: -c.scores[i])
                assert c.dst in ranked[2:] and c.src in ranked[:2]
            copied += len(done)
    # The clock starts at the first step (the pod's agents may come with counts of their own).
    start = trainer.step_env_steps
    assert decided == [start + k * 1024 for k in (1, 3, 7)], decided
    assert copied >= 2  # ties aside, each rung replaces the worse half
    trainer.close()
