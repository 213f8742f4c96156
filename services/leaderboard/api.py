"""REST routes under /api/v1 (bearer-token auth), plus /livez, /readyz, /metrics at the root.

Why one file of this size: it is the service's route table, one short handler per operation
with its documented statuses; the logic behind them lives in store.py, updater.py and
generator.py.
"""

from __future__ import annotations

import hmac
import json
import math
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from services import registry
from services.checkpoint_store import BlobChunks, BlobNotFoundError, BlobStore, StagedBlob
from services.contracts.artifacts import (
    KEY_PATTERN,
    POD_FILE_NAMES,
    CompileCacheState,
    CompileClaim,
    CompileFacts,
    PodFile,
)
from services.contracts.leaderboard import (
    ID_PATTERN,
    Candidate,
    CandidateFile,
    Experiment,
    ExperimentConfig,
    ExperimentSummary,
    GenerateRequest,
    HyperparameterStats,
    Leaderboard,
    LeaderboardStats,
    Lineage,
    LineageNode,
    Manifest,
    SubmissionLog,
    SubmissionRecord,
    SubmissionResponse,
)
from services.contracts.search_space import NUMERIC
from services.http import SPEC_BODY_LIMIT, StreamCursor, api_router, body_limit, problems
from services.leaderboard.artifacts import ArtifactStore, stage_body
from services.leaderboard.auth import require_access
from services.leaderboard.collector import BlobCollector
from services.leaderboard.generator import GeneratorService, file_location, load_strategy
from services.leaderboard.metrics import LeaderboardMetrics
from services.leaderboard.settings import LeaderboardSettings
from services.leaderboard.store import (
    LeaderboardStore,
    UnknownExperimentError,
    parse_experiment,
)
from services.leaderboard.updater import Updater, read_submission
from services.logs import get_logger
from services.redis_client import describe_error
from services.registry import UnknownNameError

log = get_logger(__name__)


@dataclass
class Services:
    """Everything a request needs, built by the app's lifespan."""

    settings: LeaderboardSettings
    store: LeaderboardStore
    blobs: BlobStore
    updater: Updater
    generator: GeneratorService
    collector: BlobCollector
    metrics: LeaderboardMetrics
    artifacts: ArtifactStore
    # (experiment, limit) -> (board version, rendered JSON); see ``leaderboard``.
    board_cache: dict[tuple[str, int], tuple[str, bytes]] = field(default_factory=dict)


BOARD_CACHE_SIZE = 256
#: Rows of an ensemble's board a scrape reads for each algorithm's best (bounds its cost).
ENSEMBLE_SCAN_ROWS = 1024


# Dependencies are async: FastAPI runs a plain ``def`` dependency in a worker thread, which
# costs more than everything else a small request does.
async def services(request: Request) -> Services:
    return request.app.state.services


Svc = Annotated[Services, Depends(services)]
ExperimentId = Annotated[str, Path(pattern=ID_PATTERN)]
CandidateId = Annotated[str, Path(pattern=ID_PATTERN)]

# The platform token, or a pod credential on its experiment's pod routes (auth.py); 403: a
# pod's credential used outside the routes a pod may call. The route class runs the same check
# on the headers before any body is read.
api = api_router(require_access, 403)
root = APIRouter()


def _field_error(loc: tuple[Any, ...], msg: str) -> RequestValidationError:
    return RequestValidationError([{"type": "value_error", "loc": loc, "msg": msg, "input": None}])


# -- experiments ---------------------------------------------------------------------------------


