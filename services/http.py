"""HTTP pieces every Podium API shares: the /api/v1 route class (token before body, bounded
bodies), error responses that never echo more than a short prefix of the input, and the error
shapes the OpenAPI documents list."""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Annotated, Any, ClassVar

import redis
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator, BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive

from services.logs import get_logger
from services.redis_client import STREAM_ID_MAX, describe_error

log = get_logger(__name__)

KIB = 1 << 10
MIB = 1 << 20

# Body limits, sized to purpose. A route declares its own with ``body_limit(n)``; a route that
# takes a JSON body and declares none gets JSON_BODY_LIMIT, a route that takes none gets
# NO_BODY_LIMIT (it never reads one; a few bytes such as ``{}`` are tolerated). An app can raise
# one route's limit from its settings through ``app.state.body_limits``, keyed by (method, path)
# (checkpoint uploads).
JSON_BODY_LIMIT = 64 * KIB
NO_BODY_LIMIT = 1 * KIB
SPEC_BODY_LIMIT = 1 * MIB  # an experiment spec or leaderboard config (env kwargs, search space)
BODY_LIMIT_KEY = "x-body-limit"

# Error responses echo at most this much of any input (a name, a path segment, a key).
ECHO_CHARS = 200

_bearer = HTTPBearer(auto_error=False, description="The API token (PODIUM_API_TOKEN).")

