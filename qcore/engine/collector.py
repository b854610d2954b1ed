"""Pause Python's cyclic garbage collector while prepare or convert builds a graph.

Both passes allocate many small objects (graph nodes, modules, dataclasses), and
each allocation burst triggers a collection that walks every object the process
holds: on 800 conv-bn-relu blocks that was about 15% of prepare + convert. Nothing
they build is garbage until they return, so collecting then, once, is enough.
Only speed depends on this: reference counting still frees what it can, and the
collector's previous state is restored on exit (a thread that finds it paused
leaves it to the thread that paused it).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