@api.put(
    "/experiments/{experiment_id}",
    response_model=Experiment,
    responses={201: {"model": Experiment, "description": "Created"}, **problems(409)},
    openapi_extra=body_limit(SPEC_BODY_LIMIT),
    summary="Create or update an experiment's leaderboard",
    description="Sets K, the generator strategy (a name registered in `podium.generators`) and "
    "its options, the algorithm ensemble and the search space. Shrinking K evicts the worst. "
    "Flipping `higher_is_better` on a non-empty board is refused (409).",
)
async def put_experiment(
    experiment_id: ExperimentId, config: ExperimentConfig, svc: Svc, response: Response
) -> Experiment:
    try:
        load_strategy(config.generator.strategy, config.generator.options)
    except UnknownNameError as e:
        raise _field_error(("body", "generator", "strategy"), str(e)) from e
    except ValidationError as e:
        raise RequestValidationError(
            [
                {**err, "loc": ("body", "generator", "options", *err["loc"])}
                for err in e.errors(include_url=False, include_context=False)
            ]
        ) from e
    except registry.PluginError as e:
        raise _field_error(("body", "generator", "strategy"), str(e)) from e
    # By registered name, from package metadata (no import): a name no pod can build would
    # only fail later, in every pod.
    known = registry.names(registry.ALGORITHMS)
    for name in config.algorithms:
        if name not in known:
            raise _field_error(
                ("body", "algorithms", name),
                str(registry.UnknownNameError("algorithm", name, known)),
            )
    exp = Experiment(
        **config.model_dump(exclude={"top_k"}),
        experiment_id=experiment_id,
        top_k=config.top_k or svc.settings.default_top_k,
    )
    try:
        # Raw, not validated: a stored configuration that no longer validates is mended by
        # exactly this PUT.
        old = await svc.store.get_config(experiment_id)
    except UnknownExperimentError:
        old = None
    if (
        old is not None
        and old.get("higher_is_better", True) != exp.higher_is_better
        and await svc.store.board_size(experiment_id)
    ):
        raise HTTPException(409, "higher_is_better cannot change while the board has candidates")
    created, evicted = await svc.store.put_config(
        experiment_id, exp.model_dump_json(), exp.top_k, exp.higher_is_better, list(exp.algorithms)
    )
    if evicted:
        svc.metrics.evictions.labels(experiment_id).inc(len(evicted))
    response.status_code = 201 if created else 200
    return exp


@api.get("/experiments", summary="Experiment ids")
async def list_experiments(svc: Svc) -> list[str]:
    return await svc.store.experiments()


@api.get(
    "/experiments/{experiment_id}",
    response_model=ExperimentSummary,
    responses=problems(404, 409),
    summary="An experiment's config, board size and totals (env steps drive budgets)",
)
async def get_experiment(experiment_id: ExperimentId, svc: Svc) -> ExperimentSummary:
    summary = await svc.store.summary(experiment_id)
    parse_experiment(experiment_id, summary)  # 409 naming the problem, not a 500
    return ExperimentSummary.model_validate(summary)


@api.delete(
    "/experiments/{experiment_id}",
    status_code=204,
    responses=problems(404),
    summary="Drop an experiment's leaderboard",
    description="Removes the board, candidates, lineage and idempotency records, compile caches "
    "and pod files; blobs nothing else references are collected (files leased to pods stay "
    "until the leases end).",
)
async def delete_experiment(experiment_id: ExperimentId, svc: Svc) -> Response:
    if not await svc.store.drop(experiment_id):
        raise UnknownExperimentError(experiment_id)
    await svc.artifacts.drop(experiment_id)
    svc.metrics.forget(experiment_id)
    await svc.collector.collect()
    return Response(status_code=204)


# -- updater -------------------------------------------------------------------------------------


