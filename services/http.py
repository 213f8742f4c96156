"""HTTP pieces every Podium API shares."""

from __future__ import annotations

import hmac
from typing import Annotated

import redis
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.logs import get_logger
from services.redis_client import describe_error

log = get_logger(__name__)

_bearer = HTTPBearer(auto_error=False, description="The API token (PODIUM_API_TOKEN).")


async def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Bearer-token check for /api/v1 (constant-time compare; 401 with WWW-Authenticate).

    ``app.state.token`` is None only when no token is configured at all (a local,
    single-user install, logged at start-up); an empty token is refused by the settings.
    """
    expected: str | None = request.app.state.token
    if expected is None:
        return
    given = credentials.credentials if credentials else ""
    if not given or not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token",
            headers={"WWW-Authenticate": 'Bearer realm="podium"'},
        )


def add_common_error_handlers(app: FastAPI, store: str) -> None:
    """422 that names where and what (never echoing the input), and 503 when Redis is down.

    ``store`` names what is unavailable in the 503 message, e.g. "leaderboard store (Redis)".
    A 503 means nothing was changed: every write path is a single Redis script or transaction.
    """

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Only where and what: echoing the input back could be huge, and a NaN in it is not
        # even JSON.
        detail = [
            {"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    async def redis_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable", error=describe_error(exc))
        return JSONResponse(
            {"detail": f"{store} unavailable; nothing was changed, retry"},
            status_code=503,
            headers={"Retry-After": "1"},
        )
