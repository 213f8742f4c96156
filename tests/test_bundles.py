"""Bundles (services/contracts/bundles.py): what packs unpacks to the same bytes; anything
tampered with, truncated, foreign, oversized or shaped to escape the destination is refused
whole, and the destination is left as it was."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from services.contracts.bundles import BundleError, files_under, pack, read_meta, unpack

META = {"kind": "test", "device": "cpu-x"}


def tree(root: Path) -> dict[str, bytes]:
    files = {"a.so": b"\x7fELF" + bytes(range(256)) * 40, "sub/dir/b.py": b"x = 1\n", "c": b""}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def packed(root: Path) -> bytes:
    out = io.BytesIO()
    pack(root, files_under(root), META, out)
    return out.getvalue()


def contents(root: Path) -> dict[str, bytes]:
    return {rel: (root / rel).read_bytes() for rel in files_under(root)}


def raw_bundle(members: list[tuple[str, bytes]], manifest: dict | None = None) -> bytes:
    """A bundle written by hand: ``members`` under their names, then the manifest (by default
    one that lists them truthfully)."""
    if manifest is None:
        files = {
            name.removeprefix("files/"): {
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
            }
            for name, data in members
        }
        manifest = {"format": "podium.bundle/1", "meta": META, "files": files}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in [*members, ("bundle.json", json.dumps(manifest).encode())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_a_bundle_unpacks_to_the_same_files(tmp_path: Path) -> None:
    files = tree(tmp_path / "src")
    (tmp_path / "src" / ".hidden").write_text("temp files are never bundled")
    data = packed(tmp_path / "src")
    assert read_meta(io.BytesIO(data)) == META
    manifest = unpack(io.BytesIO(data), tmp_path / "dest", expect=META)
    assert set(manifest["files"]) == set(files)
    assert contents(tmp_path / "dest") == files
    assert not any(p.name.startswith(".") for p in (tmp_path / "dest").iterdir())


def test_unpacking_over_existing_files_keeps_equal_ones_and_replaces_others(
    tmp_path: Path,
) -> None:
    files = tree(tmp_path / "src")
    dest = tmp_path / "dest"
    tree(dest)
    (dest / "c").write_bytes(b"stale")
    same = (dest / "a.so").stat().st_ino
    unpack(io.BytesIO(packed(tmp_path / "src")), dest)
    assert contents(dest) == files
    assert (dest / "a.so").stat().st_ino == same  # left alone: another process may map it


def refused(tmp_path: Path, data: bytes, match: str, **kw: object) -> None:
    dest = tmp_path / "dest"
    dest.mkdir(exist_ok=True)
    (dest / "kept").write_bytes(b"mine")
    with pytest.raises(BundleError, match=match):
        unpack(io.BytesIO(data), dest, **kw)  # type: ignore[arg-type]
    assert contents(dest) == {"kept": b"mine"}, "a refused bundle wrote something"
    assert [p.name for p in dest.iterdir()] == ["kept"]


def test_tampered_truncated_and_foreign_bundles_are_refused(tmp_path: Path) -> None:
    tree(tmp_path / "src")
    good = packed(tmp_path / "src")
    refused(tmp_path, good, "another device", expect={**META, "device": "cuda-H200"})
    refused(tmp_path, good[: len(good) // 2], "readable|truncated|no bundle.json")
    refused(tmp_path, b"not a tar at all", "readable")
    members = [("files/a", b"real bytes"), ("files/b", b"more")]
    lie = raw_bundle(members)
    with tarfile.open(fileobj=io.BytesIO(lie)) as tar:
        manifest = json.loads(tar.extractfile("bundle.json").read())  # type: ignore[union-attr]
    manifest["files"]["a"]["sha256"] = hashlib.sha256(b"other bytes").hexdigest()
    refused(tmp_path, raw_bundle(members, manifest), "does not match")
    del manifest["files"]["a"]
    refused(tmp_path, raw_bundle(members, manifest), "extra")
    manifest["files"]["gone"] = {"sha256": "0" * 64, "bytes": 1}
    refused(tmp_path, raw_bundle(members, manifest), "missing")
    refused(tmp_path, raw_bundle([("files/a", b"x")], {"format": "other"}), "not a podium")
    refused(tmp_path, good, "more than 10 bytes", max_bytes=10)
    refused(tmp_path, good, "more than 1 files", max_files=1)


@pytest.mark.parametrize(
    "name",
    ["files/../escape", "/etc/passwd", "files//etc/passwd", "files/.hidden", "other/a", "files/"],
)
def test_paths_that_could_escape_are_refused(tmp_path: Path, name: str) -> None:
    refused(tmp_path, raw_bundle([(name, b"evil")]), "bad file path|unexpected member")
    assert not (tmp_path / "escape").exists()


def test_links_and_devices_are_refused(tmp_path: Path) -> None:
    for kind in (tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.DIRTYPE):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w:gz") as tar:
            info = tarfile.TarInfo("files/link")
            info.type, info.linkname = kind, "/etc/passwd"
            tar.addfile(info)
        refused(tmp_path, out.getvalue(), "unexpected member")


def test_a_file_listed_twice_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, raw_bundle([("files/a", b"1"), ("files/a", b"2")]), "twice")