@api.post(
    "/experiments/{experiment_id}/submissions",
    response_model=SubmissionResponse,
    responses=problems(400, 404),
    summary="Report a trained agent (the updater)",
    description="`multipart/form-data`: a JSON part `result` (see SubmissionResult) and one file "
    "part per entry of `result.files`, named as there, whose sha256 must match (400 otherwise, "
    "nothing stored). A metadata-only result may also be sent as an `application/json` body. "
    "Inserted if it beats the K-th best (evicting it); a retry with the same `submission_id` "
    "gets the first answer (`duplicate: true`). A `parent_id` must be a candidate of this "
    "experiment (422 naming it otherwise: a lineage never points into another experiment). "
    "Bodies over the configured size get 413.",
    openapi_extra={
        "requestBody": {
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["result"],
                        "properties": {"result": {"$ref": "#/components/schemas/SubmissionResult"}},
                        "additionalProperties": {"type": "string", "format": "binary"},
                    }
                },
                "application/json": {"schema": {"$ref": "#/components/schemas/SubmissionResult"}},
            },
            "required": True,
        }
    },
)
async def submit(experiment_id: ExperimentId, request: Request, svc: Svc) -> Response:
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        # Before reading files: do not stage gigabytes for an experiment that does not exist.
        await svc.store.get_config(experiment_id)
    result, staged = await read_submission(request, svc.blobs, svc.settings.max_upload_bytes)
    answer = await svc.updater.submit(experiment_id, result, staged)
    # The hot path: serialize the model directly instead of FastAPI validating it again.
    return Response(answer.model_dump_json(), media_type="application/json")


# -- read side -----------------------------------------------------------------------------------


def _candidate(experiment_id: str, cid: str, h: dict[str, str], rank: int | None) -> Candidate:
    files = json.loads(h.get("files", "{}"))
    return Candidate(
        candidate_id=cid,
        experiment_id=experiment_id,
        status=h.get("status", "active"),
        rank=rank,
        algorithm=h["algorithm"],
        hyperparameters=json.loads(h["hyperparameters"]),
        parent_id=h.get("parent_id") or None,
        generation=int(h["generation"]),
        pod_id=h["pod_id"],
        submission_id=h["submission_id"],
        env_steps=int(h["env_steps"]),
        trained_env_steps=int(h["trained_env_steps"]) if h.get("trained_env_steps") else None,
        score=float(h["score"]),
        eval={
            "mean": float(h["eval_mean"]),
            "std": float(h["eval_std"]),
            "episodes": int(h["eval_episodes"]),
        },
        files={
            name: CandidateFile(sha256=sha, **file_location(experiment_id, cid, name))
            for name, sha in files.items()
        },
        created_at=float(h["created_at"]),
        evicted_at=float(h["evicted_at"]) if h.get("evicted_at") else None,
    )


