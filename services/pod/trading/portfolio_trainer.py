"""The portfolio gradient's trainer: portfolio_gradient.py's agents in a pod (one, or a
population of P batched on one market), behind the trainer contract
(services/pod/training/trainer.py), so ``podium train``, an experiment's tournament and PBT
inside a population pod train it as they train PPO. A ``step`` is one full-batch Adam step of
every agent on the train period's Sharpe ratio; the evaluation is the env's own, on PPO's
scale (docs/trading.md, "In a pod").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict, Field, field_validator

from services.contracts.algorithms.portfolio_gradient import POPULATION
from services.contracts.algorithms.portfolio_gradient.config import PortfolioGradientConfig
from services.pod.algorithms.spaces import check_action_space
from services.pod.roles.evaluator import EvalResult, evaluate_groups
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
from services.pod.training.trainer import Counters, RunConfig, Trainer, check_population_slot


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


class PortfolioTrainer(Trainer[PortfolioRunConfig]):
    """``len(configs)`` portfolio-gradient agents of one market, batched (one slot: a pod's
    single agent; P: a population pod); ``step``: one Adam step of each on the train Sharpe."""

    config_class = PortfolioRunConfig
    one_update_per_step = True

    def __init__(self, configs: Sequence[PortfolioRunConfig]) -> None:
        first = configs[0]
        self.size, self.configs = len(configs), list(configs)
        self.per_slot = POPULATION.hyperparameters
        for config in configs[1:]:
            check_population_slot(first, config, self.per_slot, self.size)
        train_env, eval_env = first.make_envs(1, slots=self.size)
        try:
            assert isinstance(train_env, StockTradingEnv)  # the config's validator saw to it
            check_action_space(PortfolioGradient.name, train_env.single_action_space)
            layout = FeatureLayout.of(train_env.num_stocks, first.env_kwargs)
            train = PeriodData.of(train_env.data, layout)
            cost = train_env.transaction_cost
        except BaseException:
            eval_env.close()
            raise
        finally:
            train_env.close()  # it ran no episode: the gradient reads its market
        device = torch.device(first.device)
        train = PeriodData(*(t.to(device) for t in (train.stock, train.market, train.close)))
        self.policy = PortfolioPolicy(layout, self.size).to(device)
        self.policy.fit_statistics(train)
        self._fresh = self.policy.params[0].clone()  # zero scores (equal split), 95% invested
        agents = [c.portfolio_gradient for c in configs]
        self.learner = PortfolioLearner.of(self.policy, train, cost, agents)
        self.eval_env = eval_env  # eval_episodes sub-environments per agent
        self._counters = [Counters(0, 0) for _ in configs]
        self._train_sharpe: list[float] | None = None

    def _set(self, slot: int, config: PortfolioRunConfig) -> None:
        # The market and its features were built from the first config: a slot may change
        # its step size and penalty, nothing else.
        check_population_slot(self.configs[0], config, self.per_slot, self.size)
        self.configs[slot] = config
        self.learner.adam.lr[slot] = config.portfolio_gradient.learning_rate
        self.learner.l2[slot] = config.portfolio_gradient.l2

    def reset(self, slot: int, config: PortfolioRunConfig) -> None:
        """A fresh agent in ``slot``: zero scores (equal split), 95% invested."""
        self._set(slot, config)
        adam = self.learner.adam
        with torch.no_grad():
            self.policy.params[slot] = self._fresh
            adam.moments[:, slot] = 0
            adam.steps[slot] = 0
        self._counters[slot] = Counters(0, 0)

    @property
    def step_env_steps(self) -> int:
        # Every day of the train period, read once: an env-step budget buys a gradient agent
        # as many market days as a PPO agent.
        return len(self.learner.train.close)

    def step(self) -> None:
        self._train_sharpe = self.learner.step().tolist()
        days = self.step_env_steps
        self._counters = [Counters(c.env_steps + days, c.updates + 1) for c in self._counters]

    def progress(self) -> dict[str, float]:
        if self._train_sharpe is None:
            return {}
        return {"train_sharpe": sum(self._train_sharpe) / self.size}

    def evaluate(self) -> list[EvalResult]:
        seed = self.configs[0].evaluation_seed
        return evaluate_groups(self.eval_env, self.policy.act, self.size, seed)

    def config(self, slot: int) -> PortfolioRunConfig:
        return self.configs[slot]

    def counters(self, slot: int) -> Counters:
        return self._counters[slot]

    def save(self, slot: int, directory: Path) -> None:
        """``actor.safetensors`` is the agent's policy (its parameters and feature statistics:
        enough to act), ``optimizer.safetensors`` its Adam state."""
        adam, counters = self.learner.adam, self._counters[slot]
        optimizer = {
            "moments": adam.moments[:, slot : slot + 1],
            "steps": adam.steps[slot : slot + 1],
        }
        files = {
            "actor.safetensors": tensor_bytes(self.policy.agent(slot).state_dict()),
            "optimizer.safetensors": tensor_bytes({k: v.clone() for k, v in optimizer.items()}),
            "hyperparameters.json": json_bytes(self.configs[slot].model_dump(mode="json")),
            "counters.json": json_bytes(
                {"env_steps": counters.env_steps, "updates": counters.updates}
            ),
        }
        write_files(directory, files, {"algorithm": PortfolioGradient.name})

    def load(self, slot: int, directory: Path, config: PortfolioRunConfig) -> None:
        """The agent in ``directory`` (its parameters, Adam state and counters; its feature
        statistics where the pod trains it alone) with ``config``'s learning rate and L2
        (PBT's exploit and explore)."""
        files = read_agent_files(directory, PortfolioGradient.name, {"actor", "optimizer"})
        alone = PortfolioPolicy(self.policy.layout).to(self.policy.params.device)
        load_into(alone, files.tensors["actor"], "actor.safetensors")
        statistics = {k: v for k, v in alone.state_dict().items() if k != "params"}
        mine = {k: v for k, v in self.policy.state_dict().items() if k != "params"}
        if self.size > 1 and any(not torch.equal(v, mine[k]) for k, v in statistics.items()):
            # The agents of a population share their features' scale: the train period's.
            raise CheckpointError(f"{directory}: an agent of another market's train period")
        state = files.tensors["optimizer"]
        adam = self.learner.adam
        try:
            for name, mine_ in (
                ("moments", adam.moments[:, slot : slot + 1]),
                ("steps", adam.steps[slot : slot + 1]),
            ):
                if state[name].shape != mine_.shape:  # copy_ would broadcast a smaller one
                    raise ValueError(f"{name} of shape {tuple(state[name].shape)}")
            counters: dict[str, Any] = files.documents["counters"]
            loaded = Counters(int(counters["env_steps"]), int(counters["updates"]))
        except (KeyError, RuntimeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{directory}: does not fit this agent: {exc}") from exc
        self._set(slot, config)
        with torch.no_grad():
            self.policy.params[slot] = alone.params[0]
            adam.moments[:, slot] = state["moments"][:, 0]
            adam.steps[slot] = state["steps"][0]
            if self.size == 1:  # the loaded statistics scale the features
                for name, value in statistics.items():
                    getattr(self.policy, name).copy_(value)
                self.learner.features_changed()
        self._counters[slot] = loaded

    def copy(self, dst: int, src: int, config: PortfolioRunConfig) -> None:
        self._set(dst, config)
        self.learner.adam.copy(dst, src)

    def recent_returns(self) -> list[float | None]:
        """Each slot's train Sharpe at its last step: what the agents climb (PBT inside a
        population ranks on it unless the spec says ``by: evaluation``)."""
        return [None] * self.size if self._train_sharpe is None else list(self._train_sharpe)

    def close(self) -> None:
        self.eval_env.close()
