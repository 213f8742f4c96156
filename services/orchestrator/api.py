"""The experiments API under /api/v1 (bearer-token auth)."""

from __future__ import annotations

import hashlib
import secrets
from typing import Annotated

from fastapi import Header, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from services.contracts.spec import ExperimentSpec, parse_quantity
from services.http import (
    SPEC_BODY_LIMIT,
    StreamCursor,
    api_router,
    body_limit,
    problems,
    require_token,
)
from services.orchestrator import store as st
from services.orchestrator.models import EndedPodLogOut, EventOut, ExperimentOut, ShownState
from services.orchestrator.reconciler import Reconciler, last_lines
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.store import (
    Cursor,
    Experiment,
    IdempotencyConflictError,
    NotFoundError,
    Store,
    TransitionError,
)

router = api_router(require_token)


def _store(request: Request) -> Store:
    return request.app.state.store


def _reconciler(request: Request) -> Reconciler:
    return request.app.state.reconciler


def _settings(request: Request) -> OrchestratorSettings:
    return request.app.state.settings


def _not_found(exp_id: str) -> HTTPException:
    return HTTPException(status_code=404, detail=f"experiment {exp_id[:100]!r} not found")


def _get(store: Store, exp_id: str) -> Experiment:
    exp = store.get(exp_id)
    if exp is None or exp.intent == st.DELETE:
        raise _not_found(exp_id)
    return exp


#: Redis stream ids are two unsigned 64-bit numbers.
def check_bounds(spec: ExperimentSpec, settings: OrchestratorSettings) -> None:
    """Resource requests bounded by the server's settings: 422 naming the field."""
    errors = []

    def bad(loc: tuple[str, ...], value: object, limit: object) -> None:
        errors.append(
            {
                "type": "less_than_equal",
                "loc": ("body", *loc),
                "msg": f"Input should be less than or equal to {limit} (server limit)",
                "input": value,
                "ctx": {"le": limit},
            }
        )

    r = spec.resources
    if r.gpus > settings.max_pod_gpus:
        bad(("resources", "gpus"), r.gpus, settings.max_pod_gpus)
    if r.cpu > settings.max_pod_cpu:
        bad(("resources", "cpu"), r.cpu, settings.max_pod_cpu)
    if parse_quantity(r.memory) > parse_quantity(settings.max_pod_memory):
        bad(("resources", "memory"), r.memory, settings.max_pod_memory)
    if spec.population.max_pods > settings.max_pods_per_experiment:
        bad(("population", "max_pods"), spec.population.max_pods, settings.max_pods_per_experiment)
    if errors:
        raise RequestValidationError(errors)


@router.post(
    "/experiments",
    status_code=201,
    response_model=ExperimentOut,
    responses=problems(409),
    openapi_extra=body_limit(SPEC_BODY_LIMIT),
)
def create_experiment(
    spec: ExperimentSpec,
    request: Request,
    response: Response,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> ExperimentOut:
    check_bounds(spec, _settings(request))
    store = _store(request)
    body_hash = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()
    try:
        exp_id, created = store.create(secrets.token_hex(6), spec, idempotency_key, body_hash)
    except IdempotencyConflictError as e:
        raise HTTPException(
            status_code=409,
            detail=f"Idempotency-Key was used for a different request (experiment {e.args[0]})",
        ) from e
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
    _reconciler(request).wake()
    response.headers["Location"] = f"/api/v1/experiments/{exp_id}"
    return ExperimentOut.of(_get(store, exp_id))


@router.get(
    "/experiments",
    response_model=list[ExperimentOut],
    description="Newest first, one page at a time: when there are more, the `X-Next-Cursor` "
    'header (and a `Link: <…>; rel="next"` header) gives the `cursor` of the next page.',
)
def list_experiments(
    request: Request,
    response: Response,
    state: ShownState | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=100)] = None,
) -> list[ExperimentOut]:
    try:
        after = Cursor.decode(cursor) if cursor is not None else None
    except ValueError as e:
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("query", "cursor"), "msg": str(e)}]
        ) from None
    page, nxt = _store(request).page(limit, after, state)
    if nxt is not None:
        token = nxt.encode()
        response.headers["X-Next-Cursor"] = token
        query = request.query_params.multi_items()
        params = [(k, v) for k, v in query if k != "cursor"] + [("cursor", token)]
        url = request.url.replace_query_params(**dict(params))
        response.headers["Link"] = f'<{url.path}?{url.query}>; rel="next"'
    return [ExperimentOut.of(e) for e in page]


@router.get("/experiments/{exp_id}", response_model=ExperimentOut, responses=problems(404))
def get_experiment(exp_id: str, request: Request) -> ExperimentOut:
    return ExperimentOut.of(_get(_store(request), exp_id))


