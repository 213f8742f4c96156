"""Request and response models of the leaderboard API (inputs forbid unknown fields)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.contracts.inputs import InputModel, JsonObject
from services.contracts.search_space import SearchSpace

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
FILE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class GeneratorConfig(InputModel):
    strategy: str = Field(
        default="pbt", description="Registered name in the `podium.generators` entry-point group."
    )
    options: JsonObject = Field(
        default_factory=dict, description="Strategy options, validated by the strategy."
    )


class ExperimentConfig(InputModel):
    """A leaderboard's configuration, set by the orchestrator when an experiment is created."""

    top_k: int | None = Field(default=None, ge=1, le=10_000, description="Candidates kept.")
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    algorithms: dict[str, float] = Field(
        default_factory=lambda: {"ppo": 1.0},
        min_length=1,
        description="Algorithm ensemble: name -> weight; each new pod gets one algorithm.",
    )
    search_space: SearchSpace = Field(default_factory=dict)
    higher_is_better: bool = True

    @field_validator("algorithms")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        for name, w in v.items():
            if not (w >= 0 and w < float("inf")):
                raise ValueError(f"weight of {name!r} must be finite and >= 0")
        if sum(v.values()) <= 0:
            raise ValueError("at least one algorithm needs a positive weight")
        return v


class Experiment(ExperimentConfig):
    model_config = ConfigDict(extra="ignore")
    experiment_id: str
    top_k: int  # type: ignore[assignment]


class ExperimentSummary(Experiment):
    size: int = Field(description="Candidates on the board now.")
    submissions: int = Field(description="Submissions decided (kept or not; retries once).")
    env_steps: int = Field(description="Env steps over every decided submission (budgets).")


class EvalStats(InputModel):
    mean: float = Field(allow_inf_nan=False)
    std: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    episodes: int = Field(default=0, ge=0)


class SubmissionResult(InputModel):
    """A trained agent's result, as the pod's evaluator reports it."""

    submission_id: str = Field(
        pattern=ID_PATTERN, description="Chosen by the pod; a retry with it gets the first answer."
    )
    pod_id: str = Field(max_length=253)
    algorithm: str = Field(pattern=ID_PATTERN)
    hyperparameters: JsonObject = Field(default_factory=dict)
    parent_id: str | None = Field(default=None, pattern=ID_PATTERN)
    # Bounded so no single submission can overflow the experiment's running totals.
    generation: int = Field(default=0, ge=0, le=10**9)
    env_steps: int = Field(
        default=0, ge=0, le=10**15, description="Env steps trained since the pod's previous report."
    )
    trained_env_steps: int | None = Field(
        default=None,
        ge=0,
        le=10**15,
        description="The agent's own env steps, its parents' included (its learner's count).",
    )
    batch_env_steps: int | None = Field(
        default=None,
        ge=1,
        le=10**15,
        description="Env steps the agent trains per step: its reports' env steps are whole "
        "multiples of it (the orchestrator hands out env-step budgets in whole batches).",
    )
    score: float = Field(allow_inf_nan=False, description="The evaluator's mean return.")
    eval: EvalStats
    files: dict[str, str] = Field(
        default_factory=dict,
        description="Training file name -> sha256 (lowercase hex) of its bytes; one multipart "
        "file part per name.",
    )

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        import re

        for name, digest in v.items():
            if not re.match(FILE_NAME_PATTERN, name):
                raise ValueError(f"bad file name {name!r}")
            if not re.match(SHA256_PATTERN, digest):
                raise ValueError(f"files[{name!r}] is not a lowercase hex sha256")
        return v


class SubmissionResponse(BaseModel):
    accepted: bool
    candidate_id: str | None = None
    rank: int | None = Field(default=None, description="1 = best, when accepted.")
    evicted: list[str] = Field(default_factory=list)
    reason: str | None = None
    duplicate: bool = Field(default=False, description="True when answering a retried id.")


_URI = (
    "The API path to fetch the file from (relative to the leaderboard's URL), as "
    "`download_path`: an opaque reference, never where the checkpoint store keeps it."
)


class CandidateFile(BaseModel):
    sha256: str
    uri: str = Field(description=_URI)
    download_path: str


