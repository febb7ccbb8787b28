"""Starting worker processes the way every launcher here does (tests, benchmarks, netem).

One helper, shared by ``launch`` (local ranks) and ``netem`` (ranks inside
network namespaces), so neither imports the other; and the worker's side of
the tie to its launcher (``die_with_launcher``): a worker lives in a process
group of its own, so a launcher killed from outside (``kill -9``, a CI job's
timeout) would otherwise leave its ranks running, orphaned, until their own
timeouts.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any, Dict

__all__ = ["LAUNCHER_PID_ENV", "die_with_launcher", "own_process_group"]

# The launcher's pid, in the worker's environment (``die_with_launcher``).
LAUNCHER_PID_ENV = "HIPRESS_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


def die_with_launcher() -> None:
    """In a worker: be killed (SIGKILL) when the launcher that started it dies.

    Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) fires when the
    *thread* that forked the worker ends; ``run_workers`` waits for its workers
    in that same thread, so the signal comes only when the launcher is gone. The
    launcher's pid is in ``HIPRESS_LAUNCHER_PID``; a worker whose parent is
    already another process (the launcher died before this call) exits at once.
    Does nothing without the variable, or off Linux.
    """
    want = os.environ.get(LAUNCHER_PID_ENV)
    if not want or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not allowed here: the worker then lives as before
    if os.getppid() != int(want):
        os._exit(1)  # orphaned before the signal was armed
