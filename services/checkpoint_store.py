"""Content-addressed blob store for training files (actor, critic, optimizer state, replay buffer).

A blob's name is the sha256 of its bytes, so identical files are stored once, a name can never
point at different content, and a reader can verify what it got. One interface, two backends:

- ``FilesystemBlobStore``: a local directory or a Kubernetes PersistentVolumeClaim mount;
- ``S3BlobStore``: any S3-compatible service through boto3 (AWS, MinIO, Ceph; ``endpoint_url``).

Writes are atomic. Callers stream a file into a ``staging`` temp file while hashing it
(``stage``), compare the digest with the one they expected, then ``commit`` it: the filesystem
backend fsyncs and renames the temp file into place (a reader sees the whole blob or none), S3
uploads it as one object (an S3 PUT is atomic). A rejected temp file is deleted, never renamed.
A writer holds an exclusive ``flock`` on its temp file until the file is committed or
discarded, and names it after its host. A process killed mid-upload leaves its temp file behind,
unlocked (the kernel drops a dead process's locks): when a store is created (the service's
start-up) and on every ``sweep_staging``, this host's unlocked temp files go at once, and any
temp file older than ``staging_max_age_s`` goes too (another host's, on a shared volume, whose
lock this host may not see). Every error path of a writer (a full disk included) deletes its
file; a full volume raises ``StorageFullError``, which the services answer with a retryable 503.

Why one file of this size: the filesystem and S3 stores implement one small interface, and
the staging rules above (locks, sweeps, error paths) are the same for both and must be read
together.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import hashlib
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
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
# An unlocked temp file of this host younger than this may be one a writer has just created
# and not yet locked.
STAGING_LOCK_RACE_S = 2.0
# Bytes a readiness probe writes: a full volume refuses a block even when it has inodes left.
PROBE_BYTES = 4096
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:63] or "host"


class StorageFullError(OSError):
    """The volume holding the staging files or the blobs is full (ENOSPC / EDQUOT); nothing was
    kept. Retry once space is freed."""


@contextlib.contextmanager
def _no_space_is_full(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        if e.errno in NO_SPACE and not isinstance(e, StorageFullError):
            raise StorageFullError(e.errno, f"{what}: {e.strerror}") from e
        raise


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
    """A fully written temp file and the digest of its bytes; ``commit`` or ``discard`` it.
    ``handle`` keeps the writer's lock on the file until then (a sweep leaves it alone)."""

    path: Path
    sha256: str
    size: int
    handle: BinaryIO | None = field(default=None, repr=False, compare=False)

    def discard(self) -> None:
        try:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        finally:
            _close_quietly(self.handle)
            self.handle = None


def _close_quietly(f: BinaryIO | None) -> None:
    """Close ``f``; a buffered tail that cannot be written (a full disk) is given up, and the
    descriptor is closed all the same."""
    if f is not None:
        with contextlib.suppress(OSError):
            f.close()


