"""What one synchronisation step owns: ``StepState`` and the submission ``Handle``.

A step begins with the first ``submit`` and ends when ``synchronize``
returns; the engine then replaces its ``StepState`` with a fresh one. Every
field below lives exactly that long, so nothing of a step can leak into the
next. The lock of the engine's ``StepContext`` (``context.py``) guards the
containers; the communication thread reads and mutates them between
metadata rounds. Whether the step still takes submissions is the context's
``Life`` (one enum for the engine's whole lifecycle), not a field here.

Where a message or collective is, by key (``layout.msg_key``):

    unreported  -- ready, not yet in a metadata report: (key, dst, nbytes)
    outbox      -- a send's payload waiting for its round: (key, dst) -> (payload, task)
    collective  -- an allreduce's tensor waiting for its bucket: key -> (task, tensor)
    planned     -- collectives already put into a round (they finish without
                   another report)
    roots       -- a ready broadcast collective's source rank: key -> rank
    expect      -- a recv task waiting for its message: key -> task
    early       -- a message that arrived before its recv task was ready
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from .tasks import Task

__all__ = ["StepState", "Handle"]


@dataclass(eq=False)
class StepState:
    """Everything one step owns (see the module docstring for the containers).

    Attributes:
        index: the step's number (``Engine.step`` when it began).
        handles: one per submitted gradient, in submission order.
        submitted: names submitted this step.
        coll_keys: keys of this step's collectives (``replay.py`` compares
            them with a recorded schedule).
        digest: XOR of the submitted gradients' fingerprints; equal on every
            rank that submitted the same set (checked when all have closed).
        nonfinite: this rank saw NaN/Inf (with ``nonfinite`` "skip" or
            "propagate"): data for the next report, not lifecycle.
        skipped: the step's *result*, written by the communication once every
            rank agreed on it: some rank saw NaN/Inf, so the step is undone
            (``nonfinite.finish_step``). Not lifecycle: a skipped step ends
            like any other.
    """

    index: int
    unreported: List[Tuple[int, int, int]] = field(default_factory=list)
    outbox: Dict[Tuple[int, int], Tuple[torch.Tensor, Task]] = field(default_factory=dict)
    collective: Dict[int, Tuple[Task, torch.Tensor]] = field(default_factory=dict)
    planned: List[Task] = field(default_factory=list)
    roots: Dict[int, int] = field(default_factory=dict)
    expect: Dict[int, Task] = field(default_factory=dict)
    early: Dict[int, torch.Tensor] = field(default_factory=dict)
    handles: List["Handle"] = field(default_factory=list)
    submitted: Set[str] = field(default_factory=set)
    coll_keys: Set[int] = field(default_factory=set)
    digest: int = 0
    nonfinite: bool = False
    skipped: bool = False

    def unreported_bytes(self) -> int:
        """Bytes of ready work not yet reported to the coordinator."""
        return sum(m[2] for m in self.unreported)


class Handle:
    """Completion of one submitted gradient; ``wait`` raises the step's error.

    The handle counts what must finish before the average is in place: a
    building token (released once all the gradient's tasks are added) and
    one per ``write`` task (or the lane bucket's mean). The last release
    copies the result into the caller's tensor when the engine worked on a
    contiguous copy, and sets the event. ``hold`` and ``release`` are the
    engine's side (its builder, task manager and lane); a caller only
    ``wait``s.

    Args:
        name: the gradient.
        tensor: the caller's tensor (receives the average).
        work: the tensor the engine works on (``tensor`` or a contiguous copy).
        timeout: ``wait``'s default, in seconds.
        check: raises the engine's error, if any (``wait`` polls it).
    """

    def __init__(self, name: str, tensor: torch.Tensor, work: torch.Tensor, timeout: float,
                 check: Callable[[], None]):
        self.name = name
        self.tensor = tensor
        self._work = work
        self._timeout = timeout
        self._check = check
        self._pending = 1  # the building token, released after all tasks are added
        self._event = threading.Event()
        self._lock = threading.Lock()

    def hold(self, n: int = 1) -> None:
        """Count ``n`` more completions to wait for (engine side)."""
        with self._lock:
            self._pending += n

    def release(self, n: int = 1) -> None:
        """``n`` completions happened (engine side); the last one finishes the handle."""
        with self._lock:
            self._pending -= n
            if self._pending == 0:
                if self._work is not self.tensor:
                    self.tensor.copy_(self._work)
                self._event.set()

    def done(self) -> bool:
        """True once the averaged gradient is written."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        """Block until the averaged gradient is written; return the tensor.

        Raises:
            EngineError / PeerError: the synchronisation failed.
            TimeoutError: not done within ``timeout`` seconds.
        """
        t = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        while not self._event.wait(0.05):
            self._check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"gradient {self.name!r} not synchronised within {t:.1f} s")
        self._check()
        return self.tensor
