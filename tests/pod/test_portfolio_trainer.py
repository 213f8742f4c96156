"""The portfolio gradient as a pod algorithm (services/pod/trading/portfolio_trainer.py): the
agent a pod trains is portfolio_gradient.py's learner's, its score is its backtest Sharpe on the
validation period, its training files round-trip (PBT's exploit), and what it cannot train is
refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from services.contracts.spec import ExperimentSpec
from services.contracts.training_files import CheckpointError
from services.pod.trading.backtest import backtest_candidate, metrics, run_backtest
from services.pod.trading.env import StockTradingEnv, market_periods
from services.pod.trading.portfolio_gradient import (
    FeatureLayout,
    PeriodData,
    PortfolioLearner,
    PortfolioPolicy,
)
from services.pod.trading.portfolio_trainer import PortfolioRunConfig, PortfolioTrainer
from services.pod.training.checkpoint import read_files, tensor_bytes, write_files
from services.pod.training.fit import build, train
from services.pod.training.presets import train_config

#: A short trend market: 600 days, so a step reads 360 train days.
MARKET = {"regime": "trend", "market_seed": 2, "num_days": 600}
MARKET_ARGS = ("market_seed", "num_stocks", "num_days", "regime", "validation_fraction")


def config(**fields):
    env_kwargs = fields.pop("env_kwargs", {})
    layers = [{"algorithm": "portfolio_gradient", "env_kwargs": {**MARKET, **env_kwargs}}, fields]
    return train_config("StockTrading-v0", layers)


def test_a_pods_agent_is_the_learners_and_its_score_is_its_validation_sharpe() -> None:
    cfg = config(portfolio_gradient={"learning_rate": 0.07, "l2": 0.01})
    trainer = build(cfg)
    assert isinstance(trainer, PortfolioTrainer)
    for _ in range(7):
        trainer.step()
    periods = market_periods(**{k: v for k, v in cfg.env_kwargs.items() if k in MARKET_ARGS})
    train_days = len(periods["train"].dates)
    assert trainer.counters(0).env_steps == 7 * train_days == 7 * trainer.step_env_steps
    assert trainer.counters(0).updates == 7 and "train_sharpe" in trainer.progress()
    # The learner on the train period alone, by hand: the same agent, bit for bit.
    layout = FeatureLayout.of(5, cfg.env_kwargs)
    data = PeriodData.of(periods["train"], layout)
    policy = PortfolioPolicy(layout)
    policy.fit_statistics(data)
    learner = PortfolioLearner.of(policy, data, 0.001, [cfg.portfolio_gradient])
    for _ in range(7):
        learner.step()
    torch.testing.assert_close(trainer.policy.params, policy.params, rtol=0, atol=0)
    # The pod's score (the preset: one pass of the validation period, scored by its Sharpe)
    # is the Sharpe of that period's backtest: whole shares, the env's costs.
    [score] = trainer.evaluate()
    env = StockTradingEnv(1, mode="validation", **cfg.env_kwargs)
    values = run_backtest(env, trainer.policy.act_deterministic)
    assert score.mean == pytest.approx(metrics(values).sharpe, rel=1e-4)
    trainer.close()


def test_training_files_round_trip_and_take_the_new_hyperparameters(tmp_path: Path) -> None:
    cfg = config()
    a = build(cfg)
    for _ in range(5):
        a.step()
    a.save(0, tmp_path / "a")
    # The same agent and hyperparameters: the next steps are the same steps.
    b = build(config(seed=3))
    b.load(0, tmp_path / "a", cfg)
    assert b.counters(0) == a.counters(0)
    a.step()
    b.step()
    torch.testing.assert_close(b.policy.params, a.policy.params, rtol=0, atol=0)
    # PBT's explore: the copy goes on with its own learning rate (Adam's step scales with it).
    explored = config(portfolio_gradient={"learning_rate": 0.1})
    c = build(explored)
    c.load(0, tmp_path / "a", explored)
    c.step()
    a.load(0, tmp_path / "a", cfg)
    before = a.policy.params.clone()
    a.step()
    torch.testing.assert_close(
        (c.policy.params - before) / 0.1, (a.policy.params - before) / 0.05, rtol=1e-6, atol=0
    )
    # And its own L2 penalty: a step of the same agent with another penalty is another step.
    penalised = config(portfolio_gradient={"l2": 0.5})
    d = build(penalised)
    d.load(0, tmp_path / "a", penalised)
    d.step()
    a.load(0, tmp_path / "a", cfg)
    a.step()
    assert not torch.equal(d.policy.params, a.policy.params)
    torch.testing.assert_close(  # the invested fraction's weights are not penalised
        d.policy.params[:, -3:], a.policy.params[:, -3:], rtol=0, atol=0
    )
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["algorithm"] == (
        "portfolio_gradient"
    )
    for trainer in (a, b, c, d):
        trainer.close()


def test_files_that_are_not_the_portfolio_gradients_are_refused(tmp_path: Path) -> None:
    trainer = build(config())
    trainer.save(0, tmp_path / "good")
    ppo = train_config("StockTrading-v0", [{"total_env_steps": 512, "eval_every_steps": 512}])
    ppo = ppo.model_copy(update={"ppo": ppo.ppo.model_copy(update={"num_envs": 2})})
    train(ppo, tmp_path / "ppo")
    tampered = shutil.copytree(tmp_path / "good", tmp_path / "tampered")
    (tampered / "actor.safetensors").write_bytes(b"\0" * 64)
    other_market = build(config(env_kwargs={"turbulence": False}))
    other_market.save(0, tmp_path / "other")
    # Verified files whose Adam moments would broadcast into the agent's (one column).
    good = read_files(tmp_path / "good")
    raw = {f.name: f.read_bytes() for f in (tmp_path / "good").iterdir()}
    raw.pop("manifest.json")
    moments = good.tensors["optimizer"]["moments"][..., :1].contiguous()
    steps = good.tensors["optimizer"]["steps"]
    raw["optimizer.safetensors"] = tensor_bytes({"moments": moments, "steps": steps})
    write_files(tmp_path / "narrow", raw, {"algorithm": "portfolio_gradient"})
    for directory, message in [
        (tmp_path / "ppo" / "checkpoints" / "latest", "checkpoint of 'ppo'"),
        (tampered, "actor.safetensors"),
        (tmp_path / "other", "actor.safetensors does not fit"),  # other features
        (tmp_path / "narrow", "moments of shape"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            trainer.load(0, directory, trainer.config(0))
    trainer.close()


def test_a_backtest_runs_the_agents_files(tmp_path: Path) -> None:
    result = train(config(total_env_steps=20 * 360, eval_every_steps=5 * 360), tmp_path)
    assert [r["env_steps"] for r in result.history if "eval_return" in r] == [
        1800, 3600, 5400, 7200,
    ]  # fmt: skip
    report = backtest_candidate(tmp_path / "checkpoints" / "best")
    trainer = build(config())
    trainer.load(0, tmp_path / "checkpoints" / "best", trainer.config(0))
    env = StockTradingEnv(1, mode="backtest", **trainer.config(0).env_kwargs)
    expected = run_backtest(env, trainer.policy.act)
    assert report.values["agent"].tolist() == pytest.approx(expected.tolist())
    trainer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pod_trains_on_cuda_as_on_the_cpu() -> None:
    on = {device: build(config(device=device)) for device in ("cpu", "cuda")}
    for trainer in on.values():
        for _ in range(3):
            trainer.step()
    torch.testing.assert_close(on["cuda"].policy.params.cpu(), on["cpu"].policy.params)
    cuda, cpu = (on[d].evaluate()[0].mean for d in ("cuda", "cpu"))
    assert cuda == pytest.approx(cpu, rel=1e-4)


def test_the_layout_is_read_back_from_the_spaces() -> None:
    for turbulence in (False, True):
        for momentum in (False, True):
            for stocks in (1, 2, 5):
                kwargs = {"action_mode": "weights", "turbulence": turbulence, "momentum": momentum}
                env = StockTradingEnv(1, num_stocks=stocks, num_days=400, **kwargs)
                got = FeatureLayout.of_spaces(env.single_observation_space, env.single_action_space)
                assert got == FeatureLayout.of(stocks, kwargs)


@pytest.mark.parametrize(
    ("env", "layer", "message"),
    [
        ("Pendulum-v1", {}, "env\n  Value error, portfolio_gradient trains StockTrading-v0 only"),
        ("StockTrading-v0", {"env_kwargs": {"action_mode": "shares"}}, "action_mode=weights"),
        ("StockTrading-v0", {"env_kwargs": {"simulated_markets": 4}}, "simulated_markets: 0"),
        ("StockTrading-v0", {"portfolio_gradient": {"learning_rate": 0}}, "greater than 0"),
        ("StockTrading-v0", {"portfolio_gradient": {"ent_coef": 0.1}}, "ent_coef"),
    ],
)
def test_what_it_cannot_train_is_a_named_error(env: str, layer: dict, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        train_config(env, [{"algorithm": "portfolio_gradient"}, layer])
    assert message in str(info.value)


def test_settings_that_would_fail_later_are_refused_now() -> None:
    # No env arguments (the default): no target weights, not a market it trains.
    with pytest.raises(ValidationError, match="env_kwargs\n  Value error, .*action_mode=weights"):
        PortfolioRunConfig()


@pytest.mark.parametrize("algorithm", ["portfolio_gradient", "ppo", "sac"])
def test_an_evaluation_env_the_policy_cannot_read_is_refused_at_build(algorithm: str) -> None:
    """Other features, or other stocks, in the evaluation env than in training: refused when the
    trainer is built, for every trainer (PPO's crashed at its first evaluation, a RuntimeError
    of tensor sizes, and its pod was replaced until the launch budget ran out)."""
    for other in ({"momentum": False}, {"num_stocks": 7}):
        layers = [{"algorithm": algorithm, "env_kwargs": {**MARKET, "momentum": True}},
                  {"eval_env_kwargs": other}]  # fmt: skip
        # Each side named: which shape is training's.
        refused = r"eval_env_kwargs change the env's observations.*training's \(.*evaluation's"
        with pytest.raises(ValueError, match=refused):
            build(train_config("StockTrading-v0", layers))


def test_the_spec_refuses_it_on_other_envs_and_other_names() -> None:
    base = {"name": "x", "algorithms": {"portfolio_gradient": 1.0}}
    assert ExperimentSpec.model_validate({**base, "env": {"name": "StockTrading-v0"}})
    for env, message in [
        ("Pendulum-v1", "cannot train portfolio_gradient on Pendulum-v1: portfolio_gradient "
         "trains StockTrading-v0 only"),
        ("CartPole-v1", "trains StockTrading-v0 only"),
    ]:  # fmt: skip
        with pytest.raises(ValidationError, match=message):
            ExperimentSpec.model_validate({**base, "env": {"name": env}})
    space = {"ent_coef": {"type": "choice", "values": [0.0]}}
    with pytest.raises(ValidationError, match="'ent_coef' not hyperparameters of"):
        ExperimentSpec.model_validate(
            {**base, "env": {"name": "StockTrading-v0"}, "search_space": space}
        )
    # A population pod's agents may differ in their step size and penalty, nothing else.
    trading = {**base, "env": {"name": "StockTrading-v0"}, "population": {"agents_per_pod": 2}}
    assert ExperimentSpec.model_validate(
        {**trading, "search_space": {"l2": {"type": "uniform", "low": 0.0, "high": 0.01}}}
    )
