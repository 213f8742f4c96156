"""Upload temp files left by a crashed upload are swept from the blob store's staging directory
(at the leaderboard's start-up, and on demand); live uploads and anything else stay."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fastapi.testclient import TestClient

from services.checkpoint_store import STAGING_LOCK_RACE_S, STAGING_MAX_AGE_S, FilesystemBlobStore
from services.leaderboard.app import create_app
from tests.leaderboard.conftest import AUTH, experiment, multipart, result, settings_for

API = "/api/v1/experiments"


def age(path: Path, seconds: float) -> Path:
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def test_stale_upload_files_are_swept_fresh_ones_and_blobs_stay(tmp_path: Path) -> None:
    store = FilesystemBlobStore(tmp_path / "blobs")
    sha = store.put_bytes(b"a committed blob")
    # A crashed upload (a writer never finished), an upload in flight, and a foreign file.
    crashed = store.writer()
    crashed.write(b"half of an upload")
    stale = age(crashed.path, STAGING_MAX_AGE_S + 60)
    live = store.writer()
    live.write(b"still streaming")
    foreign = store.staging_dir / "keep-me"
    foreign.write_bytes(b"not ours")
    age(foreign, STAGING_MAX_AGE_S * 10)

    again = FilesystemBlobStore(tmp_path / "blobs")  # what a restart does
    assert not stale.exists()
    assert live.path.exists() and foreign.exists()
    assert again.exists(sha) and b"".join(again.read(sha)) == b"a committed blob"
    # The live upload finishes and commits normally after the sweep.
    staged = live.finish()
    again.commit(staged)
    assert b"".join(again.read(staged.sha256)) == b"still streaming"

    # On demand, with a threshold: only files older than it go.
    old = store.writer()
    old.write(b"x")
    age(old.path, 120)
    young = store.writer()
    assert again.sweep_staging(older_than_s=60) == 1
    assert not old.path.exists() and young.path.exists()
    young.abort()
    assert sorted(p.name for p in again.staging_dir.iterdir()) == ["keep-me"]
    assert FilesystemBlobStore(tmp_path / "other", staging_max_age_s=None).sweep_staging() == 0


def test_leaderboard_start_up_sweeps_crashed_uploads(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "data")
    staging = Path(settings.data_dir) / "blobs" / ".staging"
    staging.mkdir(parents=True)
    leftovers = [staging / f".upload-crashed{i}" for i in range(3)]
    for p in leftovers:
        p.write_bytes(os.urandom(1000))
        age(p, 2 * STAGING_MAX_AGE_S)
    with TestClient(create_app(settings), headers=AUTH) as client:
        assert not any(p.exists() for p in leftovers)
        # Uploads work as before, and leave nothing in staging.
        client.put(f"{API}/e", json=experiment())
        files = {"actor": b"weights"}
        r = client.post(f"{API}/e/submissions", files=multipart(result("s", 1.0, files), files))
        assert r.status_code == 200 and r.json()["accepted"], r.text
        assert list(staging.iterdir()) == []


def test_a_dead_writers_file_goes_at_once_live_and_staged_ones_and_other_hosts_stay(
    tmp_path: Path,
) -> None:
    """Writers lock their file until commit; the kernel drops a dead process's lock, so this
    host's unlocked temp files go without waiting an hour. Another host's (a shared volume,
    whose locks this host may not see) wait for the age rule."""
    store = FilesystemBlobStore(tmp_path / "blobs")
    dead = store.writer()
    dead.write(b"cut short")
    dead._out.close()  # what the death of its process does to the lock
    age(dead.path, STAGING_LOCK_RACE_S + 1)
    writing = store.writer()
    writing.write(b"streaming")
    age(writing.path, STAGING_LOCK_RACE_S + 1)
    staged = store.stage([b"verified, not yet committed"])
    age(staged.path, STAGING_LOCK_RACE_S + 1)
    other_host = store.staging_dir / ".upload-another-node.abc123"
    other_host.write_bytes(b"theirs")
    age(other_host, STAGING_LOCK_RACE_S + 1)

    assert store.sweep_staging() == 1
    assert not dead.path.exists()
    assert writing.path.exists() and staged.path.exists() and other_host.exists()
    store.commit(staged)
    assert b"".join(store.read(staged.sha256)) == b"verified, not yet committed"
    writing.abort()
    age(other_host, STAGING_MAX_AGE_S + 1)
    assert store.sweep_staging() == 1 and list(store.staging_dir.iterdir()) == []
