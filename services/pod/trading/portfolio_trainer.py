"""The portfolio gradient's trainer: one agent of portfolio_gradient.py in a pod, behind the
trainer contract (services/pod/training/trainer.py), so ``podium train`` and an experiment's
tournament train it as they train PPO. A ``step`` is one full-batch Adam step on the train
period's Sharpe ratio; the evaluation is the env's own, on PPO's scale (docs/trading.md, "In a
pod").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from services.contracts.algorithms.portfolio_gradient.config import PortfolioGradientConfig
from services.pod.algorithms.spaces import check_action_space
from services.pod.roles.evaluator import EvalResult, Evaluator
from services.pod.trading.env import StockTradingEnv
from services.pod.trading.portfolio_gradient import (
    FeatureLayout,
    PeriodData,
    PortfolioGradient,
    PortfolioLearner,
    PortfolioPolicy,
)
from services.pod.training.checkpoint import (
    CheckpointError,
    json_bytes,
    load_into,
    read_agent_files,
    tensor_bytes,
    write_files,
)
from services.pod.training.trainer import (
    Counters,
    Roles,
    RunConfig,
    Trainer,
    train_in_process,
)


class PortfolioRunConfig(RunConfig):
    """One portfolio-gradient run: the run's fields and the agent's (``portfolio_gradient``)."""

    # Validated when left out too: the default (no env arguments) is not a market it trains.
    model_config = ConfigDict(extra="forbid", validate_default=True)

    env: str = StockTradingEnv.spec_id
    algorithm: str = PortfolioGradient.name
    portfolio_gradient: PortfolioGradientConfig = Field(default_factory=PortfolioGradientConfig)

    @field_validator("algorithm")
    @classmethod
    def _this_algorithm(cls, value: str) -> str:
        if value != PortfolioGradient.name:
            raise ValueError(f"this config trains {PortfolioGradient.name}, not {value!r}")
        return value

    @field_validator("env")
    @classmethod
    def _stock_trading(cls, value: str) -> str:
        if value != StockTradingEnv.spec_id:
            raise ValueError(
                f"{PortfolioGradient.name} trains {StockTradingEnv.spec_id} only (it "
                f"differentiates the account's returns through the market's closes), got "
                f"{value!r}"
            )
        return value

    @field_validator("env_kwargs", mode="after")
    @classmethod
    def _a_weights_market(cls, value: dict[str, Any]) -> dict[str, Any]:
        FeatureLayout.of(0, value)  # target weights, stocks in their own slots
        if value.get("simulated_markets"):
            raise ValueError(
                f"{PortfolioGradient.name} trains on the market's own train period "
                f"(simulated_markets: 0)"
            )
        return value

    @field_validator("eval_env_kwargs", mode="after")
    @classmethod
    def _the_same_features(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # The policy reads the evaluation env's observations with the train env's layout.
        train = info.data.get("env_kwargs")
        if train is not None:
            both = {**train, **value}
            if FeatureLayout.of(0, both) != FeatureLayout.of(0, train):
                raise ValueError(
                    "the evaluation env must show the train env's features (turbulence, "
                    "momentum as in env_kwargs)"
                )
        return value


class PortfolioTrainer(Trainer[PortfolioRunConfig]):
    """One portfolio-gradient agent (one slot); ``step`` is one Adam step on the train
    period's Sharpe."""

    config_class = PortfolioRunConfig
    one_update_per_step = True

    def __init__(self, configs: Sequence[PortfolioRunConfig], roles: Roles | None = None) -> None:
        [config] = configs
        train_in_process(roles, "the portfolio gradient trains in its process: no worker rolls out")
        self.size = 1
        self._built = False
        self.reset(0, config)

    def reset(self, slot: int, config: PortfolioRunConfig) -> None:
        """A fresh agent on ``config``'s market: zero scores (equal split), 95% invested."""
        self.close()
        self._config = config
        train_env, eval_env = config.make_envs(1)
        try:
            assert isinstance(train_env, StockTradingEnv)  # the config's validator saw to it
            check_action_space(PortfolioGradient.name, train_env.single_action_space)
            layout = FeatureLayout.of(train_env.num_stocks, config.env_kwargs)
            train = PeriodData.of(train_env.data, layout)
            cost = train_env.transaction_cost
        except BaseException:
            eval_env.close()
            raise
        finally:
            train_env.close()  # it ran no episode: the gradient reads its market
        device = torch.device(config.device)
        train = PeriodData(*(t.to(device) for t in (train.stock, train.market, train.close)))
        self.policy = PortfolioPolicy(layout).to(device)
        self.policy.fit_statistics(train)
        self.learner = PortfolioLearner.of(self.policy, train, cost, [config.portfolio_gradient])
        self.evaluator = Evaluator(eval_env, seed=config.evaluation_seed)
        self._env_steps = self._updates = 0
        self._train_sharpe: float | None = None
        self._built = True

    @property
    def step_env_steps(self) -> int:
        # Every day of the train period, read once: an env-step budget buys a gradient agent
        # as many market days as a PPO agent.
        return len(self.learner.train.close)

    def step(self) -> None:
        self._train_sharpe = float(self.learner.step()[0])
        self._env_steps += self.step_env_steps
        self._updates += 1

    def progress(self) -> dict[str, float]:
        return {} if self._train_sharpe is None else {"train_sharpe": self._train_sharpe}

    def evaluate(self) -> list[EvalResult]:
        return [self.evaluator.evaluate(self.policy)]  # type: ignore[arg-type]

    def config(self, slot: int) -> PortfolioRunConfig:
        return self._config

    def counters(self, slot: int) -> Counters:
        return Counters(self._env_steps, self._updates)

    def save(self, slot: int, directory: Path) -> None:
        """``actor.safetensors`` is the policy (its parameters and feature statistics: enough
        to act), ``optimizer.safetensors`` its Adam state."""
        adam = self.learner.adam
        files = {
            "actor.safetensors": tensor_bytes(self.policy.state_dict()),
            "optimizer.safetensors": tensor_bytes({"moments": adam.moments, "steps": adam.steps}),
            "hyperparameters.json": json_bytes(self._config.model_dump(mode="json")),
            "counters.json": json_bytes({"env_steps": self._env_steps, "updates": self._updates}),
        }
        write_files(directory, files, {"algorithm": PortfolioGradient.name})

    def load(self, slot: int, directory: Path, config: PortfolioRunConfig) -> None:
        """The agent in ``directory`` (its parameters, feature statistics, Adam state and
        counters) with ``config``'s learning rate and L2 (PBT's exploit and explore)."""
        files = read_agent_files(directory, PortfolioGradient.name, {"actor", "optimizer"})
        self.reset(slot, config)
        load_into(self.policy, files.tensors["actor"], "actor.safetensors")
        adam, state = self.learner.adam, files.tensors["optimizer"]
        try:
            for name, mine in (("moments", adam.moments), ("steps", adam.steps)):
                if state[name].shape != mine.shape:  # copy_ would broadcast a smaller one
                    raise ValueError(f"{name} of shape {tuple(state[name].shape)}")
                mine.copy_(state[name])
            counters: dict[str, Any] = files.documents["counters"]
            self._env_steps, self._updates = int(counters["env_steps"]), int(counters["updates"])
        except (KeyError, RuntimeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{directory}: does not fit this agent: {exc}") from exc
        self.learner.features_changed()  # the loaded statistics scale the features

    def close(self) -> None:
        if self._built:
            self.evaluator.env.close()
            self._built = False
