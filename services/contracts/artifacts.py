"""What pods keep in the leaderboard's blob store besides training files: the shared compile
caches of an experiment and each pod's own files (its last log lines, its TensorBoard event files).

Compile caches: the first pod of an experiment to claim a program key compiles, then publishes
the files its compile left in its cache directory as a bundle (services/contracts/bundles.py);
every later pod of that key fetches and unpacks them before its trainer starts. A key is the
sha256 of ``CompileFacts`` (torch version, device kind, program), so pods of another torch, GPU
or CPU model, or with other shapes, never get them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, Field

from services.contracts.inputs import InputModel
from services.contracts.leaderboard import ID_PATTERN, SHA256_PATTERN

KEY_PATTERN = SHA256_PATTERN
#: A pod id in a path or a field (a file name, so it can never leave a directory).
POD_ID_PATTERN = ID_PATTERN
#: The files a pod keeps: ``log``, its last log lines (text); ``tensorboard``, its TensorBoard
#: event files (a bundle).
PodFileName = Literal["log", "tensorboard"]
POD_FILE_NAMES: tuple[str, ...] = ("log", "tensorboard")
#: The ``kind`` in the meta of each bundle (services/contracts/bundles.py): a reader refuses
#: a bundle of another kind.
COMPILE_CACHE_KIND = "podium.compile-cache"
TENSORBOARD_KIND = "podium.tensorboard"


class CompileFacts(InputModel):
    """What a compiled program depends on: the torch build, the device it runs on (for a CPU
    its model and flags: inductor compiles for the CPU it runs on), and the program (a digest of
    the pod's configs but for the per-agent hyperparameters and seeds, and of its code)."""

    torch: str = Field(min_length=1, max_length=64)
    device: str = Field(min_length=1, max_length=200)
    program: str = Field(pattern=SHA256_PATTERN)

    def key(self) -> str:
        return compile_key(self)


def compile_key(facts: CompileFacts) -> str:
    """The program key of ``facts``: the sha256 of their canonical JSON."""
    canonical = json.dumps(facts.model_dump(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class CompileClaim(InputModel):
    """A pod asks for a program key's compile cache (POST .../compile-caches/{key}/claim)."""

    pod_id: str = Field(pattern=POD_ID_PATTERN)
    facts: CompileFacts
    refused: str | None = Field(
        default=None,
        pattern=SHA256_PATTERN,
        description="The sha256 of a published cache this pod fetched and refused (corrupt, "
        "or not for its facts): the record is dropped if it still names it, and the pod may "
        "compile and publish instead.",
    )


class CompileCacheState(BaseModel):
    """The answer to a claim: ``ready`` (fetch the bundle whose sha256 is given; none when
    the first pod compiled nothing worth sharing), ``compile`` (this pod holds the claim for
    ``ttl_s`` seconds, renewed by claiming again: compile, then publish), ``wait`` (another pod
    compiles: ask again after ``retry_after_s``)."""

    state: Literal["ready", "compile", "wait"]
    key: str
    sha256: str | None = None
    size: int | None = None
    holder: str | None = Field(default=None, description="The pod that compiles (or did).")
    ttl_s: float | None = None
    retry_after_s: float | None = None


class PodFile(BaseModel):
    """A file a pod uploaded (PUT .../pods/{pod_id}/files/{name}), replaced by its next upload."""

    pod_id: str
    name: str
    sha256: str
    size: int
    uploaded_at: float = Field(description="Epoch seconds.")
