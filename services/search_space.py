"""Hyperparameter search spaces shared by the experiment spec and the leaderboard generator.

A search space maps a hyperparameter name to a distribution: ``uniform``, ``log_uniform``,
``int_uniform`` or ``choice``. Pure Python (no numpy/torch) so every service can use it.
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Dist(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Uniform(_Dist):
    type: Literal["uniform"] = "uniform"
    low: float
    high: float

    @model_validator(mode="after")
    def _check(self) -> Uniform:
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or self.low > self.high:
            raise ValueError("need finite low <= high")
        return self

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)

    def clamp(self, value: float) -> float:
        return min(max(float(value), self.low), self.high)


class LogUniform(Uniform):
    type: Literal["log_uniform"] = "log_uniform"  # type: ignore[assignment]

    @model_validator(mode="after")
    def _positive(self) -> LogUniform:
        if self.low <= 0:
            raise ValueError("log_uniform needs low > 0")
        return self

    def sample(self, rng: random.Random) -> float:
        return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))


class IntUniform(_Dist):
    type: Literal["int_uniform"] = "int_uniform"
    low: int
    high: int

    @model_validator(mode="after")
    def _check(self) -> IntUniform:
        if self.low > self.high:
            raise ValueError("need low <= high")
        return self

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def clamp(self, value: float) -> int:
        return int(min(max(round(value), self.low), self.high))


class Choice(_Dist):
    type: Literal["choice"] = "choice"
    values: list[Any] = Field(min_length=1)

    def sample(self, rng: random.Random) -> Any:
        return rng.choice(self.values)


Distribution = Annotated[Uniform | LogUniform | IntUniform | Choice, Field(discriminator="type")]
SearchSpace = dict[str, Distribution]


def sample_space(space: SearchSpace, rng: random.Random) -> dict[str, Any]:
    return {name: dist.sample(rng) for name, dist in space.items()}
