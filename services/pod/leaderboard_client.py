"""The pod's side of the leaderboard API: generate, download a parent's files, submit, release.

Every call is retried with exponential backoff on connection errors and 5xx/429 answers, so a
leaderboard that restarts (or a Redis failover behind it) delays a pod but loses nothing. A
submission keeps its ``submission_id`` across retries; the updater is idempotent by that id, so
a retry whose first attempt did land is answered with the first answer (``duplicate: true``).

Retries go on until ``deadline`` (a ``time.monotonic()`` value; ``None`` = no limit). The pod
sets it when it is told to stop, so a final report gives up within the grace period.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from services.contracts.training_files import sha256_bytes
from services.logs import get_logger

log = get_logger(__name__)

RETRY_STATUS = {429, 500, 502, 503, 504}


class LeaderboardError(RuntimeError):
    """The leaderboard refused a request (4xx), or could not be reached before the deadline."""


class LeaderboardClient:
    def __init__(
        self,
        base_url: str,
        experiment_id: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(
            base_url=base_url.rstrip("/") + "/api/v1", headers=headers, timeout=timeout_s
        )
        self.experiment = f"/experiments/{experiment_id}"
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.deadline: float | None = None
        self.retries = 0  # every retried attempt, for logs and tests

    def close(self) -> None:
        self.http.close()

    def _request(self, what: str, send: Callable[[], httpx.Response]) -> httpx.Response:
        delay = self.initial_backoff_s
        while True:
            try:
                response = send()
                if response.status_code not in RETRY_STATUS:
                    break
                problem = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if self.deadline is not None and time.monotonic() + delay > self.deadline:
                raise LeaderboardError(f"{what}: leaderboard unavailable ({problem}); gave up")
            self.retries += 1
            log.warning("leaderboard unavailable, retrying", request=what, error=problem)
            # Jitter spreads the retries of many pods after a leaderboard restart.
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.max_backoff_s)
        if response.is_error:
            raise LeaderboardError(f"{what}: HTTP {response.status_code}: {response.text[:500]}")
        return response

    def generate(
        self, pod_id: str, algorithm: str | None = None, score: float | None = None
    ) -> dict[str, Any]:
        """Where to start: the generator's manifest (hyperparameters, parent, lease).
        ``score``: the pod's current one, when it asks whether to restart (PBT)."""
        body: dict[str, Any] = {"pod_id": pod_id}
        if algorithm is not None:
            body["algorithm"] = algorithm
        if score is not None and math.isfinite(score):
            body["score"] = score
        url = f"{self.experiment}/generate"
        return self._request("generate", lambda: self.http.post(url, json=body)).json()

    def candidate(self, candidate_id: str) -> dict[str, Any]:
        url = f"{self.experiment}/candidates/{candidate_id}"
        return self._request("candidate", lambda: self.http.get(url)).json()

    def download(self, checkpoint: dict[str, Any]) -> dict[str, bytes]:
        """Every file of a manifest's checkpoint, each checked against its sha256."""
        files: dict[str, bytes] = {}
        for name, entry in checkpoint["files"].items():
            url = f"{self.experiment}/candidates/{checkpoint['candidate_id']}/files/{name}"
            data = self._request(f"download {name}", lambda url=url: self.http.get(url)).content
            if sha256_bytes(data) != entry["sha256"]:
                raise LeaderboardError(f"download {name}: sha256 does not match the manifest")
            files[name] = data
        return files

    def submit(self, result: dict[str, Any], files: dict[str, bytes]) -> dict[str, Any]:
        """Report a result with its training files; ``result['submission_id']`` is reused by
        every retry, so the updater counts it once."""
        result = {**result, "files": {n: sha256_bytes(d) for n, d in files.items()}}
        parts: dict[str, Any] = {"result": (None, json.dumps(result), "application/json")}
        for name, data in files.items():
            parts[name] = (name, data, "application/octet-stream")
        url = f"{self.experiment}/submissions"
        return self._request("submit", lambda: self.http.post(url, files=parts)).json()

    def release(self, lease_id: str) -> None:
        """Let the parent's files go; a lease already gone (expired) is fine."""
        url = f"{self.experiment}/leases/{lease_id}"
        try:
            self._request("release", lambda: self.http.delete(url))
        except LeaderboardError as exc:
            if "HTTP 404" not in str(exc):
                raise
