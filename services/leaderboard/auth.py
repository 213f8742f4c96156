"""Who may call what on the leaderboard's /api/v1.

- The platform token (PODIUM_API_TOKEN): every route.
- A pod credential (services/contracts/credentials.py): only what a pod does, only for its own
  experiment: generate, submit, download a candidate's files (its parent's), release a lease,
  claim, fetch and publish a compile cache, upload its own files (log, TensorBoard).
  Anything else answers 403.
- Anything else: 401 (``services.http.require_token``).

``authorize`` needs only the method and the path, so it can run before routing and before the
body is read.
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.contracts.credentials import PREFIX, pod_token_experiment
from services.contracts.leaderboard import ID_PATTERN
from services.http import require_token

_ID = ID_PATTERN.removeprefix("^").removesuffix("$")
_EXPERIMENT = rf"^/api/v1/experiments/(?P<experiment>{_ID})"
# (methods, path) of every route a pod uses.
POD_ROUTES = [
    ({"POST"}, re.compile(rf"{_EXPERIMENT}/generate$")),
    ({"POST"}, re.compile(rf"{_EXPERIMENT}/submissions$")),
    ({"GET"}, re.compile(rf"{_EXPERIMENT}/candidates/{_ID}/files/{_ID}$")),
    ({"DELETE"}, re.compile(rf"{_EXPERIMENT}/leases/{_ID}$")),
    ({"POST"}, re.compile(rf"{_EXPERIMENT}/compile-caches/[0-9a-f]{{64}}/claim$")),
    ({"GET", "PUT"}, re.compile(rf"{_EXPERIMENT}/compile-caches/[0-9a-f]{{64}}$")),
    ({"PUT"}, re.compile(rf"{_EXPERIMENT}/pods/{_ID}/files/{_ID}$")),
]

_bearer = HTTPBearer(
    auto_error=False,
    description="The API token (PODIUM_API_TOKEN), or a pod's credential (its experiment's "
    "generate, submissions, candidate files, leases, compile caches and pod file uploads only).",
)


def pod_may(experiment_id: str, method: str, path: str) -> bool:
    """Whether a credential for ``experiment_id`` may send ``method`` to ``path``."""
    for methods, pattern in POD_ROUTES:
        m = pattern.match(path)
        if m and method in methods:
            return m["experiment"] == experiment_id
    return False


def authorize_pod(platform_token: str | None, given: str, method: str, path: str) -> bool:
    """True for a pod credential allowed here; HTTPException 403 for one that is not; False
    when ``given`` is no pod credential (the platform token check decides)."""
    if platform_token is None or not given.startswith(PREFIX):
        return False
    experiment_id = pod_token_experiment(platform_token, given)
    if experiment_id is None:
        return False
    if not pod_may(experiment_id, method, path):
        raise HTTPException(
            status_code=403,
            detail=f"a pod credential (experiment {experiment_id!r}) may only generate, "
            "submit, download candidate files, release leases, share compile caches and "
            "upload pod files of its own experiment",
        )
    return True


async def require_access(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    given = credentials.credentials if credentials else ""
    if authorize_pod(request.app.state.token, given, request.method, request.url.path):
        return
    await require_token(request, credentials)
