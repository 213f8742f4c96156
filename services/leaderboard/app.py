"""The leaderboard's FastAPI app: ``create_app(settings)``; the lifespan opens Redis (embedded or
``REDIS_URL``) and the checkpoint store and runs the blob collector."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio
import redis.exceptions
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from services import redis_client
from services.checkpoint_store import StorageFullError
from services.contracts.leaderboard import SubmissionResult
from services.http import BODY_LIMIT_KEY, add_common_error_handlers, clip, error_response
from services.leaderboard.api import (
    COMPILE_CACHE_PATH,
    POD_FILE_PATH,
    Services,
    api,
    root,
)
from services.leaderboard.artifacts import ArtifactStore
from services.leaderboard.collector import BlobCollector
from services.leaderboard.generator import GeneratorService
from services.leaderboard.metrics import LatencyMiddleware, LeaderboardMetrics
from services.leaderboard.settings import LeaderboardSettings
from services.leaderboard.store import (
    FieldError,
    InvalidConfigError,
    LeaderboardStore,
    StoreBusyError,
    UnknownExperimentError,
)
from services.leaderboard.updater import (
    BadSubmissionError,
    PayloadTooLargeError,
    Updater,
)
from services.logs import get_logger

log = get_logger(__name__)

# Freeing space takes a person or a collection pass: no point in retrying every second.
STORAGE_FULL_RETRY_S = 30


def create_app(settings: LeaderboardSettings | None = None) -> FastAPI:
    settings = settings or LeaderboardSettings()
    metrics = LeaderboardMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = await asyncio.to_thread(redis_client.server_url, settings)
        # A bounded pool: hundreds of concurrent requests share a few connections (waiting for
        # one rather than opening a connection each, which overflows the listen backlog).
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=settings.redis_max_connections, timeout=10
        )
        client = redis.asyncio.Redis(connection_pool=pool)
        store = LeaderboardStore(client)
        blobs = await asyncio.to_thread(settings.blob_store)
        collector = BlobCollector(store, blobs, settings.gc_grace_s)
        app.state.services = Services(
            settings=settings,
            store=store,
            blobs=blobs,
            updater=Updater(store, blobs, metrics),
            generator=GeneratorService(store, metrics, settings.lease_ttl_s),
            collector=collector,
            metrics=metrics,
            artifacts=ArtifactStore(
                store, blobs, settings.compile_claim_ttl_s, settings.compile_retry_after_s
            ),
        )
        task = asyncio.create_task(collector.run_forever(settings.gc_interval_s))
        log.info("leaderboard ready", storage=settings.storage, data_dir=str(settings.data_dir))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.aclose()
            await pool.disconnect()  # a pool passed in is not closed with its client
            await asyncio.to_thread(redis_client.stop, settings)
            log.info("leaderboard stopped")

    app = FastAPI(
        title="Podium leaderboard",
        version="1",
        description="The tournament's ranking of candidate agents: the updater keeps the top K, "
        "the generator tells new pods where to start.",
        openapi_url="/api/v1/openapi.json",
        docs_url="/api/v1/docs",
        redoc_url=None,
        lifespan=lifespan,
        # A slash redirect (307) keeps the method: a client following it turned a DELETE of a
        # lease into a DELETE of the experiment. Unknown paths answer 404.
        redirect_slashes=False,
    )
    _document_multipart_models(app, settings)
    app.state.token = settings.token()
    app.state.metrics_token = settings.metrics_token_value()
    if app.state.metrics_token is None:
        log.info("/metrics is open (names experiments and scores); set PODIUM_METRICS_TOKEN")
    # Checkpoint uploads stream to disk and keep their own, configured, limit.
    # So do the compile caches and pod files pods upload.
    app.state.body_limits = {
        ("POST", SUBMISSIONS_PATH): settings.max_upload_bytes,
        ("PUT", COMPILE_CACHE_PATH): settings.max_upload_bytes,
        ("PUT", POD_FILE_PATH): settings.max_upload_bytes,
    }
    if app.state.token is None:
        log.warning("no API token configured: /api/v1 is open (set PODIUM_API_TOKEN)")
    app.include_router(api)
    app.include_router(root)
    app.add_middleware(LatencyMiddleware, metrics=metrics)
    _add_error_handlers(app)
    return app


SUBMISSIONS_PATH = "/api/v1/experiments/{experiment_id}/submissions"


def _document_multipart_models(app: FastAPI, settings: LeaderboardSettings) -> None:
    """Add the models the submissions endpoint parses by hand (from its multipart ``result``
    part) to the OpenAPI components, so the ``$ref`` in its request body resolves, and its
    configured body limit."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = build()
            schema = SubmissionResult.model_json_schema(ref_template="#/components/schemas/{model}")
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            components.update(schema.pop("$defs", {}))
            components["SubmissionResult"] = schema
            # The uploads' configured limit (app.state.body_limits) is what they document.
            for method, path in (
                ("post", SUBMISSIONS_PATH),
                ("put", COMPILE_CACHE_PATH),
                ("put", POD_FILE_PATH),
            ):
                spec["paths"][path][method][BODY_LIMIT_KEY] = settings.max_upload_bytes
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _error(status: int, detail: str) -> Response:
    return error_response(status, detail)


def _add_error_handlers(app: FastAPI) -> None:
    add_common_error_handlers(app, "leaderboard store (Redis)")

    @app.exception_handler(UnknownExperimentError)
    async def unknown_experiment(_: Request, exc: UnknownExperimentError) -> JSONResponse:
        return _error(404, f"unknown experiment {exc.args[0]!r}")

    @app.exception_handler(PayloadTooLargeError)
    async def too_large(_: Request, exc: PayloadTooLargeError) -> JSONResponse:
        return _error(413, str(exc))

    @app.exception_handler(BadSubmissionError)
    async def bad_submission(_: Request, exc: BadSubmissionError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(InvalidConfigError)
    async def invalid_config(_: Request, exc: InvalidConfigError) -> JSONResponse:
        return _error(409, str(exc))

    @app.exception_handler(StorageFullError)
    async def storage_full(_: Request, exc: StorageFullError) -> JSONResponse:
        log.error("checkpoint store full", error=str(exc))
        return JSONResponse(
            {
                "detail": f"checkpoint store full ({exc.strerror}): nothing was stored; retry "
                "once space is freed (reports without files are still taken)"
            },
            status_code=503,
            headers={"Retry-After": str(STORAGE_FULL_RETRY_S)},
        )

    @app.exception_handler(StoreBusyError)
    async def busy(_: Request, exc: StoreBusyError) -> Response:
        return error_response(503, str(exc), {"Retry-After": "1"})

    @app.exception_handler(FieldError)  # an unknown algorithm or parent
    async def field_error(_: Request, exc: FieldError) -> JSONResponse:
        return JSONResponse(
            {"detail": [{"type": "value_error", "loc": list(exc.loc), "msg": clip(str(exc))}]},
            status_code=422,
        )
