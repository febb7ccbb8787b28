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

Any failure becomes the step's error (the context's ``fail`` callback), which
the next round reports to every peer.

The manager sees the engine only through its ``StepContext`` (``context.py``):
the lock, the current step state, the graph, the layout view and ``fail``.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .executors import Executor
from .tasks import Kind, Task

if TYPE_CHECKING:
    from .context import StepContext

__all__ = ["TaskManager"]

_log = logging.getLogger(__name__)


class TaskManager:
    """Dispatches ready tasks (see the module docstring).

    Args:
        ctx: the engine's step context.
        executor: the computing executor (``executors.py``).
    """

    def __init__(self, ctx: "StepContext", executor: Executor):
        self.ctx = ctx
        self.executor = executor

    def on_ready(self, task: Task) -> None:
        """A task's inputs are done: route it (see the module docstring)."""
        c = self.ctx
        if task.kind is Kind.RECV:
            key = task.msg[0]
            with c.cv:
                buf = c.st.early.pop(key, None)
                if buf is None:
                    c.st.expect[key] = task
            if buf is not None:
                self._deliver_to(task, buf)
            return
        if task.kind not in (Kind.SEND, Kind.ALLREDUCE):
            self.executor.submit(lambda: self.run(task))
            return
        try:
            x = task.fn(*task.inputs())
            # a broadcast's owner is known once its payload exists (``Task.root``)
            root = task.root() if task.root is not None else None
        except BaseException as err:  # a misaligned payload, or a bug in a workflow
            c.fail(err, self.grad_index(task))
            return
        key, dst = task.msg
        with c.cv:
            if task.kind is Kind.SEND:
                task.nbytes = x.numel()
                c.st.outbox[(key, dst)] = (x, task)
            else:
                task.nbytes = x.numel() * x.element_size()
                c.st.collective[key] = (task, x)
                if root is not None:
                    c.st.roots[key] = root
            c.st.unreported.append((key, dst, task.nbytes))
            c.cv.notify_all()

    def grad_index(self, task: Task) -> int:
        """The registration index of the task's gradient (-1 for a lane bucket)."""
        return self.ctx.layout.grad_index(task.grad)

    def run(self, task: Task) -> None:
        """Run a compute task on the executor; on success release its dependents."""
        c = self.ctx
        if c.error is not None:
            return
        try:
            c.graph.start(task)
            task.run()
        except BaseException as err:
            _log.error("rank %d: task %s failed: %s", c.rank, task.label, err)
            c.fail(err, self.grad_index(task))
            return
        c.graph.finish(task)
        if task.owner is not None:
            task.owner.release()

    def deliver(self, key: int, buf: torch.Tensor) -> None:
        """Message ``key`` arrived: finish its recv task, or keep it until the task is ready."""
        c = self.ctx
        with c.cv:
            task = c.st.expect.pop(key, None)
            if task is None:
                c.st.early[key] = buf
                return
        self._deliver_to(task, buf)

    def _deliver_to(self, task: Task, buf: torch.Tensor) -> None:
        task.nbytes = buf.numel()
        task.result = buf
        self.ctx.graph.finish(task)
