"""Least privilege on the leaderboard: a pod's credential does what a
pod needs on its own experiment and nothing else, and no answer shows where the checkpoint
store keeps files."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from services.contracts.credentials import pod_token
from services.leaderboard.app import create_app
from services.leaderboard.settings import LeaderboardSettings
from tests.leaderboard.conftest import AUTH, TOKEN, experiment, multipart, result, settings_for

API = "/api/v1/experiments"


def test_no_answer_exposes_a_storage_location(
    client: TestClient, lb_settings: LeaderboardSettings
) -> None:
    """Candidates and manifests carried ``file:///<data dir>/blobs/…``: now the API path."""
    client.put(f"{API}/e", json=experiment())
    files = {"actor": b"weights", "critic": b"more weights"}
    r = client.post(f"{API}/e/submissions", files=multipart(result("s", 1.0, files), files))
    cid = r.json()["candidate_id"]
    manifest = client.post(f"{API}/e/generate", json={"pod_id": "p"}).json()
    answers = [
        r.text,
        client.get(f"{API}/e/leaderboard").text,
        client.get(f"{API}/e/best").text,
        client.get(f"{API}/e/candidates/{cid}").text,
        str(manifest),
    ]
    data_dir = str(Path(lb_settings.data_dir).resolve())
    for text in answers:
        assert "file:" not in text and data_dir not in text and "/blobs/" not in text
    for f in manifest["checkpoint"]["files"].values():
        assert f["uri"] == f["download_path"]
        assert client.get(f["uri"]).headers["x-checkpoint-sha256"] == f["sha256"]


def test_a_pod_credential_works_on_its_experiments_pod_routes_only(client: TestClient) -> None:
    for exp in ("e", "other"):
        client.put(f"{API}/{exp}", json=experiment())
    admin_files = {"actor": b"parent weights"}
    client.post(
        f"{API}/other/submissions", files=multipart(result("o", 1.0, admin_files), admin_files)
    )
    pod = {"Authorization": f"Bearer {pod_token(TOKEN, 'e')}"}

    # A pod's round: report with files, ask for a parent, fetch its files, release the lease.
    files = {"actor": b"my weights"}
    r = client.post(
        f"{API}/e/submissions", files=multipart(result("s1", 1.0, files), files), headers=pod
    )
    assert r.status_code == 200 and r.json()["accepted"], r.text
    manifest = client.post(f"{API}/e/generate", json={"pod_id": "p2"}, headers=pod).json()
    assert manifest["lease_id"], manifest
    for f in manifest["checkpoint"]["files"].values():
        assert client.get(f["download_path"], headers=pod).content == files["actor"]
    lease = f"{API}/e/leases/{manifest['lease_id']}"
    assert client.delete(lease, headers=pod).status_code == 204

    # Everything else, and the same routes of another experiment: 403.
    cid = r.json()["candidate_id"]
    other = client.get(f"{API}/other/best").json()
    for method, path in [
        ("GET", f"{API}/e"),
        ("GET", f"{API}/e/leaderboard"),
        ("GET", f"{API}/e/best"),
        ("GET", f"{API}/e/lineage"),
        ("GET", f"{API}/e/submissions"),
        ("GET", f"{API}/e/candidates/{cid}"),
        ("PUT", f"{API}/e"),
        ("DELETE", f"{API}/e"),
        ("GET", API),
        ("POST", f"{API}/other/generate"),
        ("POST", f"{API}/other/submissions"),
        ("GET", other["files"]["actor"]["download_path"]),
        ("DELETE", f"{API}/other/leases/l-1"),
    ]:
        got = client.request(method, path, headers=pod)
        assert got.status_code == 403, (method, path, got.text)
        assert "its own experiment" in got.json()["detail"]
    assert client.get(f"{API}/e").status_code == 200  # the platform token still does all


def test_metrics_need_the_metrics_token_when_one_is_set(tmp_path: Path) -> None:
    """/metrics named every experiment with its scores to anyone: with PODIUM_METRICS_TOKEN set
    it answers only that token (Prometheus's) or the API token. Unset, it stays open (the
    documented default, for docker compose's Prometheus)."""
    settings = settings_for(tmp_path / "data", metrics_token="scrape-me")
    with TestClient(create_app(settings), headers=AUTH) as client:
        client.put(f"{API}/secret-project", json=experiment())
        client.post(f"{API}/secret-project/submissions", json=result("s", 42.0))
        for header in (None, "Bearer nope", "Basic scrape-me", f"Bearer {pod_token(TOKEN, 'x')}"):
            r = client.get("/metrics", headers={"Authorization": header or ""})
            assert r.status_code == 401 and "secret-project" not in r.text, header
            assert r.headers["www-authenticate"].startswith("Bearer")
        for token in ("scrape-me", TOKEN):
            r = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200
            assert 'podium_leaderboard_top_score{experiment="secret-project"} 42.0' in r.text
    with TestClient(create_app(settings_for(tmp_path / "open")), headers=AUTH) as client:
        assert client.get("/metrics", headers={"Authorization": ""}).status_code == 200
