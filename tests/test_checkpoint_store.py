"""The content-addressed blob store: filesystem backend and S3 backend against a local
S3-compatible server (moto's threaded server, real HTTP), plus the leaderboard on S3."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from fastapi.testclient import TestClient
from moto.server import ThreadedMotoServer

from services.checkpoint_store import (
    BlobNotFoundError,
    BlobStore,
    BlobTooLargeError,
    FilesystemBlobStore,
    S3BlobStore,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "podium-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "podium-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(params=["fs", "s3"])
def store(request, tmp_path: Path, s3_endpoint: str, aws_env) -> BlobStore:
    if request.param == "fs":
        return FilesystemBlobStore(tmp_path / "blobs")
    return S3BlobStore(
        f"bucket-{request.node.name.lower().replace('[', '-').replace(']', '')}"[:60],
        staging_dir=tmp_path / "staging",
        endpoint_url=s3_endpoint,
        region="us-east-1",
        create_bucket=True,
    )


def test_roundtrip_dedupe_delete_list(store: BlobStore) -> None:
    data = b"x" * (3 << 20) + b"tail"  # several read chunks
    digest = store.put_bytes(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.exists(digest) and store.size(digest) == len(data)
    assert b"".join(store.read(digest)) == data
    assert store.put_bytes(data) == digest  # same bytes, same blob
    other = store.put_bytes(b"other")
    assert {d for d, _ in store.list()} == {digest, other}
    store.delete(digest)
    assert not store.exists(digest)
    with pytest.raises(BlobNotFoundError):
        store.read(digest)
    store.delete(digest)  # deleting twice is fine
    assert [d for d, _ in store.list()] == [other]
    assert list(store.staging_dir.iterdir()) == []  # no temp files left behind


def test_staging_verifies_before_anything_is_stored(store: BlobStore) -> None:
    staged = store.stage([b"abc", b"def"])
    assert staged.sha256 == hashlib.sha256(b"abcdef").hexdigest() and staged.size == 6
    assert not store.exists(staged.sha256)  # staged is not stored
    staged.discard()
    assert not store.exists(staged.sha256) and list(store.staging_dir.iterdir()) == []
    with pytest.raises(BlobTooLargeError):
        store.stage([b"a" * 10, b"b" * 10], max_bytes=15)
    assert list(store.staging_dir.iterdir()) == []
    with pytest.raises(ValueError):
        store.exists("../../etc/passwd")


def test_filesystem_layout_and_uri(tmp_path: Path) -> None:
    store = FilesystemBlobStore(tmp_path / "b")
    digest = store.put_bytes(b"weights")
    path = tmp_path / "b" / digest[:2] / digest[2:4] / digest
    assert path.read_bytes() == b"weights"
    assert store.uri(digest) == path.resolve().as_uri()


def test_s3_objects_visible_to_any_s3_client(s3_endpoint: str, tmp_path: Path, aws_env) -> None:
    store = S3BlobStore(
        "podium-visible",
        staging_dir=tmp_path / "st",
        prefix="ckpt/",
        endpoint_url=s3_endpoint,
        create_bucket=True,
    )
    digest = store.put_bytes(b"actor")
    assert store.uri(digest) == f"s3://podium-visible/ckpt/{digest}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    obj = s3.get_object(Bucket="podium-visible", Key=f"ckpt/{digest}")
    assert obj["Body"].read() == b"actor"
    assert obj["Metadata"]["sha256"] == digest


def test_leaderboard_on_s3(s3_endpoint: str, tmp_path: Path, aws_env) -> None:
    from services.leaderboard.app import create_app
    from services.leaderboard.settings import LeaderboardSettings
    from tests.leaderboard.conftest import AUTH, TOKEN, experiment, multipart, result

    settings = LeaderboardSettings(
        data_dir=tmp_path / "d",
        api_token=TOKEN,
        storage="s3",
        s3_bucket="podium-lb",
        s3_endpoint_url=s3_endpoint,
        s3_create_bucket=True,
        gc_interval_s=3600,
    )
    api = "/api/v1/experiments/e"
    with TestClient(create_app(settings), headers=AUTH) as client:
        client.put(api, json=experiment(top_k=1))
        files = {"actor": b"A" * 1000, "optimizer": b"O"}
        a = client.post(f"{api}/submissions", files=multipart(result("a", 1.0, files), files))
        cand = client.get(f"{api}/candidates/{a.json()['candidate_id']}").json()
        # An opaque reference: the API path, not the bucket.
        assert cand["files"]["actor"]["uri"] == cand["files"]["actor"]["download_path"]
        assert "podium-lb" not in client.get(f"{api}/leaderboard").text
        assert client.get(cand["files"]["actor"]["download_path"]).content == b"A" * 1000
        bad = {"actor": b"tampered", "optimizer": b"O"}
        r = client.post(f"{api}/submissions", files=multipart(result("b", 2.0, files), bad))
        assert r.status_code == 400
        client.post(f"{api}/submissions", json=result("c", 3.0))  # evicts a
        deleted = client.portal.call(client.app.state.services.collector.collect)
        assert len(deleted) == 2
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    assert s3.list_objects_v2(Bucket="podium-lb").get("KeyCount", 0) == 0
