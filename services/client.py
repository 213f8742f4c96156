"""HTTP client for the orchestrator and leaderboard APIs, as the CLI uses them.

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
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.contracts.training_files import (
    FILE_NAME_RE,
    MANIFEST,
    CheckpointError,
    replace_dir,
    temp_dir_beside,
    verify_digests,
)
from services.platform import DEFAULT_LEADERBOARD_PORT, DEFAULT_ORCHESTRATOR_PORT, read_session

# Exit codes of the CLI (documented in docs/tournaments.md).
EXIT_OK = 0
EXIT_NOT_REACHED = 1  # the experiment ended without reaching its target / --min-reward
EXIT_USAGE = 2  # bad input: spec file, options
EXIT_API = 3  # unreachable service, refused token, unexpected answer
EXIT_TIMEOUT = 4  # --timeout passed while waiting

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "budget_exhausted"})
CHUNK = 1 << 20


class ApiError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_API, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.status = status


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


def _detail(resp: httpx.Response) -> Any:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:300] or resp.reason_phrase
    return body.get("detail", body) if isinstance(body, dict) else body


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


class _Service:
    """One API (orchestrator or leaderboard): base URL, bearer token, error mapping."""

    def __init__(self, name: str, url: str, token: str | None, timeout: float, env_hint: str):
        self.name = name
        self.url = url.rstrip("/")
        self.env_hint = env_hint
        self.token_given = bool(token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Connection errors only are retried (a request that reached the server is not).
        self.http = httpx.Client(
            base_url=self.url + "/api/v1",
            headers=headers,
            timeout=timeout,
            transport=httpx.HTTPTransport(retries=2),
        )

    def request(self, method: str, path: str, what: str = "request", **kw: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.ConnectError as e:
            raise ApiError(
                f"cannot reach the {self.name} at {self.url} ({_reason(e)}); is the platform "
                f"running (podium up)? Otherwise pass {self.env_hint}"
            ) from None
        except httpx.TimeoutException:
            raise ApiError(f"the {self.name} at {self.url} did not answer in time") from None
        except httpx.HTTPError as e:
            raise ApiError(f"request to the {self.name} at {self.url} failed: {e}") from None
        self.check(resp, what)
        return resp

    def check(self, resp: httpx.Response, what: str) -> None:
        code = resp.status_code
        if code < 400:
            return
        detail = _detail(resp)
        if code == 401:
            hint = "the token was refused" if self.token_given else "it needs a token"
            raise ApiError(
                f"the {self.name} at {self.url} answered 401 Unauthorized: {hint}; pass --token "
                "or set PODIUM_TOKEN",
                status=code,
            )
        if code == 422:
            raise ApiError(describe_422(detail, what), EXIT_USAGE, status=code)
        if code == 404 and detail == "Not Found":
            raise ApiError(
                f"the {self.name} at {self.url} has no {resp.request.url.path} (is that URL a "
                f"Podium {self.name}?)",
                status=code,
            )
        raise ApiError(f"{self.name}: {detail} (HTTP {code})", status=code)

    def json(self, method: str, path: str, what: str = "request", **kw: Any) -> Any:
        resp = self.request(method, path, what, **kw)
        try:
            return resp.json()
        except ValueError:
            raise ApiError(
                f"the {self.name} at {self.url} sent a non-JSON answer to {method} {path}"
            ) from None

    def close(self) -> None:
        self.http.close()


def _reason(e: Exception) -> str:
    text = str(e)
    if "refused" in text.lower():
        return "connection refused"
    return text or type(e).__name__


class PodiumClient:
    """The orchestrator's experiments API and the leaderboard's read side."""

    def __init__(self, endpoints: Endpoints, timeout: float = 15.0):
        self.endpoints = endpoints
        self.orchestrator = _Service(
            "orchestrator", endpoints.url, endpoints.token, timeout, "--url or set PODIUM_URL"
        )
        self._leaderboard: _Service | None = None
        self.timeout = timeout

    @property
    def leaderboard(self) -> _Service:
        if self._leaderboard is None:
            if not self.endpoints.leaderboard_url:
                raise ApiError(
                    "no leaderboard URL: pass --leaderboard-url or set PODIUM_LEADERBOARD_URL",
                    EXIT_USAGE,
                )
            self._leaderboard = _Service(
                "leaderboard",
                self.endpoints.leaderboard_url,
                self.endpoints.leaderboard_token,
                self.timeout,
                "--leaderboard-url or set PODIUM_LEADERBOARD_URL",
            )
        return self._leaderboard

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
        return self.orchestrator.json(
            "POST",
            "/experiments",
            "experiment spec",
            json=spec,
            headers={"Idempotency-Key": key},
        )

    def experiments(self, state: str | None = None) -> list[dict[str, Any]]:
        params = {"state": state} if state else None
        return self.orchestrator.json("GET", "/experiments", "query", params=params)

    def experiment(self, exp_id: str) -> dict[str, Any]:
        return self.orchestrator.json("GET", f"/experiments/{exp_id}")

    def cancel(self, exp_id: str) -> dict[str, Any]:
        return self.orchestrator.json("POST", f"/experiments/{exp_id}/cancel")

    def pod_logs(self, exp_id: str, pod_id: str, tail: int = 50) -> str:
        resp = self.orchestrator.request(
            "GET", f"/experiments/{exp_id}/pods/{pod_id}/logs", "pod logs", params={"tail": tail}
        )
        return resp.text

    def events(self, exp_id: str, limit: int = 1000) -> list[dict[str, Any]]:
        return self.orchestrator.json(
            "GET", f"/experiments/{exp_id}/events", params={"limit": limit}
        )

    # -- leaderboard ---------------------------------------------------------------------------
    def board(self, exp_id: str, limit: int | None = None) -> dict[str, Any]:
        params = {"limit": limit} if limit else None
        return self.leaderboard.json("GET", f"/experiments/{exp_id}/leaderboard", params=params)

    def best(self, exp_id: str) -> dict[str, Any]:
        return self.leaderboard.json("GET", f"/experiments/{exp_id}/best")

    def candidate(self, exp_id: str, candidate_id: str) -> dict[str, Any]:
        return self.leaderboard.json("GET", f"/experiments/{exp_id}/candidates/{candidate_id}")

    def lineage(self, exp_id: str) -> dict[str, Any]:
        """Every candidate ever inserted: ``nodes``, a flat list linked by ``parent_id``."""
        return self.leaderboard.json("GET", f"/experiments/{exp_id}/lineage")

    def submissions(self, exp_id: str, page: int = 10_000) -> list[dict[str, Any]]:
        """Every decided report (kept or not), oldest first, read page by page."""
        out: list[dict[str, Any]] = []
        params: dict[str, Any] = {"limit": page}
        while True:
            got = self.leaderboard.json("GET", f"/experiments/{exp_id}/submissions", params=params)
            out.extend(got["submissions"])
            if not got.get("next_after"):
                return out
            params["after"] = got["next_after"]

    def export(self, exp_id: str, out: Path, candidate_id: str | None = None) -> dict[str, Any]:
        """Download a candidate's training files (default: the best) into ``out``.

        Each file is hashed while it streams and checked against the sha256 the leaderboard
        lists; a ``manifest.json`` among them (Podium training files) is checked too
        (services/contracts/training_files.py): every file it lists present, with the size and
        sha256 measured while streaming (no second read), no name outside the directory. The files
        land in a temp directory beside ``out`` that is renamed into place only when every
        check passed, so ``out`` is never a half-written agent. Returns the candidate.
        """
        cand = self.candidate(exp_id, candidate_id) if candidate_id else self.best(exp_id)
        files: dict[str, dict[str, Any]] = cand.get("files") or {}
        if not files:
            raise ApiError(
                f"candidate {cand['candidate_id']} has no training files to export "
                "(its pod reported a score only)",
                EXIT_NOT_REACHED,
            )
        out = Path(out)
        tmp = temp_dir_beside(out)
        try:
            digests: dict[str, tuple[str, int]] = {}
            for name, meta in files.items():
                if not FILE_NAME_RE.match(name):  # never write outside the directory
                    raise ApiError(f"the leaderboard lists a bad file name {name!r}")
                digests[name] = self._download(meta["download_path"], tmp / name, meta["sha256"])
            if (tmp / MANIFEST).exists():  # Podium training files: check the manifest
                try:
                    verify_digests(tmp, digests)
                except CheckpointError as exc:
                    raise ApiError(f"{exc}; nothing was exported") from None
            (tmp / "candidate.json").write_text(json.dumps(cand, indent=2))
            replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cand

    def _download(self, path: str, dest: Path, sha256: str) -> tuple[str, int]:
        """Stream ``path`` into ``dest``, checking its sha256; returns (sha256, size)."""
        svc = self.leaderboard
        path = path.removeprefix("/api/v1")
        digest, size = hashlib.sha256(), 0
        try:
            with svc.http.stream("GET", path) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    svc.check(resp, "download")
                header = resp.headers.get("X-Checkpoint-SHA256")
                with open(dest, "wb") as f:
                    for chunk in resp.iter_bytes(CHUNK):
                        digest.update(chunk)
                        size += len(chunk)
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
        except httpx.HTTPError as e:
            raise ApiError(f"download of {dest.name} from the leaderboard failed: {e}") from None
        got = digest.hexdigest()
        for expected in filter(None, (sha256, header)):
            if got != expected:
                raise ApiError(
                    f"{dest.name}: sha256 {got} does not match the leaderboard's {expected}; "
                    "nothing was exported"
                )
        return got, size


def reached(exp: dict[str, Any], min_reward: float | None) -> tuple[bool, str]:
    """Whether an ended experiment passes the gate, and the sentence that says why.

    Without ``min_reward``: it succeeded (reached its target reward), or it had no target and
    ran to its budget. With ``min_reward``: it ended normally (succeeded or budget spent) and
    its best score reached ``min_reward`` (at most, when lower is better).
    """
    state = exp["state"]
    result = exp.get("result") or {}
    best = (result.get("best") or exp.get("best") or {}).get("score")
    spec = exp.get("spec") or {}
    higher = (spec.get("evaluation") or {}).get("higher_is_better", True)
    target = spec.get("target_reward")
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
    return False, f"target reward not reached: {reason} ({best_text})"