def _numeric(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def board_stats(exp: Experiment, candidates: list[Candidate]) -> LeaderboardStats:
    """Score summary and the mean / variance / covariance of the numeric hyperparameters over
    the board (what CEM fits, in the hyperparameters' own units)."""
    scores = np.array([c.score for c in candidates], dtype=float)
    names = [n for n, d in exp.search_space.items() if isinstance(d, NUMERIC)]
    if not names and candidates:
        names = sorted(
            n
            for n in candidates[0].hyperparameters
            if all(_numeric(c.hyperparameters.get(n)) for c in candidates)
        )
    rows = [
        [float(c.hyperparameters[n]) for n in names]
        for c in candidates
        if all(_numeric(c.hyperparameters.get(n)) for n in names)
    ]
    x = np.asarray(rows, dtype=float).reshape(len(rows), len(names))
    cov = (
        np.cov(x, rowvar=False, ddof=0).reshape(len(names), len(names))
        if len(rows) > 1
        else np.zeros((len(names), len(names)))
    )
    mean = x.mean(axis=0) if len(rows) else np.full(len(names), np.nan)
    algorithms: dict[str, int] = {}
    for c in candidates:
        algorithms[c.algorithm] = algorithms.get(c.algorithm, 0) + 1
    return LeaderboardStats(
        size=len(candidates),
        top_k=exp.top_k,
        score_mean=float(scores.mean()) if len(scores) else None,
        score_std=float(scores.std()) if len(scores) else None,
        score_min=float(scores.min()) if len(scores) else None,
        score_max=float(scores.max()) if len(scores) else None,
        hyperparameters=HyperparameterStats(
            names=names,
            mean={n: float(m) for n, m in zip(names, mean, strict=True) if len(rows)},
            variance={n: float(cov[i, i]) for i, n in enumerate(names) if len(rows)},
            covariance=cov.tolist() if len(rows) else [],
        ),
        algorithms=algorithms,
    )


@api.get(
    "/experiments/{experiment_id}/leaderboard",
    response_model=Leaderboard,
    responses=problems(404, 409),
    summary="The top K, best first, with board statistics",
)
async def leaderboard(
    experiment_id: ExperimentId,
    svc: Svc,
    limit: Annotated[
        int | None, Query(ge=1, le=10_000, description="Default: K (the whole board).")
    ] = None,
) -> Response:
    # Boards are read far more often than they change: a rendered board is reused while Redis
    # says (in the same single round trip that would fetch it) that its version is current.
    key = (experiment_id, limit or 0)  # 0: K, as the store reads it
    cached = svc.board_cache.get(key)
    version, raw, rows = await svc.store.top_if_changed(
        experiment_id, key[1], cached[0] if cached else ""
    )
    if raw is None and cached is not None:
        return Response(cached[1], media_type="application/json")
    assert raw is not None and rows is not None
    exp = parse_experiment(experiment_id, raw)
    candidates = [_candidate(experiment_id, cid, h, i) for i, (cid, h) in enumerate(rows, 1)]
    board = Leaderboard(
        experiment_id=experiment_id, candidates=candidates, stats=board_stats(exp, candidates)
    )
    # Serialized once here; FastAPI would validate the model again for response_model.
    body = board.model_dump_json().encode()
    if len(svc.board_cache) >= BOARD_CACHE_SIZE:
        svc.board_cache.pop(next(iter(svc.board_cache)))
    svc.board_cache[key] = (version, body)
    return Response(body, media_type="application/json")


@api.get(
    "/experiments/{experiment_id}/best",
    response_model=Candidate,
    responses=problems(404),
    summary="The best agent",
)
async def best(experiment_id: ExperimentId, svc: Svc) -> Candidate:
    _, rows = await svc.store.top(experiment_id, 1)
    if not rows:
        raise HTTPException(404, "the leaderboard is empty")
    cid, h = rows[0]
    return _candidate(experiment_id, cid, h, 1)


async def _get_candidate(svc: Services, experiment_id: str, candidate_id: str) -> Candidate:
    await svc.store.get_config(experiment_id)
    h = await svc.store.candidate(experiment_id, candidate_id)
    if h is None:
        raise HTTPException(404, f"no candidate {candidate_id!r} in {experiment_id!r}")
    rank = int(h["rank"]) if h.get("rank") else None
    return _candidate(experiment_id, candidate_id, h, rank)


@api.get(
    "/experiments/{experiment_id}/candidates/{candidate_id}",
    response_model=Candidate,
    responses=problems(404),
    summary="One candidate (also evicted ones, with status `evicted`)",
)
async def candidate(experiment_id: ExperimentId, candidate_id: CandidateId, svc: Svc) -> Candidate:
    return await _get_candidate(svc, experiment_id, candidate_id)


class _BlobResponse(StreamingResponse):
    """A blob streamed to the client whose file (or S3 stream) is closed as the response ends,
    however it ends: a client that goes away mid-download cancels the stream, and starlette
    leaves its iterator to the garbage collector (256 descriptors of aborted downloads stayed
    open for minutes)."""

    def __init__(self, chunks: BlobChunks, **kw: Any) -> None:
        super().__init__(iterate_in_threadpool(chunks), **kw)
        self.chunks = chunks

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.chunks.close()


@api.get(
    "/experiments/{experiment_id}/candidates/{candidate_id}/files/{name}",
    summary="Download one training file",
    description="Streams the blob; headers `X-Checkpoint-SHA256` and `ETag` carry its sha256 "
    "so the client can verify it. Files of an evicted candidate stay downloadable while a lease "
    "holds them or until the collector removes them (then 410).",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **problems(404, 410)},
)
async def download(
    experiment_id: ExperimentId,
    candidate_id: CandidateId,
    name: Annotated[str, Path(pattern=ID_PATTERN)],
    svc: Svc,
) -> StreamingResponse:
    cand = await _get_candidate(svc, experiment_id, candidate_id)
    if name not in cand.files:
        raise HTTPException(404, f"candidate {candidate_id!r} has no file {name!r}")
    return await _stream_blob(svc, cand.files[name].sha256, name)


