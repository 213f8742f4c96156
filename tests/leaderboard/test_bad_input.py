"""Every bad input gets a clear 4xx/503 naming the problem, and nothing is stored."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services import redis_client
from services.leaderboard.app import create_app
from tests.leaderboard.conftest import AUTH, experiment, multipart, result, settings_for

API = "/api/v1/experiments"


def blob_files(data_dir: Path) -> list[Path]:
    return [p for p in (data_dir / "blobs").glob("??/??/*")]


def staging_files(data_dir: Path) -> list[Path]:
    return list((data_dir / "blobs" / ".staging").glob("*"))


def board(client: TestClient, exp: str = "e") -> list[float]:
    return [c["score"] for c in client.get(f"{API}/{exp}/leaderboard").json()["candidates"]]


def locs(r) -> list[list]:
    return [e["loc"] for e in r.json()["detail"]]


def test_schema_violations_name_the_field(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment())
    bad = result("s1", 1.0)
    del bad["eval"]
    r = client.post(f"{API}/e/submissions", json=bad)
    assert r.status_code == 422 and ["body", "result", "eval"] in locs(r)
    r = client.post(f"{API}/e/submissions", json={**result("s1", 1.0), "surprise": 1})
    assert r.status_code == 422 and ["body", "result", "surprise"] in locs(r)
    r = client.post(f"{API}/e/submissions", json={**result("s1", 1.0), "generation": -1})
    assert r.status_code == 422 and ["body", "result", "generation"] in locs(r)
    r = client.post(f"{API}/e/submissions", json={**result("s1", 1.0), "files": {"a": "xyz"}})
    assert r.status_code == 422 and ["body", "result", "files"] in locs(r)
    r = client.post(f"{API}/e/submissions", json=result("s1", 1.0, algorithm="dqn"))
    assert r.status_code == 422 and locs(r) == [["body", "result", "algorithm"]]

    r = client.put(f"{API}/x", json={**experiment(), "top_k": 0})
    assert r.status_code == 422 and ["body", "top_k"] in locs(r)
    r = client.put(f"{API}/x", json=experiment(strategy="no-such-strategy"))
    assert r.status_code == 422 and locs(r) == [["body", "generator", "strategy"]]
    assert "pbt" in r.json()["detail"][0]["msg"]  # lists the known names
    r = client.put(f"{API}/x", json=experiment(options={"quantile": 2}))
    assert r.status_code == 422 and locs(r) == [["body", "generator", "options", "quantile"]]
    space = {"lr": {"type": "log_uniform", "low": 0, "high": 1}}
    r = client.put(f"{API}/x", json=experiment(search_space=space))
    assert r.status_code == 422 and locs(r)[0][:3] == ["body", "search_space", "lr"]
    r = client.put(f"{API}/x", json=experiment(algorithms={}))
    assert r.status_code == 422 and ["body", "algorithms"] in locs(r)
    r = client.post(f"{API}/e/generate", json={"pod": "p"})
    assert r.status_code == 422
    assert {tuple(x) for x in locs(r)} == {("body", "pod_id"), ("body", "pod")}
    assert client.get(f"{API}/x").status_code == 404  # nothing was created
    assert board(client) == []


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_scores_rejected(client: TestClient, value: str) -> None:
    client.put(f"{API}/e", json=experiment())
    body = json.dumps(result("s1", 0.0)).replace('"score": 0.0', f'"score": {value}')
    r = client.post(
        f"{API}/e/submissions", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422 and ["body", "result", "score"] in locs(r)
    assert board(client) == []
    # The id was not consumed: a corrected retry is accepted.
    assert client.post(f"{API}/e/submissions", json=result("s1", 1.0)).json()["accepted"]


def test_unknown_experiment_is_404(client: TestClient) -> None:
    for method, path, kw in [
        ("get", "/nope", {}),
        ("delete", "/nope", {}),
        ("get", "/nope/leaderboard", {}),
        ("get", "/nope/best", {}),
        ("get", "/nope/lineage", {}),
        ("get", "/nope/candidates/c-1", {}),
        ("post", "/nope/generate", {"json": {"pod_id": "p"}}),
        ("post", "/nope/submissions", {"json": result("s1", 1.0)}),
        (
            "post",
            "/nope/submissions",
            {"files": multipart(result("s1", 1.0, {"a": b"x"}), {"a": b"x"})},
        ),
    ]:
        r = getattr(client, method)(f"{API}{path}", **kw)
        assert r.status_code == 404, (method, path, r.text)
        assert "nope" in r.json()["detail"]
    client.put(f"{API}/e", json=experiment())
    assert client.get(f"{API}/e/candidates/c-1").status_code == 404
    assert client.get(f"{API}/e/best").status_code == 404  # empty board


def test_upload_over_limit_is_413_and_nothing_stored(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "d", max_upload_bytes=64 * 1024)
    with TestClient(create_app(settings), headers=AUTH) as client:
        client.put(f"{API}/e", json=experiment())
        big = {"replay_buffer": b"r" * (100 * 1024)}
        r = client.post(f"{API}/e/submissions", files=multipart(result("s1", 1.0, big), big))
        assert r.status_code == 413 and "limit" in r.json()["detail"]

        # Without Content-Length (chunked), the limit is enforced while streaming.
        def chunks():
            yield json.dumps(result("s2", 1.0)).encode()
            for _ in range(100):
                yield b" " * 1024

        r = client.post(
            f"{API}/e/submissions", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 413
        assert board(client) == []
        assert blob_files(settings.data_dir) == [] and staging_files(settings.data_dir) == []
        ok = {"actor": b"a" * 1024}
        r = client.post(f"{API}/e/submissions", files=multipart(result("s3", 1.0, ok), ok))
        assert r.status_code == 200 and r.json()["accepted"]


def test_metadata_only_json_is_bounded_like_a_field_not_like_an_upload(client: TestClient) -> None:
    """A JSON result is held in memory: it gets the 1 MiB field limit, not the upload limit."""
    client.put(f"{API}/e", json=experiment())
    body = json.dumps({**result("s1", 1.0), "hyperparameters": {"x": "y" * (2 << 20)}})
    r = client.post(
        f"{API}/e/submissions", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413
    assert board(client) == []


def test_hash_mismatch_is_400_and_nothing_stored(client: TestClient, lb_settings) -> None:
    client.put(f"{API}/e", json=experiment())
    declared = {"actor": b"what I said", "critic": b"critic"}
    sent = {"actor": b"what I sent", "critic": b"critic"}
    r = client.post(f"{API}/e/submissions", files=multipart(result("s1", 1.0, declared), sent))
    assert r.status_code == 400
    assert "actor" in r.json()["detail"] and "sha256" in r.json()["detail"]
    assert board(client) == []
    assert blob_files(lb_settings.data_dir) == []  # not even the matching critic
    assert staging_files(lb_settings.data_dir) == []
    # The id was not consumed.
    r = client.post(f"{API}/e/submissions", files=multipart(result("s1", 1.0, sent), sent))
    assert r.json()["accepted"] is True


def test_file_parts_must_match_declared_files(client: TestClient) -> None:
    client.put(f"{API}/e", json=experiment())
    files = {"actor": b"a"}
    r = client.post(f"{API}/e/submissions", files=multipart(result("s1", 1.0, files), {}))
    assert r.status_code == 422 and ["body", "files", "actor"] in locs(r)
    r = client.post(
        f"{API}/e/submissions",
        files=multipart(result("s1", 1.0, files), {**files, "extra": b"x"}),
    )
    assert r.status_code == 422 and ["body", "extra"] in locs(r)
    r = client.post(f"{API}/e/submissions", files={"actor": ("a", b"a")})
    assert r.status_code == 422 and ["body", "result"] in locs(r)
    r = client.post(f"{API}/e/submissions", json=result("s1", 1.0, files))
    assert r.status_code == 422 and ["body", "files"] in locs(r)
    assert board(client) == []


def test_malformed_multipart_is_422_and_nothing_stored(client: TestClient, lb_settings) -> None:
    client.put(f"{API}/e", json=experiment())
    files = {"actor": b"a" * 1000}
    res = json.dumps(result("s1", 1.0, files))
    twice = [
        ("result", (None, res, "application/json")),
        ("actor", ("a", b"a" * 1000)),
        ("actor", ("a", b"a" * 1000)),
    ]
    r = client.post(f"{API}/e/submissions", files=twice)
    assert r.status_code == 422 and ["body", "actor"] in locs(r) and "twice" in r.text
    r = client.post(
        f"{API}/e/submissions",
        content=b"--xyz\r\nnot a part",
        headers={"Content-Type": "multipart/form-data; boundary=xyz"},
    )
    assert r.status_code == 422
    r = client.post(
        f"{API}/e/submissions", content=b"", headers={"Content-Type": "multipart/form-data"}
    )
    assert r.status_code == 422 and "boundary" in r.text
    assert board(client) == []
    assert blob_files(lb_settings.data_dir) == [] and staging_files(lb_settings.data_dir) == []


def test_redis_down_is_503_without_partial_writes(lb_settings) -> None:
    with TestClient(create_app(lb_settings), headers=AUTH) as client:
        client.put(f"{API}/e", json=experiment(top_k=3))
        files = {"actor": b"kept"}
        client.post(f"{API}/e/submissions", files=multipart(result("s0", 1.0, files), files))
        assert redis_client.stop(lb_settings, force=True)

        new_files = {"actor": b"never stored"}
        r = client.post(
            f"{API}/e/submissions", files=multipart(result("s1", 5.0, new_files), new_files)
        )
        assert r.status_code == 503 and "Redis" in r.json()["detail"]
        assert client.post(f"{API}/e/submissions", json=result("s2", 6.0)).status_code == 503
        assert client.get(f"{API}/e/leaderboard").status_code == 503
        assert client.post(f"{API}/e/generate", json={"pod_id": "p"}).status_code == 503
        assert client.get("/readyz").status_code == 503
        assert client.get("/livez").status_code == 200
    shas = {p.name for p in blob_files(lb_settings.data_dir)}
    assert shas == {hashlib.sha256(b"kept").hexdigest()}
    # Redis back (a fresh app on the same data): exactly the state before the outage.
    with TestClient(create_app(lb_settings), headers=AUTH) as client:
        assert board(client) == [1.0]
        r = client.post(f"{API}/e/submissions", json=result("s2", 6.0))
        assert r.json()["accepted"] and r.json()["duplicate"] is False


def test_stream_cursor_beyond_64_bits_is_refused_and_the_last_id_ends_the_log(
    client: TestClient,
) -> None:
    """Issue 12, finding 4: a cursor part above 2^64-1 answered 500 (Redis refused the id)."""
    client.put(f"{API}/e", json=experiment())
    assert client.post(f"{API}/e/submissions", json=result("s1", 1.0)).status_code == 200
    big = str(2**64)
    for after in (f"{big}-0", f"0-{big}", f"{big}-{big}"):
        r = client.get(f"{API}/e/submissions", params={"after": after})
        assert r.status_code == 422 and locs(r) == [["query", "after"]], (after, r.text)
    top = str(2**64 - 1)
    r = client.get(f"{API}/e/submissions", params={"after": f"{top}-{top}"})
    assert r.status_code == 200 and r.json()["submissions"] == [], r.text
    r = client.get(f"{API}/e/submissions", params={"after": "0-0"})
    assert [s["submission_id"] for s in r.json()["submissions"]] == ["s1"]
