"""Replayed collective schedules: later steps skip the coordinator's metadata rounds.

When every gradient of a layout travels by allreduce (the uncompressed
buckets of the collective lane, and summable multi-round payloads such as
PowerSGD's P and Q), the coordinator has one job left: make every rank run
the same fused allreduces in the same order. That order is a property of
the model, not of the step. PyTorch DDP fixes its buckets after the first
iteration and from then on calls allreduce in bucket order on every rank
with no negotiation at all (its Reducer "rebuilds buckets" once, from the
order gradients arrived in). Here a coordinated step records the buckets it
ran (message keys, sizes and dtypes, in order, a ``Schedule``) and the next
steps *replay* them: each rank runs bucket i as soon as its own members of
bucket i are ready, and the transport matches the calls by order.

Why: a metadata round is one allgather, and on 4 ranks sharing 2 cores an
allgather costs ~1.5 ms of CPU per rank whatever its size (measured with
gloo, 53 or 1541 int64 per rank). The VGG-style model under Ring + PowerSGD
ran ~15 rounds per step, ~22 ms of CPU per rank of a ~230 ms step: on a
CPU-bound host that is ~10% of the wall time. Replay runs the 5 bucket
allreduces and no metadata round.

Status words. What the metadata rounds carried (an error on some rank, a
rank that skipped a step for NaN/Inf, ranks submitting different
gradients) now travels with the data: the first dtype group of every
replayed bucket carries ``STATUS_LEN`` extra elements, summed by the same
allreduce, counting the ranks that (0) hit an error, (1) cannot run the
schedule this step (a *miss*: a gradient of the schedule was not submitted,
or one outside it was, or a lane bucket flushed with members missing), and
(2) saw NaN/Inf with ``nonfinite="skip"`` (reported in the last bucket,
which waits for ``synchronize``). Counts only ever need to be non-zero to
be acted on, so any float dtype carries them. Every rank reads the same
sums, so every rank takes the same branch: on an error or a miss the bucket's
result is discarded (members are restored or were never overwritten) and the
rest of the step is coordinated as usual, whose first metadata round names
the failing rank or reports the mismatch; the next step records afresh.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Sequence, Tuple

import torch

__all__ = ["Schedule", "STATUS_LEN", "ERROR", "MISS", "SKIP", "dtype_groups", "status_tensor",
           "read_status"]

STATUS_LEN = 3
ERROR, MISS, SKIP = 0, 1, 2

Member = Tuple[int, int, torch.dtype]  # (message key, numel, dtype)


@dataclass(frozen=True)
class Schedule:
    """The fused allreduces of one coordinated step, in the order they ran.

    Attributes:
        buckets: per bucket, its members as (key, numel, dtype) in bucket order.
        keys: every member key (the step's collectives).
    """

    buckets: Tuple[Tuple[Member, ...], ...]
    keys: FrozenSet[int]

    @classmethod
    def of(cls, buckets: List[List[Member]]) -> "Schedule":
        """The schedule of the recorded ``buckets``.

        Example:
            >>> s = Schedule.of([[(7, 4, torch.float32)], [(9, 2, torch.float32)]])
            >>> len(s.buckets), sorted(s.keys)
            (2, [7, 9])
        """
        return cls(tuple(tuple(b) for b in buckets), frozenset(k for b in buckets for k, _, _ in b))



def dtype_groups(members: Sequence[Member]) -> List[Tuple[torch.dtype, List[Member]]]:
    """A bucket's members grouped by dtype: one allreduce per group, groups in order
    of first appearance and members in bucket order, coordinated or replayed alike
    (so the calls match on every rank).

    Example:
        >>> [(str(dt), [m[0] for m in ms]) for dt, ms in dtype_groups(
        ...     [(5, 3, torch.float32), (6, 2, torch.float16), (7, 1, torch.float32)])]
        [('torch.float32', [5, 7]), ('torch.float16', [6])]
    """
    out: Dict[torch.dtype, List[Member]] = {}
    for m in members:
        out.setdefault(m[2], []).append(m)
    return list(out.items())


def status_tensor(error: bool, miss: bool, skip: bool, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """This rank's ``STATUS_LEN`` status words (1 where the condition holds)."""
    return torch.tensor([float(error), float(miss), float(skip)], dtype=dtype, device=device)


def read_status(tail: torch.Tensor) -> Tuple[bool, bool, bool]:
    """(some rank erred, some rank missed, some rank skipped) from the summed words."""
    v = tail.detach().to("cpu", torch.float64).tolist()
    return v[ERROR] != 0.0, v[MISS] != 0.0, v[SKIP] != 0.0
