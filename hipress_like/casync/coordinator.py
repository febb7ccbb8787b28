"""The global coordinator for compression-aware bulk synchronisation (HiPress Sec. 3.2, Fig. 3).

Nodes report the metadata of their pending sends (message key, destination,
bytes). The coordinator keeps one FIFO queue per link (src, dst), selects a
set of non-conflicting links for the next round (each node sends to at most
one peer and receives from at most one, so no uplink or downlink is shared),
batches each selected link's messages up to ``batch_bytes``, and every node
executes the round as one bulk exchange (an all-to-all with per-peer sizes).

Uncompressed gradients can take a *collective lane* instead of links: a rank
reports such a gradient as ready with destination ``COLLECTIVE`` (-1); once
every rank has reported it, the planner puts it in the round's fused
allreduce buckets (ready order, then key; a bucket closes once it holds
``fusion_bytes``, DDP's rule), as Horovod's coordinator fuses the tensors
all ranks have ready. A collective that belongs to a static *group* (the
summed round payloads of several gradients, ``layout.py``) waits until
every member of its group is ready or declared absent on every rank, and
the group is reduced as one bucket in its fixed order, so its result never
depends on timing.

Where HiPress runs the coordinator on one node (gather metadata, plan,
broadcast the plan), here every rank runs the *same* deterministic planner on
the *same* allgathered metadata: the plans are identical by construction, no
node is special, and a round costs one metadata collective instead of a
gather plus a broadcast. ``Coordinator`` is a pure state machine (no I/O),
so it is unit-tested without any transport.

Metadata wire format, one fixed-size int64 vector per rank per round
(``encode_report``/``decode_report``): ``[flags, outstanding, error_arg,
digest, n, key_0, dst_0, nbytes_0, ...]`` padded to ``5 + 3 * capacity``
entries. ``digest`` fingerprints the set of gradients the rank submitted in
this step, so differing sets are caught when every rank has closed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["Coordinator", "Report", "RoundPlan", "encode_report", "decode_report", "report_len",
           "FLAG_CLOSED", "FLAG_ERROR", "FLAG_NONFINITE", "COLLECTIVE", "ABSENT"]

FLAG_CLOSED = 1  # the rank called synchronize(): no more submissions this step
FLAG_ERROR = 2  # the rank hit an error; peers raise too (error_arg says which gradient)
FLAG_NONFINITE = 4  # the rank saw NaN/Inf and nonfinite="skip": the step is skipped

COLLECTIVE = -1  # the destination of a message that goes through the fused allreduce lane
ABSENT = -2  # a grouped collective that will not come this step (its gradient was not submitted)

Msg = Tuple[int, int, int]  # (key, dst, nbytes)


@dataclass
class Report:
    """One rank's metadata for a round."""

    flags: int = 0
    outstanding: int = 0  # tasks not done on the reporting rank
    error_arg: int = -1  # gradient index of the error, if FLAG_ERROR
    digest: int = 0  # fingerprint of the gradients submitted this step
    msgs: List[Msg] = field(default_factory=list)


def report_len(capacity: int) -> int:
    """int64 entries of an encoded report with room for ``capacity`` messages."""
    return 5 + 3 * capacity


def encode_report(r: Report, capacity: int) -> torch.Tensor:
    """Pack a report into a fixed-size int64 tensor (at most ``capacity`` messages)."""
    if len(r.msgs) > capacity:
        raise ValueError(f"report has {len(r.msgs)} messages, capacity is {capacity}")
    out = torch.zeros(report_len(capacity), dtype=torch.int64)
    out[0], out[1], out[2], out[3], out[4] = (r.flags, r.outstanding, r.error_arg, r.digest,
                                              len(r.msgs))
    if r.msgs:
        out[5: 5 + 3 * len(r.msgs)] = torch.tensor(r.msgs, dtype=torch.int64).reshape(-1)
    return out


def decode_report(t: torch.Tensor) -> Report:
    """Inverse of ``encode_report``; validates the message count."""
    v = t.tolist()
    n = v[4]
    if n < 0 or 5 + 3 * n > len(v):
        raise ValueError(f"corrupt coordinator report: {n} messages in {len(v)} entries")
    msgs = [(v[5 + 3 * i], v[6 + 3 * i], v[7 + 3 * i]) for i in range(n)]
    return Report(flags=v[0], outstanding=v[1], error_arg=v[2], digest=v[3], msgs=msgs)


