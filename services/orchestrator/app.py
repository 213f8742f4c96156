"""The orchestrator's FastAPI app: experiments API, probes, metrics, and the reconciler thread."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services import redis_client
from services.http import add_common_error_handlers
from services.logs import get_logger
from services.orchestrator.api import router
from services.orchestrator.backends import Backend, make_backend
from services.orchestrator.leaderboard_client import (
    LeaderboardProgress,
    NoLeaderboard,
    ProgressSource,
)
from services.orchestrator.reconciler import Reconciler
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.store import Store
from services.redis_client import connect, describe_error

log = get_logger(__name__)


def make_progress_source(settings: OrchestratorSettings) -> ProgressSource:
    if settings.leaderboard_url:
        return LeaderboardProgress(settings.leaderboard_url, settings.leaderboard_token_value())
    log.warning("no leaderboard_url: target return and env-step budgets cannot be checked")
    return NoLeaderboard()


def create_app(
    settings: OrchestratorSettings | None = None,
    backend: Backend | None = None,
    progress: ProgressSource | None = None,
) -> FastAPI:
    settings = settings or OrchestratorSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        r = connect(settings)
        be = backend or make_backend(settings)
        store = Store(r)
        store.migrate()
        reconciler = Reconciler(settings, store, be, progress or make_progress_source(settings))
        app.state.settings = settings
        app.state.token = settings.token()
        app.state.redis = r
        app.state.store = store
        app.state.backend = be
        app.state.reconciler = reconciler
        if app.state.token is None:
            log.warning("no API token configured: /api/v1 is open (set PODIUM_API_TOKEN)")
        reconciler.start()
        log.info("orchestrator started", backend=settings.backend)
        try:
            yield
        finally:
            reconciler.stop()
            be.close()
            r.close()
            # The embedded Redis (no REDIS_URL) stops with its last user, data saved.
            await asyncio.to_thread(redis_client.stop, settings)

    app = FastAPI(
        title="Podium orchestrator",
        version="1",
        openapi_url="/api/v1/openapi.json",
        docs_url="/api/v1/docs",
        redoc_url=None,
        lifespan=lifespan,
        # A slash redirect (307) keeps the method: a client following it could turn a DELETE
        # of a sub-resource into a DELETE of the experiment. Unknown paths answer 404.
        redirect_slashes=False,
    )
    app.include_router(router)
    add_common_error_handlers(app, "orchestrator store (Redis)")

    @app.get("/livez", include_in_schema=False)
    def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz(request: Request) -> Response:
        try:
            # Bounded: redis-py retries a refused connection for seconds; a probe must not hang.
            await asyncio.wait_for(asyncio.to_thread(request.app.state.redis.ping), timeout=1.0)
        except (redis.RedisError, OSError, TimeoutError) as e:
            return JSONResponse(
                {"status": "unavailable", "redis": describe_error(e)}, status_code=503
            )
        reconciler = request.app.state.reconciler
        if reconciler.failed_passes >= settings.reconcile_failures_unready:
            body = {
                "status": "unavailable",
                "reconciler": f"{reconciler.failed_passes} passes failed in a row",
                "last_error": (reconciler.last_error or "")[:500],
            }
            return Response(json.dumps(body), status_code=503, media_type="application/json")
        return Response(content='{"status": "ok"}', media_type="application/json")

    @app.get("/metrics", include_in_schema=False)
    def metrics_endpoint() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
