"""CaSync's primitives as tasks in a dependency graph (HiPress Sec. 3.1, Fig. 2).

A gradient's synchronisation is a small graph of primitive tasks: ``encode``,
``decode``, ``merge`` run on the *computing* queue; ``send`` and ``recv`` on
the *communication* queue. Edges are data dependencies (a ``decode`` reads
the buffer its ``recv`` wrote). The graph keeps every task in exactly one of
four state sets, like Dask's local scheduler (``dask/local.py``):

    waiting  -- some dependency is not done yet
    ready    -- all dependencies done; handed to its queue's executor
    running  -- an executor has started it
    done     -- finished; its dependents were released

``finish(task)`` is the one place that moves a task to ``done`` and promotes
dependents whose last dependency it was (step 3 of HiPress Fig. 2). Tasks are
added after their dependencies, so the graph is acyclic by construction;
``add_dependency`` on existing tasks checks for a cycle and raises
``CycleError`` with the path. ``check_progress`` raises ``DeadlockError``
with the chain of waiting tasks when nothing can run any more.
"""
from __future__ import annotations

import itertools
import threading
import time
from enum import Enum
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..errors import HipressError

__all__ = ["Task", "TaskGraph", "Kind", "TaskState", "CycleError", "DeadlockError",
           "COMPUTE_KINDS", "COMM_KINDS"]


class _Name(str, Enum):
    """An enum of names that compare and print as their value (``task.kind == "send"``)."""

    def __str__(self) -> str:
        return self.value


class Kind(_Name):
    """What a task does; ``str`` so that ``task.kind == "send"`` reads naturally."""

    ENCODE = "encode"
    DECODE = "decode"
    MERGE = "merge"
    WRITE = "write"
    SEND = "send"
    RECV = "recv"
    ALLREDUCE = "allreduce"


class TaskState(_Name):
    """The state set a task is in (``new`` until it is added to a graph)."""

    NEW = "new"
    WAITING = "waiting"
    READY = "ready"
    RUNNING = "running"
    DONE = "done"


COMPUTE_KINDS = frozenset({Kind.ENCODE, Kind.DECODE, Kind.MERGE, Kind.WRITE})
COMM_KINDS = frozenset({Kind.SEND, Kind.RECV, Kind.ALLREDUCE})


class CycleError(HipressError, RuntimeError):
    """Adding a dependency would close a cycle; ``path`` lists the tasks."""

    def __init__(self, path: List["Task"]):
        self.path = path
        super().__init__("dependency cycle: " + " -> ".join(t.label for t in path))


class DeadlockError(HipressError, RuntimeError):
    """Tasks wait on dependencies that can never finish; ``path`` shows one chain."""

    def __init__(self, path: List["Task"], detail: str = ""):
        self.path = path
        chain = " <- ".join(t.label for t in path)
        super().__init__(f"deadlock: {chain}" + (f" ({detail})" if detail else ""))


