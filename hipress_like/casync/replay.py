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

Shared words. The last bucket's status words also carry ``SHARE_LEN`` words a
caller of the engine shares (``Engine.share``: the online planner's step
times, ``tuning/online.py``), so numbers every rank must agree on cost no
collective of their own: at a check, a separate allgather took 4-15 ms of a
70 ms step with 4 ranks on 2 cores, each hop waiting for a descheduled peer.
Word 0 counts the ranks that shared; then each value, rounded to a whole
number of ``SHARE_UNIT``, is two words (its units over and modulo
``SHARE_BASE``): integers summed in float32 or float64 are exact in any order
below 2**24, which the words of up to ``SHARE_RANKS`` ranks stay under, so
every rank reads the same sums from any transport's allreduce, as decisions
taken on them need. A bucket whose first group has a narrower dtype, a
larger world or a value past ``SHARE_MAX`` carries none.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch

from .fused import finish_bucket, reduce_fused, scatter
from .tasks import DeadlockError

if TYPE_CHECKING:
    from .context import StepContext

__all__ = ["Schedule", "Replayer", "STATUS_LEN", "ERROR", "MISS", "SKIP", "SHARE_LEN",
           "SHARE_VALUES", "SHARE_UNIT", "SHARE_MAX", "dtype_groups", "op_of",
           "status_tensor", "read_status", "read_shared"]

_log = logging.getLogger(__name__)

FLAGS_LEN = 3
ERROR, MISS, SKIP = 0, 1, 2
SHARE_VALUES = 2  # values a rank shares (``Engine.share``)
SHARE_LEN = 1 + 2 * SHARE_VALUES  # the count of ranks that shared, then two words a value
SHARE_UNIT = 1e-6  # a shared value's resolution (microseconds of a time in seconds)
SHARE_BASE = 1 << 12  # a value's whole units, high and low word: each below this
SHARE_MAX = SHARE_BASE * SHARE_BASE * SHARE_UNIT  # 16.7 s
SHARE_RANKS = 1 << 12  # the sums of up to this many ranks' words stay below 2**24
SHARE_DTYPES = (torch.float32, torch.float64)
STATUS_LEN = FLAGS_LEN + SHARE_LEN

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

    def to_list(self) -> List[List[List[Any]]]:
        """Plain data for a checkpoint: per bucket ``[key, numel, "float32"]`` members.

        A resumed run that replays the saved schedule fuses its allreduces as
        the uninterrupted run did; recording its own, the fusion would follow
        that step's timing, and with 3 or more ranks a float sum's last bits
        depend on where an element sits in the fused buffer (gloo's ring
        reduces each chunk from a different rank).
        """
        return [[[int(k), int(n), str(dt).replace("torch.", "")] for k, n, dt in b]
                for b in self.buckets]

    @classmethod
    def from_list(cls, buckets: Sequence[Sequence[Sequence[Any]]]) -> "Schedule":
        """Inverse of ``to_list``.

        Raises:
            ValueError: not a saved schedule.
        """
        try:
            return cls.of([[(int(k), int(n), getattr(torch, str(dt))) for k, n, dt in b]
                           for b in buckets])
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a saved replay schedule: {e}") from e



def dtype_groups(members: Sequence[Member], ops: Optional[Mapping[int, str]] = None
                 ) -> List[Tuple[torch.dtype, List[Member]]]:
    """A bucket's members grouped by dtype and reduction (``ops``: key -> op, "sum"
    when absent; ``op_of`` reads it back): one allreduce per group, groups in
    order of first appearance and members in bucket order, coordinated or
    replayed alike (so the calls match on every rank).

    Example:
        >>> [(str(dt), [m[0] for m in ms]) for dt, ms in dtype_groups(
        ...     [(5, 3, torch.float32), (6, 2, torch.float16), (7, 1, torch.float32)])]
        [('torch.float32', [5, 7]), ('torch.float16', [6])]
    """
    out: Dict[Tuple[torch.dtype, str], List[Member]] = {}
    for m in members:
        out.setdefault((m[2], op_of(m[0], ops)), []).append(m)
    return [(dt, ms) for (dt, _), ms in out.items()]


