"""The HTTP clients of Podium's APIs: one retry policy, one bearer header, and the leaderboard's
client, typed with the leaderboard's own models (services/contracts/leaderboard.py), that the
pods, the orchestrator and the CLI all use.

The retry policy (tenacity): connection errors and 429/5xx answers are retried with jittered
exponential backoff, so a leaderboard that restarts (or a Redis failover behind it) delays a
caller but loses nothing; a 4xx is never retried. Retries go on until ``deadline`` (a
``time.monotonic()`` value; a pod sets it when told to stop, so a final report gives up within
the grace period) or for ``retry_for_s`` seconds (the orchestrator: 0, a reconcile pass must not
wait on the leaderboard; the CLI: a few seconds). A submission keeps its ``submission_id``
across retries and the updater is idempotent by that id, so a retry whose first attempt did
land is answered with the first answer (``duplicate: true``).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    wait_random_exponential,
)

from services.contracts.artifacts import CompileCacheState, CompileClaim, PodFile
from services.contracts.leaderboard import (
    Candidate,
    ExperimentConfig,
    ExperimentSummary,
    GenerateRequest,
    Leaderboard,
    Lineage,
    Manifest,
    ManifestCheckpoint,
    SubmissionLog,
    SubmissionResponse,
    SubmissionResult,
)
from services.contracts.training_files import CHUNK, sha256_bytes
from services.logs import get_logger

log = get_logger(__name__)

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
M = TypeVar("M", bound=BaseModel)


def bearer(token: str | None) -> dict[str, str]:
    """The Authorization header of every Podium API call (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class ServiceError(RuntimeError):
    """A service refused a request (``status``, and the answer's ``detail``), or could not be
    reached (``status`` None; ``detail`` "timeout", or why it could not connect), or answered
    something its models do not describe (``status`` and ``detail`` None)."""

    def __init__(
        self,
        message: str,
        service: str,
        url: str,
        status: int | None = None,
        detail: Any = None,
        path: str = "",
    ):
        super().__init__(message)
        self.service, self.url, self.status, self.detail, self.path = (
            service,
            url,
            status,
            detail,
            path,
        )


class LeaderboardError(ServiceError):
    """The leaderboard refused a request, or could not be reached before the deadline."""


class ExperimentConfigError(LeaderboardError):
    """409: the experiment's configuration is in conflict: it no longer validates, its generator
    strategy fails, or an update contradicts it. No retry or new pod mends it: a pod exits as
    bad input."""


def _detail(resp: httpx.Response) -> Any:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:300] or resp.reason_phrase
    return body.get("detail", body) if isinstance(body, dict) else body


