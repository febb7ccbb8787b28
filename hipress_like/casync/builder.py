"""``StepBuilder``: the interface through which a workflow adds one gradient's tasks.

A workflow (``workflows.py``) never touches the task graph, the step's
containers or handles; it calls four methods, each returning the ``Task``
it added, and passes tasks as the inputs of later ones, so the data each
task produces travels with it (``Task.run``):

    compute(kind, part, fn, inputs)   fn(*results of inputs) -> result
    send(part, phase, dst, payload)   sends ``payload.result`` to rank dst
    recv(part, phase, src)            result: the bytes received from src
    collective(payload, phase, view, op, root)  reduces ``view(payload.result)``
                                      in place across ranks (or broadcasts it
                                      from ``root()``, or gathers it); result:
                                      the payload, or the broadcast buffer, or
                                      every rank's payload in rank order

Message keys (``layout.msg_key``) come from the gradient's index, the
partition, the phase and the sender, so every rank names a message alike.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional

from .coordinator import COLLECTIVE
from .layout import GradLayout, msg_key
from .step import Handle, StepState
from .tasks import Kind, Task, TaskGraph

__all__ = ["StepBuilder"]


class StepBuilder:
    """Adds one gradient's tasks to the step's graph.

    Args:
        graph: the engine's task graph.
        step: the current step (collective keys are recorded in it).
        grad: the gradient's layout entry.
        handle: completed by the gradient's ``write`` tasks.
        rank, size: this rank and the world size.
    """

    def __init__(self, graph: TaskGraph, step: StepState, grad: GradLayout, handle: Handle,
                 rank: int, size: int):
        self._graph = graph
        self._step = step
        self.grad = grad
        self._handle = handle
        self._added: List[Task] = []
        self.rank, self.size = rank, size

    def _add(self, t: Task, inputs: Iterable[Task]) -> Task:
        self._added.append(t)
        return self._graph.add(t, inputs)

    def seal(self) -> None:
        """The gradient's tasks are all added: results may be dropped after their
        last reader (``TaskGraph.seal``)."""
        self._graph.seal(self._added)
        self._added = []

    def compute(self, kind: Kind, p: int, fn: Callable[..., Any],
                inputs: Iterable[Task] = ()) -> Task:
        """Add a compute task (encode, decode, merge, write) reading ``inputs``."""
        write = kind == Kind.WRITE
        t = Task(kind, self.grad.name, p, fn, owner=self._handle if write else None)
        if write:
            self._handle.hold()
        return self._add(t, inputs)

    def send(self, p: int, phase: int, dst: int, payload: Task) -> Task:
        """Add a send of ``payload``'s result to rank ``dst``."""
        t = Task(Kind.SEND, self.grad.name, p, _identity, info=f"->{dst} ph{phase}",
                 msg=(msg_key(self.grad.idx, p, phase, self.rank), dst))
        return self._add(t, [payload])

    def recv(self, p: int, phase: int, src: int) -> Task:
        """Add a receive from ``src``; its result is the received bytes."""
        t = Task(Kind.RECV, self.grad.name, p, None, info=f"<-{src} ph{phase}",
                 msg=(msg_key(self.grad.idx, p, phase, src), src))
        return self._add(t, ())

    def collective(self, payload: Task, phase: int,
                   view: Optional[Callable[[Any], Any]] = None, op: str = "sum",
                   root: Optional[Callable[[], int]] = None) -> Task:
        """Add a collective-lane task: ``view(payload.result)`` (the payload itself by
        default) is reduced in place (``op``: "sum" or "max"; the layout's
        ``ops`` must say the same) by a fused allreduce once every rank has it
        ready; the task's result is then the payload, now merged (e.g. PowerSGD's
        P). Whole uncompressed gradients take the lane's static buckets instead
        (``lane.py``).

        ``op`` "broadcast": ``view`` returns the buffer every rank holds (the
        owner's payload, a buffer of its size elsewhere), ``root()`` names the
        owner once the payload exists, and the result is the buffer, filled.
        ``op`` "gather": the result is every rank's payload, in rank order.
        The layout's ``ops`` and ``algos`` must say the same."""
        key = msg_key(self.grad.idx, 0, phase, 0)
        t = Task(Kind.ALLREDUCE, self.grad.name, 0, view or _identity, info=op,
                 msg=(key, COLLECTIVE), root=root)
        self._step.coll_keys.add(key)
        return self._add(t, [payload])


def _identity(x: Any) -> Any:
    return x
