"""How the orchestrator learns an experiment's progress: the leaderboard, over HTTP only.

The seam is ``ProgressSource``: register an experiment, read its progress (best evaluated score,
best candidate, total env steps the pods reported), delete it. ``LeaderboardClient`` talks to
the leaderboard service:

- ``PUT    /api/v1/experiments/{id}``: register (top_k, generator, algorithms, search space,
  higher_is_better);
- ``GET    /api/v1/experiments/{id}/best``: the best candidate (``score``, ``candidate_id``);
  404 while there is none;
- ``GET    /api/v1/experiments/{id}``: the experiment summary; its ``env_steps`` field (the
  total env steps of every submission the pods made) drives the env-step budget;
- ``DELETE /api/v1/experiments/{id}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from services.logs import get_logger
from services.spec import ExperimentSpec

log = get_logger(__name__)


@dataclass
class Progress:
    best: dict[str, Any] | None = None  # the best candidate as the leaderboard returns it
    env_steps: int | None = None

    @property
    def best_score(self) -> float | None:
        if self.best is None or self.best.get("score") is None:
            return None
        return float(self.best["score"])


class ProgressSource(Protocol):
    def register(self, experiment_id: str, spec: ExperimentSpec) -> None: ...

    def progress(self, experiment_id: str) -> Progress: ...

    def delete(self, experiment_id: str) -> None: ...

    def reporters(self, experiment_id: str, after: str | None) -> tuple[set[str], str | None]:
        """Pod ids with a decided report after stream id ``after``, and the new cursor."""
        ...


class NoLeaderboard:
    """No leaderboard configured: no scores, so only wall-time and pod budgets can end a run."""

    def register(self, experiment_id: str, spec: ExperimentSpec) -> None:
        return None

    def progress(self, experiment_id: str) -> Progress:
        return Progress()

    def delete(self, experiment_id: str) -> None:
        return None

    def reporters(self, experiment_id: str, after: str | None) -> tuple[set[str], str | None]:
        return set(), after


def leaderboard_config(spec: ExperimentSpec) -> dict[str, Any]:
    return {
        "top_k": spec.top_k,
        "generator": {"strategy": spec.generator.strategy, "options": spec.generator.options},
        "algorithms": spec.algorithms,
        "search_space": {k: v.model_dump() for k, v in spec.search_space.items()},
        "higher_is_better": spec.evaluation.higher_is_better,
    }


class LeaderboardClient:
    def __init__(self, base_url: str, token: str | None, timeout_s: float = 5.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(
            base_url=base_url.rstrip("/") + "/api/v1", headers=headers, timeout=timeout_s
        )

    def register(self, experiment_id: str, spec: ExperimentSpec) -> None:
        r = self.http.put(f"/experiments/{experiment_id}", json=leaderboard_config(spec))
        r.raise_for_status()

    def progress(self, experiment_id: str) -> Progress:
        out = Progress()
        r = self.http.get(f"/experiments/{experiment_id}/best")
        if r.status_code != 404:
            r.raise_for_status()
            out.best = r.json()
        r = self.http.get(f"/experiments/{experiment_id}")
        if r.status_code != 404:
            r.raise_for_status()
            steps = r.json().get("env_steps")
            out.env_steps = int(steps) if steps is not None else None
        return out

    def delete(self, experiment_id: str) -> None:
        r = self.http.delete(f"/experiments/{experiment_id}")
        if r.status_code != 404:
            r.raise_for_status()

    def reporters(self, experiment_id: str, after: str | None) -> tuple[set[str], str | None]:
        """From the submission log (``GET …/submissions``): the cursor returned is that of the
        last full page read, since the log gives one for full pages only; the caller keeps the
        union, so the partial page read again next time adds nothing twice."""
        pods: set[str] = set()
        while True:
            params: dict[str, Any] = {"limit": 1000, **({"after": after} if after else {})}
            r = self.http.get(f"/experiments/{experiment_id}/submissions", params=params)
            if r.status_code == 404:
                return pods, after
            r.raise_for_status()
            page = r.json()
            pods.update(s["pod_id"] for s in page["submissions"])
            if not page.get("next_after"):
                return pods, after
            after = page["next_after"]

    def close(self) -> None:
        self.http.close()
