"""Waiting on gloo works off the caller's thread, so that a wait can be given up.

A gloo ``work.wait(timeout)`` cannot be interrupted: the thread inside it
stays there until the work completes, fails or times out. The torch.distributed
transport (``torch_dist``) therefore hands each wait to a waiter thread of its
own (``Waiter``) and polls for a peer's abort while it waits; on an abort the
caller gives the wait up and raises at once, and the waiter stays in the wait
until the peer it waits for exits or the deadline passes.

At exit such an abandoned wait must end before the interpreter finalises:
``join_waiters_at_exit`` (registered with ``atexit``) ends idle waiters and
gives a busy one up to ``EXIT_JOIN`` seconds. Once none is left inside a
wait, it runs the ``when_idle_at_exit`` hooks (the transport releases its
groups there, so a peer's abandoned wait on this rank ends now, not when
this interpreter has finished finalising).
"""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, List, Optional

__all__ = ["Waiter", "Pending", "wait_loop", "join_waiters_at_exit", "when_idle_at_exit",
           "EXIT_JOIN"]

log = logging.getLogger(__name__)

# At exit, how long to wait for a waiter thread still inside a wait its caller gave
# up on (``join_waiters_at_exit``): such a wait ends when the peer it waits for
# exits, and that must happen before this interpreter finalises, not during it.
EXIT_JOIN = 3.0
# Every waiter thread of this process, with its queue.
_waiters: "weakref.WeakKeyDictionary[threading.Thread, queue.SimpleQueue]" = \
    weakref.WeakKeyDictionary()
# Run at exit once no waiter thread is inside a wait (``join_waiters_at_exit``).
when_idle_at_exit: List[Callable[[], None]] = []


class Waiter:
    """One waiter thread and its queue (one per transport that waits on gloo).

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self.queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=wait_loop, args=(self.queue,), daemon=True,
                                       name=name)
        _waiters[self.thread] = self.queue
        self.thread.start()

    def submit(self, works: list, deadline: float) -> "Pending":
        """Hand ``works`` to the thread, to be waited for in turn until ``deadline``."""
        pending = Pending(works, deadline)
        self.queue.put(pending)
        return pending

    def stop(self) -> None:
        """End the thread after the wait it may be in."""
        self.queue.put(None)


class Pending:
    """One wait handed to the waiter thread: its works, deadline, and outcome."""

    def __init__(self, works: list, deadline: float) -> None:
        self.works = works
        self.deadline = deadline
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.at = 0  # the index of the work being waited for (the failed one, on error)


def wait_loop(q: "queue.SimpleQueue") -> None:
    """The waiter thread of one transport: waits for each ``Pending`` in turn. It holds
    no reference to the transport, so the transport can be collected; a wait a caller
    gave up on (an abort) ends at its deadline, or when the peer it waits for exits
    (see ``join_waiters_at_exit``)."""
    while True:
        pending = q.get()
        if pending is None:
            return
        try:
            for i, work in enumerate(pending.works):
                pending.at = i
                remaining = max(pending.deadline - time.monotonic(), 0.001)
                work.wait(timeout=timedelta(seconds=remaining))
        except BaseException as e:
            pending.error = e
        finally:
            pending.done.set()


def join_waiters_at_exit() -> None:
    """At exit, before the interpreter finalises: end the idle waiter threads, and give
    one still inside a wait its caller gave up on up to ``EXIT_JOIN`` seconds to end.

    Such a wait ends with an error when the peer it waits for exits, which, with every
    rank ending together, is often while this interpreter finalises; a daemon thread
    coming back from ``work.wait`` then is killed as it retakes the GIL, by an unwind
    through pybind11's noexcept frame: ``std::terminate`` and exit status 134 after a
    clean run (the MXNet refusals job did that on the 3 ranks an abort had reached).
    Gloo cannot cut such a wait short: destroying the group leaves it blocked, and a
    point-to-point wait that times out closes its connection."""
    waiters = list(_waiters.items())
    for _, q in waiters:
        q.put(None)  # an idle waiter ends at once
    deadline = time.monotonic() + EXIT_JOIN
    busy = False
    for thread, _ in waiters:
        thread.join(max(deadline - time.monotonic(), 0.0))
        if thread.is_alive():
            busy = True
            log.debug("a waiter is still inside an abandoned wait at exit")
    if busy:
        return
    for hook in when_idle_at_exit:
        try:
            hook()
        except Exception as e:  # exit goes on whatever a hook does
            log.debug("exit hook %r failed: %s", hook, e)


atexit.register(join_waiters_at_exit)
