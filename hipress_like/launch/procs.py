"""Starting worker processes the way every launcher here does (tests, benchmarks, netem).

One helper, shared by ``launch`` (local ranks) and ``netem`` (ranks inside
network namespaces), so neither imports the other.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict

__all__ = ["own_process_group"]


def own_process_group() -> Dict[str, Any]:
    """``subprocess.Popen`` arguments that start a worker in a process group of its own,
    in the caller's session.

    A process group lets a supervisor kill the worker's whole tree (``killpg``).
    A new *session* would do that too, but Linux's autogroup scheduler (on by
    default) gives each session its own share of the CPU, and ranks sharing
    cores then wait behind their own group's turn for every coordination round
    (several times slower small allgathers; docs/design.md, "Threads, the GIL
    and the CPU scheduler").
    """
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}