class Candidate(BaseModel):
    candidate_id: str
    experiment_id: str
    status: Literal["active", "evicted"]
    rank: int | None = None
    algorithm: str
    hyperparameters: dict[str, Any]
    parent_id: str | None
    generation: int
    pod_id: str
    submission_id: str
    env_steps: int = Field(description="Env steps the pod trained since its previous report.")
    trained_env_steps: int | None = Field(
        default=None,
        description="The agent's own env steps, its parents' included (None: not reported).",
    )
    score: float
    eval: dict[str, float]
    files: dict[str, CandidateFile]
    created_at: float
    evicted_at: float | None = None


class HyperparameterStats(BaseModel):
    names: list[str] = Field(description="Numeric hyperparameters, order of the covariance.")
    mean: dict[str, float]
    variance: dict[str, float]
    covariance: list[list[float]]


class LeaderboardStats(BaseModel):
    size: int
    top_k: int
    score_mean: float | None
    score_std: float | None
    score_min: float | None
    score_max: float | None
    hyperparameters: HyperparameterStats
    algorithms: dict[str, int]


class Leaderboard(BaseModel):
    experiment_id: str
    candidates: list[Candidate]
    stats: LeaderboardStats


class GenerateRequest(InputModel):
    pod_id: str = Field(max_length=253)
    algorithm: str | None = Field(default=None, description="Pin the algorithm (ensemble).")
    score: float | None = Field(
        default=None,
        allow_inf_nan=False,
        description="The asking pod's current score, when it asks whether to restart from a "
        "better parent: PBT with a `truncation` option answers `keep` unless the pod is in the "
        "bottom share of the population.",
    )


class ManifestFile(BaseModel):
    uri: str = Field(description=_URI)
    sha256: str
    download_path: str


class ManifestCheckpoint(BaseModel):
    candidate_id: str
    files: dict[str, ManifestFile]


class Manifest(BaseModel):
    """Where a new pod starts: its algorithm, hyperparameters and weights."""

    experiment_id: str
    pod_id: str
    algorithm: str
    hyperparameters: dict[str, Any]
    parent_id: str | None
    parent_score: float | None = Field(
        default=None,
        description="The parent's score when chosen: a pod compares it with its own to decide "
        "whether to restart from it (PBT's exploit), without asking again.",
    )
    generation: int
    checkpoint: Literal["fresh"] | ManifestCheckpoint
    decision: str = Field(
        description="fresh | exploit | explore | cem | keep (strategy-specific); `keep`: go on "
        "training the agent you have (no parent, no hyperparameters)."
    )
    strategy: str
    lease_id: str | None = Field(
        default=None,
        description="Protects the parent's files from collection until released or expired.",
    )
    lease_expires_at: float | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if (self.checkpoint == "fresh") != (self.parent_id is None):
            raise ValueError("a parent comes with its checkpoint and vice versa")
        return self


class LineageNode(BaseModel):
    """One candidate ever inserted. The lineage is a flat list of these; ``parent_id`` links a
    node to its parent (clients rebuild the tree), so a chain of any depth serializes."""

    candidate_id: str
    parent_id: str | None = Field(
        description="The candidate it was trained from; None (or one no longer in the list) "
        "for a root."
    )
    algorithm: str
    generation: int
    pod_id: str = ""
    submission_id: str = ""
    env_steps: int = Field(
        default=0, description="Env steps the pod trained since its previous report."
    )
    score: float
    status: Literal["active", "evicted"]
    created_at: float = Field(description="When it was inserted (epoch seconds).")
    evicted_at: float | None = None


class Lineage(BaseModel):
    experiment_id: str
    nodes: list[LineageNode] = Field(description="Every candidate ever inserted, oldest first.")
    events: int = Field(description="Entries in the lineage stream.")


class SubmissionRecord(BaseModel):
    """One decided report, kept on the board or not (retries are not repeated)."""

    submission_id: str
    pod_id: str
    algorithm: str
    score: float
    env_steps: int = Field(
        description="Env steps the pod trained since its previous report; their running sum "
        "over the log is the experiment's env steps (0 for rejects recorded before this field)."
    )
    batch_env_steps: int | None = Field(
        default=None, description="Env steps the pod trains per step, when it said."
    )
    accepted: bool
    candidate_id: str | None = Field(default=None, description="When accepted.")
    parent_id: str | None = None
    generation: int | None = None
    decided_at: float = Field(description="When the leaderboard decided (epoch seconds).")


class SubmissionLog(BaseModel):
    experiment_id: str
    submissions: list[SubmissionRecord] = Field(description="In the order they were decided.")
    next_after: str | None = Field(
        description="Pass as ``after`` for the next page; None when this page is the last."
    )
