"""Hyperparameter search spaces shared by the experiment spec and the leaderboard generator.

A search space maps a hyperparameter name to a distribution: ``uniform``, ``log_uniform``,
``int_uniform`` or ``choice``. Pure Python (no numpy/torch) so every service can use it.
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from services.contracts.inputs import check_json_value

#: Marks a setting (``json_schema_extra`` of an algorithm config's field) that, set true, acts
#: over the run's whole budget (PPO's ``anneal_lr``): a tournament of more than one agent, each
#: training an unknown share of the budget, cannot honour it, so a search space may not draw it
#: there (services/contracts/spec.py). A plugin's config marks its own the same way.
WHOLE_RUN = {"x-whole-run": True}


class _Dist(BaseModel):
    # Input models (spec, leaderboard registration): bounds must survive a JSON round trip.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class Uniform(_Dist):
    type: Literal["uniform"] = "uniform"
    low: float
    high: float

    @model_validator(mode="after")
    def _check(self) -> Uniform:
        if self.low > self.high:  # finiteness: the model's allow_inf_nan=False
            raise ValueError("need low <= high")
        return self

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)

    def clamp(self, value: float) -> float:
        return min(max(float(value), self.low), self.high)

    def perturb(self, value: Any, rng: random.Random, factors: tuple[float, ...]) -> float:
        """PBT explore with one of ``factors`` (e.g. 0.8 / 1.2), clamped to bounds: on a
        linear range a step of (factor - 1) of its width. Multiplying the value instead would
        throw a discount of 0.95 (x0.8, x1.2) onto the bounds of [0.8, 0.99] at every step."""
        step = (rng.choice(factors) - 1.0) * (self.high - self.low)
        return self.clamp(float(value) + step)

    # CEM fits its Gaussian in this coordinate (log space for log-uniform), where sampling is
    # uniform, so a unit step means the same everywhere in the range.
    def to_unit(self, value: Any) -> float:
        return float(value)

    def from_unit(self, x: float) -> float:
        return self.clamp(x)

    def unit_range(self) -> float:
        return self.high - self.low


class LogUniform(Uniform):
    type: Literal["log_uniform"] = "log_uniform"  # type: ignore[assignment]

    @model_validator(mode="after")
    def _positive(self) -> LogUniform:
        if self.low <= 0:
            raise ValueError("log_uniform needs low > 0")
        return self

    def sample(self, rng: random.Random) -> float:
        return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))

    def perturb(self, value: Any, rng: random.Random, factors: tuple[float, ...]) -> float:
        """On a log range (learning rates) a factor is the natural step: multiply."""
        return self.clamp(float(value) * rng.choice(factors))

    def to_unit(self, value: Any) -> float:
        return math.log(max(float(value), self.low))

    def from_unit(self, x: float) -> float:
        return self.clamp(math.exp(x))

    def unit_range(self) -> float:
        return math.log(self.high) - math.log(self.low)


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

    def perturb(self, value: Any, rng: random.Random, factors: tuple[float, ...]) -> int:
        """Multiply and round; when rounding would undo the move, step by one instead."""
        factor = rng.choice(factors)
        moved = self.clamp(float(value) * factor)
        if moved == int(value):
            moved = self.clamp(int(value) + (1 if factor > 1 else -1))
        return moved

    def to_unit(self, value: Any) -> float:
        return float(value)

    def from_unit(self, x: float) -> int:
        return self.clamp(x)

    def unit_range(self) -> float:
        return float(self.high - self.low)


class Choice(_Dist):
    type: Literal["choice"] = "choice"
    values: Annotated[list[Any], AfterValidator(check_json_value)] = Field(min_length=1)

    def sample(self, rng: random.Random) -> Any:
        return rng.choice(self.values)

    def clamp(self, value: Any) -> Any:
        return value if value in self.values else self.values[0]

    def perturb(self, value: Any, rng: random.Random, factors: tuple[float, ...] = ()) -> Any:
        """Move to a neighbouring value in the listed order (values are often ordered sizes)."""
        if len(self.values) == 1:
            return self.values[0]
        i = self.values.index(value) if value in self.values else 0
        if i == 0:
            return self.values[1]
        if i == len(self.values) - 1:
            return self.values[-2]
        return self.values[i + rng.choice((-1, 1))]


Distribution = Annotated[Uniform | LogUniform | IntUniform | Choice, Field(discriminator="type")]
SearchSpace = dict[str, Distribution]


NUMERIC = (Uniform, LogUniform, IntUniform)


def pinned_values(space: SearchSpace) -> dict[str, Any]:
    """Name → value for the names the space sets to one value for every draw (a one-value
    choice): run settings every agent shares, not searched."""
    return {
        name: dist.values[0]
        for name, dist in space.items()
        if isinstance(dist, Choice) and len(dist.values) == 1
    }


def pinned_names(space: SearchSpace) -> frozenset[str]:
    """The names of ``pinned_values``."""
    return frozenset(pinned_values(space))


def sample_space(space: SearchSpace, rng: random.Random) -> dict[str, Any]:
    return {name: dist.sample(rng) for name, dist in space.items()}


def contains(dist: Uniform | LogUniform | IntUniform | Choice, value: Any) -> bool:
    """Whether ``value`` lies in the distribution's support (bounds inclusive)."""
    if isinstance(dist, Choice):
        return value in dist.values
    try:
        return dist.low <= float(value) <= dist.high
    except (TypeError, ValueError):
        return False
