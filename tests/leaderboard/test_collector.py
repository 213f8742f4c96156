"""Blob collection: evicted candidates' files go once nothing references them; a parent's files
stay while a pod holds a lease on them; rejected and orphaned uploads are swept."""

from __future__ import annotations

import hashlib
import time

from fastapi.testclient import TestClient

from services.leaderboard.api import Services
from tests.leaderboard.conftest import experiment, multipart, result

API = "/api/v1/experiments"


def svc(client: TestClient) -> Services:
    return client.app.state.services


def collect(client: TestClient) -> list[str]:
    return client.portal.call(svc(client).collector.collect)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def submit(client: TestClient, sid: str, score: float, files: dict[str, bytes]) -> dict:
    r = client.post(f"{API}/e/submissions", files=multipart(result(sid, score, files), files))
    assert r.status_code == 200, r.text
    return r.json()


def test_leased_parent_survives_eviction_until_released(client: TestClient) -> None:
    blobs = svc(client).blobs
    client.put(f"{API}/e", json=experiment(top_k=1, options={"explore": False}))
    a = submit(client, "a", 1.0, {"actor": b"A", "shared": b"S"})
    manifest = client.post(f"{API}/e/generate", json={"pod_id": "p"}).json()
    assert manifest["parent_id"] == a["candidate_id"] and manifest["decision"] == "exploit"

    b = submit(client, "b", 2.0, {"actor": b"B", "shared": b"S"})
    assert b["evicted"] == [a["candidate_id"]]
    assert collect(client) == []  # A's actor is leased, S still used by B
    url = manifest["checkpoint"]["files"]["actor"]["download_path"]
    got = client.get(url)
    assert got.status_code == 200 and got.content == b"A"  # the pod can still download

    assert client.delete(f"{API}/e/leases/{manifest['lease_id']}").status_code == 204
    assert collect(client) == [sha(b"A")]
    assert not blobs.exists(sha(b"A"))
    assert blobs.exists(sha(b"S")) and blobs.exists(sha(b"B"))
    assert client.get(url).status_code == 410

    # Dropping the experiment frees the rest.
    assert client.delete(f"{API}/e").status_code == 204
    assert not blobs.exists(sha(b"S")) and not blobs.exists(sha(b"B"))


def test_expired_lease_no_longer_protects(lb_settings) -> None:
    from services.leaderboard.app import create_app
    from tests.leaderboard.conftest import AUTH

    lb_settings.lease_ttl_s = 0.2
    with TestClient(create_app(lb_settings), headers=AUTH) as client:
        client.put(f"{API}/e", json=experiment(top_k=1))
        submit(client, "a", 1.0, {"actor": b"A"})
        client.post(f"{API}/e/generate", json={"pod_id": "p"})
        submit(client, "b", 2.0, {"actor": b"B"})
        assert collect(client) == []
        time.sleep(0.3)
        assert collect(client) == [sha(b"A")]


def test_rejected_and_orphaned_uploads_are_collected(client: TestClient) -> None:
    blobs = svc(client).blobs
    client.put(f"{API}/e", json=experiment(top_k=1))
    submit(client, "a", 5.0, {"actor": b"A"})
    r = submit(client, "b", 1.0, {"actor": b"loser"})
    assert r["accepted"] is False
    assert blobs.exists(sha(b"loser"))  # stored before the decision...
    assert collect(client) == [sha(b"loser")]  # ...collected after
    # A blob Redis never heard of (an upload interrupted before its decision) is swept.
    orphan = blobs.put_bytes(b"interrupted upload")
    assert collect(client) == []
    assert client.portal.call(svc(client).collector.sweep) == [orphan]
    assert blobs.exists(sha(b"A"))  # referenced blobs are never swept


def test_resubmitting_a_collected_blob_stores_it_again(client: TestClient) -> None:
    blobs = svc(client).blobs
    client.put(f"{API}/e", json=experiment(top_k=1))
    submit(client, "a", 1.0, {"actor": b"X"})
    submit(client, "b", 2.0, {"actor": b"Y"})
    assert collect(client) == [sha(b"X")]
    c = submit(client, "c", 3.0, {"actor": b"X"})
    assert c["accepted"] and blobs.exists(sha(b"X"))
    got = client.get(f"{API}/e/candidates/{c['candidate_id']}/files/actor")
    assert got.content == b"X"
