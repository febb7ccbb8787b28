"""Executors for the computing queue (HiPress Sec. 3.1, Q_comp).

The task manager is given an executor rather than creating threads itself,
so tests can swap in ``SyncExecutor`` and get a deterministic, single-thread
run. ``ThreadExecutor`` runs tasks FIFO on one daemon thread by default: one
is enough to overlap compression with communication and with the
framework's own compute on a 2-core machine, and keeps torch's intra-op
threads from oversubscribing.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Callable, Deque, Optional

__all__ = ["Executor", "SyncExecutor", "ThreadExecutor"]

_log = logging.getLogger(__name__)


class Executor:
    """Runs callables; ``submit`` never blocks on the work itself."""

    def submit(self, fn: Callable[[], None]) -> None:
        """Schedule ``fn`` to run."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop accepting work and release threads."""


class SyncExecutor(Executor):
    """Runs work in the submitting thread, iteratively (no recursion).

    A task that submits more work while running (a finished task releasing
    its dependents) has that work queued and run by the outermost
    ``submit`` call, so long dependency chains do not grow the stack.
    """

    def __init__(self) -> None:
        self._q: Deque[Callable[[], None]] = deque()
        self._local = threading.local()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now (or after the work already being drained here)."""
        self._q.append(fn)
        if getattr(self._local, "draining", False):
            return
        self._local.draining = True
        try:
            while self._q:
                self._q.popleft()()
        finally:
            self._local.draining = False


class ThreadExecutor(Executor):
    """Runs work FIFO on ``threads`` daemon threads."""

    def __init__(self, threads: int = 1, name: str = "hipress-compute"):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, found {threads}")
        self._q: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException:  # the task wrapper reports errors; never kill the worker
                _log.exception("uncaught error in compute task")

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue ``fn``."""
        self._q.put(fn)

    def shutdown(self) -> None:
        """Stop the worker threads after queued work."""
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=5)