def op_of(key: int, ops: Optional[Mapping[int, str]]) -> str:
    """The reduction of collective ``key``: the layout's ``ops`` entry, else "sum"."""
    return ops.get(key, "sum") if ops else "sum"


def status_tensor(error: bool, miss: bool, skip: bool, dtype: torch.dtype,
                  device: torch.device,
                  share: Optional[Sequence[float]] = None) -> torch.Tensor:
    """This rank's ``STATUS_LEN`` status words: 1 where the condition holds, then the
    shared words (``Engine.share``; zeros without ``share``, or in a dtype not in
    ``SHARE_DTYPES``, or when a value is not a finite number within 0 .. ``SHARE_MAX``:
    then every rank reads None)."""
    words = [float(error), float(miss), float(skip)] + [0.0] * SHARE_LEN
    if share is not None and dtype in SHARE_DTYPES and len(share) <= SHARE_VALUES \
            and all(math.isfinite(v) and 0 <= v < SHARE_MAX for v in share):
        units = [min(round(v / SHARE_UNIT), SHARE_BASE * SHARE_BASE - 1) for v in share]
        split = [float(w) for u in units for w in divmod(u, SHARE_BASE)]
        words[FLAGS_LEN:FLAGS_LEN + 1 + len(split)] = [1.0] + split
    return torch.tensor(words, dtype=dtype, device=device)


def read_status(tail: torch.Tensor) -> Tuple[bool, bool, bool]:
    """(some rank erred, some rank missed, some rank skipped) from the summed words."""
    v = tail.detach().to("cpu", torch.float64).tolist()
    return v[ERROR] != 0.0, v[MISS] != 0.0, v[SKIP] != 0.0


def read_shared(tail: torch.Tensor, size: int) -> Optional[Tuple[float, ...]]:
    """The mean over the ``size`` ranks of each shared value, from the summed status
    words ``tail``; None when some rank shared nothing."""
    v = tail.detach().to("cpu", torch.float64).tolist()[FLAGS_LEN:]
    if v[0] != size or size > SHARE_RANKS:
        return None
    return tuple((hi * SHARE_BASE + lo) * SHARE_UNIT / size
                 for hi, lo in zip(v[1::2], v[2::2]))


