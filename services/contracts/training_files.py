"""Podium training files without torch: the manifest, its checks, and the atomic write.

A set of training files is a directory whose ``manifest.json`` names the format and lists every file
with its sha256 and size (see services/pod/training/checkpoint.py for what the files hold). This
module is everything about that directory that needs no tensors, so the pod (which parses the files
with torch and safetensors) and the CLI's ``podium export`` (which must not import torch) verify a
download with the same code: a file name that could leave the directory, a missing file, a wrong
size or sha256 is a ``CheckpointError``, never a silently different agent."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FORMAT = "podium.training-files/1"
MANIFEST = "manifest.json"
CHUNK = 1 << 20
# The leaderboard accepts exactly these names for uploaded files
# (services/contracts/leaderboard.py):
# no separators, no leading dot, so a name can never reach outside its directory.
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(ValueError):
    """Training files that are missing, truncated, tampered with, or do not fit the agent."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True).encode()


def read_manifest(directory: Path) -> dict[str, Any]:
    """The directory's manifest, parsed and checked in shape (format, names, entries); the
    files themselves are checked by ``verified_files`` / ``verify_digests``."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{directory}: no {MANIFEST}; not a Podium checkpoint") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{directory / MANIFEST}: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{directory}: unsupported checkpoint format {found!r}")
    files = manifest.get("files", {})
    if not isinstance(files, dict):
        raise CheckpointError(f"{directory / MANIFEST}: 'files' is not a mapping")
    for name, entry in files.items():
        if not FILE_NAME_RE.match(name) or name == MANIFEST:
            raise CheckpointError(f"{directory}: bad file name {name!r} in manifest")
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not SHA256_RE.match(entry["sha256"])
            or not isinstance(entry.get("bytes"), int)
            or isinstance(entry["bytes"], bool)
        ):
            raise CheckpointError(
                f"{directory / MANIFEST}: entry of {name!r} needs a lowercase hex 'sha256' and "
                "an integer 'bytes'"
            )
    return manifest


def _mismatch(directory: Path, name: str) -> CheckpointError:
    return CheckpointError(
        f"{directory / name}: size or sha256 does not match the manifest (truncated or modified)"
    )


def _missing(directory: Path, name: str) -> CheckpointError:
    return CheckpointError(f"{directory}: file {name} is missing")


def verified_files(directory: Path, manifest: dict[str, Any]) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every file the manifest lists, each checked before it is yielded."""
    directory = Path(directory)
    for name, entry in manifest.get("files", {}).items():
        try:
            data = (directory / name).read_bytes()
        except FileNotFoundError as exc:
            raise _missing(directory, name) from exc
        if len(data) != entry["bytes"] or sha256_bytes(data) != entry["sha256"]:
            raise _mismatch(directory, name)
        yield name, data


def verify_digests(directory: Path, digests: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """Check every file the manifest in ``directory`` lists against ``digests`` (name ->
    (sha256, size)), computed as the files were written, so nothing is read twice; a listed
    file without a digest is missing. Returns the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for name, entry in manifest["files"].items():
        if name not in digests:
            raise _missing(directory, name)
        sha256, size = digests[name]
        if size != entry["bytes"] or sha256 != entry["sha256"]:
            raise _mismatch(directory, name)
    return manifest


def replace_dir(tmp: Path, directory: Path) -> None:
    """Move the complete ``tmp`` into ``directory``'s place; an existing directory is renamed
    aside first and removed after, so a reader sees the old set or the new one."""
    old = None
    if directory.exists():
        old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
        directory.rename(old)
    tmp.rename(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def temp_dir_beside(directory: Path) -> Path:
    """A new empty directory next to ``directory`` (same filesystem: the rename is atomic)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def write_files(directory: Path, files: dict[str, bytes], meta: dict[str, Any]) -> dict[str, str]:
    """Atomically write ``files`` plus a manifest into ``directory``; return name -> sha256."""
    directory = Path(directory)
    for name in files:
        if not FILE_NAME_RE.match(name) or name == MANIFEST:
            raise CheckpointError(f"bad training file name {name!r}")
    digests = {name: sha256_bytes(data) for name, data in files.items()}
    manifest = {
        **meta,
        "format": FORMAT,
        "files": {n: {"sha256": digests[n], "bytes": len(d)} for n, d in files.items()},
    }
    tmp = temp_dir_beside(directory)
    try:
        for name, data in {**files, MANIFEST: json_bytes(manifest)}.items():
            with open(tmp / name, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return digests