@dataclass
class RoundPlan:
    """One round: messages per link, ``links[(src, dst)] = [(key, nbytes)]``, and the
    fused allreduce buckets of the collective lane, ``buckets = [[(key, nbytes)]]``
    (every rank runs them in this order, before the links' exchange)."""

    links: Dict[Tuple[int, int], List[Tuple[int, int]]]
    buckets: List[List[Tuple[int, int]]] = field(default_factory=list)

    def sends_of(self, rank: int) -> Dict[int, List[Tuple[int, int]]]:
        """Messages ``rank`` sends, by destination."""
        return {d: m for (s, d), m in self.links.items() if s == rank}

    def recvs_of(self, rank: int) -> Dict[int, List[Tuple[int, int]]]:
        """Messages ``rank`` receives, by source."""
        return {s: m for (s, d), m in self.links.items() if d == rank}

    @property
    def nbytes(self) -> int:
        """Total bytes moved in the round."""
        return sum(b for m in self.links.values() for _, b in m)


class Coordinator:
    """Per-link queues and the round planner (replicated on every rank).

    Args:
        size: number of ranks.
        batch_bytes: most bytes batched on one link in one round (a single
            larger message still goes, alone).
        matching: select non-conflicting links (HiPress); False lets every
            link with work go in every round (a full all-to-all).
        batching: False sends one message per link per round (the
            coordinator "switched off" for comparison).
        fusion_bytes: a fused allreduce closes once it holds this many bytes.
        solo: keys of collectives that are already fused (the collective
            lane's static buckets): each is its own allreduce, never fused
            at run time, so its result does not depend on timing.
        groups: key -> the keys of its static group, in order: the group
            leaves as one bucket once each member is ready on every rank
            or reported ``ABSENT`` by every rank.
    """

    def __init__(self, size: int, batch_bytes: int = 8 << 20, matching: bool = True,
                 batching: bool = True, fusion_bytes: int = 25 << 20,
                 solo: Iterable[int] = (), groups: Optional[Mapping[int, Tuple[int, ...]]] = None):
        if size < 1:
            raise ValueError(f"size must be >= 1, found {size}")
        if batch_bytes < 1 or fusion_bytes < 1:
            raise ValueError(f"batch_bytes and fusion_bytes must be >= 1, found {batch_bytes}, "
                             f"{fusion_bytes}")
        self.size = size
        self.batch_bytes = batch_bytes
        self.fusion_bytes = fusion_bytes
        self.matching = matching
        self.batching = batching
        # collectives already fused (the lane's static buckets): each is its own allreduce
        self.solo = frozenset(solo)
        self.groups = {k: g for k, g in (groups or {}).items() if k not in self.solo}
        self._absent: Dict[int, int] = {}  # grouped key -> ranks that declared it absent
        self._grouped: Dict[int, int] = {}  # grouped key ready on every rank -> nbytes
        self._queues: Dict[Tuple[int, int], Deque[Tuple[int, int, int]]] = {}
        self._round = 0
        # collective lane: key -> [ranks that reported it, nbytes]; then ready FIFO
        self._partial: Dict[int, List[int]] = {}
        self._ready: List[Tuple[int, int, int]] = []  # (round ready, key, nbytes)
        self._arrived = False  # a collective became ready in the latest add_reports

    def add_reports(self, reports: Sequence[Report]) -> None:
        """Queue every rank's newly reported messages (rank order, report order)."""
        self._arrived = False
        for src, rep in enumerate(reports):
            for key, dst, nbytes in rep.msgs:
                if dst == ABSENT:
                    self._absent[key] = self._absent.get(key, 0) + 1
                    continue
                if dst == COLLECTIVE:
                    self._add_collective(src, key, nbytes)
                    continue
                if not (0 <= dst < self.size) or dst == src:
                    raise ValueError(f"rank {src} reported a send to invalid destination {dst}")
                self._queues.setdefault((src, dst), deque()).append((key, nbytes, self._round))
        self._round += 1

    def _add_collective(self, src: int, key: int, nbytes: int) -> None:
        entry = self._partial.setdefault(key, [0, nbytes])
        if entry[1] != nbytes:
            raise ValueError(f"rank {src} reported {nbytes} bytes for collective {key}, another "
                             f"rank {entry[1]}")
        entry[0] += 1
        if entry[0] > self.size:
            raise ValueError(f"collective {key} reported more than once by a rank")
        if entry[0] == self.size:
            del self._partial[key]
            if key in self.groups:
                self._grouped[key] = nbytes
                return
            self._ready.append((self._round, key, nbytes))
            self._arrived = True

    def empty(self) -> bool:
        """No message is queued on any link and no collective is pending."""
        return (not any(self._queues.values()) and not self._partial and not self._ready
                and not self._grouped)

    def held(self) -> bool:
        """Ready collectives are being held for fusion (see ``plan_round``)."""
        return bool(self._ready)

    def links_pending(self) -> bool:
        """Some link message is queued (a round could be planned ahead)."""
        return any(self._queues.values())

    def queued_bytes(self) -> int:
        """Bytes waiting in all link queues."""
        return sum(b for q in self._queues.values() for _, b, _ in q)

    def plan_round(self, final: bool = True) -> RoundPlan:
        """Select links and batch messages for the next round.

        ``final`` (every rank has closed its step: nothing more will come)
        flushes every ready collective. Otherwise ready collectives are held
        while they keep arriving and stay under ``fusion_bytes`` (one more
        metadata round fuses them into fewer, larger allreduces); a round in
        which none arrived flushes them, so a pause in the backward pass
        starts the reduction (Horovod's cycle does the same).

        1. Order links with work by the age of their oldest message (oldest
           first, so nothing starves), then by queued bytes (largest first).
        2. Greedily take a link if its sender is not yet sending and its
           receiver not yet receiving (with ``matching``).
        3. On each taken link, pop messages FIFO while the batch stays within
           ``batch_bytes`` (always at least one message).
        """
        cand = []
        for link, q in self._queues.items():
            if q:
                cand.append((q[0][2], -sum(b for _, b, _ in q), link))
        cand.sort()
        busy_src, busy_dst = set(), set()
        links: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
        for _, _, (s, d) in cand:
            if self.matching and (s in busy_src or d in busy_dst):
                continue
            busy_src.add(s)
            busy_dst.add(d)
            q = self._queues[(s, d)]
            key, nb, _ = q.popleft()
            batch, total = [(key, nb)], nb
            while q and self.batching and total + q[0][1] <= self.batch_bytes:
                key, nb, _ = q.popleft()
                batch.append((key, nb))
                total += nb
            links[(s, d)] = batch
        return RoundPlan(links, self._plan_buckets(final))

    def _plan_buckets(self, final: bool) -> List[List[Tuple[int, int]]]:
        """The collectives that all ranks have ready, fused into buckets.

        In ready order, then key, a bucket takes tensors until it holds at
        least ``fusion_bytes`` (DDP's ``bucket_cap_mb`` rule: buckets end just
        above the cap, so a tensor larger than it goes alone). While
        collectives keep arriving (``final`` is False and one arrived in the
        latest reports), only closed buckets leave; the open one is held for
        the next round. ``solo`` collectives come first, each alone.
        """
        ready = sorted(self._ready)
        # A solo collective leaves at once and alone, whatever else is ready:
        # fusing it with whatever happened to be ready in the same round would
        # move its elements to other offsets of the allreduce, and so change
        # their summation order (gloo reduces each chunk along the ring from
        # another rank), from run to run.
        solo = [[(key, nb)] for _, key, nb in ready if key in self.solo]
        ready = [r for r in ready if r[1] not in self.solo]
        buckets: List[List[Tuple[int, int]]] = []
        total, closed_upto, closed_items = 0, 0, 0
        for i, (_, key, nb) in enumerate(ready):
            if not buckets or not self.batching or total >= self.fusion_bytes:
                buckets.append([])
                total = 0
            buckets[-1].append((key, nb))
            total += nb
            if not self.batching or total >= self.fusion_bytes:
                closed_upto, closed_items = len(buckets), i + 1
        if not final and self.batching and self._arrived:
            buckets, self._ready = buckets[:closed_upto], ready[closed_items:]
        else:
            self._ready = []
        return solo + self._group_buckets() + buckets

    def _group_buckets(self) -> List[List[Tuple[int, int]]]:
        """Static groups whose every member is ready (or absent) on every rank, each
        one bucket in the group's order, groups in order of their first ready key."""
        out: List[List[Tuple[int, int]]] = []
        for key in sorted(self._grouped):
            if key not in self._grouped:
                continue  # taken with an earlier member's group
            group = self.groups[key]
            if all(k in self._grouped or self._absent.get(k, 0) == self.size for k in group):
                out.append([(k, self._grouped.pop(k)) for k in group if k in self._grouped])
                for k in group:
                    self._absent.pop(k, None)
        return out
