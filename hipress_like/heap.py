"""Keep Python's cyclic garbage collector off the objects a training process carries for
its whole life.

A process that imports torch, this library and a data library holds a quarter of a
million objects the collector tracks (modules, functions, classes, constants) and
that never become garbage. Every full collection traverses all of them, and so does
the one the interpreter runs at exit: on a loaded 2-core host (4 busy processes
beside 2 ranks) that last collection alone took ~1.9 s, most of the time a rank
that had already reported its error spent exiting (issue 46 asks for an exit within
3 s of the error). ``gc.freeze()`` moves every object alive at that moment to a
permanent generation that no collection traverses (Python's documented tool for
long-lived heaps): the same exit then took ~0.4 s.

``settle()`` does it once per process, after a collection, where what is alive is
what the process keeps: at the end of ``init()`` (every face's), when a script has
imported its libraries and built nothing yet. Objects created later (the model, the
engines, the data) are collected as usual. The price: an object alive at ``init()``
that later becomes garbage inside a reference cycle is never collected (one that is
freed by its reference count still is). ``HIPRESS_GC_FREEZE=0`` turns it off.
Libraries a script imports after ``init()`` are not frozen (import them first).
"""
from __future__ import annotations

import gc
import logging
import os
import threading

__all__ = ["ENV", "settle", "settled"]

log = logging.getLogger(__name__)

#: The environment variable that turns ``settle`` off (``0``).
ENV = "HIPRESS_GC_FREEZE"

_lock = threading.Lock()
_done = False


def settle() -> bool:
    """Collect once, then freeze every object alive (``gc.freeze``); once per process.

    Returns:
        True if this call froze the heap; False if an earlier call did, or
        ``HIPRESS_GC_FREEZE=0``.
    """
    global _done
    with _lock:
        if _done or os.environ.get(ENV, "1").strip() == "0":
            return False
        _done = True
    gc.collect()
    gc.freeze()
    log.debug("froze %d objects for the garbage collector (%s=0 turns it off)",
              gc.get_freeze_count(), ENV)
    return True


def settled() -> bool:
    """Whether ``settle`` has frozen the heap in this process."""
    return _done
