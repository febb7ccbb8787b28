"""The task manager (HiPress Sec. 3.1): where a task goes once its inputs are done.

The task graph (``tasks.py``) calls ``TaskManager.on_ready`` with each task
that becomes ready:

- ``encode``/``decode``/``merge``/``write`` run on the computing executor
  (``run``); a ``write`` completes its gradient's handle;
- a ``send`` computes its payload and waits in the step's outbox, a
  collective its tensor in the step's collectives, both reported to the
  coordinator in the next metadata round (``rounds.py``) or matched by a
  replayed schedule (``replay.py``);
- a ``recv`` waits in the step's ``expect`` until the round that carries its
  message calls ``deliver`` (or takes a message that arrived first).

Any failure becomes the engine's error (``Engine._fail``), which the next
round reports to every peer.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from .tasks import Kind, Task

__all__ = ["TaskManager"]

_log = logging.getLogger(__name__)


class TaskManager:
    """Dispatches an engine's ready tasks (its lock, step state, executor, errors).

    Args:
        eng: the engine.
        executor: the computing executor (``executors.py``).
    """

    def __init__(self, eng: Any, executor: Any):
        self.eng = eng
        self.executor = executor

    def on_ready(self, task: Task) -> None:
        """A task's inputs are done: route it (see the module docstring)."""
        e = self.eng
        if task.kind is Kind.RECV:
            key = task.msg[0]
            with e._cv:
                buf = e._st.early.pop(key, None)
                if buf is None:
                    e._st.expect[key] = task
            if buf is not None:
                self._deliver_to(task, buf)
            return
        if task.kind not in (Kind.SEND, Kind.ALLREDUCE):
            self.executor.submit(lambda: self.run(task))
            return
        try:
            x = task.fn(*task.inputs())
        except BaseException as err:  # a misaligned payload, or a bug in a workflow
            e._fail(err, self.grad_index(task))
            return
        key, dst = task.msg
        with e._cv:
            if task.kind is Kind.SEND:
                task.nbytes = x.numel()
                e._st.outbox[(key, dst)] = (x, task)
            else:
                task.nbytes = x.numel() * x.element_size()
                e._st.collective[key] = (task, x)
            e._st.unreported.append((key, dst, task.nbytes))
            e._cv.notify_all()

    def grad_index(self, task: Task) -> int:
        """The registration index of the task's gradient (-1 for a lane bucket)."""
        g = self.eng._layout.grads.get(task.grad)
        return g.idx if g is not None else -1

    def run(self, task: Task) -> None:
        """Run a compute task on the executor; on success release its dependents."""
        e = self.eng
        if e._error is not None:
            return
        try:
            e._graph.start(task)
            task.run()
        except BaseException as err:
            _log.error("rank %d: task %s failed: %s", e.rank, task.label, err)
            e._fail(err, self.grad_index(task))
            return
        e._graph.finish(task)
        if task.owner is not None:
            task.owner._release()

    def deliver(self, key: int, buf: torch.Tensor) -> None:
        """Message ``key`` arrived: finish its recv task, or keep it until the task is ready."""
        e = self.eng
        with e._cv:
            task = e._st.expect.pop(key, None)
            if task is None:
                e._st.early[key] = buf
                return
        self._deliver_to(task, buf)

    def _deliver_to(self, task: Task, buf: torch.Tensor) -> None:
        task.nbytes = buf.numel()
        task.result = buf
        self.eng._graph.finish(task)
