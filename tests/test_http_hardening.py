"""Hostile HTTP against both real services.

Requests are sent with http.client where a test needs to send headers without the body they
announce: a server that answers at once has not waited for (or read) the body."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from typing import Annotated
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.cli.platform import Platform
from services.contracts.artifacts import CompileFacts
from services.http import (
    BODY_LIMIT_KEY,
    ECHO_CHARS,
    JSON_BODY_LIMIT,
    SPEC_BODY_LIMIT,
    add_common_error_handlers,
    api_router,
)
from tests.leaderboard.conftest import experiment, multipart, result
from tests.orchestrator.conftest import spec
from tests.orchestrator.servers import ServerThread
from tests.platform_servers import standin_platform

# Long enough that a server waiting for a body it was promised is caught, short enough to keep
# the suite fast: every answer below comes before the body, so it comes at once.
ANSWER_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with standin_platform(tmp_path_factory.mktemp("hardening")) as p:
        yield p


def send_head(
    url: str, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, bytes]:
    """Send the request line, ``headers`` and only ``body`` of the body they announce; return
    the status and body of the answer (a timeout if the server waits for the rest)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=ANSWER_TIMEOUT_S)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders(body or None)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def huge(auth: dict[str, str] | None = None, length: int = 200 << 20) -> dict[str, str]:
    return {"Content-Type": "application/json", "Content-Length": str(length), **(auth or {})}


MUTATING = [  # (service, method, path): routes that take a JSON body
    ("orchestrator", "POST", "/api/v1/experiments"),
    ("leaderboard", "PUT", "/api/v1/experiments/e1"),
    ("leaderboard", "POST", "/api/v1/experiments/e1/generate"),
    ("leaderboard", "POST", "/api/v1/experiments/e1/submissions"),
]


def base(services: Platform, name: str) -> str:
    return services.orchestrator_url if name == "orchestrator" else services.leaderboard_url


def auth(services: Platform, name: str = "") -> dict[str, str]:
    return {"Authorization": f"Bearer {services.token}"}


# -- the token before the body, and bounded bodies --------------------------------


@pytest.mark.parametrize(("service", "method", "path"), MUTATING)
def test_no_token_is_answered_before_the_body_is_read(
    services: Platform, service: str, method: str, path: str
) -> None:
    url = base(services, service)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic eDp5"}):
        # 200 MB announced, a few bytes sent: a server that reads the body first never answers.
        status, _ = send_head(url, method, path, huge(headers), b'{"name": "')
        assert status == 401
        # A chunked body (no length to check up front) alike.
        chunked = {"Content-Type": "application/json", "Transfer-Encoding": "chunked", **headers}
        status, _ = send_head(url, method, path, chunked, chunk(b'{"x": "' + b"a" * 4096))
        assert status == 401


@pytest.mark.parametrize(("service", "method", "path"), MUTATING[:3])
def test_a_body_over_the_limit_is_413_before_it_is_read(
    services: Platform, service: str, method: str, path: str
) -> None:
    status, body = send_head(
        base(services, service), method, path, huge(auth(services, service)), b"{"
    )
    assert status == 413 and "limit" in json.loads(body)["detail"]


@pytest.mark.parametrize(
    ("service", "method", "path", "limit"),
    [
        ("orchestrator", "POST", "/api/v1/experiments", SPEC_BODY_LIMIT),
        ("leaderboard", "PUT", "/api/v1/experiments/e1", SPEC_BODY_LIMIT),
        ("leaderboard", "POST", "/api/v1/experiments/e1/generate", JSON_BODY_LIMIT),
    ],
)
def test_a_chunked_body_is_cut_off_as_it_crosses_the_limit(
    services: Platform, service: str, method: str, path: str, limit: int
) -> None:
    headers = {
        "Content-Type": "application/json",
        "Transfer-Encoding": "chunked",
        **auth(services, service),
    }
    # One byte past the limit and no final chunk: only a server counting while it streams
    # answers (413); one without a limit waits for the rest.
    status, body = send_head(
        base(services, service), method, path, headers, chunk(b" " * (limit + 1))
    )
    assert status == 413 and str(limit) in json.loads(body)["detail"]