async def _stream_blob(svc: Services, sha: str, name: str) -> StreamingResponse:
    """The blob ``sha`` as a download named ``name``; its sha256 in ``X-Checkpoint-SHA256``
    and ``ETag`` for the client to verify. 410 when it is gone from the store."""
    try:
        size = await run_in_threadpool(svc.blobs.size, sha)
        chunks = await run_in_threadpool(svc.blobs.read, sha)
    except BlobNotFoundError as e:
        raise HTTPException(410, f"file {name!r} was collected") from e
    return _BlobResponse(
        chunks,
        media_type="application/octet-stream",
        headers={
            "X-Checkpoint-SHA256": sha,
            "ETag": f'"{sha}"',
            "Content-Length": str(size),
            "Content-Disposition": f'attachment; filename="{name}"',
        },
    )


@api.get(
    "/experiments/{experiment_id}/lineage",
    response_model=Lineage,
    responses=problems(404),
    summary="Every candidate ever inserted, as a flat list linked by parent_id",
    description="Oldest first. Each node names its parent (`parent_id`); a node whose parent "
    "is null or not in the list is a root. Clients rebuild the tree, so a PBT chain of any "
    "depth serializes.",
)
async def lineage(experiment_id: ExperimentId, svc: Svc) -> Response:
    await svc.store.get_config(experiment_id)
    events = await svc.store.lineage_events(experiment_id)
    evicted_at = {
        e["candidate_id"]: float(e.get("time", 0)) for e in events if e.get("event") == "evict"
    }
    nodes = [
        LineageNode(
            candidate_id=e["candidate_id"],
            parent_id=e.get("parent_id") or None,
            algorithm=e.get("algorithm", ""),
            generation=int(e.get("generation", 0)),
            pod_id=e.get("pod_id", ""),
            submission_id=e.get("submission_id", ""),
            env_steps=int(e.get("env_steps", 0)),
            score=float(e["score"]),
            status="evicted" if e["candidate_id"] in evicted_at else "active",
            created_at=float(e.get("time", 0)),
            evicted_at=evicted_at.get(e["candidate_id"]),
        )
        for e in events
        if e.get("event") == "insert"
    ]
    body = Lineage(experiment_id=experiment_id, nodes=nodes, events=len(events))
    # Serialized once here; FastAPI would validate thousands of nodes again for response_model.
    return Response(body.model_dump_json(), media_type="application/json")


