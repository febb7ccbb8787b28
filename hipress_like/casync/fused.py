"""Fused allreduce buckets: reducing several tensors with one call, and what follows it.

Shared by the coordinated rounds (``rounds.py``) and the replayed schedule
(``replay.py``), so that a bucket is summed and finished the same way on
either path (and gives the same bits). ``run_named`` runs the solo
collective of a gradient whose decision names its collective
(``layout.Layout.algos``): a ring or tree sum, a broadcast, a gather.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from .collectives import allreduce_by, bruck_allgather, tree_broadcast
from .tasks import Task
from .timeline import Event
from .transport.base import Transport

if TYPE_CHECKING:
    from .context import StepContext

__all__ = ["reduce_fused", "scatter", "finish_bucket", "run_named"]


def scatter(flat: torch.Tensor, xs: List[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into the tensors it concatenates."""
    off = 0
    for x in xs:
        x.copy_(flat[off: off + x.numel()].view_as(x))
        off += x.numel()


def reduce_fused(xs: List[torch.Tensor], channel: Transport, timeout: float,
                 op: str = "sum") -> None:
    """Reduce ``xs`` (one dtype) across ranks with one allreduce (``op``: sum or
    max), in place."""
    flat = xs[0] if len(xs) == 1 else torch.cat(xs)
    channel.allreduce(flat, op, timeout)
    if len(xs) > 1:
        scatter(flat, xs)


def run_named(x: torch.Tensor, channel: Transport, timeout: float, op: str,
              algo: str, root: Optional[int] = None) -> Any:
    """Run one named collective (``op``: sum, max, broadcast, gather; ``algo``: the
    layout's algorithm; ``root``: a broadcast's source rank) on ``x``; return the
    task's new result (the filled broadcast buffer, or the gathered payloads), or
    None when ``x`` was a view reduced in place (the task's result is then its
    payload, as for a bucket)."""
    if op == "gather":
        return bruck_allgather(channel, x, timeout)
    if op == "broadcast":
        if root is None:
            raise ValueError("a broadcast collective needs its root rank; found none "
                             "(pass root= to StepBuilder.collective)")
        if algo == "backend":
            channel.broadcast(x, root, timeout)
        else:
            tree_broadcast(channel, x, root, timeout)
        return x
    if op == "sum" and algo in ("ring", "tree"):
        allreduce_by(algo, channel, x, timeout)
    else:
        channel.allreduce(x, op, timeout)
    return None


def finish_bucket(ctx: "StepContext", tasks: List[Task], t0: float, nbytes: int,
                  result: Any = None) -> None:
    """After a bucket's allreduce: a static lane bucket writes its means (``lane.py``),
    a summed payload (PowerSGD's P or Q) goes on to its next task as it is (the
    allreduce task's result is its input, now summed); a named collective's task
    takes ``result`` (``run_named``)."""
    lanes = ctx.layout.lane_by_key
    grads = 0
    for t in tasks:
        lane = lanes.get(t.msg[0])
        if lane is not None:
            lane.write_mean(ctx.size)
            grads += len(lane.arrived)
        elif result is not None:
            t.result = result
            grads += 1
        else:
            t.result = t.deps[0].result if t.deps else None
            grads += 1
        ctx.graph.finish(t)
    # the event's "part" counts the gradients the fused allreduce carried
    ctx.timeline.add(Event("bucket", "", grads, t0, time.perf_counter(), nbytes,
                           "comm", ctx.st.index))