class Task:
    """One primitive: what it does (``fn``), what it waits for, and when it ran.

    The data a task produces travels with it: ``run()`` calls ``fn`` with the
    ``result`` of each dependency, in dependency order, and keeps what ``fn``
    returns as this task's ``result``. Once every task that reads a result
    has finished and its builder has sealed it (``TaskGraph.seal``: no more
    readers will be added), the graph drops it, so a received buffer lives no
    longer than its last reader.

    Attributes:
        kind: a ``Kind``.
        grad: gradient name; ``part``: partition index; ``nbytes``: bytes moved.
        fn: called by ``run()`` with the dependencies' results. A send's
            ``fn`` returns the payload; an allreduce's returns the tensor
            to sum in place (its result is then its input, now summed); a
            recv has no ``fn``: the communication executor stores the
            received buffer as its result.
        result: what ``fn`` returned (or the received bytes).
        start, end: ``time.perf_counter()`` stamps for the timeline.
        msg: (message key, peer rank) of a send or recv; (key, ``COLLECTIVE``)
            of a collective (``layout.msg_key``). Given at construction.
        owner: the submission handle a ``write`` task completes (its
            ``release`` is called once the task is done).
        root: a broadcast collective's source rank, as a function called once
            the task is ready (the owner is known only once its payload
            exists: ``lane_workflows.py``).
    """

    __slots__ = ("id", "kind", "grad", "part", "fn", "nbytes", "info", "deps", "dependents",
                 "pending", "state", "start", "end", "msg", "owner", "result", "readers", "root")
    _ids = itertools.count()

    def __init__(self, kind: str, grad: str, part: int, fn: Optional[Callable[..., Any]],
                 nbytes: int = 0, info: str = "", *, msg: Optional[Tuple[int, int]] = None,
                 owner: Any = None, root: Optional[Callable[[], int]] = None):
        try:
            kind = Kind(kind)
        except ValueError:
            raise ValueError(f"unknown task kind {kind!r}; known: "
                             f"{', '.join(k.value for k in Kind)}") from None
        self.id = next(Task._ids)
        self.kind = kind
        self.grad = grad
        self.part = part
        self.fn = fn
        self.nbytes = nbytes
        self.info = info
        self.deps: List[Task] = []
        self.dependents: List[Task] = []
        self.pending = 0
        self.state = TaskState.NEW
        self.start = 0.0
        self.end = 0.0
        self.msg = msg
        self.owner = owner
        self.root = root
        self.result: Any = None
        # dependents that have not finished (they read ``result``), plus one for
        # whoever may still add readers, until ``TaskGraph.seal`` releases it
        self.readers = 1

    def inputs(self) -> List[Any]:
        """The dependencies' results, in dependency order."""
        return [d.result for d in self.deps]

    def run(self) -> Any:
        """Call ``fn`` on the dependencies' results; keep and return its result."""
        self.result = self.fn(*self.inputs())
        return self.result

    @property
    def queue(self) -> str:
        """"comm" for send/recv, "compute" otherwise."""
        return "comm" if self.kind in COMM_KINDS else "compute"

    @property
    def label(self) -> str:
        """Short human-readable name used in errors and the timeline."""
        extra = f" {self.info}" if self.info else ""
        return f"{self.kind}({self.grad}#{self.part}{extra})"

    def __repr__(self) -> str:
        return f"<Task {self.label} {self.state}>"


