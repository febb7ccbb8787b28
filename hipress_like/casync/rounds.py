"""Coordinated rounds: one step's communication when nothing can be replayed.

The loop (``Rounds.step``, on the engine's communication thread) repeats
three steps, one method each:

1. ``_report``: report this rank's new sends and collectives, its flags (closed, error,
   non-finite) and its outstanding task count (``coordinator.Report``), in
   one allgather on the engine's transport;
2. ``_plan``: every rank runs the same deterministic ``Coordinator`` on the same
   reports (HiPress Sec. 3.2 without a special node): the round's links and
   batches, and the fused allreduce buckets that every rank has ready;
3. ``_execute``: hand the round to the round executor (its own thread and data channel,
   so round r+1 is planned while round r moves: ``pipeline``), or run it
   inline without a data channel: buckets first (``fused.py``), then one
   ``alltoallv`` for the links (``_exchange``), finishing their tasks.

The step ends in the same round on every rank: when all have closed, no
message is queued and no task is outstanding anywhere. A peer's error flag
becomes an ``EngineError`` naming it; differing submitted sets become a
``GradientMismatchError``.

``Rounds`` sees the engine only through its ``StepContext`` (``context.py``):
the lock, the step state, the graph, the layout view, the transport and
data channel, and the ``fail`` and ``deliver`` callbacks.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import msgpack
import torch

from ..compressors.payload import pad8
from .coordinator import (
    FLAG_CLOSED,
    FLAG_ERROR,
    FLAG_NONFINITE,
    Coordinator,
    Report,
    decode_report,
    encode_report,
)
from .errors import ConfigMismatchError, EngineError, GradientMismatchError, PeerFailureError
from .fused import finish_bucket, reduce_fused, run_named
from .layout import split_key
from .replay import dtype_groups, op_of
from .tasks import DeadlockError, Task, TaskState
from .timeline import Event
from .transport.base import Transport, TransportError
from .wire import frame, frame_nbytes, unframe

if TYPE_CHECKING:
    from .context import StepContext

__all__ = ["Rounds", "tell_peers"]

_log = logging.getLogger(__name__)


def _shape_tag(plan: Any) -> str:
    """A name of the round's exchange shape (each link's bytes), equal on every rank:
    a transport that matches calls by name reuses the set-up of an equal exchange."""
    links = sorted((s, d, sum(pad8(nb) for _, nb in msgs)) for (s, d), msgs in
                   plan.links.items())
    return hashlib.blake2b(repr(links).encode(), digest_size=8).hexdigest()


@dataclass
class _Pace:
    """How the metadata loop paces itself: whether the next report waits (and for
    how many idle rounds it has backed off), and when work last moved."""

    idle: bool = False
    idle_rounds: int = 0
    last_progress: float = field(default_factory=time.monotonic)


# Errors a rank learned from its peers, or that every rank finds alike from the same
# reports: telling the peers again would blame this rank for them.
_NOT_OURS = (TransportError, PeerFailureError, GradientMismatchError, ConfigMismatchError,
             DeadlockError)


def tell_peers(ctx: "StepContext", err: BaseException) -> None:
    """An error arose on this rank inside its communication: abort the transport
    (``Transport.abort``), so that peers blocked waiting for this rank raise at
    once, naming it and ``err``, instead of at their timeout. Errors learned from
    peers, and those every rank finds alike, are not told (``_NOT_OURS``).
    Once told, ``ctx.told`` is set: this rank then skips the metadata round that
    would report its error (peers that raised at the abort never join it)."""
    if isinstance(err, _NOT_OURS) or not isinstance(err, Exception):
        return
    try:
        told = ctx.transport.abort(f"{type(err).__name__}: {err}")
    except Exception as e:  # telling is best effort: the error itself is raised anyway
        _log.debug("rank %d: could not tell the peers: %s", ctx.rank, e)
        return
    if told:
        with ctx.cv:
            ctx.told = True


def _all_closed(reports: List[Report]) -> bool:
    return all(r.flags & FLAG_CLOSED for r in reports)


class Rounds:
    """The coordinated communication of a step context, and its round executor thread.

    Args:
        ctx: the engine's step context; with a data channel (``ctx.data``, from
            ``transport.split()``) rounds run on a round executor thread, without
            one inline.
    """

    def __init__(self, ctx: "StepContext"):
        self.ctx = ctx
        self.data = ctx.data
        self.record: Optional[List[List[Tuple[int, int, torch.dtype]]]] = None
        self._busy = 0  # rounds handed over and not finished (guarded by ctx.cv)
        self._thread: Optional[threading.Thread] = None
        if self.data is not None:
            self._q: "queue.Queue" = queue.Queue(maxsize=1)  # plan one round ahead
            self._thread = threading.Thread(target=self._main, daemon=True,
                                            name=f"hipress-rounds-{ctx.rank}")
            self._thread.start()

    # -- the metadata loop ---------------------------------------------------
    def step(self) -> bool:
        """Run coordinated bulk rounds until the step is complete on every rank.

        Returns: whether the step is skipped (NaN/Inf with ``nonfinite="skip"``).
        """
        c = self.ctx
        coord = Coordinator(c.size, c.config.batch_bytes, matching=c.config.matching,
                            batching=c.config.coordinator, fusion_bytes=c.config.fusion_bytes,
                            solo=set(c.layout.lane_by_key) | c.layout.solo,
                            groups=c.layout.groups)
        pace = _Pace()
        while True:
            reports, closed_here, t0 = self._report(coord, pace)
            plan, last = self._plan(coord, reports)
            if last:
                self._last_round(plan, t0)  # lets the executor finish its bookkeeping
                return any(r.flags & FLAG_NONFINITE for r in reports)
            self._execute(coord, plan, reports, closed_here, t0, pace)

    def _report(self, coord: Coordinator, pace: _Pace) -> Tuple[List[Report], bool, float]:
        """Wait while idle (backing off) for work worth a round, then allgather this
        rank's report and hand every rank's to ``coord``.

        Returns:
            The reports (rank order), whether this rank had sealed its step when
            it reported, and the round's start (``perf_counter``).

        Raises:
            EngineError: some rank reported an error (this rank's own is re-raised).
        """
        c, cfg = self.ctx, self.ctx.config
        if c.told and c.error is not None:  # the peers know already (``tell_peers``)
            raise c.error
        with c.cv:
            st = c.st
            wait = min(cfg.idle_wait * (1 << min(pace.idle_rounds, 20)), cfg.idle_wait_max)
            deadline = time.monotonic() + (wait if pace.idle else 0.0)
            while (pace.idle and not c.sealed and c.error is None
                   and st.unreported_bytes() < cfg.batch_bytes):
                rest = deadline - time.monotonic()
                if rest <= 0:
                    break
                c.cv.wait(rest)
            msgs = st.unreported[: cfg.report_capacity]
            del st.unreported[: cfg.report_capacity]
            closed_here = c.sealed
            flags = (FLAG_CLOSED if closed_here else 0) | \
                (FLAG_ERROR if c.error is not None else 0) | \
                (FLAG_NONFINITE if st.nonfinite else 0)
            rep = Report(flags=flags, outstanding=self._unplanned_outstanding(),
                         error_arg=c.error_arg, digest=st.digest, msgs=msgs)
        t0 = time.perf_counter()
        got = c.transport.allgather(encode_report(rep, cfg.report_capacity), cfg.timeout)
        reports = [decode_report(t) for t in got]
        self._check_peer_errors(reports)
        coord.add_reports(reports)
        return reports, closed_here, t0

    def _plan(self, coord: Coordinator, reports: List[Report]) -> Tuple[Any, bool]:
        """The round every rank plans alike from the same reports.

        Returns:
            (plan, last): the round's plan (None when nothing is left), and
            whether it is the step's last round on every rank.

        Raises:
            GradientMismatchError: every rank has sealed, with differing submissions.
        """
        closed = _all_closed(reports)
        if closed and len({r.digest for r in reports}) > 1:
            self._submitted_mismatch()
        if closed and coord.empty() and all(r.outstanding == 0 for r in reports):
            return None, True
        plan = coord.plan_round(final=closed)
        if plan.buckets:
            c = self.ctx
            with c.cv:
                c.st.planned.extend(c.st.collective[key][0]
                                    for b in plan.buckets for key, _ in b)
        if closed and plan.buckets and not plan.links and coord.empty():
            # Every rank has closed, and every task still outstanding on every
            # rank (collectives of earlier rounds aside) is a collective of
            # this round: once the rounds run, the step is complete
            # everywhere, so the closing metadata round is skipped.
            nkeys = sum(len(b) for b in plan.buckets)
            if all(r.outstanding == nkeys for r in reports):
                return plan, True
        return plan, False

    def _execute(self, coord: Coordinator, plan: Any, reports: List[Report],
                 closed_here: bool, t0: float, pace: _Pace) -> None:
        """Run the round (inline, or on the round executor), then decide how the
        next report is paced.

        Raises:
            DeadlockError: every rank has sealed and nothing moved for ``timeout``.
        """
        c, cfg = self.ctx, self.ctx.config
        closed = _all_closed(reports)
        moved = bool(plan.links or plan.buckets) or any(r.msgs for r in reports)
        if plan.links or plan.buckets:
            if self.data is None:
                self.run_round(plan, t0, c.transport)
            else:
                self._hand_over(("round", plan))
                # A held tail of collectives after this rank closed flushes as soon
                # as every rank has closed: keep the metadata rounds going for it.
                if not coord.links_pending() and not (coord.held() and closed_here):
                    # No queued link message to plan ahead: let the round run
                    # alone instead of polling peers with metadata rounds that
                    # compete for the cores (with more ranks than cores, polling
                    # alongside slows the fused allreduces). Work that
                    # arrives meanwhile is reported, and batched, right after.
                    self._wait_idle(closed_here)
        now = time.monotonic()
        if moved:
            pace.last_progress = now
        elif closed and now - pace.last_progress > cfg.timeout:
            c.graph.check_progress()
            raise DeadlockError([], f"no progress for {cfg.timeout:.0f} s with every rank "
                                    "closed; outstanding tasks per rank: "
                                    f"{[r.outstanding for r in reports]}")
        # A round that only held arriving collectives waits the base idle
        # time (or until a batch of new work is reported) before the next,
        # so the held bucket grows instead of paying a metadata round per
        # arriving gradient.
        held = coord.held() and not plan.links
        pace.idle = not moved or held
        pace.idle_rounds = pace.idle_rounds + 1 if not moved else 0

    def _unplanned_outstanding(self) -> int:
        """Tasks not done, less the collectives already planned into a round (they
        complete without further coordination). Call with the context's lock held.

        The graph is read first: a planned collective finishing in between is then
        counted, not missed, so the figure can only be too high (one more
        metadata round), never too low."""
        st = self.ctx.st
        n = self.ctx.graph.outstanding()
        st.planned = [t for t in st.planned if t.state is not TaskState.DONE]
        return n - len(st.planned)

    def _check_peer_errors(self, reports: List[Report]) -> None:
        c = self.ctx
        bad = [(r, rep) for r, rep in enumerate(reports) if rep.flags & FLAG_ERROR]
        if not bad:
            return
        if c.error is not None:
            raise c.error
        names = c.layout.names
        parts = [f"rank {r}" + (f" (gradient {names[rep.error_arg]!r})"
                                if rep.error_arg in names else "") for r, rep in bad]
        raise PeerFailureError(f"synchronisation aborted: an error occurred on "
                               f"{', '.join(parts)}; see that rank's log for the cause",
                               ranks=[r for r, _ in bad])

    def _submitted_mismatch(self) -> None:
        c = self.ctx
        mine = msgpack.packb(sorted(c.st.submitted))
        lists = [set(msgpack.unpackb(b)) for b in
                 c.transport.allgather_bytes(mine, c.config.timeout)]
        union = set().union(*lists)
        missing = {r: sorted(union - s)[:5] for r, s in enumerate(lists) if union - s}
        desc = "; ".join(f"rank {r} did not submit {m}" for r, m in missing.items())
        raise GradientMismatchError(
            f"ranks submitted different gradients in step {c.st.index}: {desc}. Every rank "
            "must submit the same gradients each step (submit zeros for unused parameters)")

    # -- the round executor ----------------------------------------------------
    def _last_round(self, plan: Any, t0: float) -> None:
        """Run the step's last round (``plan``, or none), then wait until the round
        executor has finished every round handed to it."""
        if self.data is None:
            if plan is not None:
                self.run_round(plan, t0, self.ctx.transport)
            return
        if plan is not None:
            self._hand_over(("round", plan))
        fence = threading.Event()
        self._hand_over(("fence", fence))
        fence.wait(self.ctx.config.timeout)

    def _wait_idle(self, reported_closed: bool) -> None:
        """Block until the round executor has finished every handed-over round, or
        until this rank has news worth one metadata round: it sealed its step since
        its last report (the planner can then flush every remaining bucket behind
        the running one), or it has a full fusion bucket of newly ready work."""
        c = self.ctx
        deadline = time.monotonic() + c.config.timeout
        with c.cv:
            while self._busy and c.error is None:
                if time.monotonic() > deadline:
                    return  # the executor's own transport timeout reports the failure
                if (c.sealed and not reported_closed) or \
                        c.st.unreported_bytes() >= c.config.fusion_bytes:
                    return
                c.cv.wait(0.05)

    def _hand_over(self, item: Tuple[str, Any]) -> None:
        """Queue work for the round executor; at most one round waits (backpressure)."""
        c = self.ctx
        if item[0] == "round":
            with c.cv:
                self._busy += 1
        while True:
            try:
                self._q.put(item, timeout=0.05)
                return
            except queue.Full:
                if c.error is not None:
                    raise c.error from None

    def _main(self) -> None:
        """The round executor: runs planned rounds in order on the data channel."""
        c = self.ctx
        while True:
            item = self._q.get()
            if item is None:
                return
            kind, arg = item
            if kind == "fence":
                arg.set()
            else:
                if c.error is None:
                    try:
                        self.run_round(arg, time.perf_counter(), self.data)
                    except BaseException as err:
                        tell_peers(c, err)
                        c.fail(err, -1)
                with c.cv:
                    self._busy -= 1
                    c.cv.notify_all()

    def close(self) -> None:
        """Stop the round executor thread."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5)

    # -- executing a round -----------------------------------------------------
    def run_round(self, plan: Any, t0: float, channel: Transport) -> None:
        """Run a planned round: its buckets, then its links' exchange."""
        if plan.buckets:
            self._run_buckets(plan.buckets, channel)
        if plan.links:
            self._exchange(plan, time.perf_counter() if plan.buckets else t0, channel)

    def _run_buckets(self, buckets: Any, channel: Transport) -> None:
        """The collective lane: one fused allreduce per bucket, dtype and op; a
        static bucket of whole gradients then writes their means (``lane.py``), a
        summed payload (PowerSGD's P or Q) goes on to its next task as it is.

        Every rank runs the same buckets in the same order (the replicated
        coordinator planned them), so the allreduce calls match up.
        """
        c = self.ctx
        lay = c.layout
        for bucket in buckets:
            t0 = time.perf_counter()
            with c.cv:
                items = [c.st.collective.pop(key) for key, _ in bucket]
                root = c.st.roots.get(bucket[0][0])
            if len(bucket) == 1 and bucket[0][0] in lay.solo:
                key = bucket[0][0]
                (task, x), = items
                out = run_named(x, channel, c.config.timeout, op_of(key, lay.ops),
                                lay.algos.get(key, "backend"), root)
                finish_bucket(c, [task], t0, bucket[0][1], result=out)
                continue
            members = [(key, x.numel(), x.dtype) for (key, _), (_, x) in zip(bucket, items)]
            if self.record is not None:
                self.record.append(members)
            xs = {key: x for (key, _), (_, x) in zip(bucket, items)}
            for _, group in dtype_groups(members, lay.ops):
                reduce_fused([xs[k] for k, _, _ in group], channel, c.config.timeout,
                             op_of(group[0][0], lay.ops))
            finish_bucket(c, [t for t, _ in items], t0, sum(nb for _, nb in bucket))

    def _exchange(self, plan: Any, t0: float, channel: Transport) -> None:
        """One bulk ``alltoallv`` moving every link's batch of the round, each link's
        message framed (``wire.py``: header, length, checksums) and checked on arrival.

        Raises:
            WireError: a message arrived damaged or not as the plan expects (names
                its sender and, for a failed checksum, the payload).
            EngineError: a message arrived with another length than the plan's.
        """
        c = self.ctx
        me, n = c.rank, c.size
        check = c.config.wire_check
        send: List[Optional[torch.Tensor]] = [None] * n
        recv_nbytes = [0] * n
        sent_tasks: List[Task] = []
        with c.cv:
            outgoing = {d: [c.st.outbox.pop((k, d)) for k, _ in msgs]
                        for d, msgs in plan.sends_of(me).items()}
            step = c.st.index
        total = 0
        for dst, items in outgoing.items():
            send[dst] = frame([p for p, _ in items], me, dst, step, check)
            total += send[dst].numel()
            sent_tasks.extend(t for _, t in items)
        recvs = plan.recvs_of(me)
        for src, msgs in recvs.items():
            recv_nbytes[src] = frame_nbytes([nb for _, nb in msgs], check)
        out = channel.alltoallv(send, recv_nbytes, c.config.timeout, tag=_shape_tag(plan))
        for t in sent_tasks:
            c.graph.finish(t)
        for src, msgs in recvs.items():
            buf = out[src]
            if buf is None or buf.numel() != recv_nbytes[src]:
                raise EngineError(f"rank {src} sent {0 if buf is None else buf.numel()} bytes, "
                                  f"expected {recv_nbytes[src]}", ranks=[src])
            keys = [key for key, _ in msgs]
            views = unframe(buf, [nb for _, nb in msgs], src=src, dst=me, step=step,
                            label=lambda i, keys=keys: self._label(keys[i]))
            for key, view in zip(keys, views):
                if view.device != c.device:  # gloo receives on the CPU; the gradients' device
                    view = view.to(c.device)
                c.deliver(key, view)
        c.timeline.add(Event("round", "", len(plan.links), t0, time.perf_counter(),
                             total + sum(recv_nbytes), "comm", c.st.index))

    def _label(self, key: int) -> str:
        """A message key in words: its gradient's name, partition and phase."""
        g, p, phase, _ = split_key(key)
        name = self.ctx.layout.names.get(g, f"#{g}")
        return f"gradient {name!r} partition {p}" + (f" phase {phase}" if phase else "")
