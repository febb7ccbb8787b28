"""Static fusion buckets for the collective lane (the buckets of DDP's Reducer).

Gradients the plan leaves uncompressed are averaged by the transport's
allreduce (``EngineConfig.raw_collective``). Their buckets are fixed once, at
``Engine.register``: in reverse registration order (the order backward
produces gradients, as DDP assumes), one dtype per bucket, a bucket closing
once it holds ``fusion_bytes`` (DDP's ``bucket_cap_mb`` rule: it ends just
above the cap, so a larger gradient goes alone). Each bucket owns one flat
buffer, allocated on first use and reused every step:

1. ``submit`` copies the gradient into its slot of the buffer, which is the
   only read of the gradient before its average comes back;
2. when the bucket's last member arrives (or at ``synchronize`` for a
   bucket some gradients of which were not submitted), the bucket's NaN/Inf
   check runs over the buffer the copies have just brought into cache, and
   the bucket is reported to the coordinator as one collective;
3. after the allreduce (a sum), one pass writes ``slot / N`` into each
   gradient and completes its handle (``write_mean``).

Against fusing per round what each rank reports ready, this reports and
tracks one collective per bucket instead of one per gradient (the Python
work per gradient is a copy), allocates nothing per step, and reads each
gradient once before the send instead of twice (a scan, then the copy).
Per-gradient fusion used to spend its time in ``submit`` before the first
allreduce could start (docs/design.md has the before and after of
``bench/sync.py --nets loopback --lists resnet50 --only ps+identity``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..compressors.base import all_finite
from .replay import STATUS_LEN

__all__ = ["LaneBucket", "plan_lane_buckets"]


@dataclass
class LaneBucket:
    """One static bucket: its members' slots in a persistent flat buffer.

    Attributes:
        index: position among the engine's buckets.
        dtype: the members' dtype.
        slots: gradient index -> (start, end) in the buffer, in slot order.
        numel: buffer length.
        key: the collective's message key (identical on every rank).
        arrived: this step's submitted members as (gradient index, name,
            tensor, handle), in arrival order.
        flushed: the bucket's collective was created this step.
    """

    index: int
    dtype: torch.dtype
    slots: Dict[int, Tuple[int, int]]
    numel: int
    key: int = -1
    buf: Optional[torch.Tensor] = None
    store: Optional[torch.Tensor] = None  # buf plus the status words of a replayed step
    arrived: List[Tuple[int, str, torch.Tensor, Any]] = field(default_factory=list)
    flushed: bool = False

    def slot(self, idx: int, like: torch.Tensor) -> torch.Tensor:
        """The flat view of gradient ``idx``'s slot (allocates the buffer, zeroed,
        on ``like``'s device at first use: unsubmitted slots must stay finite)."""
        if self.buf is None:
            self.store = torch.zeros(self.numel + STATUS_LEN, dtype=self.dtype,
                                     device=like.device)
            self.buf = self.store[:self.numel]
        s, e = self.slots[idx]
        return self.buf[s:e]

    def complete(self) -> bool:
        """Every member has arrived this step."""
        return len(self.arrived) == len(self.slots)

    def first_nonfinite(self) -> Optional[Tuple[int, str]]:
        """(index, name) of the first arrived member holding NaN/Inf, else None.

        A full bucket is checked in one pass over the buffer; a bucket flushed
        with members missing checks only the arrived slots."""
        assert self.buf is not None
        if self.complete() and all_finite(self.buf):
            return None
        for idx, name, _, _ in self.arrived:
            s, e = self.slots[idx]
            if not all_finite(self.buf[s:e]):
                return idx, name
        return None

    def write_mean(self, n: int) -> None:
        """After the allreduce (a sum): each arrived gradient = its slot / ``n``, in
        one pass per gradient; then complete the gradients' handles."""
        assert self.buf is not None
        for idx, _, tensor, _ in self.arrived:
            s, e = self.slots[idx]
            torch.div(self.buf[s:e].view(tensor.shape), n, out=tensor)
        for _, _, _, handle in self.arrived:
            handle.release()

    def restore(self) -> None:
        """Undo an allreduce whose result is discarded (a replayed bucket some rank
        could not run, ``replay.py``): the buffer holds the arrived gradients again."""
        assert self.buf is not None
        self.buf.zero_()
        for idx, _, tensor, _ in self.arrived:
            s, e = self.slots[idx]
            self.buf[s:e].view(tensor.shape).copy_(tensor)

    def reset(self) -> None:
        """Forget this step's arrivals (the buffer is kept)."""
        self.arrived = []
        self.flushed = False


def plan_lane_buckets(grads: Sequence[Tuple[int, int, torch.dtype]], fusion_bytes: int,
                      fuse: bool = True) -> List[LaneBucket]:
    """Static buckets for the lane's gradients.

    Args:
        grads: (gradient index, numel, dtype) in registration order.
        fusion_bytes: a bucket closes once it holds at least this many bytes.
        fuse: False gives every gradient its own bucket (the coordinator
            "switched off", for comparison).

    Returns:
        The buckets in reverse registration order of their first member.

    Example:
        >>> [sorted(b.slots) for b in plan_lane_buckets(
        ...     [(0, 10, torch.float32), (1, 10, torch.float32), (2, 10, torch.float32)], 80)]
        [[1, 2], [0]]
    """
    buckets: List[LaneBucket] = []
    open_: Dict[torch.dtype, LaneBucket] = {}
    for idx, numel, dtype in reversed(list(grads)):
        b = open_.get(dtype)
        if b is None:
            b = LaneBucket(len(buckets), dtype, {}, 0)
            buckets.append(b)
            open_[dtype] = b
        b.slots[idx] = (b.numel, b.numel + numel)
        b.numel += numel
        if not fuse or b.numel * torch.empty((), dtype=dtype).element_size() >= fusion_bytes:
            del open_[dtype]
    return buckets