class StagingWriter:
    """Streams one upload into a staging temp file, hashing and counting; ``finish`` fsyncs it
    and returns the StagedBlob, ``abort`` deletes it. Any failure deletes the file before it
    is raised. Blocking file I/O: call from a thread."""

    def __init__(self, staging_dir: Path, max_bytes: int | None = None):
        with _no_space_is_full("staging an upload"):
            fd, name = tempfile.mkstemp(dir=staging_dir, prefix=f"{STAGING_PREFIX}{_host_tag()}.")
        self.path = Path(name)
        self._out = os.fdopen(fd, "wb")
        # Unsupported on some network filesystems: the age rule of the sweep covers those.
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._digest = hashlib.sha256()
        self.size = 0
        self.max_bytes = max_bytes

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.max_bytes is not None and self.size > self.max_bytes:
            self.abort()
            raise BlobTooLargeError(f"blob larger than {self.max_bytes} bytes")
        self._digest.update(chunk)
        try:
            with _no_space_is_full("staging an upload"):
                self._out.write(chunk)
        except BaseException:
            self.abort()
            raise

    def flush(self) -> None:
        try:
            with _no_space_is_full("staging an upload"):
                self._out.flush()
        except BaseException:
            self.abort()
            raise

    def finish(self) -> StagedBlob:
        self.flush()
        try:
            with _no_space_is_full("staging an upload"):
                os.fsync(self._out.fileno())
        except BaseException:
            self.abort()
            raise
        return StagedBlob(self.path, self._digest.hexdigest(), self.size, handle=self._out)

    def abort(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        finally:
            _close_quietly(self._out)


class BlobStore(abc.ABC):
    """Interface every backend implements; blobs are addressed by their sha256 hex digest."""

    def __init__(self, staging_dir: Path, staging_max_age_s: float | None = STAGING_MAX_AGE_S):
        self.staging_dir = Path(staging_dir)
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        if staging_max_age_s is not None:
            self.sweep_staging(staging_max_age_s)

    def sweep_staging(self, older_than_s: float = STAGING_MAX_AGE_S) -> int:
        """Delete upload temp files left by a dead process: this host's unlocked ones, and any
        not modified for ``older_than_s`` seconds; returns how many. Only this store's own
        temp files are touched."""
        now = time.time()
        ours = f"{STAGING_PREFIX}{_host_tag()}."
        removed = 0
        with os.scandir(self.staging_dir) as entries:
            for entry in entries:
                if not entry.name.startswith(STAGING_PREFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):  # committed or swept meanwhile
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    age = now - entry.stat().st_mtime
                    dead = (
                        entry.name.startswith(ours)
                        and age > STAGING_LOCK_RACE_S
                        and _unlocked(entry.path)
                    )
                    if dead or age > older_than_s:
                        os.unlink(entry.path)
                        removed += 1
        if removed:
            log.info("stale upload files swept", count=removed, staging_dir=str(self.staging_dir))
        return removed

    def writer(self, max_bytes: int | None = None) -> StagingWriter:
        """A temp file in the staging directory that hashes what is written to it."""
        return StagingWriter(self.staging_dir, max_bytes)

    def check_writable(self) -> None:
        """Raise (StorageFullError on a full volume) unless an upload can be staged now."""
        w = self.writer()
        w.write(b"\0" * PROBE_BYTES)
        w.flush()
        w.abort()

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
    def read(self, sha256: str) -> BlobChunks:
        """The blob's bytes in chunks (close it when done with it before the end); raises
        ``BlobNotFoundError``."""

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
        with _no_space_is_full("storing a blob"):
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

    def read(self, sha256: str) -> BlobChunks:
        try:
            f = self._path(sha256).open("rb")
        except FileNotFoundError as e:
            raise BlobNotFoundError(sha256) from e
        return BlobChunks(f)

    def delete(self, sha256: str) -> None:
        self._path(sha256).unlink(missing_ok=True)

    def list(self) -> Iterator[tuple[str, float]]:
        for path in self.root.glob("??/??/*"):
            if SHA256_RE.match(path.name):
                with contextlib.suppress(FileNotFoundError):
                    yield path.name, path.stat().st_mtime

    def uri(self, sha256: str) -> str:
        return self._path(sha256).as_uri()


def _unlocked(path: str) -> bool:
    """Whether no process holds the writer's lock on ``path`` (False when locks are not
    supported there: only the age rule applies then)."""
    try:
        with open(path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True  # closing the file drops the lock
    except OSError:
        return False


class BlobChunks(Iterator[bytes]):
    """A blob's bytes, ``CHUNK`` at a time, from an open file or stream (closed at the end).

    ``close`` releases the file at once, from any thread, even while another thread is reading
    a chunk (a download whose client went away: the read in flight is not waited for, and the
    reader closes the file once its read returns). A generator left unfinished would keep its
    file open until the garbage collector found it."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()  # held while reading a chunk
        self._closed = False

    def __next__(self) -> bytes:
        with self._lock:
            chunk = b"" if self._closed else self._stream.read(CHUNK)
            if not chunk:
                self._closed = True
                self._stream.close()
                raise StopIteration
        if self._closed:  # closed while this chunk was read: nobody else will close it
            self.close()
        return chunk

    def close(self) -> None:
        self._closed = True
        if self._lock.acquire(blocking=False):  # else the read in flight closes it after
            try:
                self._stream.close()
            finally:
                self._lock.release()


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

    def read(self, sha256: str) -> BlobChunks:
        from botocore.exceptions import ClientError

        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(sha256))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise BlobNotFoundError(sha256) from e
            raise
        return BlobChunks(obj["Body"])

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
