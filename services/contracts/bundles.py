"""A bundle: a directory tree's files in one gzip'd tar, with a JSON manifest that lists each
file's sha256 and size and says what the bundle is (its ``meta``); torch-free, so the pod (which
packs its compile cache and TensorBoard files) and the command line (which unpacks TensorBoard
files) share it.

Packing reads each file once, hashing it as it goes into the tar (``bundle.json``, the manifest,
is the last member). Unpacking trusts nothing in the archive: every member must be a regular
file under ``files/`` whose path is plain (relative, no ``..``, no hidden or odd names), none
twice, within a size and a count limit; each is written to a staging directory beside the
destination while it is hashed, and only when the manifest (its format, the ``meta`` the caller
expects, every file's sha256 and size, nothing missing, nothing extra) checks out are the files
moved into place, each with an atomic rename. Anything wrong is a ``BundleError`` and leaves the
destination as it was. Nothing is unpickled: the tar and the JSON manifest are all that is read.
A caller checks the archive's own sha256 against a record it trusts before it unpacks
(services/api_client.py streams and hashes downloads).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import IO, Any

FORMAT = "podium.bundle/1"
MANIFEST = "bundle.json"
FILES = "files"
CHUNK = 1 << 20
#: A path component of a bundled file: no separators, not hidden, nothing a shell or another
#: filesystem would read differently.
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=-]{0,254}$")
MAX_DEPTH = 8
MAX_MANIFEST_BYTES = 16 << 20
#: Defaults of ``unpack``'s limits: far above a compile cache (tens of MB, hundreds of files)
#: or a pod's TensorBoard files, far below what would fill a disk.
MAX_BYTES = 8 << 30
MAX_FILES = 100_000


class BundleError(ValueError):
    """A bundle that is malformed, tampered with, truncated, too large, or not the one asked
    for (its ``meta`` differs): nothing of it was written."""


def check_path(name: str) -> str:
    """``name`` if it is a plain relative POSIX path (see ``_PART``), else ``BundleError``."""
    parts = PurePosixPath(name).parts
    if (
        not parts
        or len(parts) > MAX_DEPTH
        or str(PurePosixPath(*parts)) != name
        or not all(_PART.match(p) for p in parts)
    ):
        raise BundleError(f"bad file path {name[:200]!r} in bundle")
    return name


def files_under(root: Path, skip: Iterable[str] = ()) -> dict[str, tuple[int, int]]:
    """Relative path -> (size, mtime_ns) of every regular file below ``root`` whose path a
    bundle can hold, but those whose first component is in ``skip``; {} when ``root`` is not
    a directory. Symbolic links are not followed."""
    root, skip = Path(root), set(skip)
    out: dict[str, tuple[int, int]] = {}
    if not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir.parts and rel_dir.parts[0] in skip:
            dirnames.clear()
            continue
        for filename in filenames:
            rel = (rel_dir / filename).as_posix()
            try:
                check_path(rel)
            except BundleError:
                continue  # temp and lock files, hidden files: never part of a bundle
            with contextlib.suppress(OSError):
                st = os.lstat(Path(dirpath) / filename)
                if not os.path.islink(Path(dirpath) / filename):
                    out[rel] = (st.st_size, st.st_mtime_ns)
    return out


class _Hashing(io.RawIOBase):
    """Reads ``size`` bytes of ``f``, hashing them (tarfile reads exactly the size it was given)."""

    def __init__(self, f: IO[bytes], size: int) -> None:
        self.f, self.left, self.digest = f, size, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b)[: self.left]
        n = self.f.readinto(view)  # type: ignore[attr-defined]
        if not n:
            if self.left:
                raise BundleError("a file shrank while it was being bundled")
            return 0
        self.digest.update(view[:n])
        self.left -= n
        return n


def pack(root: Path, paths: Iterable[str], meta: Mapping[str, Any], out: IO[bytes]) -> dict:
    """Write the files ``paths`` (relative to ``root``) and a manifest holding ``meta`` to
    ``out`` as a gzip'd tar; returns the manifest. A file that vanished meanwhile is left out."""
    root = Path(root)
    files: dict[str, dict[str, Any]] = {}
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=6, format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(set(paths)):
            check_path(rel)
            try:
                f = open(root / rel, "rb")  # noqa: SIM115 (closed below, after the tar read it)
            except FileNotFoundError:
                continue
            with f:
                size = os.fstat(f.fileno()).st_size
                info = tarfile.TarInfo(f"{FILES}/{rel}")
                info.size, info.mode = size, 0o644
                reader = _Hashing(f, size)
                tar.addfile(info, io.BufferedReader(reader, CHUNK))
                files[rel] = {"sha256": reader.digest.hexdigest(), "bytes": size}
        manifest = {"format": FORMAT, "meta": dict(meta), "files": files}
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    return manifest


