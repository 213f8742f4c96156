"""A full checkpoint volume: an upload answers a retryable 503 naming the
cause, leaves no staging file behind (reading and discarding both hit ENOSPC), /readyz says the
blob store is not writable, reports without files and the generator keep working, and uploads
work again once space is freed.

The volume is a real 2 MiB tmpfs (mounting needs root); where that cannot run, the same path is
driven by a file object that fails with ENOSPC."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from services.checkpoint_store import FilesystemBlobStore
from tests.leaderboard.conftest import (
    AUTH,
    ThreadedServer,
    experiment,
    multipart,
    result,
    settings_for,
)

API = "/api/v1/experiments"


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def _can_mount() -> bool:
    probe = Path(f"/tmp/podium-tmpfs-probe-{uuid.uuid4().hex[:8]}")
    try:
        if not _mount_tmpfs(probe, "64k"):
            return False
        subprocess.run(["umount", str(probe)], check=True)
        return True
    except OSError:  # no mount binary
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


CAN_MOUNT = _can_mount()


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "blobs"
    if not _mount_tmpfs(where, "2m"):
        pytest.skip("mounting a tmpfs is not permitted here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def staging_files(blob_dir: Path) -> list[str]:
    return sorted(p.name for p in (blob_dir / ".staging").iterdir())


def fill(volume: Path, leave: int) -> Path:
    """Fill ``volume`` up to ``leave`` free bytes."""
    filler = volume / "filler"
    st = os.statvfs(volume)
    free = st.f_bavail * st.f_frsize
    filler.write_bytes(b"\0" * max(0, free - leave))
    return filler


def check_full_volume(http: httpx.Client, blob_dir: Path, free_space: callable) -> None:
    assert http.put(f"{API}/e", json=experiment()).status_code == 201
    files = {"actor": os.urandom(512 * 1024), "critic": os.urandom(1024)}
    r = http.post(f"{API}/e/submissions", files=multipart(result("s1", 1.0, files), files))
    assert r.status_code == 503, r.text
    assert "full" in r.json()["detail"] and int(r.headers["Retry-After"]) > 0
    assert staging_files(blob_dir) == []  # nothing left behind
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "degraded", ready.text
    assert "not writable" in ready.json()["blob_store"]
    # The metadata path and the generator do not need the volume.
    assert http.post(f"{API}/e/submissions", json=result("m1", 0.5)).json()["accepted"]
    assert http.post(f"{API}/e/generate", json={"pod_id": "p"}).status_code == 200

    free_space()
    assert http.get("/readyz").json() == {"status": "ok"}
    r = http.post(f"{API}/e/submissions", files=multipart(result("s1", 1.0, files), files))
    assert r.status_code == 200 and r.json()["accepted"], r.text
    assert staging_files(blob_dir) == []
    best = http.get(f"{API}/e/best").json()
    got = http.get(best["files"]["actor"]["download_path"])
    assert got.content == files["actor"]


def test_a_full_volume_answers_503_and_leaks_nothing(tmp_path: Path, small_volume: Path) -> None:
    settings = settings_for(tmp_path / "data", blob_dir=small_volume)
    with (
        ThreadedServer(settings) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http,
    ):
        filler = fill(small_volume, leave=0)
        check_full_volume(http, small_volume, filler.unlink)


class _FullDisk:
    """A writer's file object on a volume with ``room`` bytes left: writes, flushes and the
    flush of ``close`` fail with ENOSPC past it (and the descriptor is closed regardless)."""

    def __init__(self, real, volume: dict[str, int]):
        self.real, self.volume = real, volume

    def write(self, data: bytes) -> int:
        if len(data) > self.volume["room"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.volume["room"] -= len(data)
        return self.real.write(data)

    def flush(self) -> None:
        self.real.flush()

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()
        if self.volume["room"] == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullStore(FilesystemBlobStore):
    volume: ClassVar[dict[str, int]] = {"room": 0}

    def writer(self, max_bytes=None):
        w = super().writer(max_bytes)
        w._out = _FullDisk(w._out, self.volume)
        return w


@pytest.mark.skipif(CAN_MOUNT, reason="the real full volume test runs instead")
def test_a_full_volume_answers_503_and_leaks_nothing_injected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blob_dir = tmp_path / "blobs"
    settings = settings_for(tmp_path / "data", blob_dir=blob_dir)
    monkeypatch.setattr(type(settings), "blob_store", lambda self: _FullStore(blob_dir))

    def free_space() -> None:
        _FullStore.volume["room"] = 1 << 30

    with (
        ThreadedServer(settings) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http,
    ):
        check_full_volume(http, blob_dir, free_space)
