"""Per-rank timeline of tasks and bulk rounds (the view of HiPress Fig. 13c).

Every finished task and every bulk-exchange round is recorded with its kind,
gradient, partition, start, end and bytes. ``save_chrome_trace`` writes the
Chrome trace-event JSON format, which opens in chrome://tracing or Perfetto:
one process per rank, one thread row per queue (compute, comm).
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Deque, Dict, Iterable, List, Optional, Tuple, Union

__all__ = ["Event", "Timeline", "COMPRESSION_KINDS", "COMMUNICATION_KINDS"]

# The kinds of event, grouped: compression work (compute tasks, casync/tasks.py), and the
# transfers themselves: the coordinator's bulk rounds (casync/rounds.py), the lane's
# fused buckets (casync/fused.py), round allreduces.
COMPRESSION_KINDS = ("encode", "decode", "merge", "write")
COMMUNICATION_KINDS = ("round", "bucket", "allreduce")


@dataclass(frozen=True)
class Event:
    """One timed span."""

    kind: str
    grad: str
    part: int
    start: float  # seconds, time.perf_counter()
    end: float
    nbytes: int
    queue: str
    step: int


class Timeline:
    """Collects events of one rank; bounded so long runs do not grow memory.

    Args:
        rank: this process's rank (the trace's pid).
        max_events: oldest events are dropped beyond this many.
    """

    def __init__(self, rank: int = 0, max_events: int = 200_000):
        self.rank = rank
        self.max_events = max_events
        # a ring: once full, each event drops the oldest in O(1)
        self._events: Deque[Event] = deque(maxlen=max_events)
        self._added = 0  # events ever recorded (``since``'s marks count these)
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.enabled = True

    def add(self, event: Event) -> None:
        """Record one event."""
        if not self.enabled:
            return
        with self._lock:
            self._events.append(event)
            self._added += 1

    def since(self, mark: int = 0) -> Tuple[List[Event], int]:
        """The events recorded after ``mark`` and the mark to pass next time.

        A reader that runs every step (``plan="adaptive"``) reads what is new
        in time proportional to it, not to the whole timeline.

        Args:
            mark: the mark an earlier call returned (0: every event kept).

        Returns:
            (events recorded since ``mark`` that the bound has not dropped, oldest
            first; the new mark).
        """
        with self._lock:
            n = max(0, min(self._added - mark, len(self._events)))
            out = list(islice(reversed(self._events), n))
            out.reverse()
            return out, self._added

    def extend(self, events: Iterable[Event]) -> None:
        """Record several events."""
        for e in events:
            self.add(e)

    @property
    def events(self) -> List[Event]:
        """A copy of the recorded events."""
        with self._lock:
            return list(self._events)

    def summary(self, step: Optional[int] = None) -> Dict[str, Dict[str, float]]:
        """Total seconds, count and bytes per event kind (optionally one step)."""
        out: Dict[str, Dict[str, float]] = {}
        for e in self.events:
            if step is not None and e.step != step:
                continue
            s = out.setdefault(e.kind, {"seconds": 0.0, "count": 0, "bytes": 0})
            s["seconds"] += e.end - e.start
            s["count"] += 1
            s["bytes"] += e.nbytes
        return out

    def chrome_trace(self) -> Dict[str, list]:
        """The trace-event JSON object (microsecond timestamps)."""
        tids = {"compute": 1, "comm": 2}
        evs = [{"name": "process_name", "ph": "M", "pid": self.rank,
                "args": {"name": f"rank {self.rank}"}}]
        for q, tid in tids.items():
            evs.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                        "args": {"name": q}})
        for e in self.events:
            evs.append({
                "name": f"{e.kind} {e.grad}#{e.part}" if e.grad else e.kind,
                "cat": e.kind, "ph": "X", "pid": self.rank, "tid": tids.get(e.queue, 3),
                "ts": (e.start - self._t0) * 1e6, "dur": max(0.0, (e.end - e.start) * 1e6),
                "args": {"grad": e.grad, "part": e.part, "bytes": e.nbytes, "step": e.step},
            })
        return {"traceEvents": evs, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: Union[str, os.PathLike]) -> None:
        """Write the Chrome trace JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