class ServiceClient:
    """One Podium API at ``base_url`` (``/api/v1`` below it) with the one retry policy."""

    service = "service"
    error: type[ServiceError] = ServiceError
    #: The error of a 409 answer, where the service gives 409 a meaning of its own.
    conflict_error: type[ServiceError] | None = None

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        retry_for_s: float | None = None,
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.url = base_url.rstrip("/")
        self.token_given = bool(token)
        self.http = httpx.Client(
            base_url=self.url + "/api/v1", headers=bearer(token), timeout=timeout_s
        )
        self.retry_for_s = retry_for_s
        self.initial_backoff_s, self.max_backoff_s = initial_backoff_s, max_backoff_s
        self.deadline: float | None = None
        self.retries = 0  # every retried attempt, for logs and tests

    def close(self) -> None:
        self.http.close()

    def __enter__(self: Any) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the retry policy ----------------------------------------------------------------------
    def _give_up(self, state: RetryCallState) -> bool:
        resume = state.upcoming_sleep
        if self.deadline is not None and time.monotonic() + resume > self.deadline:
            return True
        return (
            self.retry_for_s is not None and state.seconds_since_start + resume > self.retry_for_s
        )

    def _before_sleep(self, state: RetryCallState) -> None:
        self.retries += 1
        outcome = state.outcome
        if outcome is not None and outcome.failed:
            exc = outcome.exception()
            problem = f"{type(exc).__name__}: {exc}"
        else:
            resp = outcome.result() if outcome is not None else None
            problem = f"HTTP {resp.status_code}" if resp is not None else "?"
        log.warning(f"{self.service} unavailable, retrying", url=self.url, error=problem)

    def _retrying(self) -> Retrying:
        return Retrying(
            retry=retry_if_exception_type(httpx.TransportError)
            | retry_if_result(lambda r: r.status_code in RETRY_STATUS),
            # Jitter spreads the retries of many pods after a leaderboard restart.
            wait=wait_random_exponential(multiplier=self.initial_backoff_s, max=self.max_backoff_s),
            stop=self._give_up,
            before_sleep=self._before_sleep,
            # Out of time: the last answer (or error) stands.
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )

    def request(self, method: str, path: str, what: str = "request", **kw: Any) -> httpx.Response:
        """Send with the retry policy; a 4xx (or a 5xx that outlasted it) is ``self.error``."""
        try:
            resp: httpx.Response = self._retrying()(self.http.request, method, path, **kw)
        except httpx.TimeoutException:
            raise self.error(
                f"{what}: the {self.service} at {self.url} did not answer in time",
                self.service,
                self.url,
                detail="timeout",
                path=path,
            ) from None
        except httpx.HTTPError as exc:
            raise self.error(
                f"{what}: cannot reach the {self.service} at {self.url} ({_reason(exc)})",
                self.service,
                self.url,
                detail=_reason(exc),
                path=path,
            ) from None
        self.check(resp, what)
        return resp

    def check(self, resp: httpx.Response, what: str) -> None:
        if resp.status_code < 400:
            return
        detail = _detail(resp)
        conflict = resp.status_code == 409 and self.conflict_error is not None
        raise (self.conflict_error if conflict else self.error)(
            f"{what}: HTTP {resp.status_code}: {str(detail)[:500]}",
            self.service,
            self.url,
            resp.status_code,
            detail,
            resp.request.url.path,
        )

    def json(self, method: str, path: str, what: str = "request", **kw: Any) -> Any:
        resp = self.request(method, path, what, **kw)
        try:
            return resp.json()
        except ValueError:
            raise self.error(
                f"{what}: the {self.service} at {self.url} sent a non-JSON answer",
                self.service,
                self.url,
                resp.status_code,
                path=path,
            ) from None

    def model(self, model: type[M], method: str, path: str, what: str, **kw: Any) -> M:
        """The answer, parsed by the API's own response model."""
        body = self.json(method, path, what, **kw)
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            raise self.error(
                f"{what}: the {self.service} at {self.url} answered with an unexpected "
                f"{model.__name__}: {exc.errors()[0]['msg']}",
                self.service,
                self.url,
                path=path,
            ) from None


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "refused" in text.lower():
        return "connection refused"
    return text or type(exc).__name__


