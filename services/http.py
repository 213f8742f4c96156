"""HTTP pieces every Podium API shares."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

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
