"""The orchestrator and leaderboard APIs as the CLI uses them, over the shared clients
(services/api_client.py).

Every failure becomes an ``ApiError`` whose message a user can act on (which service, which
URL, what to do) and whose ``exit_code`` the CLI exits with; no traceback reaches the user.

Where the services are: ``--url`` / ``PODIUM_URL`` (orchestrator), ``--leaderboard-url`` /
``PODIUM_LEADERBOARD_URL``, ``--token`` / ``PODIUM_TOKEN``. When no URL is given, a platform
started with ``podium up`` on the data directory (``PODIUM_DATA_DIR``, default ``data``) is
found through its session file; otherwise the defaults are the embedded platform's ports on
127.0.0.1.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from services.api_client import LeaderboardClient, ServiceClient, ServiceError
from services.cli.errors import EXIT_API, EXIT_NOT_REACHED, EXIT_USAGE, CliError
from services.cli.outputs import EXPORT_MARK, export_dir, output_dir
from services.cli.platform import DEFAULT_LEADERBOARD_PORT, DEFAULT_ORCHESTRATOR_PORT, read_session
from services.contracts.artifacts import TENSORBOARD_KIND, PodFile
from services.contracts.bundles import BundleError, unpack
from services.contracts.leaderboard import Candidate, Leaderboard, Lineage, SubmissionRecord
from services.contracts.training_files import (
    FILE_NAME_RE,
    MANIFEST,
    CheckpointError,
    replace_dir,
    temp_dir_beside,
    verify_digests,
)

T = TypeVar("T")
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "budget_exhausted"})


class ApiError(CliError):
    """A service refused, or could not be reached: exits 3 unless the refusal says otherwise
    (a 422 is bad input: 2)."""

    def __init__(self, message: str, exit_code: int = EXIT_API, status: int | None = None):
        super().__init__(message, exit_code, status)


@dataclass
class Endpoints:
    url: str
    leaderboard_url: str | None
    token: str | None
    leaderboard_token: str | None
    source: str  # where they came from, for messages


def resolve(
    url: str | None = None,
    token: str | None = None,
    leaderboard_url: str | None = None,
    leaderboard_token: str | None = None,
    data_dir: str | Path | None = None,
) -> Endpoints:
    """Explicit values first, then a running ``podium up`` on ``data_dir``, then defaults."""
    session = None
    if url is None:
        session = read_session(data_dir or os.environ.get("PODIUM_DATA_DIR", "data"))
    if session is not None:
        return Endpoints(
            url=session["orchestrator_url"],
            leaderboard_url=leaderboard_url or session["leaderboard_url"],
            token=token if token is not None else session.get("token"),
            leaderboard_token=leaderboard_token
            if leaderboard_token is not None
            else (token if token is not None else session.get("token")),
            source=f"the platform running on {session.get('data_dir')}",
        )
    if url is None:
        url = f"http://127.0.0.1:{DEFAULT_ORCHESTRATOR_PORT}"
        leaderboard_url = leaderboard_url or f"http://127.0.0.1:{DEFAULT_LEADERBOARD_PORT}"
    return Endpoints(
        url=url,
        leaderboard_url=leaderboard_url,
        token=token,
        leaderboard_token=leaderboard_token if leaderboard_token is not None else token,
        source="--url / PODIUM_URL",
    )


def describe_422(detail: Any, what: str = "request") -> str:
    """FastAPI's validation errors as ``field.path: message`` lines ("body" dropped)."""
    if not isinstance(detail, list):
        return f"invalid {what}: {detail}"
    lines = []
    for err in detail:
        if not isinstance(err, dict):
            lines.append(f"  {err}")
            continue
        loc = [str(p) for p in err.get("loc", [])]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        lines.append(f"  {'.'.join(loc) or '(root)'}: {err.get('msg', err)}")
    return f"invalid {what}:\n" + "\n".join(lines)


# A CLI call retries an unreachable or overloaded service this long, then says so.
RETRY_FOR_S = 3.0


class OrchestratorClient(ServiceClient):
    service = "orchestrator"


