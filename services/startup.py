"""How a process imports its heavy modules (torch, its compiler) before its first step.

An import of torch makes hundreds of thousands of objects, nearly none of them garbage, and the
cyclic collector's passes over them took about a quarter of the import (docs/benchmarks.md).
``importing()`` keeps the collector off while a process imports in bulk, then freezes what is
alive into the permanent generation: later collections (a pod's, many per round) skip those
objects, and a process that forks (the pod launcher) leaves their pages shared with its pods.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


@contextmanager
def importing(*, freeze: bool) -> Iterator[None]:
    """Run the block (its imports) with the cyclic collector off; then, with ``freeze``, move
    what is alive out of later collections: for a process that imports once, not for one that
    may call this again with garbage of its own alive (it would never be collected). What the
    imports left unreachable stays too: a few thousand objects after torch's, less than the
    collection that would free them costs on a start-up's critical path."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        if freeze:
            gc.freeze()


def import_all(names: Iterable[str], *, freeze: bool) -> None:
    """Import the modules ``names`` as one block (``importing``)."""
    with importing(freeze=freeze):
        for name in names:
            importlib.import_module(name)
