"""The experiment spec: what a user submits to the orchestrator (REST body or YAML file).

Every name in it (env, algorithms, generator strategy) is checked against the registry without
importing anything; unknown names fail validation with the list of known names. Resource
requests are bounded by server settings in the API layer, not here, because the bounds are a
property of the cluster, not of the spec.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    AliasChoices,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services import registry
from services.contracts.algorithms.card import card_names
from services.contracts.algorithms.hyperparameters import (
    check_hyperparameter_names,
    check_hyperparameter_values,
    check_population,
    misfits,
    whole_run_settings,
)
from services.contracts.envpool_tasks import ENVPOOL_PREFIX, ENVPOOL_TASKS
from services.contracts.envs import argument_problem, unreachable_target
from services.contracts.inputs import InputModel, JsonObject, check_json_value
from services.contracts.search_space import SearchSpace, pinned_values
from services.contracts.strategies import PopulationExploit, board_counts, options_model

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_GYM_ID = re.compile(r"^[A-Za-z0-9_\-./]+$")
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def parse_quantity(value: str | int | float) -> Decimal:
    """A Kubernetes resource quantity ("2Gi", "500m", "1.5") as a number."""
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _QUANTITY.match(str(value).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a resource quantity: {value!r} (examples: 2Gi, 512Mi, 500m)")
    try:
        return Decimal(m.group(1)) * _SUFFIX[m.group(2)]
    except InvalidOperation as e:  # pragma: no cover - regex already restricts the digits
        raise ValueError(f"not a resource quantity: {value!r}") from e


def _known_envs() -> list[str]:
    return registry.names(registry.ENVS)


def _gym_ids() -> list[str]:
    # gymnasium imports no torch; its registry lists the ids a pod can make without plugins.
    import gymnasium

    return sorted(gymnasium.envs.registry)


def check_env_name(name: str) -> str:
    """Registered Podium env, a registered gymnasium id, ``gym:<gymnasium id>``, or
    ``envpool:<EnvPool task>`` (the tasks in ``contracts.envpool_tasks``).

    Gymnasium's ``module:Env-v0`` syntax imports a module named by the caller, so any other
    ':' is refused.
    """
    known = _known_envs()
    if name in known:
        return name
    if name.startswith(ENVPOOL_PREFIX) and name.removeprefix(ENVPOOL_PREFIX) in ENVPOOL_TASKS:
        return name
    gym_id = name.removeprefix("gym:")
    if _GYM_ID.match(gym_id) and gym_id in _gym_ids():
        return name
    hint = (
        " (module:id syntax is not allowed)" if ":" in gym_id.removeprefix(ENVPOOL_PREFIX) else ""
    )
    raise ValueError(
        f"unknown env {name!r}{hint}; known: {', '.join(known)}, or any gymnasium id as "
        f"'gym:<id>' (e.g. gym:{_gym_ids()[0] if _gym_ids() else 'CartPole-v1'}), or an "
        f"EnvPool task as '{ENVPOOL_PREFIX}<id>' (e.g. {ENVPOOL_PREFIX}HalfCheetah-v5)"
    )


def _check_names(kind: str, group: str, given: list[str]) -> None:
    known = registry.names(group)
    unknown = [n for n in given if n not in known]
    if unknown:
        raise ValueError(
            f"unknown {kind} {', '.join(map(repr, unknown))}; known: {', '.join(known) or '(none)'}"
        )


class EnvSpec(InputModel):
    name: str = Field(
        description=(
            "Registered env name (podium.envs), gym:<gymnasium id> or envpool:<EnvPool task>."
        )
    )
    kwargs: JsonObject = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return check_env_name(v)


class GeneratorSpec(InputModel):
    strategy: str = Field(default="pbt", description="Registered generator (podium.generators).")
    options: JsonObject = Field(default_factory=dict)

    @field_validator("strategy")
    @classmethod
    def _known(cls, v: str) -> str:
        _check_names("generator strategy", registry.GENERATORS, [v])
        return v

    @model_validator(mode="after")
    def _options(self) -> GeneratorSpec:
        # Checked here, by the strategy's own options model, so a bad option is a 422 at
        # submission rather than an experiment the leaderboard refuses later. The built-ins'
        # models are contracts (services/contracts/strategies.py): no leaderboard import.
        try:
            options_model(self.strategy).model_validate(self.options)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or '(options)'}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(f"bad options for {self.strategy!r}: {problems}") from None
        return self


class Halving(InputModel):
    """Successive halving across the experiment's pods (Jamieson and Talwalkar, 2016): rung
    after rung, the better ``1/eta`` of the pods train on and the rest are stopped, so the
    env steps of the stopped pods go to the better ones. Rung k is reached once the pods'
    reports count ``(k + 1) * max_pods * agents_per_pod * rung_env_steps`` env steps (each
    rung spends the same env steps: with eta 2, half the pods, each trained twice as long); the
    pods kept are then ``ceil(max_pods / eta**(k + 1))``, those with the best last scores, down
    to one."""

    rung_env_steps: int = Field(
        ge=1,
        le=10**12,
        description="Env steps each agent of max_pods pods trains before the first rung "
        "(counted over all pods: a rung is max_pods * agents_per_pod times this).",
    )
    eta: int = Field(
        default=2, ge=2, le=16, description="Each rung keeps the best 1/eta of the pods."
    )


class Population(InputModel):
    min_pods: int = Field(default=1, ge=1)
    max_pods: int = Field(default=4, ge=1)
    agents_per_pod: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Agents one pod trains together (one process, stacked weights, same "
        "architecture); "
        "each is its own candidate on the leaderboard.",
    )
    exploit: PopulationExploit | None = Field(
        default=None,
        description="PBT among each pod's agents, between its iterations (needs "
        "agents_per_pod >= 2); unset: the pod's agents train apart and only the generator's "
        "strategy selects, across pods.",
    )
    halving: Halving | None = Field(
        default=None,
        description="Successive halving across pods: at each rung the orchestrator stops "
        "the pods with the worse last scores and runs fewer pods from then on; unset: the "
        "pod count follows capacity only.",
    )

    @model_validator(mode="after")
    def _order(self) -> Population:
        if self.min_pods > self.max_pods:
            raise ValueError("min_pods must be <= max_pods")
        if self.exploit is not None and self.agents_per_pod < 2:
            raise ValueError("exploit needs agents_per_pod >= 2: it selects among one pod's agents")
        if self.halving is not None and self.max_pods < self.halving.eta:
            raise ValueError(
                f"halving needs max_pods >= eta ({self.halving.eta}): its first rung keeps "
                f"1/eta of max_pods pods"
            )
        return self

    @property
    def halving_rung_env_steps(self) -> int:
        """The env steps all pods' reports count between two rungs of ``halving``."""
        assert self.halving is not None
        return self.max_pods * self.agents_per_pod * self.halving.rung_env_steps