def _set_intent(request: Request, exp_id: str, intent: str) -> ExperimentOut:
    store = _store(request)
    exp = _get(store, exp_id)
    if exp.invalid:
        raise HTTPException(
            status_code=409, detail=f"the stored experiment is invalid (delete it): {exp.invalid}"
        )
    try:  # one Redis script: an accepted cancel is final, an ended experiment stays ended
        store.set_intent(exp_id, intent)
    except NotFoundError:
        raise _not_found(exp_id) from None
    except TransitionError as e:
        raise HTTPException(status_code=409, detail=str(e)) from None
    _reconciler(request).wake()
    return ExperimentOut.of(_get(store, exp_id))


@router.post(
    "/experiments/{exp_id}/cancel",
    status_code=202,
    response_model=ExperimentOut,
    responses=problems(404, 409),
)
def cancel_experiment(exp_id: str, request: Request) -> ExperimentOut:
    return _set_intent(request, exp_id, st.CANCEL)


@router.post(
    "/experiments/{exp_id}/pause",
    status_code=202,
    response_model=ExperimentOut,
    responses=problems(404, 409),
)
def pause_experiment(exp_id: str, request: Request) -> ExperimentOut:
    return _set_intent(request, exp_id, st.PAUSE)


@router.post(
    "/experiments/{exp_id}/resume",
    status_code=202,
    response_model=ExperimentOut,
    responses=problems(404, 409),
)
def resume_experiment(exp_id: str, request: Request) -> ExperimentOut:
    return _set_intent(request, exp_id, st.RUN)


@router.delete("/experiments/{exp_id}", status_code=204, responses=problems(404))
def delete_experiment(exp_id: str, request: Request) -> Response:
    """Stops its pods (gracefully) and forgets it; it is gone from the API at once, and the
    Idempotency-Key that created it is free again."""
    try:
        _store(request).set_intent(exp_id, st.DELETE)
    except NotFoundError:
        raise _not_found(exp_id) from None
    _reconciler(request).wake()
    return Response(status_code=204)


@router.get("/experiments/{exp_id}/events", response_model=list[EventOut], responses=problems(404))
def experiment_events(
    exp_id: str,
    request: Request,
    after: StreamCursor = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[dict]:
    store = _store(request)
    _get(store, exp_id)
    return store.events(exp_id, after=after, limit=limit)


@router.get(
    "/experiments/{exp_id}/pods/{pod_id}/logs",
    # The log is text; errors stay JSON like everywhere else (the response class would set
    # the media type of every documented response).
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **problems(404)},
    summary="The last lines of a pod's log",
    description="Local backend: the pod's log file; Kubernetes: `pods/log` of its container. "
    "A pod that has ended and is gone: the last lines the orchestrator kept of it "
    "(`ended-pods`).",
)
def pod_logs(
    exp_id: str,
    pod_id: Annotated[str, Path(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)],
    request: Request,
    tail: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> Response:
    _get(_store(request), exp_id)
    text = request.app.state.backend.pod_log_tail(exp_id, pod_id, tail)
    if not text and (kept := _store(request).pod_log(exp_id, pod_id)) is not None:
        text = last_lines(kept.log, tail)
    if not text:
        raise HTTPException(status_code=404, detail=f"no logs for pod {pod_id!r} of {exp_id!r}")
    return PlainTextResponse(text + "\n")


@router.get(
    "/experiments/{exp_id}/ended-pods",
    response_model=list[EndedPodLogOut],
    responses=problems(404),
    summary="The last log lines of the experiment's ended pods",
    description="Kept by the orchestrator when each pod ended (the newest `ended_pod_logs` "
    "pods, their last `ended_pod_log_lines` lines), in the order they ended, so that they "
    "outlive the pods; deleted with the experiment.",
)
def ended_pods(
    exp_id: str,
    request: Request,
    tail: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> list[EndedPodLogOut]:
    store = _store(request)
    _get(store, exp_id)
    return [
        EndedPodLogOut(**{**p.model_dump(), "log": last_lines(p.log, tail)})
        for p in store.pod_logs(exp_id)
    ]


class PlatformOut(BaseModel):
    """Where the rest of the platform is, as this orchestrator is configured."""

    leaderboard_url: str | None = Field(
        description="The leaderboard's URL the pods use (PODIUM_LEADERBOARD_URL); null if none."
    )


@router.get(
    "/platform",
    response_model=PlatformOut,
    summary="Where the rest of the platform is",
    description="Lets a client given only the orchestrator's URL find the leaderboard "
    "(`podium export --url …`). Read-only.",
)
def platform_info(request: Request) -> PlatformOut:
    return PlatformOut(leaderboard_url=request.app.state.settings.leaderboard_url)