@api.get(
    "/experiments/{experiment_id}/submissions",
    response_model=SubmissionLog,
    responses=problems(404),
    summary="Every decided report, kept or not, oldest first (paged)",
    description="What each pod reported and when the leaderboard decided it: score, env steps "
    "since the pod's previous report, accepted or not. The history behind best-score-over-time "
    "plots; retries appear once. Page with `after` = the previous page's `next_after`.",
)
async def submission_log(
    experiment_id: ExperimentId,
    svc: Svc,
    after: StreamCursor = None,
    limit: Annotated[int, Query(ge=1, le=100_000, description="Reports per page.")] = 10_000,
) -> Response:
    await svc.store.get_config(experiment_id)
    records: list[SubmissionRecord] = []
    cursor, more = after, True
    while more and len(records) < limit:
        # Entries, not reports, are counted by Redis (evictions and generator decisions share
        # the stream), so read in chunks until the page is full or the stream ends.
        count = min(max(limit - len(records), 1_000), 10_000)
        page = await svc.store.lineage_page(experiment_id, cursor, count)
        more = len(page) == count
        for entry_id, e in page:
            if len(records) == limit:
                more = True
                break
            cursor = entry_id
            kind = e.get("event")
            if kind not in ("insert", "reject"):
                continue
            generation = e.get("generation")
            records.append(
                SubmissionRecord(
                    submission_id=e.get("submission_id", ""),
                    pod_id=e.get("pod_id", ""),
                    algorithm=e.get("algorithm", ""),
                    score=float(e["score"]),
                    env_steps=int(e.get("env_steps") or 0),
                    batch_env_steps=int(e["batch"]) if e.get("batch") else None,
                    accepted=kind == "insert",
                    candidate_id=e.get("candidate_id") if kind == "insert" else None,
                    parent_id=e.get("parent_id") or None,
                    generation=int(generation) if generation else None,
                    decided_at=float(e.get("time", 0)),
                )
            )
    body = SubmissionLog(
        experiment_id=experiment_id, submissions=records, next_after=cursor if more else None
    )
    return Response(body.model_dump_json(), media_type="application/json")


# -- generator -----------------------------------------------------------------------------------


@api.post(
    "/experiments/{experiment_id}/generate",
    response_model=Manifest,
    responses=problems(404, 409),
    summary="Where a new pod starts (the generator)",
    description="Runs the experiment's strategy. When the manifest names a parent, its files "
    "are leased to the pod (`lease_id`) so they are not collected while it downloads them; "
    "release with DELETE .../leases/{lease_id}, or let the lease expire.",
)
async def generate(experiment_id: ExperimentId, req: GenerateRequest, svc: Svc) -> Manifest:
    return await svc.generator.generate(experiment_id, req)


@api.delete(
    "/experiments/{experiment_id}/leases/{lease_id}", status_code=204, responses=problems(404)
)
async def release_lease(
    experiment_id: ExperimentId,
    lease_id: Annotated[str, Path(pattern=ID_PATTERN)],
    svc: Svc,
) -> Response:
    if not await svc.store.release(experiment_id, lease_id):
        raise HTTPException(404, f"no lease {lease_id!r} (released or expired)")
    return Response(status_code=204)


# -- pods' artifacts: compile caches and pod files (services/leaderboard/artifacts.py) ----------

COMPILE_CACHE_PATH = "/api/v1/experiments/{experiment_id}/compile-caches/{key}"
POD_FILE_PATH = "/api/v1/experiments/{experiment_id}/pods/{pod_id}/files/{name}"
CompileKey = Annotated[str, Path(pattern=KEY_PATTERN, description="sha256 of the facts")]
PodId = Annotated[str, Path(pattern=ID_PATTERN)]
PodFileName = Annotated[str, Path(pattern=f"^({'|'.join(POD_FILE_NAMES)})$")]
_OCTETS = {
    "requestBody": {
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    }
}


def _check_key(key: str, facts: CompileFacts, loc: tuple[Any, ...]) -> None:
    if facts.key() != key:
        raise _field_error(loc, f"the facts' key is {facts.key()}, not the path's {key}")


@api.post(
    "/experiments/{experiment_id}/compile-caches/{key}/claim",
    response_model=CompileCacheState,
    responses=problems(404),
    summary="Claim a program key's compile cache",
    description="`ready`: fetch the published cache (GET .../compile-caches/{key}; `sha256` "
    "null: nothing to fetch). `compile`: this pod compiles and publishes (PUT); its claim lasts "
    "`ttl_s` and is renewed by claiming again. `wait`: another pod compiles; ask again after "
    "`retry_after_s`. `refused` drops a published cache this pod found corrupt. The path's key "
    "must be the sha256 of `facts` (422 otherwise).",
)
async def claim_compile_cache(
    experiment_id: ExperimentId, key: CompileKey, req: CompileClaim, svc: Svc
) -> CompileCacheState:
    _check_key(key, req.facts, ("body", "facts"))
    await svc.store.get_config(experiment_id)
    return await svc.artifacts.claim(experiment_id, key, req)


