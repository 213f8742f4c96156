"""The stock-trading tournament: selection on the validation period only, and that it learns."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from services.contracts.algorithms.ppo.config import PPOConfig
from services.contracts.strategies import PBTOptions, population_exploits
from services.pod.trading.backtest import metrics
from services.pod.trading.local_tournament import LOCAL_PBT
from services.pod.trading.market import MarketData, synthetic_market
from services.pod.trading.tournament import TournamentPlan, evaluate_market
from tests.pod.harness import run_fresh_python

ENV = {
    "validation_fraction": 0.2,
    "action_mode": "weights",
    "turbulence": True,
    "transaction_cost": 0.001,
    "rebalance_band": 0.01,
    "episode_length": 63,
}
HPS = [{"learning_rate": 3e-4}, {"learning_rate": 1e-3}]


def _with_other_backtest(data: MarketData, backtest_days: int) -> MarketData:
    """``data`` with every price of the last ``backtest_days`` days changed (a crash)."""
    close = data.close.copy()
    close[-backtest_days:] *= np.linspace(1.0, 0.3, backtest_days)[:, None]
    return MarketData.from_ohlcv(
        data.dates, data.tickers, data.open, np.maximum(data.high, close),
        np.minimum(data.low, close), close, data.volume,
    )  # fmt: skip


@pytest.mark.parametrize("simulated", [0, 2])
def test_training_and_selection_never_read_the_backtest_period(simulated: int) -> None:
    """Two markets equal up to the backtest period and different in it: the tournament trains
    and keeps exactly the same agent on both; only the backtest report differs. With
    simulated markets, theirs differ after their train periods too (nothing reads those)."""
    data = synthetic_market(4, num_stocks=3, num_days=600, regime="trend")
    other = _with_other_backtest(data, 120)  # the default split leaves the last 20% = 120
    replicas = [
        synthetic_market(4, num_stocks=3, num_days=600, regime="trend", replica=k)
        for k in range(simulated)
    ]
    changed = [_with_other_backtest(m, 240) for m in replicas]  # validation and backtest
    ppo = PPOConfig(num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2)
    torch.manual_seed(0)
    reports = [
        evaluate_market(d, ENV, TournamentPlan(ppo, HPS, rounds=2, round_env_steps=128, seed=1), m)
        for d, m in ((data, replicas), (other, changed))
    ]
    a, b = (r.tournament for r in reports)
    assert a.history == b.history and (a.slot, a.round) == (b.slot, b.round)
    for x, y in zip(a.agent.state_dict().values(), b.agent.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y)
    assert reports[0].backtest_dates[0] == data.dates[480]
    assert not np.allclose(
        reports[0].backtest_values["buy-and-hold"], reports[1].backtest_values["buy-and-hold"]
    )
    # The kept snapshot is the best of every (agent, round) on the validation period.
    assert a.validation_sharpe == max(max(scores) for scores in a.history)
    assert a.history[a.round][a.slot] == a.validation_sharpe
    with pytest.raises(ValueError, match="validation period"):
        evaluate_market(data, {**ENV, "validation_fraction": 0.0}, TournamentPlan(ppo, HPS, 1, 128))


def _easy_market(days: int = 1000, stocks: int = 3) -> MarketData:
    """Prices that swing around a flat level (log-deviation AR(1), φ = 0.8, std 8%): holding
    earns nothing on average, buying below the moving average and selling above it does."""
    rng = np.random.default_rng(7)
    x = np.zeros((days, stocks))
    for t in range(1, days):
        x[t] = 0.8 * x[t - 1] + rng.normal(0.0, 0.08 * np.sqrt(1 - 0.8**2), stocks)
    close = 50.0 * np.exp(x + 0.0002 * np.arange(days)[:, None])
    dates = np.busday_offset(np.datetime64("2015-01-02"), np.arange(days), roll="forward")
    return MarketData.from_ohlcv(
        dates, ("A", "B", "C"), close, close * 1.005, close * 0.995, close, np.ones_like(close)
    )


def test_on_round_reports_every_round_as_it_ends() -> None:
    """A benchmark's clock: ``on_round`` gets each round's validation Sharpe ratios, the
    leaderboard the tournament keeps, before the next round trains."""
    data = synthetic_market(2, num_stocks=3, num_days=600, regime="crash")
    ppo = PPOConfig(num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2)
    seen: list[tuple[int, list[float], int]] = []
    updates = 0

    def count(*_: object) -> None:
        nonlocal updates
        updates += 1

    plan = TournamentPlan(ppo, HPS, rounds=3, round_env_steps=128, seed=1)
    with pytest.MonkeyPatch.context() as mp:
        from services.pod.roles.learner import PPOLearner

        iterate = PPOLearner.iterate
        mp.setattr(PPOLearner, "iterate", lambda self, *a: (count(), iterate(self, *a))[1])
        report = evaluate_market(
            data, ENV, plan, on_round=lambda r, scores: seen.append((r, scores, updates))
        )
    history = report.tournament.history
    assert [(r, s) for r, s, _ in seen] == list(enumerate(history)) and len(history) == 3
    per_round = 128 // (4 * 16)
    assert [u for _, _, u in seen] == [per_round, 2 * per_round, 3 * per_round]


def test_a_pod_of_the_spec_scores_on_the_validation_period_as_the_tournament() -> None:
    """``evaluation.env_kwargs`` {mode: validation, score: sharpe}: a pod trains on the train
    period and its evaluator ranks agents by their validation Sharpe ratio, the very score the
    in-process tournament keeps snapshots by (``validation_sharpes``)."""
    from services.contracts.spec import ExperimentSpec
    from services.pod.trading.tournament import PERIOD_KWARGS, validation_sharpes
    from services.pod.training.onpolicy import OnPolicyTrainer
    from services.pod.training.presets import pod_config
    from tests.pod.harness import make_spec

    on_validation = {"mode": "validation", "score": "sharpe"}
    spec = ExperimentSpec.model_validate(
        make_spec(
            env={"name": "StockTrading-v0", "kwargs": {"regime": "crash", "num_stocks": 3}},
            evaluation={"episodes": 1, "env_kwargs": on_validation},
        )
    )
    small = {"num_envs": 4, "num_steps": 16, "num_minibatches": 2}
    configs = [pod_config(spec, {**small, **hps}, seed=1 + i) for i, hps in enumerate(HPS)]
    assert configs[0].eval_env_kwargs == on_validation
    train_env, eval_env = configs[0].make_envs(2)
    assert (train_env.mode, eval_env.mode, eval_env.score) == ("train", "validation", "sharpe")
    assert eval_env.data.dates[0] > train_env.data.dates[-1]
    # A population pod of two agents: its trainer builds the population's evaluation env.
    trainer = OnPolicyTrainer(configs)
    trainer.step()
    scores = [r.mean for r in trainer.evaluate()]
    env_kwargs = configs[0].env_kwargs
    kwargs = {k: v for k, v in env_kwargs.items() if k not in PERIOD_KWARGS}
    expected = validation_sharpes(trainer.population, eval_env.data, kwargs)
    assert scores == pytest.approx(expected, rel=1e-6)  # the evaluator sums in float32
    assert len(set(scores)) == 2  # two agents, two scores
    trainer.close()


@pytest.mark.slow
def test_tournament_beats_buy_and_hold_on_an_easy_market() -> None:
    """On a strongly mean-reverting market a small tournament's kept agent has a higher
    held-out Sharpe than buy-and-hold and equal weight, costs paid (env-step budget:
    2 agents x 3 rounds x 16,384 steps)."""
    torch.set_num_threads(1)
    data = _easy_market()
    ppo = PPOConfig(
        num_envs=16, num_steps=64, num_minibatches=4, update_epochs=5, gamma=0.97,
        norm_obs=True, norm_reward=True, log_std_init=-0.5,
    )  # fmt: skip
    plan = TournamentPlan(ppo, HPS, rounds=3, round_env_steps=16_384, seed=0)
    report = evaluate_market(data, {**ENV, "episode_length": 252}, plan)
    sharpe = {k: metrics(v).sharpe for k, v in report.backtest_values.items()}
    assert sharpe["agent"] > sharpe["buy-and-hold"] + 0.2, sharpe
    assert sharpe["agent"] > sharpe["equal weight"], sharpe


def test_simulated_markets_are_trained_on() -> None:
    """The same tournament with and without a simulated market trains different agents."""
    data = synthetic_market(4, num_stocks=3, num_days=600, regime="trend")
    replica = synthetic_market(4, num_stocks=3, num_days=600, regime="trend", replica=0)
    ppo = PPOConfig(num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2)
    plan = TournamentPlan(ppo, HPS, rounds=1, round_env_steps=256, seed=1)
    alone, simulated = (evaluate_market(data, ENV, plan, m) for m in ([], [replica]))
    assert alone.tournament.history != simulated.tournament.history


def test_a_tournament_builds_no_optimiser_it_never_steps() -> None:
    """The population steps its agents with its own batched Adam, exploits by copying slots
    and keeps its snapshots to backtest: a whole tournament with PBT in a fresh process
    builds no torch.optim optimiser, so it never imports torch._dynamo (~1 CPU s: a
    tournament's own wall time, docs/benchmarks.md)."""
    code = (
        "import sys\n"
        "from services.contracts.algorithms.ppo.config import PPOConfig\n"
        "from services.pod.trading.market import synthetic_market\n"
        "from services.pod.trading.tournament import TournamentPlan, evaluate_market\n"
        f"env = {ENV!r}\n"
        "data = synthetic_market(2, num_stocks=3, num_days=600, regime='crash')\n"
        "ppo = PPOConfig(num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2)\n"
        "hps = [{'learning_rate': 1e-4 * (i + 1)} for i in range(4)]\n"
        "plan = TournamentPlan(ppo, hps, rounds=3, round_env_steps=128, seed=1)\n"
        "report = evaluate_market(data, env, plan)\n"
        "assert len(report.tournament.history) == 3\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
    )
    run_fresh_python(code)


def test_pbt_in_process_is_the_leaderboards_decision() -> None:
    """``population_exploits``: the bottom ``truncation`` share (at least one agent, as the
    leaderboard's ``in_bottom``) restarts from a parent of the top ``quantile``, only from a
    better one (by more than ``exploit_margin``), worst agent first."""
    rng = random.Random(0)
    scores = [0.1, 0.5, 0.3, -0.2]
    assert population_exploits(scores, LOCAL_PBT, rng) == [(3, 1)]
    assert population_exploits(scores[:2], LOCAL_PBT, rng) == [(0, 1)]  # P = 2: one replaced
    eight = [0.0, 0.7, 0.1, 0.6, -0.3, 0.2, 0.3, -0.1]
    pairs = population_exploits(eight, LOCAL_PBT, rng)
    assert [a for a, _ in pairs] == [4, 7] and {p for _, p in pairs} <= {1, 3}
    every = PBTOptions()  # the leaderboard's default: any agent below the best
    assert population_exploits(scores, every, rng) == [(3, 1), (0, 1), (2, 1)]
    assert population_exploits([0.2] * 4, LOCAL_PBT, rng) == []  # no better parent
    margin = PBTOptions(truncation=0.25, exploit_margin=0.8)
    assert population_exploits(scores, margin, rng) == []
    lower = population_exploits([1.0, 3.0, 2.0, 0.5], LOCAL_PBT, rng, higher_is_better=False)
    assert lower == [(1, 3)]
    # The in-process default is the leaderboard's PBT with the worst quarter replaced.
    assert LOCAL_PBT.perturb_factors == PBTOptions().perturb_factors == (0.8, 1.2)
    assert LOCAL_PBT.quantile == PBTOptions().quantile and LOCAL_PBT.truncation == 0.25


@pytest.mark.parametrize("factors", [None, (3.0,)])
def test_the_tournaments_exploit_copies_the_parent_and_explores_by_the_options(factors) -> None:
    """After a round the worst agent takes the leader's agent and every per-agent
    hyperparameter, with the learning rate and entropy coefficient each times one of the plan's
    ``perturb_factors`` (the leaderboard's 0.8 / 1.2 by default); the others keep theirs."""
    data = synthetic_market(4, num_stocks=3, num_days=600, regime="trend")
    ppo = PPOConfig(num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2)
    hps = [
        {"learning_rate": 1e-4 * (i + 1), "ent_coef": 0.01 * (i + 1), "gamma": 0.9 + 0.02 * i}
        for i in range(4)
    ]
    pbt = LOCAL_PBT if factors is None else PBTOptions(truncation=0.25, perturb_factors=factors)
    plan = TournamentPlan(ppo, hps, rounds=2, round_env_steps=128, seed=1, pbt=pbt)
    result = evaluate_market(data, ENV, plan).tournament
    first = result.history[0]
    loser, leader = int(np.argmin(first)), int(np.argmax(first))
    configs = [agent.config for agent in result.final_agents]
    assert configs[loser].gamma == hps[leader]["gamma"]
    for name in ("learning_rate", "ent_coef"):
        factor = getattr(configs[loser], name) / hps[leader][name]
        assert any(factor == pytest.approx(f) for f in pbt.perturb_factors), (name, factor)
    for i in set(range(4)) - {loser}:
        assert configs[i].learning_rate == hps[i]["learning_rate"]
        assert configs[i].gamma == hps[i]["gamma"]
