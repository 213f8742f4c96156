"""Content-addressed blob store for training files (actor, critic, optimizer state, replay buffer).

A blob's name is the sha256 of its bytes, so identical files are stored once, a name can never
point at different content, and a reader can verify what it got. One interface, two backends:

- ``FilesystemBlobStore``: a local directory or a Kubernetes PersistentVolumeClaim mount;
- ``S3BlobStore``: any S3-compatible service through boto3 (AWS, MinIO, Ceph; ``endpoint_url``).

Writes are atomic. Callers stream a file into a ``staging`` temp file while hashing it
(``stage``), compare the digest with the one they expected, then ``commit`` it: the filesystem
backend fsyncs and renames the temp file into place (a reader sees the whole blob or none), S3
uploads it as one object (an S3 PUT is atomic). A rejected temp file is deleted, never renamed.
A process killed mid-upload leaves its temp file behind: every store sweeps staging files older
than ``staging_max_age_s`` when it is created (the service's start-up), and ``sweep_staging``
does it on demand.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from services.logs import get_logger

log = get_logger(__name__)

CHUNK = 1 << 20
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
STAGING_PREFIX = ".upload-"
# A live upload touches its temp file with every write and is committed seconds after its last
# byte, so a temp file untouched this long belongs to a process that died; the margin also
# covers replicas that share the staging directory.
STAGING_MAX_AGE_S = 3600.0


class BlobTooLargeError(ValueError):
    """The stream passed the size limit; nothing was kept."""


class BlobNotFoundError(FileNotFoundError):
    pass


def check_digest(sha256: str) -> str:
    if not SHA256_RE.match(sha256):
        raise ValueError(f"not a lowercase hex sha256: {sha256!r}")
    return sha256


@dataclass
class StagedBlob:
    """A fully written temp file and the digest of its bytes; ``commit`` or ``discard`` it."""

    path: Path
    sha256: str
    size: int

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class StagingWriter:
    """Streams one upload into a staging temp file, hashing and counting; ``finish`` fsyncs it
    and returns the StagedBlob, ``abort`` deletes it. Blocking file I/O: call from a thread."""

    def __init__(self, staging_dir: Path, max_bytes: int | None = None):
        fd, name = tempfile.mkstemp(dir=staging_dir, prefix=STAGING_PREFIX)
        self.path = Path(name)
        self._out = os.fdopen(fd, "wb")
        self._digest = hashlib.sha256()
        self.size = 0
        self.max_bytes = max_bytes

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.max_bytes is not None and self.size > self.max_bytes:
            raise BlobTooLargeError(f"blob larger than {self.max_bytes} bytes")
        self._digest.update(chunk)
        self._out.write(chunk)

    def finish(self) -> StagedBlob:
        self._out.flush()
        os.fsync(self._out.fileno())
        self._out.close()
        return StagedBlob(path=self.path, sha256=self._digest.hexdigest(), size=self.size)

    def abort(self) -> None:
        self._out.close()
        self.path.unlink(missing_ok=True)


class BlobStore(abc.ABC):
    """Interface every backend implements; blobs are addressed by their sha256 hex digest."""

    def __init__(self, staging_dir: Path, staging_max_age_s: float | None = STAGING_MAX_AGE_S):
        self.staging_dir = Path(staging_dir)
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        if staging_max_age_s is not None:
            self.sweep_staging(staging_max_age_s)

    def sweep_staging(self, older_than_s: float = STAGING_MAX_AGE_S) -> int:
        """Delete upload temp files not modified for ``older_than_s`` seconds (left by a crashed
        upload); returns how many. Only this store's own temp files are touched."""
        cutoff = time.time() - older_than_s
        removed = 0
        with os.scandir(self.staging_dir) as entries:
            for entry in entries:
                if not entry.name.startswith(STAGING_PREFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):  # committed or swept meanwhile
                    if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
        if removed:
            log.info("stale upload files swept", count=removed, staging_dir=str(self.staging_dir))
        return removed

    def writer(self, max_bytes: int | None = None) -> StagingWriter:
        """A temp file in the staging directory that hashes what is written to it."""
        return StagingWriter(self.staging_dir, max_bytes)

    def stage(self, chunks: Iterable[bytes], max_bytes: int | None = None) -> StagedBlob:
        """Write ``chunks`` to a temp file in the staging directory, hashing as it goes."""
        w = self.writer(max_bytes)
        try:
            for chunk in chunks:
                w.write(chunk)
            return w.finish()
        except BaseException:
            w.abort()
            raise

    def put_bytes(self, data: bytes) -> str:
        """Store ``data`` and return its digest (small blobs, tests, tools)."""
        staged = self.stage([data])
        self.commit(staged)
        return staged.sha256

    def commit(self, staged: StagedBlob) -> None:
        """Move a verified staged file into the store (atomically); the temp file is consumed."""
        try:
            if not self.exists(staged.sha256):
                self._commit(staged)
        finally:
            staged.discard()

    @abc.abstractmethod
    def _commit(self, staged: StagedBlob) -> None: ...

    @abc.abstractmethod
    def exists(self, sha256: str) -> bool: ...

    @abc.abstractmethod
    def size(self, sha256: str) -> int: ...

    @abc.abstractmethod
    def read(self, sha256: str) -> Iterator[bytes]:
        """The blob's bytes in chunks; raises ``BlobNotFoundError``."""

    @abc.abstractmethod
    def delete(self, sha256: str) -> None:
        """Remove the blob; a missing blob is not an error."""

    @abc.abstractmethod
    def list(self) -> Iterator[tuple[str, float]]:
        """Every stored digest with its modification time (epoch seconds)."""

    @abc.abstractmethod
    def uri(self, sha256: str) -> str:
        """Where the blob lives, for clients that read the storage directly."""