def halving_pods(population: Population, env_steps: int | None) -> int | None:
    """Pods successive halving keeps once the pods' reports count ``env_steps`` env steps;
    None without halving."""
    halving = population.halving
    if halving is None:
        return None
    pods = population.max_pods
    rungs = (env_steps or 0) // population.halving_rung_env_steps
    for _ in range(min(rungs, 64)):  # 64 rungs halve any max_pods to one
        pods = math.ceil(pods / halving.eta)
    return pods


class Resources(InputModel):
    gpus: int = Field(
        default=0,
        ge=0,
        le=1,
        description="0 or 1: a pod trains on one device (more GPUs: more pods, max_pods).",
    )
    cpu: float = Field(default=1.0, gt=0, description="CPU cores per pod.")
    memory: str = Field(default="2Gi", description="Memory per pod (Kubernetes quantity).")

    @field_validator("memory", mode="before")
    @classmethod
    def _quantity(cls, v: Any) -> str:
        if isinstance(v, int) and not isinstance(v, bool):
            v = str(v)
        if not isinstance(v, str):
            raise ValueError("memory must be a quantity string such as 2Gi")
        if parse_quantity(v) <= 0:
            raise ValueError("memory must be > 0")
        return v

    @property
    def memory_bytes(self) -> int:
        return int(parse_quantity(self.memory))


class Round(InputModel):
    """How long a pod trains between reports to the leaderboard: env steps or seconds."""

    env_steps: int | None = Field(default=None, gt=0)
    seconds: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one(self) -> Round:
        if (self.env_steps is None) == (self.seconds is None):
            raise ValueError("set exactly one of env_steps or seconds")
        return self


class Budget(InputModel):
    total_env_steps: int | None = Field(default=None, gt=0)
    wall_time_s: float | None = Field(default=None, gt=0)
    pods_launched: int | None = Field(default=None, gt=0)


class Evaluation(InputModel):
    episodes: int = Field(default=10, ge=1)
    every_rounds: int = Field(default=1, ge=1)
    seed: int | None = Field(
        default=None,
        ge=0,
        lt=2**31,
        description="Seed of the evaluation episodes' start states, the same for every pod so "
        "that scores are comparable (default: derived from the experiment's name).",
    )
    env_kwargs: JsonObject = Field(
        default_factory=dict,
        description="The evaluation env's arguments on top of env.kwargs, e.g. a trading "
        "env's held-out period and score: {mode: validation, score: sharpe}.",
    )
    higher_is_better: bool = True