# A service's credential check, e.g. ``require_token``: the dependency of its /api/v1 router,
# raising 401 (or 403) from the request's headers and path alone.
Auth = Callable[[Request, HTTPAuthorizationCredentials | None], Awaitable[None]]


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` cut to about ``limit`` characters, saying how many were left out.

    The end is kept too: a message that quotes a huge input usually closes with what the
    reader needs (the known names, the limit)."""
    if len(text) <= limit:
        return text
    tail = limit // 4
    return f"{text[: limit - tail]}…({len(text) - limit} characters left out)…{text[-tail:]}"


def _stream_id(value: str | None) -> str | None:
    if value is not None and any(int(part) > STREAM_ID_MAX for part in value.split("-")):
        raise ValueError(f"not a stream id: each part must be at most {STREAM_ID_MAX}")
    return value


#: A query parameter holding a Redis stream id (a page's cursor): ASCII digits only, since
#: ``\d`` also matches other scripts' digits, which Redis refuses (a 500, not a 422).
StreamCursor = Annotated[
    str | None,
    Query(
        pattern=r"^[0-9]{1,20}-[0-9]{1,20}$",
        description="Where the page starts: after this stream id (the last event's `id` of the "
        "previous page, or a submissions page's `next_after`); omit for the first.",
    ),
    AfterValidator(_stream_id),
]


def _unauthorized() -> HTTPException:
    return HTTPException(
        status_code=401,
        detail="missing or wrong bearer token",
        headers={"WWW-Authenticate": 'Bearer realm="podium"'},
    )


def _is_platform_token(expected: str, given: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


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
    if not _is_platform_token(expected, credentials.credentials if credentials else ""):
        raise _unauthorized()


def body_limit(limit: int) -> dict[str, Any]:
    """``openapi_extra`` declaring a route's request-body limit in bytes (also documented)."""
    return {BODY_LIMIT_KEY: limit}


class BodyTooLargeError(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than this route's {limit}-byte limit")


def _declared_length(request: Request) -> int | None:
    value = request.headers.get("content-length", "")
    return int(value) if value.isdigit() else None


def _limited(receive: Receive, limit: int) -> Receive:
    """``receive`` that fails (413) as soon as the body passes ``limit`` bytes."""
    seen = 0

    async def limited() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLargeError(limit)
        return message

    return limited


# What FastAPI's bare 400 "error parsing the body" was caused by, in words.
_UNPARSABLE: dict[type[Exception], str] = {
    UnicodeDecodeError: "body is not UTF-8",
    RecursionError: "JSON nested too deep",
}


class ApiRoute(APIRoute):
    """Route class of every /api/v1 router.

    FastAPI reads and parses a route's body before any dependency runs, so a token checked in a
    dependency comes too late to protect memory. This class runs the router's credential check
    (``auth``, the same function as its dependency) on the headers first, then checks the
    declared Content-Length against the route's body limit (413 before the route does
    anything), and only then lets the route read its body, through a ``receive`` that answers
    413 as soon as the limit is crossed (a chunked or lying body).
    """

    auth: ClassVar[Auth | None] = None  # set by ``api_router``

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        # Every operation documents its limit (an app's override is documented by the app).
        self.openapi_extra = {**(self.openapi_extra or {}), BODY_LIMIT_KEY: self.body_limit}

    @property
    def body_limit(self) -> int:
        declared = (self.openapi_extra or {}).get(BODY_LIMIT_KEY)
        if declared is not None:
            return declared
        return JSON_BODY_LIMIT if self.body_field is not None else NO_BODY_LIMIT

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        path, route_limit = self.path, self.body_limit

        auth = self.auth

        async def guarded(request: Request) -> Response:
            if auth is not None:
                await auth(request, await _bearer(request))
            overrides: Mapping[tuple[str, str], int] = getattr(request.app.state, "body_limits", {})
            limit = overrides.get((request.method, path), route_limit)
            length = _declared_length(request)
            if length is not None and length > limit:
                raise BodyTooLargeError(limit)
            try:
                return await handler(Request(request.scope, _limited(request.receive, limit)))
            except StarletteHTTPException as e:
                # FastAPI answers a body its JSON parser gives up on with a bare 400: one that
                # is not even text (invalid UTF-8), or one nested deeper than the parser's
                # recursion limit. Both are invalid input like any malformed JSON: 422 naming
                # the body (the status docs and clients expect).
                why = next((m for t, m in _UNPARSABLE.items() if isinstance(e.__cause__, t)), None)
                if e.status_code == 400 and why is not None:
                    raise RequestValidationError(
                        [{"type": "json_invalid", "loc": ("body",), "msg": why}]
                    ) from e
                raise

        return guarded


# -- error responses -----------------------------------------------------------------------------


class Problem(BaseModel):
    """An error: what went wrong, in words (input echoed at most as a short prefix)."""

    detail: str


class FieldProblem(BaseModel):
    type: str
    loc: list[str | int]
    msg: str


class ValidationProblem(BaseModel):
    """422: each bad field, where (``loc``) and what (``msg``); the input is never echoed."""

    detail: list[FieldProblem]


_DESCRIPTIONS = {
    400: "The request is well-formed but its content is wrong",
    401: "Missing or wrong bearer token",
    403: "The credential is valid but not for this route",
    404: "Not found",
    409: "Conflicts with the current state",
    410: "Gone",
    413: "Request body larger than this route's limit",
    503: "The store (Redis) is unavailable; nothing was changed, retry (Retry-After)",
}


def problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for error statuses a route returns, with their bodies."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        if code == 422:
            out[422] = {"model": ValidationProblem, "description": "Invalid input, field named"}
        else:
            out[code] = {"model": Problem, "description": _DESCRIPTIONS[code]}
    return out


def api_router(auth: Auth, *more_problems: int) -> APIRouter:
    """The /api/v1 router of a service. ``auth(request, credentials)`` is its credential check:
    the router's dependency (what the OpenAPI document shows as security), also run by the
    route class before any body is read. Every route documents what any route can answer
    (401, 413, 422, 503, and ``more_problems``)."""
    route_class = type("ApiRoute", (ApiRoute,), {"auth": staticmethod(auth)})
    return APIRouter(
        prefix="/api/v1",
        dependencies=[Depends(auth)],
        route_class=route_class,
        responses=problems(401, 413, 422, 503, *more_problems),
    )


def error_response(status: int, detail: str, headers: Mapping[str, str] | None = None) -> Response:
    return JSONResponse({"detail": clip(detail)}, status_code=status, headers=headers)


def _allowed_methods(request: Request) -> str:
    """Every documented method of the requested path (Starlette's 405 names only those of the
    first route that matched the path, one of several routes of the same resource)."""
    path = request.url.path
    methods: set[str] = set()
    for template, operations in request.app.openapi().get("paths", {}).items():
        if re.fullmatch(re.sub(r"\\{[^}/]+\\}", "[^/]+", re.escape(template)), path):
            methods.update(m.upper() for m in operations if m != "parameters")
    return ", ".join(sorted(methods))


def _clip_loc(part: Any) -> str | int:
    return part if isinstance(part, int) else clip(str(part), 64)


def add_common_error_handlers(app: FastAPI, store: str) -> None:
    """422 that names where and what (never echoing the input; names and messages cut to a
    short prefix), other HTTP errors with their detail cut the same way, and 503 when Redis is
    down.

    ``store`` names what is unavailable in the 503 message, e.g. "leaderboard store (Redis)".
    A 503 means nothing was changed: every write path is a single Redis script or transaction.
    """

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only where and what: echoing the input back could be huge, and a NaN in it is not
        # even JSON. A message or key may quote the input (an unknown name), so both are cut.
        # A body sent as a form or text (curl -d's default) is not read as JSON: say why.
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        json_or_upload = kind.endswith("json") or kind.startswith("multipart/")
        hint = "" if json_or_upload else " (send it as JSON: Content-Type: application/json)"
        detail = [
            {
                "type": str(e.get("type")),
                "loc": [_clip_loc(p) for p in e.get("loc", ())],
                "msg": clip(str(e.get("msg")))
                + (hint if tuple(e.get("loc", ())) == ("body",) else ""),
            }
            for e in exc.errors()
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code in (204, 304):  # no body allowed
            return Response(status_code=exc.status_code, headers=exc.headers)
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
        return error_response(exc.status_code, detail, headers)

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    async def redis_down(_: Request, exc: Exception) -> Response:
        log.warning("redis unavailable", error=describe_error(exc))
        return error_response(
            503, f"{store} unavailable; nothing was changed, retry", {"Retry-After": "1"}
        )