class Replayer:
    """Runs a recorded ``Schedule`` over a step context (its lock, step state, layout
    view and channel; ``context.py``).

    Args:
        ctx: the engine's step context.
        channel: the transport the fused allreduces run on (the engine's data
            channel when it has one).
    """

    def __init__(self, ctx: "StepContext", channel: Any):
        self.ctx = ctx
        self.channel = channel

    def step(self, sched: Schedule) -> Optional[bool]:
        """Run ``sched``'s fused allreduces in order, with no metadata round.

        Each bucket runs once this rank's members are ready (the last one also
        waits for ``synchronize``); its first dtype group carries the status
        words that tell every rank the same thing at once.

        Returns:
            Whether the step is skipped, or None when some rank could not run
            the schedule: the bucket in hand was discarded (its members are as
            before) and the caller coordinates the rest of the step.
        """
        c = self.ctx
        last = len(sched.buckets) - 1
        skipped, shared = False, None
        for i, bucket in enumerate(sched.buckets):
            state = self._await_bucket(sched, i, i == last)
            t0 = time.perf_counter()
            with c.cv:
                items = [c.st.collective[k] for k, _, _ in bucket] if state == "ok" else []
                skip = c.st.nonfinite and i == last
                share = c.share if i == last else None
            xs = {k: x for (k, _, _), (_, x) in zip(bucket, items)}
            ops = c.layout.ops
            groups = dtype_groups(bucket, ops)
            erred, missed, skipped, shared = self._status_allreduce(
                groups[0][1], xs, (state == "error", state == "miss", skip), share)
            if erred or missed:
                _log.debug("rank %d: replay of step %d stopped at bucket %d (%s); "
                           "coordinating the rest", c.rank, c.st.index, i,
                           "an error" if erred else "other gradients")
                return None
            for _, members in groups[1:]:
                reduce_fused([xs[k] for k, _, _ in members], self.channel, c.config.timeout,
                             op_of(members[0][0], ops))
            with c.cv:
                for k in xs:
                    del c.st.collective[k]
                c.st.unreported = [m for m in c.st.unreported if m[0] not in xs]
            finish_bucket(c, [t for t, _ in items], t0,
                          sum(m[1] * m[2].itemsize for m in bucket))
        with c.cv:  # the step's shared words (``Engine.shared``)
            c.share, c.shared = None, (c.st.index, shared)
        return skipped

    def _status_allreduce(self, members: Sequence[Member], xs: Dict[int, torch.Tensor],
                          status: Tuple[bool, bool, bool],
                          share: Optional[Sequence[float]] = None
                          ) -> Tuple[bool, bool, bool, Optional[Tuple[float, ...]]]:
        """Reduce a replayed bucket's first group with this rank's ``status`` (error,
        miss, skip) and shared values ``share`` behind it; return the reduced words,
        read as flags (a sum or a max of 0/1 words is nonzero when any rank set
        one), and the shared values' means (``read_shared``; None unless the
        group is summed).

        ``xs`` maps keys to the members' tensors, empty when this rank cannot run
        the bucket (it sends zeros). A lane bucket alone is summed in place, in
        its buffer's spare room, and rebuilt if the result is discarded; other
        members are summed in a copy, written back only if the result is kept.
        """
        c = self.ctx
        dtype = members[0][2]
        total = sum(m[1] for m in members)
        lane = c.layout.lane_by_key.get(members[0][0]) if len(members) == 1 and xs else None
        if lane is not None and lane.store is not None:
            flat = lane.store
        else:
            lane = None
            dev = next(iter(xs.values())).device if xs else c.device
            flat = torch.zeros(total + STATUS_LEN, dtype=dtype, device=dev)
            if xs:
                torch.cat([xs[k] for k, _, _ in members], out=flat[:total])
        op = op_of(members[0][0], c.layout.ops)
        flat[total:] = status_tensor(*status, dtype, flat.device,
                                     share if op == "sum" else None)
        self.channel.allreduce(flat, op, c.config.timeout)
        words = read_status(flat[total:])
        if words[0] or words[1]:
            if lane is not None:
                lane.restore()
        elif xs and lane is None:
            scatter(flat, [xs[k] for k, _, _ in members])
        return words + (read_shared(flat[total:], c.size) if op == "sum" else None,)

    def _await_bucket(self, sched: Schedule, i: int, last: bool) -> str:
        """Wait until this rank can run replayed bucket ``i``: "ok" (its members are
        ready; for the last bucket, also ``synchronize`` was called), "error" (this
        rank failed) or "miss" (this rank closed a step whose gradients are not the
        schedule's: a member will never come, or a collective outside it exists)."""
        c = self.ctx
        keys = [k for k, _, _ in sched.buckets[i]]
        deadline = time.monotonic() + c.config.timeout
        with c.cv:
            while True:
                st = c.st
                if c.error is not None:
                    return "error"
                sealed = c.sealed
                if sealed and (c.layout.lane_partial() or not st.coll_keys <= sched.keys
                               or any(k not in st.coll_keys for k in keys)):
                    return "miss"
                if (sealed or not last) and all(k in st.collective for k in keys):
                    return "ok"
                if time.monotonic() > deadline:
                    raise DeadlockError([], f"replayed bucket {i} of step {st.index} not "
                                            f"ready on rank {c.rank} within "
                                            f"{c.config.timeout:.0f} s")
                c.cv.wait(0.05)
