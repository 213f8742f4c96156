"""Where torch.compile keeps what it built, so a pod's restart and a PBT child's new pod do not
pay the compile again.

Inductor writes its kernels (C++ or Triton sources and their builds) and, with the FX graph
cache and AOTAutograd's cache on (their defaults in torch 2.13, set here explicitly so that an
image's environment cannot turn them off unnoticed), whole compiled graphs under
``TORCHINDUCTOR_CACHE_DIR``; a process that compiles a program already there loads it (counted
in ``torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]``) instead of building it.
Its default is a directory under /tmp, lost with the container, so the pod points it at a
directory that outlives the process: ``PODIUM_COMPILE_CACHE_DIR``, which the local backend sets
beside the experiments (every pod of the platform shares it: entries are keyed by the graph,
the torch version and the device, so sharing is safe), else ``<PODIUM_POD_DIR>/compile-cache``.

Imports no torch: ``use_compile_cache`` runs before torch is imported.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.logs import get_logger

log = get_logger(__name__)

CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"
#: Torch's switches of the caches that hold whole compiled graphs (the FX graph cache and
#: AOTAutograd's, which holds the forward and backward of a differentiated graph).
FLAGS = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def use_compile_cache(directory: Path | None) -> Path | None:
    """Point inductor's caches at ``directory`` (created) and turn the graph caches on; an
    operator's own ``TORCHINDUCTOR_CACHE_DIR`` wins. Returns the directory in use (None: torch's
    default). Call before torch compiles anything (before it is imported is safest)."""
    for name, value in FLAGS.items():
        os.environ.setdefault(name, value)
    if os.environ.get(CACHE_DIR):
        chosen = Path(os.environ[CACHE_DIR])
        log.info("compile cache", dir=str(chosen), source=CACHE_DIR)
        return chosen
    if directory is None:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only volume: compile into torch's default, say so
        log.warning("compile cache unavailable", dir=str(directory), error=str(exc))
        return None
    os.environ[CACHE_DIR] = str(directory)
    log.info("compile cache", dir=str(directory), source="PODIUM_COMPILE_CACHE_DIR")
    return directory