class FilesystemBlobStore(BlobStore):
    """Blobs under ``root/ab/cd/<sha256>``; temp files in ``root/.staging`` (same filesystem,
    so the final rename is atomic)."""

    def __init__(self, root: Path, staging_max_age_s: float | None = STAGING_MAX_AGE_S):
        self.root = Path(root).resolve()
        super().__init__(self.root / ".staging", staging_max_age_s)

    def _path(self, sha256: str) -> Path:
        check_digest(sha256)
        return self.root / sha256[:2] / sha256[2:4] / sha256

    def _commit(self, staged: StagedBlob) -> None:
        dest = self._path(staged.sha256)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged.path, dest)
        # Make the rename itself durable.
        dir_fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def exists(self, sha256: str) -> bool:
        return self._path(sha256).is_file()

    def size(self, sha256: str) -> int:
        try:
            return self._path(sha256).stat().st_size
        except FileNotFoundError as e:
            raise BlobNotFoundError(sha256) from e

    def read(self, sha256: str) -> Iterator[bytes]:
        try:
            f = self._path(sha256).open("rb")
        except FileNotFoundError as e:
            raise BlobNotFoundError(sha256) from e
        return _chunks(f)

    def delete(self, sha256: str) -> None:
        self._path(sha256).unlink(missing_ok=True)

    def list(self) -> Iterator[tuple[str, float]]:
        for path in self.root.glob("??/??/*"):
            if SHA256_RE.match(path.name):
                with contextlib.suppress(FileNotFoundError):
                    yield path.name, path.stat().st_mtime

    def uri(self, sha256: str) -> str:
        return self._path(sha256).as_uri()


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    with f:
        while chunk := f.read(CHUNK):
            yield chunk


class S3BlobStore(BlobStore):
    """Blobs as objects ``<prefix><sha256>`` in one bucket of an S3-compatible service.

    Credentials come from boto3's usual chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
    a mounted profile, an instance role). Uploads are staged on local disk first so the digest is
    checked before anything reaches the bucket.
    """

    def __init__(
        self,
        bucket: str,
        *,
        staging_dir: Path,
        prefix: str = "blobs/",
        endpoint_url: str | None = None,
        region: str | None = None,
        create_bucket: bool = False,
        client: object | None = None,
        staging_max_age_s: float | None = STAGING_MAX_AGE_S,
    ):
        import boto3  # imported here: the filesystem backend needs none of boto3's start-up

        super().__init__(staging_dir, staging_max_age_s)
        self.bucket, self.prefix = bucket, prefix
        self.client = client or boto3.client("s3", endpoint_url=endpoint_url, region_name=region)
        if create_bucket:
            self._ensure_bucket(region)

    def _ensure_bucket(self, region: str | None) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            kwargs: dict = {"Bucket": self.bucket}
            if region and region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
            self.client.create_bucket(**kwargs)

    def _key(self, sha256: str) -> str:
        return self.prefix + check_digest(sha256)

    def _commit(self, staged: StagedBlob) -> None:
        self.client.upload_file(
            str(staged.path),
            self.bucket,
            self._key(staged.sha256),
            ExtraArgs={"Metadata": {"sha256": staged.sha256}},
        )

    def _head(self, sha256: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(sha256))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def exists(self, sha256: str) -> bool:
        return self._head(sha256) is not None

    def size(self, sha256: str) -> int:
        head = self._head(sha256)
        if head is None:
            raise BlobNotFoundError(sha256)
        return int(head["ContentLength"])

    def read(self, sha256: str) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(sha256))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise BlobNotFoundError(sha256) from e
            raise
        return obj["Body"].iter_chunks(CHUNK)

    def delete(self, sha256: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(sha256))

    def list(self) -> Iterator[tuple[str, float]]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(self.prefix) :]
                if SHA256_RE.match(name):
                    yield name, obj["LastModified"].timestamp()

    def uri(self, sha256: str) -> str:
        return f"s3://{self.bucket}/{self._key(sha256)}"