@api.put(
    "/experiments/{experiment_id}/compile-caches/{key}",
    response_model=CompileCacheState,
    responses=problems(404, 413),
    openapi_extra=_OCTETS,
    summary="Publish a program key's compile cache",
    description="The body is the cache as a bundle (services/contracts/bundles.py), stored in "
    "the blob store; an empty body says the first pod compiled nothing worth sharing. The first "
    "publish of a key wins (a later one is discarded). The answer is the key's state.",
)
async def publish_compile_cache(
    experiment_id: ExperimentId,
    key: CompileKey,
    request: Request,
    svc: Svc,
    pod_id: Annotated[str, Query(pattern=ID_PATTERN)],
    torch: Annotated[str, Query(min_length=1, max_length=64)],
    device: Annotated[str, Query(min_length=1, max_length=200)],
    program: Annotated[str, Query(pattern=KEY_PATTERN)],
) -> CompileCacheState:
    facts = CompileFacts(torch=torch, device=device, program=program)
    _check_key(key, facts, ("query", "program"))
    staged: StagedBlob | None = await _upload(experiment_id, request, svc)
    if staged is not None and staged.size == 0:
        await run_in_threadpool(staged.discard)
        staged = None
    req = CompileClaim(pod_id=pod_id, facts=facts)
    return await svc.artifacts.publish(experiment_id, key, req, staged)


@api.get(
    "/experiments/{experiment_id}/compile-caches/{key}",
    summary="Download a program key's published compile cache",
    description="Streams the bundle; `X-Checkpoint-SHA256` carries the sha256 the record "
    "names, which the pod checks before it unpacks anything. 404: none published (or nothing "
    "to fetch).",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **problems(404, 410)},
)
async def fetch_compile_cache(
    experiment_id: ExperimentId, key: CompileKey, svc: Svc
) -> StreamingResponse:
    record = await svc.artifacts.record(experiment_id, key)
    if not record or not record.get("sha256"):
        raise HTTPException(404, f"no compile cache published for key {key}")
    return await _stream_blob(svc, record["sha256"], f"compile-cache-{key[:16]}.tar.gz")


@api.put(
    "/experiments/{experiment_id}/pods/{pod_id}/files/{name}",
    response_model=PodFile,
    responses=problems(404, 413),
    openapi_extra=_OCTETS,
    summary="Keep a pod's file (its last log lines, its TensorBoard files)",
    description="`log`: the pod's last log lines (text); `tensorboard`: its TensorBoard event "
    "files as a bundle (services/contracts/bundles.py). Replaces the pod's previous upload of "
    "that name. Pods upload them as they run and before they exit, so that nothing a user "
    "reads is lost with the pod.",
)
async def put_pod_file(
    experiment_id: ExperimentId, pod_id: PodId, name: PodFileName, request: Request, svc: Svc
) -> PodFile:
    staged = await _upload(experiment_id, request, svc)
    return await svc.artifacts.put_pod_file(experiment_id, pod_id, name, staged)


async def _upload(experiment_id: str, request: Request, svc: Services) -> StagedBlob:
    """The body, staged in the blob store (404 first for an unknown experiment: nothing is
    staged for it)."""
    await svc.store.get_config(experiment_id)
    return await stage_body(request, svc.blobs, svc.settings.max_upload_bytes)


@api.get(
    "/experiments/{experiment_id}/pod-files",
    response_model=list[PodFile],
    responses=problems(404),
    summary="The files the experiment's pods kept (oldest upload first)",
)
async def list_pod_files(experiment_id: ExperimentId, svc: Svc) -> list[PodFile]:
    await svc.store.get_config(experiment_id)
    return await svc.artifacts.pod_files(experiment_id)