def api_error(exc: ServiceError, env_hint: str, token_given: bool, what: str) -> ApiError:
    """A service's refusal as the message a user can act on, and the CLI's exit code."""
    name, url, code = exc.service, exc.url, exc.status
    if code is None:
        if exc.detail not in (None, "timeout"):  # could not connect: ``detail`` says why
            return ApiError(
                f"cannot reach the {name} at {url} ({exc.detail}); is the platform running "
                f"(podium up)? Otherwise pass {env_hint}"
            )
        return ApiError(str(exc).removeprefix(f"{what}: "))
    if code == 401:
        hint = "the token was refused" if token_given else "it needs a token"
        return ApiError(
            f"the {name} at {url} answered 401 Unauthorized: {hint}; pass --token or set "
            "PODIUM_TOKEN",
            status=code,
        )
    if code == 422:
        return ApiError(describe_422(exc.detail, what), EXIT_USAGE, status=code)
    if code == 404 and exc.detail == "Not Found":
        return ApiError(
            f"the {name} at {url} has no {exc.path} (is that URL a Podium {name}?)", status=code
        )
    return ApiError(f"{name}: {exc.detail} (HTTP {code})", status=code)


class PodiumClient:
    """The orchestrator's experiments API and the leaderboard's read side, for the CLI: every
    refusal becomes an ``ApiError``."""

    def __init__(self, endpoints: Endpoints, timeout: float = 15.0):
        self.endpoints = endpoints
        self.timeout = timeout
        self.orchestrator = OrchestratorClient(
            endpoints.url, endpoints.token, timeout_s=timeout, retry_for_s=RETRY_FOR_S
        )
        self._leaderboard: LeaderboardClient | None = None

    @property
    def leaderboard(self) -> LeaderboardClient:
        if self._leaderboard is None:
            url = self.endpoints.leaderboard_url or self._discover_leaderboard()
            if not url:
                raise ApiError(
                    "no leaderboard URL (the orchestrator has none configured): pass "
                    "--leaderboard-url or set PODIUM_LEADERBOARD_URL",
                    EXIT_USAGE,
                )
            self._leaderboard = LeaderboardClient(
                url,
                token=self.endpoints.leaderboard_token,
                timeout_s=self.timeout,
                retry_for_s=RETRY_FOR_S,
            )
        return self._leaderboard

    def _discover_leaderboard(self) -> str | None:
        """The leaderboard's URL as the orchestrator knows it (a deployment given by --url
        only). It is the URL the pods use: inside a cluster it may not resolve from here, and
        the error then names it and --leaderboard-url."""
        try:
            info = self._orchestrator("GET", "/platform", "platform lookup")
        except ApiError as exc:
            if exc.status == 404:  # an orchestrator older than the lookup
                return None
            raise
        return info.get("leaderboard_url") if isinstance(info, dict) else None

    @contextmanager
    def _refusals(self, service: ServiceClient, what: str = "request") -> Iterator[None]:
        hint = (
            "--url or set PODIUM_URL"
            if service is self.orchestrator
            else "--leaderboard-url or set PODIUM_LEADERBOARD_URL"
        )
        try:
            yield
        except ServiceError as exc:
            raise api_error(exc, hint, service.token_given, what) from None

    def _orchestrator(self, method: str, path: str, what: str = "request", **kw: Any) -> Any:
        with self._refusals(self.orchestrator, what):
            return self.orchestrator.json(method, path, what, **kw)

    def close(self) -> None:
        self.orchestrator.close()
        if self._leaderboard is not None:
            self._leaderboard.close()

    def __enter__(self) -> PodiumClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- orchestrator --------------------------------------------------------------------------
    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        """Create an experiment; a retry after a lost answer returns the same experiment."""
        key = idempotency_key or uuid.uuid4().hex
        return self._orchestrator(
            "POST", "/experiments", "experiment spec", json=spec, headers={"Idempotency-Key": key}
        )

    def experiments(self, state: str | None = None, page: int = 1000) -> list[dict[str, Any]]:
        """Every experiment (newest first), following the orchestrator's pages."""
        params: dict[str, Any] = {"limit": page, **({"state": state} if state else {})}
        out: list[dict[str, Any]] = []
        while True:
            with self._refusals(self.orchestrator, "query"):
                resp = self.orchestrator.request("GET", "/experiments", "query", params=params)
            out += resp.json()
            cursor = resp.headers.get("X-Next-Cursor")
            if not cursor:
                return out
            params["cursor"] = cursor

    def experiment(self, exp_id: str) -> dict[str, Any]:
        return self._orchestrator("GET", f"/experiments/{exp_id}")

    def cancel(self, exp_id: str) -> dict[str, Any]:
        """Cancel the experiment; one that has already ended is answered as it is (the API's
        409: there is nothing left to cancel)."""
        try:
            return self._orchestrator("POST", f"/experiments/{exp_id}/cancel")
        except ApiError as exc:
            if exc.status == 409 and (exp := self.experiment(exp_id))["state"] in TERMINAL:
                return exp
            raise

    def pod_logs(self, exp_id: str, pod_id: str, tail: int = 50) -> str:
        path = f"/experiments/{exp_id}/pods/{pod_id}/logs"
        with self._refusals(self.orchestrator, "pod logs"):
            return self.orchestrator.request("GET", path, "pod logs", params={"tail": tail}).text

    def ended_pods(self, exp_id: str, tail: int = 50) -> list[dict[str, Any]]:
        """The last log lines the orchestrator kept of the experiment's ended pods."""
        path = f"/experiments/{exp_id}/ended-pods"
        return self._orchestrator("GET", path, params={"tail": tail})

    def events(self, exp_id: str, limit: int = 1000) -> list[dict[str, Any]]:
        return self._orchestrator("GET", f"/experiments/{exp_id}/events", params={"limit": limit})

    # -- leaderboard ---------------------------------------------------------------------------
    def _ask(self, call: Callable[[LeaderboardClient], T], what: str = "request") -> T:
        lb = self.leaderboard
        with self._refusals(lb, what):
            return call(lb)

    def board(self, exp_id: str, limit: int | None = None) -> Leaderboard:
        return self._ask(lambda lb: lb.board(exp_id, limit))

    def best(self, exp_id: str) -> Candidate:
        return self._ask(lambda lb: lb.best_or_error(exp_id))

    def candidate(self, exp_id: str, candidate_id: str) -> Candidate:
        return self._ask(lambda lb: lb.candidate(candidate_id, exp_id))

    def lineage(self, exp_id: str) -> Lineage:
        return self._ask(lambda lb: lb.lineage(exp_id))

    def submissions(self, exp_id: str, page: int = 10_000) -> list[SubmissionRecord]:
        """Every decided report (kept or not), oldest first, read ``page`` at a time."""
        return self._ask(lambda lb: lb.submissions(exp_id, page).submissions)

    def export(self, exp_id: str, out: Path, candidate_id: str | None = None) -> Candidate:
        """Download a candidate's training files (default: the best) into ``out``.

        Each file is hashed while it streams and checked against the sha256 the leaderboard
        lists; a ``manifest.json`` among them (Podium training files) is checked too
        (services/contracts/training_files.py): every file it lists present, with the size and
        sha256 measured while streaming (no second read), no name outside the directory. The
        files land in a temp directory beside ``out`` that is renamed into place only when every
        check passed, so ``out`` is never a half-written agent; a directory holding other files
        than an earlier export is refused before anything is downloaded. Returns the candidate.
        """
        out = export_dir(Path(out), "export into")
        cand = self.candidate(exp_id, candidate_id) if candidate_id else self.best(exp_id)
        if not cand.files:
            raise ApiError(
                f"candidate {cand.candidate_id} has no training files to export "
                "(its pod reported a score only)",
                EXIT_NOT_REACHED,
            )
        tmp = temp_dir_beside(out)
        try:
            digests: dict[str, tuple[str, int]] = {}
            for name, meta in cand.files.items():
                if not FILE_NAME_RE.match(name):  # never write outside the directory
                    raise ApiError(f"the leaderboard lists a bad file name {name!r}")
                digests[name] = self._download(meta.download_path, tmp / name, meta.sha256)
            if (tmp / MANIFEST).exists():  # Podium training files: check the manifest
                try:
                    verify_digests(tmp, digests)
                except CheckpointError as exc:
                    raise ApiError(f"{exc}; nothing was exported") from None
            (tmp / EXPORT_MARK).write_text(cand.model_dump_json(indent=2))
            replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cand

    # -- what pods kept (services/pod/runtime/pod_files.py) --------------------------------------
    def pod_files(self, exp_id: str, name: str) -> list[PodFile]:
        """The experiment's pods' uploads of ``name`` (``log``, ``tensorboard``), oldest first."""
        files = self._ask(lambda lb: lb.pod_files(exp_id), "pod files")
        return [f for f in files if f.name == name]

    def pod_log(self, exp_id: str, entry: PodFile) -> str:
        """A pod's uploaded log lines, checked against their sha256."""
        path = self.leaderboard.pod_file_path(exp_id, entry.pod_id, entry.name)
        data = self._ask(lambda lb: lb.request("GET", path, "pod log").content, "pod log")
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ApiError(f"pod {entry.pod_id}'s log does not match its sha256")
        return data.decode(errors="replace")

    def tensorboard(self, exp_id: str, out: Path) -> list[PodFile]:
        """Every pod's TensorBoard files into ``out/<pod id>/`` (each download checked against
        its sha256, each bundle unpacked only once it checks out whole:
        services/contracts/bundles.py); the uploads read."""
        entries = self.pod_files(exp_id, "tensorboard")
        output_dir(out, "--out")
        for entry in entries:
            path = self.leaderboard.pod_file_path(exp_id, entry.pod_id, entry.name)
            fd, name = tempfile.mkstemp(prefix=".download-", dir=out)
            os.close(fd)
            try:
                self._download(path, Path(name), entry.sha256)
                with open(name, "rb") as f:
                    unpack(f, out / entry.pod_id, expect={"kind": TENSORBOARD_KIND})
            except BundleError as exc:
                raise ApiError(f"pod {entry.pod_id}'s TensorBoard files: {exc}") from None
            finally:
                os.unlink(name)
        return entries

    def _download(self, path: str, dest: Path, sha256: str) -> tuple[str, int]:
        """Stream ``path`` into ``dest``, checking its sha256; returns (sha256, size)."""
        got, size, header = self._ask(lambda lb: lb.stream_to(path, dest), "download")
        for expected in filter(None, (sha256, header)):
            if got != expected:
                raise ApiError(
                    f"{dest.name}: sha256 {got} does not match the leaderboard's {expected}; "
                    "nothing was exported"
                )
        return got, size


