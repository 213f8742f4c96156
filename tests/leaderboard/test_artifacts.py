"""The pods' artifacts on the real leaderboard app (embedded Redis, filesystem blob store):
compile caches claimed, published and fetched once per program key, refused ones replaced; pod
files kept and replaced; their blobs referenced while named and collected after; what a pod's
credential may do; bad input answered with the field named."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from fastapi.testclient import TestClient

from services.contracts.artifacts import CompileFacts
from services.contracts.credentials import pod_token
from tests.leaderboard.conftest import TOKEN, experiment

API = "/api/v1/experiments"
FACTS = CompileFacts(torch="2.13.0+cpu", device="cpu-x86_64-abc", program="a" * 64)
KEY = FACTS.key()


def claim(client: TestClient, pod: str, exp: str = "e", **kw: Any) -> dict[str, Any]:
    body = {"pod_id": pod, "facts": FACTS.model_dump(), **kw}
    r = client.post(f"{API}/{exp}/compile-caches/{KEY}/claim", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def publish(client: TestClient, pod: str, data: bytes, exp: str = "e") -> dict[str, Any]:
    params = {"pod_id": pod, **FACTS.model_dump()}
    r = client.put(f"{API}/{exp}/compile-caches/{KEY}", params=params, content=data)
    assert r.status_code == 200, r.text
    return r.json()


def svc(client: TestClient) -> Any:
    return client.app.state.services  # type: ignore[attr-defined]


def refs(client: TestClient, sha: str) -> int | None:
    value = client.portal.call(svc(client).store.r.hget, "podium:blob:refs", sha)
    return int(value) if value is not None else None


def test_one_pod_compiles_the_others_wait_then_fetch_the_same_bytes(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment())
    assert claim(client, "p0")["state"] == "compile"
    # Every other pod waits while p0 holds the claim; p0 asking again renews it.
    for pod in ("p1", "p2", "p3"):
        waiting = claim(client, pod)
        assert waiting["state"] == "wait" and waiting["holder"] == "p0", waiting
        # A few waiters ask again soon: an eager holder says "nothing" a second after its claim.
        assert waiting["retry_after_s"] == 0.25
    assert claim(client, "p0")["state"] == "compile"

    bundle = b"compiled programs" * 1000
    done = publish(client, "p0", bundle)
    sha = hashlib.sha256(bundle).hexdigest()
    assert done == {**done, "state": "ready", "sha256": sha, "size": len(bundle), "holder": "p0"}
    for pod in ("p1", "p2", "p3"):
        ready = claim(client, pod)
        assert ready["state"] == "ready" and ready["sha256"] == sha
        got = client.get(f"{API}/e/compile-caches/{KEY}")
        assert got.content == bundle and got.headers["x-checkpoint-sha256"] == sha
    # The first publish stays: a late one (a pod that gave up waiting) is discarded.
    assert publish(client, "p2", b"another build")["sha256"] == sha
    assert refs(client, sha) == 1


def test_many_waiters_together_ask_about_twenty_times_a_second(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment())
    claim(client, "p0")
    hints = [claim(client, f"p{i}")["retry_after_s"] for i in range(1, 101)]
    assert hints[:5] == [0.25] * 5  # the first five: every 0.25 s each
    assert hints[19] == 1.0 and hints[39:] == [2.0] * 61  # 20 waiters: 1 s; 40 and more: 2 s
    assert claim(client, "p7")["retry_after_s"] == 2.0  # one asking again is not one more


def test_a_refused_cache_is_dropped_and_compiled_again(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment())
    claim(client, "p0")
    sha = publish(client, "p0", b"bad build")["sha256"]
    # A refusal naming another digest (stale) changes nothing.
    assert claim(client, "p1", refused="f" * 64)["state"] == "ready"
    again = claim(client, "p1", refused=sha)
    assert again["state"] == "compile" and again["holder"] == "p1", again
    assert refs(client, sha) is None  # no longer named: the collector may take it
    assert client.get(f"{API}/e/compile-caches/{KEY}").status_code == 404
    good = publish(client, "p1", b"good build")
    assert good["sha256"] == hashlib.sha256(b"good build").hexdigest()


def test_nothing_to_share_is_ready_without_a_download(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment())
    claim(client, "p0")
    assert publish(client, "p0", b"")["sha256"] is None
    ready = claim(client, "p1")
    assert ready["state"] == "ready" and ready["sha256"] is None
    assert client.get(f"{API}/e/compile-caches/{KEY}").status_code == 404


def test_a_claim_of_a_pod_that_died_expires(tmp_path: Any) -> None:
    from services.leaderboard.app import create_app
    from tests.leaderboard.conftest import AUTH, settings_for

    app = create_app(settings_for(tmp_path / "data", compile_claim_ttl_s=0.3))
    with TestClient(app, headers=AUTH) as client:
        client.put(f"{API}/e", json=experiment())
        assert claim(client, "p0")["state"] == "compile"
        assert claim(client, "p1")["state"] == "wait"
        time.sleep(0.5)  # p0 never claimed again
        assert claim(client, "p1")["state"] == "compile"


def test_caches_are_per_experiment_and_need_matching_facts(client: TestClient) -> None:
    for exp in ("e", "f"):
        client.put(f"{API}/{exp}", json=experiment())
    claim(client, "p0", exp="e")
    publish(client, "p0", b"e's build", exp="e")
    assert claim(client, "p0", exp="f")["state"] == "compile"  # another experiment's key

    other = FACTS.model_copy(update={"device": "cuda-H200-sm90-cu12.8"}).model_dump()
    r = client.post(f"{API}/e/compile-caches/{KEY}/claim", json={"pod_id": "p1", "facts": other})
    assert r.status_code == 422 and "facts" in str(r.json()["detail"][0]["loc"]), r.text
    r = client.put(
        f"{API}/e/compile-caches/{KEY}",
        params={"pod_id": "p1", **other},
        content=b"x",
    )
    assert r.status_code == 422 and "program" in str(r.json()["detail"]), r.text
    assert client.post(f"{API}/e/compile-caches/nothex/claim", json={}).status_code == 422
    r = client.post(
        f"{API}/nope/compile-caches/{KEY}/claim", json={"pod_id": "p", "facts": FACTS.model_dump()}
    )
    assert r.status_code == 404


def test_pod_files_are_kept_replaced_and_collected(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment())
    first = client.put(f"{API}/e/pods/p0/files/log", content=b"line 1\nline 2\n").json()
    second = client.put(f"{API}/e/pods/p0/files/log", content=b"line 2\nline 3\n").json()
    client.put(f"{API}/e/pods/p1/files/tensorboard", content=b"events")
    listed = client.get(f"{API}/e/pod-files").json()
    assert [(f["pod_id"], f["name"]) for f in listed] == [("p0", "log"), ("p1", "tensorboard")]
    got = client.get(f"{API}/e/pods/p0/files/log")
    assert got.content == b"line 2\nline 3\n"
    assert got.headers["x-checkpoint-sha256"] == second["sha256"]
    # The replaced upload is no longer referenced: collected; the kept one is not.
    assert refs(client, first["sha256"]) is None and refs(client, second["sha256"]) == 1
    collected = client.portal.call(svc(client).collector.collect)
    assert first["sha256"] in collected and second["sha256"] not in collected
    assert client.get(f"{API}/e/pods/p0/files/nope").status_code == 422
    assert client.get(f"{API}/e/pods/p9/files/log").status_code == 404


def test_dropping_the_experiment_releases_its_artifacts(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment())
    claim(client, "p0")
    cache = publish(client, "p0", b"programs")["sha256"]
    log = client.put(f"{API}/e/pods/p0/files/log", content=b"bye\n").json()["sha256"]
    assert client.delete(f"{API}/e").status_code == 204
    assert refs(client, cache) is None and refs(client, log) is None
    assert not svc(client).blobs.exists(cache) and not svc(client).blobs.exists(log)
    client.put(f"{API}/e", json=experiment())  # created anew: nothing of the old one
    assert claim(client, "p0")["state"] == "compile"
    assert client.get(f"{API}/e/pod-files").json() == []


def test_a_pod_credential_shares_only_its_own_experiments_artifacts(client: TestClient) -> None:
    for exp in ("e", "other"):
        client.put(f"{API}/{exp}", json=experiment())
    pod = {"Authorization": f"Bearer {pod_token(TOKEN, 'e')}"}
    body = {"pod_id": "p0", "facts": FACTS.model_dump()}
    params = {"pod_id": "p0", **FACTS.model_dump()}
    r = client.post(f"{API}/e/compile-caches/{KEY}/claim", json=body, headers=pod)
    assert r.status_code == 200, r.text
    r = client.put(f"{API}/e/compile-caches/{KEY}", params=params, content=b"b", headers=pod)
    assert r.status_code == 200, r.text
    assert client.get(f"{API}/e/compile-caches/{KEY}", headers=pod).content == b"b"
    assert client.put(f"{API}/e/pods/p0/files/log", content=b"x", headers=pod).status_code == 200
    for method, path in [
        ("POST", f"{API}/other/compile-caches/{KEY}/claim"),
        ("GET", f"{API}/other/compile-caches/{KEY}"),
        ("PUT", f"{API}/other/pods/p0/files/log"),
        ("GET", f"{API}/e/pod-files"),  # reading pods' files is the user's, not a pod's
        ("GET", f"{API}/e/pods/p0/files/log"),
    ]:
        got = client.request(method, path, headers=pod)
        assert got.status_code == 403, (method, path, got.text)


def test_uploads_over_the_limit_are_refused_and_keep_nothing(tmp_path: Any) -> None:
    from services.leaderboard.app import create_app
    from tests.leaderboard.conftest import AUTH, settings_for

    app = create_app(settings_for(tmp_path / "data", max_upload_bytes=1000))
    with TestClient(app, headers=AUTH) as client:
        client.put(f"{API}/e", json=experiment())
        r = client.put(f"{API}/e/pods/p0/files/tensorboard", content=b"x" * 1001)
        assert r.status_code == 413, r.text

        def chunks() -> Any:  # no Content-Length: the limit holds while streaming
            for _ in range(11):
                yield b"y" * 100

        r = client.put(f"{API}/e/pods/p0/files/tensorboard", content=chunks())
        assert r.status_code == 413, r.text
        assert client.get(f"{API}/e/pod-files").json() == []
        assert list(svc(client).blobs.list()) == []
        assert list((tmp_path / "data" / "blobs" / ".staging").iterdir()) == []