@api.get(
    "/experiments/{experiment_id}/pods/{pod_id}/files/{name}",
    summary="Download a pod's file",
    description="Streams it with its sha256 in `X-Checkpoint-SHA256`.",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **problems(404, 410)},
)
async def get_pod_file(
    experiment_id: ExperimentId, pod_id: PodId, name: PodFileName, svc: Svc
) -> StreamingResponse:
    entry = await svc.artifacts.pod_file(experiment_id, pod_id, name)
    if entry is None:
        raise HTTPException(404, f"pod {pod_id!r} of {experiment_id!r} kept no {name!r}")
    return await _stream_blob(svc, entry.sha256, f"{pod_id}-{name}")


# -- probes and metrics --------------------------------------------------------------------------


@root.get("/livez", include_in_schema=False)
async def livez() -> dict[str, str]:
    return {"status": "ok"}


@root.get("/readyz", include_in_schema=False)
async def readyz(request: Request) -> JSONResponse:
    """503 without Redis. A blob store that cannot take a file (a full volume) is reported as
    ``degraded`` with the reason, still 200: generate, reads and reports without files keep
    working, and taking the only replica out of its Service would stop those too."""
    svc: Services | None = getattr(request.app.state, "services", None)
    try:
        if svc is None:
            raise ConnectionError("starting")
        await svc.store.r.ping()
    except Exception as e:  # any failure to reach Redis means not ready
        return JSONResponse({"status": "unavailable", "error": describe_error(e)}, status_code=503)
    try:
        await run_in_threadpool(svc.blobs.check_writable)
    except OSError as e:
        return JSONResponse({"status": "degraded", "blob_store": f"not writable: {e}"})
    return JSONResponse({"status": "ok"})


def _may_scrape(request: Request) -> bool:
    """With a metrics token set, /metrics needs it (or the API token) as a bearer token."""
    expected = request.app.state.metrics_token
    if expected is None:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    return any(
        hmac.compare_digest(given.encode(), token.encode())
        for token in (expected, request.app.state.token)
        if token is not None
    )


@root.get("/metrics", include_in_schema=False)
async def metrics(request: Request, svc: Svc) -> PlainTextResponse:
    if not _may_scrape(request):
        return PlainTextResponse(
            "metrics need the metrics token (PODIUM_METRICS_TOKEN) as a bearer token\n",
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="podium-metrics"'},
        )
    try:
        ranks = svc.settings.metrics_top_ranks
        # A series of an experiment that is no longer stored is one deleted through another
        # replica (read before the store: one created meanwhile keeps its first counts).
        seen = svc.metrics.experiments()
        stored = await svc.store.experiments()
        for exp in seen - set(stored):
            svc.metrics.forget(exp)
        for exp in stored:
            config, rows = await svc.store.top(exp, limit=ranks)  # best first
            # An ensemble's best of each algorithm may rank low: read further down its board
            # (at most 1,024 rows). The labels are the experiment's own algorithms (a bounded
            # set): the updater refuses a submission of any other.
            if len(config.get("algorithms") or {}) > 1 and len(rows) == ranks:
                config, rows = await svc.store.top(exp, limit=max(ranks, ENSEMBLE_SCAN_ROWS))
            size = await svc.store.board_size(exp)
            by_algorithm: dict[str, float] = {}
            for _, h in rows:
                by_algorithm.setdefault(h["algorithm"], float(h["score"]))
            scores = [float(h["score"]) for _, h in rows[:ranks]]
            svc.metrics.set_board(exp, size, scores, by_algorithm)
    except Exception as e:  # a scrape still returns the counters when Redis is down
        log.debug("board gauges not refreshed", error=describe_error(e))
    return PlainTextResponse(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)