def reached(exp: dict[str, Any], min_reward: float | None) -> tuple[bool, str]:
    """Whether an ended experiment passes the gate, and the sentence that says why.

    Without ``min_reward``: it succeeded (reached its target return), or it had no target and
    ran to its budget. With ``min_reward``: it ended normally (succeeded or budget spent) and
    its best score reached ``min_reward`` (at most, when lower is better).
    """
    state = exp["state"]
    result = exp.get("result") or {}
    best = (result.get("best") or exp.get("best") or {}).get("score")
    spec = exp.get("spec") or {}
    higher = (spec.get("evaluation") or {}).get("higher_is_better", True)
    target = spec.get("target_return")
    reason = exp.get("reason") or ""
    best_text = "no evaluated agent" if best is None else f"best score {best:g}"
    if state in ("failed", "cancelled"):
        return False, f"experiment {state}: {reason} ({best_text})"
    if min_reward is not None:
        ok = best is not None and (best >= min_reward if higher else best <= min_reward)
        cmp = (">=" if higher else "<=") if ok else ("<" if higher else ">")
        return ok, (
            f"{best_text} {cmp} min reward {min_reward:g} ({state}: {reason})"
            if best is not None
            else f"{best_text}; min reward {min_reward:g} not reached ({state}: {reason})"
        )
    if state == "succeeded":
        return True, f"succeeded: {reason} ({best_text})"
    if state == "budget_exhausted" and target is None:
        return True, f"finished: {reason} ({best_text})"
    return False, f"target return not reached: {reason} ({best_text})"