class TaskGraph:
    """The task sets and the dependency bookkeeping; thread-safe.

    Args:
        on_ready: called (outside the lock) with each task that becomes ready.
    """

    def __init__(self, on_ready: Callable[[Task], None]):
        self._on_ready = on_ready
        self._lock = threading.RLock()
        self.waiting: Dict[int, Task] = {}
        self.ready: Dict[int, Task] = {}
        self.running: Dict[int, Task] = {}
        self.done: Dict[int, Task] = {}

    def add(self, task: Task, deps: Iterable[Task] = ()) -> Task:
        """Insert ``task`` after ``deps`` (which must already be in the graph)."""
        released = False
        with self._lock:
            for d in deps:
                if d.state is TaskState.NEW:
                    raise ValueError(f"{d.label} must be added before its dependent {task.label}")
                self._link(task, d)
            if task.pending:
                task.state = TaskState.WAITING
                self.waiting[task.id] = task
            else:
                task.state = TaskState.READY
                self.ready[task.id] = task
                released = True
        if released:
            self._on_ready(task)
        return task

    @staticmethod
    def _link(task: Task, dep: Task) -> bool:
        """Record the edge ``dep`` -> ``task`` (the graph's lock held): ``dep`` gains a
        reader, and unless it is done, ``task`` one more pending dependency; True then."""
        task.deps.append(dep)
        dep.readers += 1
        if dep.state is TaskState.DONE:
            return False
        dep.dependents.append(task)
        task.pending += 1
        return True

    def add_dependency(self, task: Task, dep: Task) -> None:
        """Make waiting ``task`` also wait for ``dep``; raise ``CycleError`` on a cycle."""
        with self._lock:
            path = self._path(dep, task)
            if path is not None:
                raise CycleError([task] + path)
            if task.state not in (TaskState.WAITING, TaskState.READY):
                raise ValueError(f"cannot add a dependency to {task.label} in state {task.state}")
            if self._link(task, dep) and task.state is TaskState.READY:
                del self.ready[task.id]
                task.state = TaskState.WAITING
                self.waiting[task.id] = task

    @staticmethod
    def _path(src: Task, dst: Task) -> Optional[List[Task]]:
        """A dependency path src -> ... -> dst following ``deps`` edges, if any."""
        stack = [(src, [src])]
        seen = set()
        while stack:
            t, p = stack.pop()
            if t is dst:
                return p
            if t.id in seen:
                continue
            seen.add(t.id)
            stack.extend((d, p + [d]) for d in t.deps)
        return None

    def start(self, task: Task) -> None:
        """Move ``task`` from ready to running and stamp its start time."""
        with self._lock:
            if task.state is not TaskState.READY:
                raise RuntimeError(f"{task.label} started in state {task.state}")
            del self.ready[task.id]
            task.state = TaskState.RUNNING
            self.running[task.id] = task
            task.start = time.perf_counter()

    def finish(self, task: Task) -> None:
        """Mark ``task`` done and release dependents whose last dependency it was.

        Mutates: the four state sets, ``task.state``/``end``, each
        dependent's ``pending`` count, and each dependency's ``readers``
        count (a result nobody will read again is dropped). Newly ready
        tasks go to ``on_ready``.
        """
        released: List[Task] = []
        with self._lock:
            if task.state is TaskState.RUNNING:
                del self.running[task.id]
            elif task.state is TaskState.READY:  # comm tasks may finish without a start
                del self.ready[task.id]
                task.start = task.start or time.perf_counter()
            else:
                raise RuntimeError(f"{task.label} finished in state {task.state}")
            task.state = TaskState.DONE
            task.end = time.perf_counter()
            self.done[task.id] = task
            for t in task.dependents:
                t.pending -= 1
                if t.pending == 0:
                    del self.waiting[t.id]
                    t.state = TaskState.READY
                    self.ready[t.id] = t
                    released.append(t)
            task.dependents = []
            for d in task.deps:
                d.readers -= 1
                if d.readers == 0:  # done, and sealed: nobody reads it again
                    d.result = None
        for t in released:
            self._on_ready(t)

    def seal(self, tasks: Iterable[Task]) -> None:
        """No more tasks will read these tasks' results than are in the graph now:
        release the builder's hold, dropping results nobody will read again.

        Mutates: each task's ``readers`` (and ``result``, once it is 0 and the
        task is done)."""
        with self._lock:
            for t in tasks:
                t.readers -= 1
                if t.readers == 0 and t.state is TaskState.DONE:
                    t.result = None

    def outstanding(self) -> int:
        """Number of tasks not done."""
        with self._lock:
            return len(self.waiting) + len(self.ready) + len(self.running)

    def check_progress(self) -> None:
        """Raise ``DeadlockError`` if tasks wait but nothing is ready or running."""
        with self._lock:
            if self.waiting and not self.ready and not self.running:
                t = next(iter(self.waiting.values()))
                path = [t]
                while True:
                    blockers = [d for d in t.deps if d.state is not TaskState.DONE]
                    if not blockers or blockers[0] in path:
                        break
                    t = blockers[0]
                    path.append(t)
                raise DeadlockError(path, f"{len(self.waiting)} task(s) waiting, none runnable")

    def clear_done(self) -> List[Task]:
        """Drop finished tasks (end of a step) and return them for the timeline."""
        with self._lock:
            done = list(self.done.values())
            self.done.clear()
            return done