def test_uploads_keep_their_configured_limit(services: Platform) -> None:
    url, headers = services.leaderboard_url, auth(services)
    assert httpx.put(f"{url}/api/v1/experiments/up", json=experiment(), headers=headers).is_success
    files = {"model.safetensors": b"w" * (3 * SPEC_BODY_LIMIT)}  # larger than any JSON body
    r = httpx.post(
        f"{url}/api/v1/experiments/up/submissions",
        files=multipart(result("big-1", 1.0, files), files),
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["accepted"], r.text


def test_a_route_without_a_body_refuses_a_large_one_before_acting(services: Platform) -> None:
    url, headers = services.leaderboard_url, auth(services)
    assert httpx.put(f"{url}/api/v1/experiments/keep", json=experiment(), headers=headers)
    r = httpx.request(
        "DELETE", f"{url}/api/v1/experiments/keep", content=b"x" * (64 << 10), headers=headers
    )
    assert r.status_code == 413
    assert httpx.get(f"{url}/api/v1/experiments/keep", headers=headers).status_code == 200


def _operations(doc: dict) -> Iterator[tuple[str, str, dict]]:
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            yield method.upper(), path, op


def test_every_route_declares_and_enforces_a_body_limit(services: Platform) -> None:
    for service in ("orchestrator", "leaderboard"):
        url = base(services, service)
        doc = httpx.get(f"{url}/api/v1/openapi.json").json()
        for method, path, op in _operations(doc):
            limit = op[BODY_LIMIT_KEY]
            assert isinstance(limit, int) and limit > 0, (service, method, path)
            # Parameters that pass their checks: the body limit is what is tested.
            facts = CompileFacts(torch="2", device="cpu", program="0" * 64)
            concrete = path.replace("{key}", facts.key()).replace("{name}", "log")
            concrete = re.sub(r"\{[^}]+\}", "nosuch-1", concrete)
            if method == "PUT" and "/compile-caches/" in path:
                concrete += f"?pod_id=nosuch-1&torch=2&device=cpu&program={'0' * 64}"
            status, _ = send_head(
                url, method, concrete, huge(auth(services, service), limit + 1), b"{"
            )
            assert status == 413, (service, method, path, status)


# -- errors echo at most a short prefix ---------------------------------------------


def test_errors_echo_only_a_prefix_of_huge_input(services: Platform) -> None:
    big = "x" * 200_000
    lb, orch = services.leaderboard_url, services.orchestrator_url
    answers = [
        httpx.put(
            f"{lb}/api/v1/experiments/echo",
            json=experiment(strategy=big),
            headers=auth(services),
        ),
        httpx.post(
            f"{orch}/api/v1/experiments",
            json=spec("echo", env={"name": big}),
            headers=auth(services),
        ),
        httpx.post(
            f"{orch}/api/v1/experiments",
            json={**spec("echo"), big: 1},  # an unknown field's name is echoed in `loc`
            headers=auth(services),
        ),
    ]
    for r in answers:
        assert r.status_code == 422, r.text[:300]
        assert len(r.content) < 4 * ECHO_CHARS, len(r.content)
        error = r.json()["detail"][0]
        assert "xxxxxxxx" in error["msg"] + "".join(map(str, error["loc"]))
    # The known names, at the end of the message, survive the cut.
    assert "pbt" in answers[0].json()["detail"][0]["msg"]
    long_id = "y" * 6000
    r = httpx.get(f"{orch}/api/v1/experiments/{long_id}", headers=auth(services))
    assert r.status_code == 404 and len(r.content) < 4 * ECHO_CHARS


# -- no slash redirect may re-target a request --------------------------------------


def test_a_trailing_slash_is_404_and_never_redirected(services: Platform) -> None:
    lb = httpx.Client(
        base_url=services.leaderboard_url, headers=auth(services), follow_redirects=True
    )
    orch = httpx.Client(
        base_url=services.orchestrator_url,
        headers=auth(services),
        follow_redirects=True,
    )
    with lb, orch:
        assert lb.put("/api/v1/experiments/canary-lb-1", json=experiment()).is_success
        # What a client made of `DELETE …/leases/..`: a following client used to land on the
        # experiment itself and delete it.
        r = lb.delete("/api/v1/experiments/canary-lb-1/")
        assert r.status_code == 404 and not r.history
        assert lb.get("/api/v1/experiments/canary-lb-1").status_code == 200

        exp_id = orch.post("/api/v1/experiments", json=spec("slash")).json()["id"]
        for method in ("DELETE", "GET"):
            r = orch.request(method, f"/api/v1/experiments/{exp_id}/")
            assert r.status_code == 404 and not r.history
        assert orch.get(f"/api/v1/experiments/{exp_id}").status_code == 200
        for client in (lb, orch):
            r = client.get("/api/v1/experiments/")
            assert r.status_code == 404 and not r.history
        orch.delete(f"/api/v1/experiments/{exp_id}")


# -- the OpenAPI documents list every status ----------------------------------------

# Statuses each route returns besides the common ones, by (method, path).
ROUTE_STATUSES = {
    "orchestrator": {
        ("POST", "/api/v1/experiments"): {201, 409},
        ("GET", "/api/v1/experiments"): {200},
        ("GET", "/api/v1/experiments/{exp_id}"): {200, 404},
        ("POST", "/api/v1/experiments/{exp_id}/cancel"): {202, 404, 409},
        ("POST", "/api/v1/experiments/{exp_id}/pause"): {202, 404, 409},
        ("POST", "/api/v1/experiments/{exp_id}/resume"): {202, 404, 409},
        ("DELETE", "/api/v1/experiments/{exp_id}"): {204, 404},
        ("GET", "/api/v1/experiments/{exp_id}/events"): {200, 404},
        ("GET", "/api/v1/experiments/{exp_id}/pods/{pod_id}/logs"): {200, 404},
        ("GET", "/api/v1/experiments/{exp_id}/ended-pods"): {200, 404},
        ("GET", "/api/v1/platform"): {200},
    },
    # 409 on GET experiment, leaderboard and generate: a stored config that no longer validates.
    "leaderboard": {
        ("PUT", "/api/v1/experiments/{experiment_id}"): {200, 201, 409},
        ("GET", "/api/v1/experiments"): {200},
        ("GET", "/api/v1/experiments/{experiment_id}"): {200, 404, 409},
        ("DELETE", "/api/v1/experiments/{experiment_id}"): {204, 404},
        ("POST", "/api/v1/experiments/{experiment_id}/submissions"): {200, 400, 404},
        ("GET", "/api/v1/experiments/{experiment_id}/submissions"): {200, 404},
        ("GET", "/api/v1/experiments/{experiment_id}/leaderboard"): {200, 404, 409},
        ("GET", "/api/v1/experiments/{experiment_id}/best"): {200, 404},
        ("GET", "/api/v1/experiments/{experiment_id}/candidates/{candidate_id}"): {200, 404},
        (
            "GET",
            "/api/v1/experiments/{experiment_id}/candidates/{candidate_id}/files/{name}",
        ): {200, 404, 410},
        ("GET", "/api/v1/experiments/{experiment_id}/lineage"): {200, 404},
        ("POST", "/api/v1/experiments/{experiment_id}/generate"): {200, 404, 409},
        ("DELETE", "/api/v1/experiments/{experiment_id}/leases/{lease_id}"): {204, 404},
        ("POST", "/api/v1/experiments/{experiment_id}/compile-caches/{key}/claim"): {200, 404},
        ("PUT", "/api/v1/experiments/{experiment_id}/compile-caches/{key}"): {200, 404},
        ("GET", "/api/v1/experiments/{experiment_id}/compile-caches/{key}"): {200, 404, 410},
        ("PUT", "/api/v1/experiments/{experiment_id}/pods/{pod_id}/files/{name}"): {200, 404},
        ("GET", "/api/v1/experiments/{experiment_id}/pods/{pod_id}/files/{name}"): {
            200,
            404,
            410,
        },
        ("GET", "/api/v1/experiments/{experiment_id}/pod-files"): {200, 404},
    },
}
COMMON = {
    "orchestrator": {401, 413, 422, 503},
    "leaderboard": {401, 403, 413, 422, 503},  # 403: a pod credential off the pod routes
}


def _resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


@pytest.mark.parametrize("service", ["orchestrator", "leaderboard"])
def test_openapi_documents_every_status_with_its_body(services: Platform, service: str) -> None:
    doc = httpx.get(f"{base(services, service)}/api/v1/openapi.json").json()
    seen = set()
    for method, path, op in _operations(doc):
        seen.add((method, path))
        documented = {int(code) for code in op["responses"]}
        expected = ROUTE_STATUSES[service][(method, path)] | COMMON[service]
        assert documented == expected, (method, path, documented ^ expected)
        for code, response in op["responses"].items():
            if int(code) < 400:
                continue
            schema = _resolve(doc, response["content"]["application/json"]["schema"])
            assert "detail" in schema["required"], (method, path, code)
            detail = _resolve(doc, schema["properties"]["detail"])
            assert detail["type"] == ("array" if code == "422" else "string"), (path, code)
    assert seen == set(ROUTE_STATUSES[service])  # a new route is added to this table


def test_documented_error_bodies_are_what_the_services_send(services: Platform) -> None:
    """The shapes above, checked against real answers (schemathesis does this at scale)."""
    lb, orch = services.leaderboard_url, services.orchestrator_url
    r = httpx.get(f"{orch}/api/v1/experiments/nope", headers=auth(services))
    assert r.status_code == 404 and set(r.json()) == {"detail"}
    r = httpx.get(f"{lb}/api/v1/experiments/nope/lineage")
    assert r.status_code == 401 and isinstance(r.json()["detail"], str)
    r = httpx.put(f"{lb}/api/v1/experiments/x", json={"top_k": 0}, headers=auth(services))
    assert r.status_code == 422
    assert all(set(e) == {"type", "loc", "msg"} for e in r.json()["detail"])


def test_a_wrong_method_names_every_method_of_the_resource(services: Platform) -> None:
    url = f"{services.leaderboard_url}/api/v1/experiments/some-exp"
    r = httpx.request("PATCH", url, headers=auth(services))
    assert r.status_code == 405 and r.headers["Allow"] == "DELETE, GET, PUT"


@pytest.mark.parametrize(("service", "method", "path"), MUTATING[:3])
def test_a_body_that_is_not_text_is_422_naming_the_body(
    services: Platform, service: str, method: str, path: str
) -> None:
    r = httpx.request(
        method,
        base(services, service) + path,
        content=b"\xb5m\xff\xfe",
        headers={"Content-Type": "application/json", **auth(services)},
    )
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"]


@pytest.mark.parametrize(("service", "method", "path"), MUTATING[:3])
def test_json_nested_too_deep_is_422_naming_the_body(
    services: Platform, service: str, method: str, path: str
) -> None:
    """JSON nested 10,000 deep was a bare 400 (the parser's recursion limit).
    Every body is within the smallest JSON limit (64 KiB)."""
    deep = [b"[" * d + b"]" * d for d in (10_000, 30_000)]
    for body in (*deep, b'{"a":' * 10_000 + b"1" + b"}" * 10_000):
        r = httpx.request(
            method,
            base(services, service) + path,
            content=body,
            headers={"Content-Type": "application/json", **auth(services)},
        )
        assert r.status_code == 422, r.text
        problem = r.json()["detail"][0]
        assert problem["loc"] == ["body"] and "deep" in problem["msg"]


def test_the_routers_own_credential_check_runs_before_the_body() -> None:
    """A service's scoped credentials (403 off their routes) are refused as early as a
    missing token: the route class runs the router's own check, not a copy of it."""

    async def auth(
        request: Request,
        credentials: Annotated[
            HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))
        ],
    ) -> None:
        if credentials is None:
            raise HTTPException(401, "no token")
        if credentials.credentials == "scoped":
            raise HTTPException(403, f"not for {request.method} {request.url.path}")

    router = api_router(auth, 403)

    @router.post("/things")
    async def make(thing: dict[str, int]) -> dict[str, int]:
        return thing

    app = FastAPI()
    app.include_router(router)
    add_common_error_handlers(app, "store")
    with ServerThread(app) as srv:
        for token, expected in (("scoped", 403), (None, 401)):
            headers = huge({"Authorization": f"Bearer {token}"} if token else {})
            assert send_head(srv.url, "POST", "/api/v1/things", headers, b"{")[0] == expected
        r = httpx.post(
            f"{srv.url}/api/v1/things", json={"a": 1}, headers={"Authorization": "Bearer x"}
        )
        assert r.status_code == 200 and r.json() == {"a": 1}