class ExperimentSpec(InputModel):
    name: str = Field(description="DNS-1123 label: lower-case letters, digits, '-'.")
    env: EnvSpec
    algorithms: dict[str, float] = Field(
        min_length=1,
        description="Algorithm name → weight (> 0): its share of the experiment's pods.",
    )
    search_space: SearchSpace = Field(default_factory=dict)
    generator: GeneratorSpec = Field(default_factory=GeneratorSpec)
    population: Population = Field(default_factory=Population)
    resources: Resources = Field(default_factory=Resources)
    round: Round = Field(default_factory=lambda: Round(env_steps=100_000))
    target_return: float | None = Field(
        default=None,
        # The name a run config and the presets use; specs written before it said
        # target_reward, still accepted (deprecated: docs/orchestrator.md).
        validation_alias=AliasChoices("target_return", "target_reward"),
        description="Stop the experiment once the best evaluated agent's return reaches it.",
    )
    top_k: int = Field(default=8, ge=1, le=1024, description="Leaderboard size.")
    budget: Budget = Field(default_factory=Budget)
    evaluation: Evaluation = Field(default_factory=Evaluation)
    priority: int = Field(default=0, ge=-1000, le=1000, description="Higher preempts lower.")

    @model_validator(mode="after")
    def _population_pods(self) -> ExperimentSpec:
        # Population pods stack their agents' weights:
        # refused here, by the pods' own torch-free check, rather than by every pod at start.
        if self.population.agents_per_pod > 1:
            pins = pinned_values(self.search_space)
            check_population(
                self.population.agents_per_pod, self.algorithms, self.search_space, pins
            )
        return self

    @model_validator(mode="after")
    def _reachable(self) -> ExperimentSpec:
        # Settings the rest of the spec makes dead: each would be accepted and never act.
        options = options_model(self.generator.strategy).model_validate(self.generator.options)
        for name, count in board_counts(options).items():
            if count > self.top_k:
                raise ValueError(
                    f"generator.options.{name} ({count}) > top_k ({self.top_k}): the board "
                    "never holds that many candidates"
                )
        p, budget = self.population, self.budget
        if budget.pods_launched is not None and budget.pods_launched < p.min_pods:
            raise ValueError(
                f"budget.pods_launched ({budget.pods_launched}) < population.min_pods "
                f"({p.min_pods}): the experiment could never run its minimum of pods"
            )
        total = budget.total_env_steps
        if total is None:
            return self
        if p.halving is not None and total <= (rung := p.halving_rung_env_steps):
            raise ValueError(
                f"population.halving: its first rung comes at {rung:,} env steps counted "
                f"(max_pods * agents_per_pod * rung_env_steps), and the experiment ends "
                f"at budget.total_env_steps ({total:,}): no pod would ever be stopped"
            )
        most = total // p.agents_per_pod  # one pod's agents given the whole budget
        if p.exploit is not None and p.exploit.every_env_steps > most:
            raise ValueError(
                f"population.exploit.every_env_steps ({p.exploit.every_env_steps:,}): an "
                f"agent trains at most {most:,} env steps of budget.total_env_steps "
                f"({total:,} over agents_per_pod), so it would never be judged"
            )
        return self

    @model_validator(mode="after")
    def _whole_run(self) -> ExperimentSpec:
        # Settings marked WHOLE_RUN (PPO's anneal_lr: the learning rate to 0 over the budget)
        # act over a budget of which a tournament's agent trains an unknown share (PBT carries
        # agents across slots): they would act over the wrong horizon. Pods leave them off.
        slots = self.population.max_pods * self.population.agents_per_pod
        if slots > 1 and (names := whole_run_settings(self.search_space, self.algorithms)):
            raise ValueError(
                f"search_space.{names[0]}: true cannot be honoured by a tournament of {slots} "
                "agents (it acts over the run's whole budget, of which each agent trains an "
                "unknown share); leave it false, or run one pod of one agent"
            )
        return self

    @model_validator(mode="after")
    def _target_reachable(self) -> ExperimentSpec:
        # A target no episode can reach (Pendulum's 200 for -200) never stops the experiment:
        # without a budget it would run for ever.
        higher = self.evaluation.higher_is_better
        if higher and (why := unreachable_target(self.env.name, self.target_return)):
            raise ValueError(f"target_return {why}; without one it runs to its budget")
        return self

    @model_validator(mode="after")
    def _env_arguments(self) -> ExperimentSpec:
        # A misspelt argument would make every pod exit on start (and be replaced, until the
        # launch budget ends): refused here where the env's card lists what it takes.
        for field, given in (("env.kwargs", self.env.kwargs),
                             ("evaluation.env_kwargs", self.evaluation.env_kwargs)):  # fmt: skip
            if problem := argument_problem(self.env.name, field, given):
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _action_spaces(self) -> ExperimentSpec:
        # DQN on Pendulum would be accepted and every pod would exit "bad input": refused
        # here from the torch-free table the pods' algorithms declare their kinds in. A model
        # check (after the population check, whose message names the cause first), so it
        # names both fields.
        if problems := misfits(self.env.name, list(self.algorithms)):
            raise ValueError(f"algorithms do not fit env.name: {'; '.join(problems)}")
        return self

    @field_validator("name")
    @classmethod
    def _dns(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("must be a DNS-1123 label (a-z, 0-9, '-', at most 63 characters)")
        return v

    @field_validator("search_space")
    @classmethod
    def _hyperparameter_names(cls, v: SearchSpace, info: ValidationInfo) -> SearchSpace:
        # A name the pods would refuse is refused here (422 at submission), instead of an
        # experiment whose pods all exit on start: the pods' own check, torch-free.
        if algorithms := list(info.data.get("algorithms") or {}):  # none: they failed
            check_hyperparameter_names(v, algorithms)
            check_hyperparameter_values(v, algorithms)
        return v

    @field_validator("algorithms")
    @classmethod
    def _algorithms(cls, v: dict[str, float]) -> dict[str, float]:
        _check_names("algorithm", registry.ALGORITHMS, list(v))
        # A plugin registered under podium.algorithms without a card would make every pod
        # exit on start: refused here, with what pods do train. A pod-trainable algorithm has
        # a card under podium.algorithm_cards (torch-free, services/contracts/algorithms/);
        # the pod still checks the class itself and exits 2 if the card lied.
        trainable = set(card_names())
        untrainable = [a for a in v if a not in trainable]
        if untrainable:
            raise ValueError(
                f"algorithm {', '.join(map(repr, untrainable))} is registered but no pod can "
                f"train it (an algorithm a pod trains has a card under "
                f"{registry.ALGORITHM_CARDS}); pods train: {', '.join(sorted(trainable))}"
            )
        bad = [k for k, w in v.items() if not (w > 0 and math.isfinite(w))]
        if bad:
            raise ValueError(f"weights must be finite and > 0: {', '.join(bad)}")
        return v


class SpecError(ValueError):
    """A spec file that cannot be loaded; the message names the file and the fields."""


#: What a search space's entry is, for an entry that is none of them.
_DISTRIBUTIONS = (
    "a search_space entry is {type: uniform, low: L, high: H} (or log_uniform, int_uniform) "
    "or {type: choice, values: [...]}; one value pins a setting: {type: choice, values: [V]}"
)
_NOT_A_DISTRIBUTION = {"union_tag_not_found", "union_tag_invalid", "model_attributes_type"}


def describe_errors(exc: ValidationError) -> list[str]:
    """One ``  field.path: message`` line per validation error (CLI and spec files alike)."""
    lines = []
    for err in exc.errors():
        loc = err["loc"]
        message = err["msg"]
        if loc[:1] == ("search_space",) and len(loc) == 2 and err["type"] in _NOT_A_DISTRIBUTION:
            message = f"{message} ({_DISTRIBUTIONS})"
        lines.append(f"  {'.'.join(str(p) for p in loc) or '(root)'}: {message}")
    return lines


class _UniqueKeyLoader(yaml.SafeLoader):
    """``safe_load`` that refuses a key given twice in one mapping: YAML says a mapping's keys
    are unique, PyYAML keeps the last one silently (a second ``search_space:`` would drop
    the first's names without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice in one mapping", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> Any:
    """A YAML file's value; a ValueError says why it cannot be read (missing, unreadable, not
    UTF-8, not YAML). Spec files and the CLI's config files are read with it."""
    try:
        return yaml.load(Path(path).read_bytes().decode("utf-8"), Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise ValueError("cannot read: it does not exist") from None
    except OSError as e:
        raise ValueError(f"cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML: {e}") from None


def read_spec_mapping(path: str | Path) -> dict[str, Any]:
    """A spec file's YAML as a mapping of JSON values, not yet validated; SpecError names the
    file. What JSON cannot carry (YAML's ``.nan`` / ``.inf``, dates, binary, non-string keys)
    is refused here, with the field named: the mapping is sent as JSON and stored."""
    try:
        data = read_yaml(path)
    except ValueError as e:
        raise SpecError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected an experiment spec (a mapping) at the top level")
    try:
        check_json_value(data)
    except ValueError as e:
        raise SpecError(f"{path}: invalid experiment spec:\n  {e}") from None
    return data


def load_spec(path: str | Path) -> ExperimentSpec:
    data = read_spec_mapping(path)
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as e:
        lines = describe_errors(e)
        raise SpecError(f"{path}: invalid experiment spec:\n" + "\n".join(lines)) from e