class LeaderboardClient(ServiceClient):
    """The leaderboard API. ``experiment_id`` is the default experiment of the per-experiment
    calls (a pod knows only its own); each call may name another."""

    service = "leaderboard"
    error = LeaderboardError
    conflict_error = ExperimentConfigError

    def __init__(self, base_url: str, experiment_id: str = "", token: str | None = None, **kw: Any):
        super().__init__(base_url, token, **kw)
        self.experiment_id = experiment_id

    def _exp(self, experiment_id: str | None) -> str:
        return f"/experiments/{experiment_id or self.experiment_id}"

    # -- the orchestrator's calls --------------------------------------------------------------
    def register(self, config: ExperimentConfig, experiment_id: str | None = None) -> None:
        body = config.model_dump(mode="json")
        self.request("PUT", self._exp(experiment_id), "register", json=body)

    def summary(self, experiment_id: str | None = None) -> ExperimentSummary | None:
        """The experiment's summary, None when the leaderboard does not know it."""
        return self._or_none(ExperimentSummary, self._exp(experiment_id), "summary")

    def best(self, experiment_id: str | None = None) -> Candidate | None:
        """The best candidate, None while there is none (or the experiment is unknown)."""
        return self._or_none(Candidate, f"{self._exp(experiment_id)}/best", "best")

    def best_or_error(self, experiment_id: str | None = None) -> Candidate:
        """The best candidate; a LeaderboardError (404, saying why) while there is none."""
        return self.model(Candidate, "GET", f"{self._exp(experiment_id)}/best", "best")

    def delete(self, experiment_id: str | None = None) -> None:
        try:
            self.request("DELETE", self._exp(experiment_id), "delete")
        except LeaderboardError as exc:
            if exc.status != 404:
                raise

    def _or_none(self, model: type[M], path: str, what: str) -> M | None:
        try:
            return self.model(model, "GET", path, what)
        except LeaderboardError as exc:
            if exc.status == 404:
                return None
            raise

    # -- the pods' calls -----------------------------------------------------------------------
    def generate(
        self, pod_id: str, algorithm: str | None = None, score: float | None = None
    ) -> Manifest:
        """Where to start: the generator's manifest (hyperparameters, parent, lease).
        ``score``: the pod's current one, when it asks whether to restart (PBT)."""
        if score is not None and not math.isfinite(score):
            score = None
        body = GenerateRequest(pod_id=pod_id, algorithm=algorithm, score=score)
        return self.model(
            Manifest,
            "POST",
            f"{self._exp(None)}/generate",
            "generate",
            json=body.model_dump(exclude_none=True),
        )

    def candidate(self, candidate_id: str, experiment_id: str | None = None) -> Candidate:
        path = f"{self._exp(experiment_id)}/candidates/{candidate_id}"
        return self.model(Candidate, "GET", path, "candidate")

    def download(self, checkpoint: ManifestCheckpoint) -> dict[str, bytes]:
        """Every file of a manifest's checkpoint, each checked against its sha256."""
        files: dict[str, bytes] = {}
        for name, entry in checkpoint.files.items():
            path = entry.download_path.removeprefix("/api/v1")
            data = self.request("GET", path, f"download {name}").content
            if sha256_bytes(data) != entry.sha256:
                raise LeaderboardError(
                    f"download {name}: sha256 does not match the manifest", self.service, self.url
                )
            files[name] = data
        return files

    def submit(
        self, result: SubmissionResult | dict[str, Any], files: dict[str, bytes]
    ) -> SubmissionResponse:
        """Report a result with its training files; its ``submission_id`` is reused by every
        retry, so the updater counts it once. A result the leaderboard's model refuses is not
        sent (a LeaderboardError with status 422, as the leaderboard would answer)."""
        data = result.model_dump() if isinstance(result, BaseModel) else dict(result)
        try:
            body = SubmissionResult.model_validate(
                {**data, "files": {name: sha256_bytes(d) for name, d in files.items()}}
            )
        except ValidationError as exc:
            raise LeaderboardError(
                f"submit: invalid result: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}",
                self.service,
                self.url,
                422,
            ) from None
        parts: dict[str, Any] = {
            "result": (None, body.model_dump_json(), "application/json"),
            **{name: (name, data, "application/octet-stream") for name, data in files.items()},
        }
        return self.model(
            SubmissionResponse, "POST", f"{self._exp(None)}/submissions", "submit", files=parts
        )

    def release(self, lease_id: str) -> None:
        """Let the parent's files go; a lease already gone (expired) is fine."""
        try:
            self.request("DELETE", f"{self._exp(None)}/leases/{lease_id}", "release")
        except LeaderboardError as exc:
            if exc.status != 404:
                raise

    def compile_claim(self, claim: CompileClaim) -> CompileCacheState:
        """Ask for the compile cache of ``claim.facts``' key: ``ready`` (fetch it), ``compile``
        (this pod compiles and publishes; claiming again renews it) or ``wait``."""
        key = claim.facts.key()
        path = f"{self._exp(None)}/compile-caches/{key}/claim"
        body = claim.model_dump(mode="json", exclude_none=True)
        return self.model(CompileCacheState, "POST", path, "compile cache claim", json=body)

    def compile_publish(self, claim: CompileClaim, data: bytes) -> CompileCacheState:
        """Publish a compile cache bundle (empty: nothing to share); the key's state after."""
        facts = claim.facts
        params = {"pod_id": claim.pod_id, **facts.model_dump()}
        path = f"{self._exp(None)}/compile-caches/{facts.key()}"
        return self.model(
            CompileCacheState,
            "PUT",
            path,
            "compile cache publish",
            params=params,
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )

    def compile_fetch(self, key: str, dest: Path) -> tuple[str, int, str | None]:
        """Stream the key's published cache into ``dest``: its sha256, size and the sha256
        the leaderboard's record names (the caller compares them with the claim's answer)."""
        return self.stream_to(f"{self._exp(None)}/compile-caches/{key}", dest)

    def put_pod_file(self, pod_id: str, name: str, data: bytes) -> PodFile:
        """Keep one of the pod's files (``log``, ``tensorboard``), replacing its last upload."""
        path = f"{self._exp(None)}/pods/{pod_id}/files/{name}"
        headers = {"Content-Type": "application/octet-stream"}
        return self.model(PodFile, "PUT", path, f"upload {name}", content=data, headers=headers)

    # -- the CLI's calls -----------------------------------------------------------------------
    def pod_files(self, experiment_id: str) -> list[PodFile]:
        """The files the experiment's pods kept, oldest upload first."""
        body = self.json("GET", f"{self._exp(experiment_id)}/pod-files", "pod files")
        return [PodFile.model_validate(f) for f in body]

    def pod_file_path(self, experiment_id: str, pod_id: str, name: str) -> str:
        """Where ``stream_to`` downloads a pod's file from."""
        return f"{self._exp(experiment_id)}/pods/{pod_id}/files/{name}"

    def board(self, experiment_id: str, limit: int | None = None) -> Leaderboard:
        params = {"limit": limit} if limit else None
        path = f"{self._exp(experiment_id)}/leaderboard"
        return self.model(Leaderboard, "GET", path, "leaderboard", params=params)

    def lineage(self, experiment_id: str) -> Lineage:
        """Every candidate ever inserted: ``nodes``, a flat list linked by ``parent_id``."""
        return self.model(Lineage, "GET", f"{self._exp(experiment_id)}/lineage", "lineage")

    def submissions(self, experiment_id: str, page: int = 10_000) -> SubmissionLog:
        """Every decided report (kept or not), oldest first, read page by page."""
        return self.submissions_since(experiment_id, None, page)[0]

    def submissions_since(
        self, experiment_id: str, after: str | None, page: int = 10_000
    ) -> tuple[SubmissionLog, str | None]:
        """The decided reports after stream id ``after``, oldest first, read page by page; and
        the cursor to resume from: that of the last full page read (the log gives one for full
        pages only), else ``after``."""
        path = f"{self._exp(experiment_id)}/submissions"
        params: dict[str, Any] = {"limit": page, **({"after": after} if after else {})}
        log_ = self.model(SubmissionLog, "GET", path, "submissions", params=params)
        while log_.next_after:
            after = params["after"] = log_.next_after
            more = self.model(SubmissionLog, "GET", path, "submissions", params=params)
            log_ = more.model_copy(update={"submissions": log_.submissions + more.submissions})
        return log_, after

    def stream_to(self, download_path: str, dest: Path) -> tuple[str, int, str | None]:
        """Stream a candidate's file into ``dest`` (fsynced), hashing it on the way; its
        sha256, its size and the sha256 the leaderboard's header states."""
        digest, size = hashlib.sha256(), 0
        with self._stream(download_path.removeprefix("/api/v1")) as resp:
            header = resp.headers.get("X-Checkpoint-SHA256")
            with open(dest, "wb") as f:
                for chunk in resp.iter_bytes(CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        return digest.hexdigest(), size, header

    @contextmanager
    def _stream(self, path: str) -> Iterator[httpx.Response]:
        try:
            with self.http.stream("GET", path) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    self.check(resp, "download")
                yield resp
        except httpx.HTTPError as exc:
            raise LeaderboardError(
                f"download: the leaderboard at {self.url} failed: {exc}", self.service, self.url
            ) from None
