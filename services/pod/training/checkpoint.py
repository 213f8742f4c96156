"""Training files: everything needed to continue training an agent, or to run it.

A checkpoint is a directory:

* ``actor.safetensors`` — the policy (actor weights + observation statistics): enough to act;
* ``critic.safetensors`` — critic weights and return statistics;
* ``optimizer.safetensors`` + ``optimizer.json`` — optimiser tensors, then its param groups;
* ``hyperparameters.json`` — the training config; ``counters.json`` — env steps, updates;
* ``manifest.json`` — format version, algorithm and the sha256 + size of every file above.

Weights go through safetensors and everything else through JSON, so loading a checkpoint from
the network never runs pickled code. Every file is checked against the manifest before it is
parsed: a truncated or tampered file is an error, never a silently different agent. A
directory is written next to its destination and renamed into place, so readers see either
the old checkpoint or the new one. The manifest, its checks and the write need no torch
(services/contracts/training_files.py, shared with the CLI's export); this module adds the
tensors and knows no algorithm: what each writes is its trainer's (onpolicy.py, offpolicy.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

# The torch-free part, importable from here for the pod's modules.
from services.contracts.training_files import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    json_bytes,
    read_manifest,
    sha256_bytes,
    verified_files,
    write_files,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "CheckpointError",
    "TrainingFiles",
    "json_bytes",
    "load_into",
    "optimizer_from_files",
    "optimizer_to_files",
    "read_agent_files",
    "read_files",
    "sha256_bytes",
    "tensor_bytes",
    "write_files",
]


def tensor_bytes(state: dict[str, torch.Tensor]) -> bytes:
    # safetensors refuses views of shared storage; clone makes every tensor its own.
    return st_save({k: v.detach().contiguous().clone().cpu() for k, v in state.items()})


def optimizer_to_files(state: dict[str, Any]) -> tuple[bytes, bytes]:
    """An optimiser's ``state_dict()`` as a safetensors file (its tensors) and a JSON one."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value
            else:
                scalars.setdefault(str(index), {})[name] = value
    meta = {"param_groups": state["param_groups"], "scalars": scalars}
    return tensor_bytes(tensors), json_bytes(meta)


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    for index, values in meta.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


@dataclass
class TrainingFiles:
    """A verified checkpoint, parsed: tensors by file, JSON documents by file."""

    manifest: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]]
    documents: dict[str, Any]


def read_files(directory: Path) -> TrainingFiles:
    """Read and verify a checkpoint directory. Raises ``CheckpointError`` on any defect."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    documents: dict[str, Any] = {}
    for name, data in verified_files(directory, manifest):
        try:
            if name.endswith(".safetensors"):
                tensors[name.removesuffix(".safetensors")] = st_load(data)
            elif name.endswith(".json"):
                documents[name.removesuffix(".json")] = json.loads(data)
        except (SafetensorError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{directory / name}: cannot be parsed ({exc})") from exc
    return TrainingFiles(manifest=manifest, tensors=tensors, documents=documents)


def read_agent_files(directory: Path, algorithm: str, needed: Iterable[str]) -> TrainingFiles:
    """``read_files``, refusing files another algorithm wrote or that lack one of ``needed``
    (tensor files, by stem): the one check every trainer's ``load`` makes before it parses
    them, so a PBT parent of another kind is a ``CheckpointError``, never a half-loaded agent.
    The algorithm first: another algorithm's files lack other files, and its name says why."""
    files = read_files(directory)
    if (found := files.manifest.get("algorithm")) != algorithm:
        raise CheckpointError(f"{directory}: checkpoint of {found!r}, agent is {algorithm!r}")
    if missing := set(needed) - files.tensors.keys():
        raise CheckpointError(f"{directory}: missing {sorted(missing)}")
    return files


def load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """``module.load_state_dict(state)``, strict; a ``CheckpointError`` naming ``what``."""
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{what} does not fit this agent: {exc}") from exc