# -- stream cursors: ASCII digits only ----------------------------------------------------------


@pytest.mark.parametrize("digit", ["\uff11", "\u0663", "\u0967"])  # fullwidth, Arabic, Devanagari 1
def test_a_cursor_of_non_ascii_digits_is_422_on_both_services(
    services: Platform, digit: str
) -> None:
    """``\\d`` matches any Unicode digit, Redis only ASCII ones: such a cursor was a 500."""
    headers = auth(services)
    exp_id = httpx.post(
        f"{services.orchestrator_url}/api/v1/experiments",
        json=spec("cursor", target_return=None),
        headers=headers,
    ).json()["id"]
    httpx.put(
        f"{services.leaderboard_url}/api/v1/experiments/e1",
        json=experiment(),
        headers=auth(services),
    )
    for url in (
        f"{services.orchestrator_url}/api/v1/experiments/{exp_id}/events",
        f"{services.leaderboard_url}/api/v1/experiments/e1/submissions",
    ):
        for after in (f"{digit}-0", f"0-{digit}", f"1{digit}-0"):
            r = httpx.get(url, params={"after": after}, headers=headers)
            assert r.status_code == 422, (url, after, r.status_code, r.text[:300])
            assert r.json()["detail"][0]["loc"] == ["query", "after"]


def test_a_misspelled_search_space_name_is_answered_with_the_name_meant(services: Platform) -> None:
    """The API cuts a long message in its middle: the valid names listed at its end hid
    ``learning_rate`` from whoever misspelled it."""
    body = spec("typo", search_space={"learning_rat": {"type": "uniform", "low": 0.1, "high": 0.2}})
    r = httpx.post(
        f"{services.orchestrator_url}/api/v1/experiments", json=body, headers=auth(services)
    )
    assert r.status_code == 422, r.text
    error = r.json()["detail"][0]
    assert error["loc"] == ["body", "search_space"]
    assert "'learning_rat': did you mean 'learning_rate'?" in error["msg"], error["msg"]
    assert "podium algorithms --names" in error["msg"]
