"""Where the pod's compiled programs are kept, so a pod's restart and a PBT child's new pod load
them instead of compiling again: each program's saved graphs (services/pod/algorithms/
compiled.py) and inductor's kernels, under ``TORCHINDUCTOR_CACHE_DIR``, with inductor's graph
caches on (``FLAGS``: torch saves a compiled graph as AOTAutograd's cache entry; an environment
that turns them off is overridden, with a warning). Its default, under /tmp, is lost with the
container, so the pod points it at a directory that outlives the process:
``PODIUM_COMPILE_CACHE_DIR``, which the local backend sets beside the experiments (every pod of
the platform shares it: entries are keyed by what fixes the graph, the torch version and the
device), else ``<PODIUM_POD_DIR>/compile-cache``.

Kernels are shared libraries, loaded from where they were built: the cache directory must allow
executables (an emptyDir or a volume does), and so must the temporary directory. Docker's
``--tmpfs /tmp`` (compose's hardening) is ``noexec``: where ``/tmp`` is, temporary files go to
``<cache>/tmp`` instead (``TMPDIR``; an operator's own wins). Imports no torch:
``use_compile_cache`` runs before torch is imported.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from services.logs import get_logger
from services.pod.mkl_dispatch import CACHE_DIR, operator_cache_dir

log = get_logger(__name__)

#: The cache's subdirectory that takes temporary files where /tmp is noexec (never shared).
TMP = "tmp"
#: Torch's switches of the FX graph cache and AOTAutograd's (the saved graphs' format).
FLAGS = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def use_compile_cache(directory: Path | None) -> Path | None:
    """Point inductor's caches at ``directory`` (created; an operator's ``TORCHINDUCTOR_CACHE_DIR``
    wins), graph caches on, before torch is imported; the directory in use (None: torch's)."""
    for name, value in FLAGS.items():
        if os.environ.get(name, value) != value:
            log.warning("compile cache flag overridden", flag=name, was=os.environ[name], now=value)
        os.environ[name] = value
    chosen, source = operator_cache_dir(), CACHE_DIR
    if chosen is None and directory is not None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only volume: compile into torch's default, say so
            log.warning("compile cache unavailable", dir=str(directory), error=str(exc))
            return None
        chosen = os.environ[CACHE_DIR] = str(directory)
        source = "PODIUM_COMPILE_CACHE_DIR"
    if chosen is None:
        return None
    log.info("compile cache", dir=chosen, source=source)
    _executable_tmp(Path(chosen))
    return Path(chosen)


def _noexec(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_NOEXEC)
    except OSError:
        return False


def _executable_tmp(cache: Path) -> None:
    """Where the temporary directory cannot hold a library to load (noexec), use
    ``<cache>/tmp``, unless the operator chose ``TMPDIR`` or the cache is noexec too."""
    if os.environ.get("TMPDIR") or not _noexec(tempfile.gettempdir()):
        return
    tmp = cache / TMP
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    if _noexec(str(tmp)):
        log.warning("compile cache is noexec: compiled programs cannot load", dir=str(cache))
        return
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # gettempdir() looks again
    log.info("temporary files in the compile cache: /tmp is noexec", dir=str(tmp))