def _read_manifest(tar: tarfile.TarFile, member: tarfile.TarInfo) -> dict[str, Any]:
    if member.size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    f = tar.extractfile(member)
    assert f is not None
    try:
        manifest = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(f"{MANIFEST} is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"not a {FORMAT} bundle")
    if not isinstance(manifest.get("meta"), dict) or not isinstance(manifest.get("files"), dict):
        raise BundleError(f"{MANIFEST} needs a 'meta' and a 'files' mapping")
    for name, entry in manifest["files"].items():
        check_path(name)
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not isinstance(entry.get("bytes"), int)
        ):
            raise BundleError(f"{MANIFEST}: bad entry for {name!r}")
    return manifest


def read_meta(source: IO[bytes]) -> dict[str, Any]:
    """The ``meta`` of the bundle in ``source`` (its manifest checked in shape only)."""
    try:
        with tarfile.open(fileobj=source, mode="r:gz") as tar:
            for member in tar:
                if member.name == MANIFEST and member.isreg():
                    return _read_manifest(tar, member)["meta"]
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise BundleError(f"not a readable bundle: {exc}") from None
    raise BundleError(f"no {MANIFEST} in the bundle")


def unpack(
    source: IO[bytes],
    dest: Path,
    expect: Mapping[str, Any] | None = None,
    max_bytes: int = MAX_BYTES,
    max_files: int = MAX_FILES,
) -> dict[str, Any]:
    """Check the bundle in ``source`` whole (see the module docstring), then move its files into
    ``dest`` (created); returns the manifest. ``expect``: what the manifest's ``meta`` must hold
    (key by key; a bundle of something else is refused). A file already in ``dest`` with the
    same bytes is left alone; one with other bytes is replaced atomically."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest))
    try:
        staged, manifest = _stage(source, staging, max_bytes, max_files)
        if manifest is None:
            raise BundleError(f"no {MANIFEST} in the bundle (truncated?)")
        for key, value in (expect or {}).items():
            if manifest["meta"].get(key) != value:
                raise BundleError(
                    f"a bundle of another {key}: {manifest['meta'].get(key)!r}, not {value!r}"
                )
        listed = manifest["files"]
        if set(staged) != set(listed):
            extra, missing = sorted(set(staged) - set(listed)), sorted(set(listed) - set(staged))
            raise BundleError(f"files differ from the manifest: extra {extra}, missing {missing}")
        for rel, (sha256, size) in staged.items():
            if listed[rel]["sha256"] != sha256 or listed[rel]["bytes"] != size:
                raise BundleError(f"{rel}: sha256 or size does not match the manifest")
        for rel, (sha256, _) in staged.items():
            target = dest / rel
            if target.is_file() and not target.is_symlink() and _sha256_of(target) == sha256:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / FILES / rel, target)
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _stage(
    source: IO[bytes], staging: Path, max_bytes: int, max_files: int
) -> tuple[dict[str, tuple[str, int]], dict[str, Any] | None]:
    """Every file member of the archive, written below ``staging/files`` and hashed: rel
    path -> (sha256, size), and the manifest (None if the archive had none)."""
    root = staging / FILES
    staged: dict[str, tuple[str, int]] = {}
    manifest = None
    total = 0
    try:
        with tarfile.open(fileobj=source, mode="r|gz") as tar:
            for member in tar:
                if manifest is not None:
                    raise BundleError(f"members after {MANIFEST}")
                if member.name == MANIFEST and member.isreg():
                    manifest = _read_manifest(tar, member)
                    continue
                prefix, _, rel = member.name.partition("/")
                if prefix != FILES or not member.isreg():
                    raise BundleError(f"unexpected member {member.name[:200]!r} in bundle")
                check_path(rel)
                if rel in staged:
                    raise BundleError(f"{rel} is in the bundle twice")
                if len(staged) >= max_files:
                    raise BundleError(f"more than {max_files} files")
                total += member.size
                if total > max_bytes:
                    raise BundleError(f"more than {max_bytes} bytes unpacked")
                staged[rel] = _write(tar, member, root / rel)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise BundleError(f"not a readable bundle: {exc}") from None
    return staged, manifest


def _write(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> tuple[str, int]:
    f = tar.extractfile(member)
    assert f is not None
    target.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with open(target, "xb") as out:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
            out.write(chunk)
    if size != member.size:
        raise BundleError(f"{member.name}: truncated")
    return digest.hexdigest(), size


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
