"""Transport over torch.distributed (gloo on CPU, NCCL on GPU).

The engine's communication thread must never interleave with collectives
the user issues on the default group from the main thread, so the
transport runs on its OWN process group (``dist.new_group``, a collective
call: every rank constructs its transport at the same point). Tensors live
on the group's device (CPU for gloo, the current CUDA device for NCCL).

Bulk exchange: ``alltoallv`` posts one ``batch_isend_irecv`` of the
non-empty messages only (tag = call number, since gloo matches
point-to-point messages by tag). It measured faster than one
``dist.all_to_all_single`` with uneven splits (``bulk="a2a"``, kept for
comparison) at every message size but the smallest (docs/design.md). It also
suits CaSync's rounds, where each node sends to one peer and receives from
one: absent messages cost nothing instead of a full all-to-all.

Timeouts and naming the culprit:

1. Every collective is issued with ``async_op=True`` and waited on with
   ``work.wait(timeout)``.
2. A daemon heartbeat thread publishes, every ``heartbeat_interval``
   seconds, two counters per rank in the rendezvous store (the default
   group's TCPStore): ``hb`` (+1 each beat) and ``seq`` (how many
   collectives this rank has entered). Counters are ``store.add`` keys, so
   reading them never blocks and no clocks are compared.
3. When a wait fails (timeout or closed connection) the rank diagnoses:
   ranks that posted a ``closed`` key left on purpose; ranks whose ``hb``
   did not advance over a few intervals are dead (or frozen); ranks whose
   ``seq`` is behind ours never entered this collective (stalled). It
   raises ``PeerError`` naming them. If the store itself is unreachable,
   its host (global rank 0) is gone and the error says so.
4. The transport is then unusable: the failed collective may still be
   pending inside the backend, so later calls raise ``TransportError``.
5. A rank that fails by itself inside its communication (an exception in
   the bulk exchange, a damaged message) calls ``abort(reason)``: it posts
   the reason under an abort key in the store (shared by the channels
   ``split()`` opens). The heartbeat thread reads that key with each beat;
   on gloo, a collective is waited on by a waiter thread while the caller
   polls for an abort, so a peer blocked waiting for the failed rank raises
   ``PeerError`` naming it and its reason within about a heartbeat, not at
   its timeout. NCCL's works are polled the same way (``is_completed()``,
   from the caller: an NCCL wait does not block inside gloo's sockets).
6. A killed rank posts nothing. The survivor whose diagnosis finds it
   (item 3: no heartbeat) posts that finding under the death key;
   the other survivors, blocked on other channels or on peers that only
   reacted, read it with their next beat and raise ``PeerError`` naming the
   dead rank, instead of each waiting for a closed connection and running
   the diagnosis again. The finding is about a process, so it is posted
   once per process under a global key and read by every transport.

``store(prefix)`` hands out the same rendezvous store to protocols built on
the transport (``c10d_store``: a ``dist.PrefixStore`` over a client
connection of its own); a store call that cannot reach it raises
``PeerError`` naming its host. The waiter thread of item 5, and how it ends
at exit, is ``waiter``.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from datetime import timedelta
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .base import DEFAULT_TIMEOUT, PeerError, Transport, TransportError
from .c10d_store import C10dStore, own_store_client, post_abort, read_aborts, rendezvous_store
from .waiter import Waiter, when_idle_at_exit

__all__ = ["TorchDistTransport"]

log = logging.getLogger(__name__)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# Transports are created collectively in the same order on every rank, so
# this per-process counter gives the same store key prefix on every rank.
_instances = itertools.count()
# Every open transport of this process, for the store host's linger at exit.
_live: "weakref.WeakSet[TorchDistTransport]" = weakref.WeakSet()
# Set once a collective of this process failed (``_post_failed``).
_failed_here = threading.Event()
# After a failure, the store host (global rank 0) keeps the store up at exit
# this long at most, until each peer posted its own failure, closed, or
# stopped heartbeating: peers still diagnosing read heartbeats from that store,
# and with it gone they could only blame rank 0 (``_linger_as_store_host``).
_STORE_LINGER = 5.0
# How often a caller waiting on a collective looks for a peer's abort (the
# heartbeat thread reads the store; this only reads a field it sets).
_ABORT_POLL = 0.02
_ABORT_REASON_CHARS = 2000


class TorchDistTransport(Transport):
    """``Transport`` over a dedicated torch.distributed process group.

    Args:
        group: a process group reserved for this transport. ``None`` (the
            usual case) creates one over all ranks with ``dist.new_group``;
            that is a collective call, so every rank must construct its
            transport at the same point of the program.
        group_timeout: seconds the backend itself waits inside one
            operation (the new group's timeout); per-call timeouts shorter
            than this are enforced by ``work.wait``.
        heartbeat_interval: seconds between heartbeats in the store; a dead
            peer is named after about three intervals.
        store: the store for heartbeats; default: the default group's store.
        bulk: how ``alltoallv`` moves data: ``"p2p"`` (``batch_isend_irecv``
            of the non-empty messages; the default, measured faster on
            gloo) or ``"a2a"`` (one ``all_to_all_single``).
        abort_key: the store key peers post an abort under (``abort``);
            default: this transport's own. ``split()`` passes its parent's,
            so one abort reaches every channel of the family.

    Raises:
        TransportError: torch.distributed is not initialised.

    Example:
        >>> dist.init_process_group("gloo")          # env:// from torchrun
        >>> t = TorchDistTransport()
        >>> t.allreduce(torch.ones(3))
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *,
                 group_timeout: float = DEFAULT_TIMEOUT, heartbeat_interval: float = 0.25,
                 store: Optional[dist.Store] = None, bulk: str = "p2p",
                 abort_key: Optional[str] = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise TransportError(
                "TorchDistTransport needs an initialised default process group; call "
                "torch.distributed.init_process_group(...) first (torchrun sets the env:// "
                "variables), or use hipress_like.launch.launch.run_workers")
        if bulk not in ("p2p", "a2a"):
            raise ValueError(f"bulk must be 'p2p' or 'a2a', got {bulk!r}")
        self.bulk = bulk
        self._group_timeout = float(group_timeout)
        self.backend = str(dist.get_backend())
        self._owns_group = group is None
        if group is None:
            group = dist.new_group(timeout=timedelta(seconds=group_timeout))
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise TransportError("this process is not a member of the given group")
        self._global = [dist.get_global_rank(group, r) for r in range(self.size)]
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else torch.device("cpu"))
        self._store = store if store is not None else own_store_client()
        self._prefix = f"hipress/transport/{next(_instances)}"
        self._interval = float(heartbeat_interval)
        self._seq = 0
        self._broken: Optional[str] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._store_error: Optional[str] = None
        self._abort_key = abort_key or f"{self._prefix}/abort"
        # shared by the channels of one family (this transport and its splits)
        self._aborts = _families.setdefault(self._abort_key, _Aborts())
        self._waiter: Optional[Waiter] = None  # waits on gloo works for ``_wait``
        self._polls = self.backend == "nccl"  # the caller polls the works (``_poll``)
        # of the call in progress (``_run``): the source rank of each receive its works
        # begin with (gloo's exchange), and the index of the work whose wait failed
        self._labels: List[int] = []
        self._failed_at: Optional[int] = None
        # the collective works (not point-to-point) of the last call (``_release_at_exit``)
        self._collective_works: list = []
        self._beat()  # first heartbeat before any collective, so peers see us
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name=f"hipress-heartbeat-r{self.rank}")
        self._hb_thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))
        _live.add(self)
        # One collective over the new group up front: NCCL creates its
        # communicator lazily and requires the first operation (before any
        # point-to-point) to involve every rank; on gloo it checks the group.
        self.barrier(timeout=group_timeout)

    # -- heartbeat and diagnosis -------------------------------------------------

    def _key(self, kind: str, rank: int) -> str:
        return f"{self._prefix}/{kind}/{rank}"

    def _beat(self, published: List[int] = None) -> None:
        self._store.add(self._key("hb", self.rank), 1)
        if published is not None:
            seq = self._seq
            if seq != published[0]:
                self._store.add(self._key("seq", self.rank), seq - published[0])
                published[0] = seq

    def _heartbeat_loop(self) -> None:
        published = [0]
        while not self._stop.wait(self._interval):
            try:
                self._beat(published)
                self._read_aborts()
            except Exception as e:  # store host gone: remember it for the diagnosis
                self._store_error = f"{type(e).__name__}: {e}"
                log.debug("heartbeat to the store failed: %s", self._store_error)
                return

    def _read_aborts(self) -> None:
        """Read the abort counter; when it moved, collect the peers' reasons. Then the
        death counter likewise (item 6)."""
        _deaths.read_from(self._store)
        a = self._aborts
        n = int(self._store.add(self._abort_key, 0))
        if n <= a.read:
            return
        a.read = n
        found = read_aborts(self._store, self._abort_key, self.size, self.rank)
        if found and a.peers is None:
            a.peers = found

    def abort(self, reason: str) -> bool:
        """Tell every peer that this rank failed and why (``Transport.abort``): the
        reason goes under this rank's abort key, then the abort counter moves.
        Bounded (2 s): a dead store host must not hold up the error.

        Returns:
            Whether the abort is posted (False: the store could not be reached).
        """
        a = self._aborts
        if a.own is not None:
            return a.posted
        a.own = reason  # this rank's own waits stop too: the peers will not complete them
        _failed_here.set()  # as store host, linger at exit until peers have read it
        a.posted = post_abort(self._store, self._abort_key, self.rank, reason,
                              _ABORT_REASON_CHARS)
        return a.posted

    def _dead_peers(self) -> Dict[int, str]:
        """Peers (group ranks) another survivor's diagnosis found dead (item 6)."""
        if not _deaths.found:
            return {}
        return {r: _deaths.found[g] for r, g in enumerate(self._global)
                if g in _deaths.found and r != self.rank}

    def _stopped(self) -> bool:
        """No wait of this transport can complete any more: a peer or this rank
        aborted, or a peer was found dead."""
        return self._aborts.stop or bool(_deaths.found and self._dead_peers())

    def _abort_error(self, where: str) -> TransportError:
        peers = self._aborts.peers
        dead = self._dead_peers()
        if not peers and dead:
            ranks = sorted(dead)
            why = "; ".join(f"rank {r} {dead[r]}" for r in ranks)
            return PeerError(f"{where}: rank(s) {ranks} stopped heartbeating (process died or "
                             f"froze), found by a peer: {why}", ranks=ranks)
        if not peers:
            return TransportError(f"{where}: this rank failed and told its peers "
                                  f"({self._aborts.own})")
        ranks = sorted(peers)
        why = "; ".join(f"rank {r}: {peers[r]}" for r in ranks)
        return PeerError(f"{where}: rank(s) {ranks} failed and told their peers why: {why}",
                         ranks=ranks)

    def _read_counters(self, kind: str) -> Dict[int, int]:
        return {r: int(self._store.add(self._key(kind, r), 0)) for r in range(self.size)}

    def _post_failed(self) -> None:
        """Mark this *process* as one that saw a collective fail, for every transport's
        diagnosis: when it then exits, peers still diagnosing must not blame it for
        the failure it only reacted to (4 ranks, rank 3 killed: a survivor used to
        blame rank 0, which had failed and exited first)."""
        _failed_here.set()
        try:
            self._store.add(f"{_FAILED_PREFIX}/{self._global[self.rank]}", 1)
        except Exception as e:  # the store host may be the dead one
            log.debug("could not post the failed key: %s", e)

    def _failed_within(self, seconds: float) -> List[int]:
        """The peers that posted a failure within ``seconds`` (polled; [] if none did, or
        the store cannot be read)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                failed = self._read_failed()
            except Exception:  # the store host is gone: nothing more to learn
                return []
            if failed or time.monotonic() >= deadline:
                return failed
            time.sleep(self._interval / 2)

    def _read_failed(self) -> List[int]:
        return [r for r in range(self.size) if r != self.rank
                and int(self._store.add(f"{_FAILED_PREFIX}/{self._global[r]}", 0))]

    def _diagnose(self, op: str, seq: int, cause: str, missing: Optional[int] = None
                  ) -> TransportError:
        """Find which peers made collective ``seq`` fail; return the error to raise.

        ``missing``: the peer whose message a receive of this call timed out waiting
        for (gloo's point-to-point exchange), named when no peer left or stalled."""
        where = f"rank {self.rank}: {op} (call #{seq}) failed ({cause})"
        if self._dead_peers() and not self._aborts.peers:
            return self._abort_error(where)  # a survivor found the dead rank already
        found: Dict[str, object] = {}

        def probe() -> None:
            try:
                hb0 = self._read_counters("hb")
                time.sleep(3 * self._interval + 0.05)  # also lets peers publish their seq
                hb1 = self._read_counters("hb")
                seqs = self._read_counters("seq")
                # read last: a survivor posts "failed" before it can close or exit
                closed = [r for r, v in self._read_counters("closed").items()
                          if v and r != self.rank]
                failed = self._read_failed()
                found.update(closed=closed, hb0=hb0, hb1=hb1, seqs=seqs, failed=failed)
            except Exception as e:
                found["store_error"] = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=probe, daemon=True, name="hipress-diagnose")
        t.start()
        until = time.monotonic() + 3 * self._interval + 5.0
        while t.is_alive() and time.monotonic() < until:
            t.join(_ABORT_POLL)
            if self._aborts.peers or self._dead_peers():
                break  # a peer said why, or another survivor's probe ended first
        if self._aborts.peers or self._dead_peers():  # a peer said why, or found it
            return self._abort_error(where)
        store_error = found.get("store_error") or self._store_error
        if t.is_alive() or store_error:
            store_rank = self._group_rank_of_global(0)
            why = store_error or "no answer within 5s"
            ranks = [store_rank] if store_rank is not None and store_rank != self.rank else []
            return PeerError(
                f"{where}; the rendezvous store is unreachable ({why}): its host, global "
                "rank 0, has died or stalled, or the link to it is too slow", ranks=ranks)
        failed = found["failed"]
        closed = [r for r in found["closed"] if r not in failed]

        def never_arrived(then: str = "") -> PeerError:
            """The sender went past this call without sending to this rank."""
            return PeerError(
                f"{where}: rank {missing}'s message never arrived; it left this exchange "
                f"without sending it to this rank (it is at call #{found['seqs'][missing]})"
                f"{then}", ranks=[missing])

        if missing in closed and found["seqs"][missing] > seq:
            # ... then closed its transport (cleanly: gloo delivers what it sent): the
            # missing message is the cause; by a race with this rank's timeout, under
            # load, only the close was named ("closed their transport or exited")
            return never_arrived(" and has since closed its transport or exited")
        dead = [r for r in range(self.size) if r != self.rank and r not in closed
                and r not in failed and found["hb1"][r] == found["hb0"][r]]
        self._aborts.dead.update(dead)  # the store host's linger at exit waits for none
        if dead:  # tell the survivors blocked elsewhere (item 6)
            _deaths.post(self._store, [self._global[r] for r in dead],
                         f"(rank {self.rank}'s diagnosis of {op} call #{seq}: {cause})")
        behind = [r for r in range(self.size) if r != self.rank and r not in closed
                  and r not in failed and r not in dead and found["seqs"][r] <= seq]
        parts = []
        if closed:
            parts.append(f"rank(s) {closed} closed their transport or exited")
        if dead:
            parts.append(f"rank(s) {dead} stopped heartbeating (process died or froze, "
                         "or its link is too slow to carry the heartbeat)")
        at = [found["seqs"][r] for r in behind]
        if behind and (closed or dead):
            # A rank that left explains the failure; the ones behind are most likely held
            # up by it on another channel (4 ranks, rank 3 raised: ranks 1 and 2 waited for
            # it in a bulk exchange and rank 0 blamed them too), so they are not blamed.
            parts.append(f"rank(s) {behind} had not entered this collective yet (at call(s) "
                         f"{at}; not blamed: likely held up by the rank(s) that left)")
        elif behind:
            parts.append(f"rank(s) {behind} never entered this collective (stalled; they are "
                         f"at call(s) {at})")
        if parts:
            if failed:
                parts.append(f"rank(s) {failed} saw the failure too (not blamed)")
            return PeerError(f"{where}: " + "; ".join(parts),
                             ranks=sorted(closed + dead) if closed or dead else behind)
        if missing is not None and found["seqs"][missing] > seq:
            return never_arrived()  # its own next call failed waiting for us, and said so
        if missing is not None and missing not in failed:
            return PeerError(
                f"{where}: rank {missing}'s message had not arrived by the timeout; rank "
                f"{missing} is alive and inside this exchange, so its link is slower than the "
                "timeout allows, or the message was lost on the way", ranks=[missing])
        if not failed:
            # Every peer alive and inside: a peer that timed out just before this rank
            # (waiting on another channel for a message this rank never got either) posts
            # its failure after its own diagnosis; give it that long (a rank whose message
            # was dropped on the way otherwise learns nothing, by a race).
            failed = self._failed_within(3 * self._interval + 1.0)
        if failed:
            return PeerError(f"{where}: rank(s) {failed} failed in an earlier collective and "
                             "left; see their logs for the rank that caused it", ranks=[])
        return TransportError(
            f"{where}; every peer is alive and inside this collective, so the exchange is "
            "slower than the timeout: raise the timeout or shrink the message")

    def _group_rank_of_global(self, global_rank: int) -> Optional[int]:
        try:
            return self._global.index(global_rank)
        except ValueError:
            return None

    # -- running one collective --------------------------------------------------

    def _run(self, op: str, start, timeout: float) -> None:
        """Issue ``start(seq)`` (async work or a list of them); wait for all with ``timeout``."""
        seq = self._begin_call(timeout)
        deadline = time.monotonic() + timeout
        self._labels, self._failed_at = [], None
        try:
            if self._stopped():
                raise _Aborted()
            works = start(seq)
            works = works if isinstance(works, list) else [works]
            self._collective_works = [] if op == "alltoallv" and self.bulk == "p2p" else works
            self._wait(works, deadline)
        except _Aborted:
            err = self._abort_error(f"rank {self.rank}: {op} (call #{seq}) aborted")
            self._broken = f"{op} (call #{seq}) aborted: {err}"
            if self._aborts.peers or self._dead_peers():  # this rank only reacted
                self._post_failed()
            raise err from None
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            cause = (f"timed out after {timeout:.3g}s" if "timed out" in msg.lower()
                     else f"{type(e).__name__}: {msg[:300]}")
            at = self._failed_at
            missing = (self._labels[at] if at is not None and at < len(self._labels)
                       and "timed out" in msg.lower() else None)
            err = self._diagnose(op, seq, cause, missing=missing)
            self._broken = f"{op} (call #{seq}) failed: {err}"
            self._post_failed()
            raise err from e

    def _wait(self, works: list, deadline: float) -> None:
        """Wait for ``works`` until ``deadline``; on gloo, raise ``_Aborted`` as soon
        as a peer aborts (the waiter thread waits; this thread polls)."""
        if not works:
            return
        if self._polls:
            self._poll(works, deadline)
            return
        if self._waiter is None:
            self._waiter = Waiter(f"hipress-wait-r{self.rank}")
            weakref.finalize(self, self._waiter.stop)  # ends the waiter with the transport
        pending = self._waiter.submit(works, deadline)
        while not pending.done.wait(_ABORT_POLL):
            if self._stopped():
                raise _Aborted()
        if pending.error is not None:
            self._failed_at = pending.at
            raise pending.error

    def _poll(self, works: list, deadline: float) -> None:
        """NCCL: poll ``works`` until done, a peer's abort or death, or ``deadline``. An
        NCCL wait cannot be left early, so the caller polls; on any failure the group's
        communicators are aborted, which frees the kernels still waiting on the GPU
        (the transport is unusable after a failure anyway, item 4)."""
        pending, nap = list(works), 5e-5
        try:
            while pending:
                pending = [w for w in pending if not w.is_completed()]
                if not pending:
                    break
                if self._stopped():
                    raise _Aborted()
                if time.monotonic() >= deadline:
                    raise TimeoutError("NCCL work timed out")
                time.sleep(nap)  # short first: a collective's latency is the poll's
                nap = min(2 * nap, _ABORT_POLL / 4)
            for w in works:
                w.wait()  # raises the work's own error, if it failed
        except BaseException:
            self._abort_group()
            raise

    def _abort_group(self) -> None:
        if self.group is None:  # freed (``free``): nothing left to abort
            return
        try:
            self.group.abort()
        except Exception as e:  # older torch, or already aborted
            log.debug("could not abort the NCCL group: %s", e)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device and t.is_contiguous():
            return t
        return t.to(self.device).contiguous()

    # -- the collectives ---------------------------------------------------------

    def alltoallv(self, send: Sequence[Optional[torch.Tensor]], recv_nbytes: Sequence[int],
                  timeout: float = DEFAULT_TIMEOUT, tag: Optional[str] = None
                  ) -> List[Optional[torch.Tensor]]:
        in_splits, out_splits = self._alltoallv_counts(send, recv_nbytes)
        if self.bulk == "p2p":
            received = self._alltoallv_p2p(send, in_splits, out_splits, timeout)
        else:
            received = self._alltoallv_a2a(send, in_splits, out_splits, timeout)
        received[self.rank] = self._own_message(send)
        return received

    def _alltoallv_p2p(self, send, in_splits, out_splits, timeout) -> List[Optional[torch.Tensor]]:
        # Only non-empty messages become operations; both sides know the sizes.
        # gloo matches point-to-point messages by tag: the call number keeps
        # consecutive exchanges between the same pair apart.
        received: List[Optional[torch.Tensor]] = [None] * self.size
        sends = {p: self._on_device(send[p]) for p in range(self.size) if in_splits[p]}
        for p in range(self.size):
            if out_splits[p]:
                received[p] = torch.empty(out_splits[p], dtype=torch.uint8, device=self.device)

        def start(seq: int) -> list:
            tag = seq % (1 << 30)
            recvs = [(p, t) for p, t in enumerate(received) if t is not None]
            if self.backend == "gloo":
                # One work per message, the receives first: a receive that times out
                # says whose message never arrived (``_diagnose``'s ``missing``).
                self._labels = [p for p, _ in recvs]
                works = [dist.irecv(t, self._global[p], self.group, tag) for p, t in recvs]
                return works + [dist.isend(t, self._global[p], self.group, tag)
                                for p, t in sends.items()]
            ops = [dist.P2POp(dist.isend, t, self._global[p], self.group, tag)
                   for p, t in sends.items()]
            ops += [dist.P2POp(dist.irecv, t, self._global[p], self.group, tag)
                    for p, t in recvs]
            return dist.batch_isend_irecv(ops) if ops else []

        with self._lock:
            self._run("alltoallv", start, timeout)
        return received

    def _alltoallv_a2a(self, send, in_splits, out_splits, timeout) -> List[Optional[torch.Tensor]]:
        parts = [self._on_device(send[p]) for p in range(self.size) if in_splits[p]]
        inp = (torch.cat(parts) if parts
               else torch.empty(0, dtype=torch.uint8, device=self.device))
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=self.device)
        with self._lock:
            self._run("alltoallv", lambda seq: dist.all_to_all_single(
                out, inp, out_splits, in_splits, group=self.group, async_op=True), timeout)
        received: List[Optional[torch.Tensor]] = []
        offset = 0
        for n in out_splits:
            received.append(out[offset:offset + n] if n else None)
            offset += n
        return received

    def allgather(self, tensor: torch.Tensor, timeout: float = DEFAULT_TIMEOUT
                  ) -> List[torch.Tensor]:
        src = self._on_device(tensor)
        outs = [torch.empty_like(src) for _ in range(self.size)]
        with self._lock:
            self._run("allgather", lambda seq: dist.all_gather(
                outs, src, group=self.group, async_op=True), timeout)
        return outs

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        self._check_root(root)
        buf = self._on_device(tensor)
        with self._lock:
            self._run(f"broadcast(root={root})", lambda seq: dist.broadcast(
                buf, src=self._global[root], group=self.group, async_op=True), timeout)
        return self._copy_back(tensor, buf)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        self._check_op(op, _REDUCE_OPS)
        buf = self._on_device(tensor)
        with self._lock:
            self._run(f"allreduce({op})", lambda seq: dist.all_reduce(
                buf, op=_REDUCE_OPS[op], group=self.group, async_op=True), timeout)
        return self._copy_back(tensor, buf)

    def barrier(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        # A one-element allreduce rather than dist.barrier: the same code path
        # (and the same failure diagnosis) as every other collective.
        one = torch.zeros(1, device=self.device)
        with self._lock:
            self._run("barrier", lambda seq: dist.all_reduce(
                one, group=self.group, async_op=True), timeout)

    def store(self, prefix: str) -> C10dStore:
        """The rendezvous store under ``prefix``, over a client connection of its own
        (``Transport.store``); its host is global rank 0."""
        return rendezvous_store(prefix, host_rank=self._group_rank_of_global(0))

    def split(self) -> "TorchDistTransport":
        """An independent channel: a new process group over the same ranks (collective)."""
        ranks = list(self._global)
        group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=self._group_timeout))
        t = TorchDistTransport(group, group_timeout=self._group_timeout,
                               heartbeat_interval=self._interval, store=self._store,
                               bulk=self.bulk, abort_key=self._abort_key)
        t._owns_group = True
        return t

    def free(self, timeout: float = 10.0, watch: Sequence["Transport"] = ()) -> bool:
        """Close, then destroy this transport's own process group once every rank closed.

        The ranks' ``closed`` keys in the store say when nobody can still be
        inside an operation on the group (no collective is used: it could
        pair up with a peer's unfinished one). A group passed in by the
        caller is theirs and is not destroyed. The wait ends early, leaving
        the group to process exit, once a peer is found waiting in a
        collective this rank never entered, on this transport or one of
        ``watch`` (``peers_waiting``): such a peer cannot close before this
        process exits, and waiting for it would only delay the moment its
        transport reports the failure.
        """
        self.close()
        if not self._owns_group:
            return True
        deadline = time.monotonic() + timeout
        next_look = 0.0
        try:
            while not all(self._read_counters("closed").values()):
                now = time.monotonic()
                if now > deadline:
                    return False
                if now >= next_look:
                    next_look = now + 0.1
                    waiting = [r for t in (self, *watch) for r in t.peers_waiting()]
                    if waiting:
                        log.debug("rank %d: rank(s) %s wait in a collective this rank left; "
                                  "not waiting for them to close", self.rank, sorted(set(waiting)))
                        return False
                time.sleep(0.005)
        except Exception as e:  # the store host is gone: leave the group to process exit
            log.debug("rank %d: cannot read the closed keys: %s", self.rank, e)
            return False
        if dist.is_initialized():
            dist.destroy_process_group(self.group)
        # Drop this object's hold on the group too: gloo's device, its event-loop
        # thread and its sockets go with the last reference, and a transport in a
        # reference cycle (an engine's) would otherwise keep them until a full
        # garbage collection, which a training loop may never run. Each such loop
        # wakes about 100 times a second (plan="auto"'s trial engines left eight).
        self._owns_group, self.group, self._collective_works = False, None, []
        return True

    def peers_waiting(self) -> List[int]:
        """Peers that have begun a collective on this transport that this rank has not
        (from the counts they publish with each heartbeat, so up to one heartbeat
        late)."""
        try:
            return [r for r, n in self._read_counters("seq").items()
                    if r != self.rank and n > self._seq]
        except Exception:  # the store host is gone: nothing can be said
            return []

    def close(self) -> None:
        """Stop the heartbeat and tell peers this rank left on purpose."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._waiter is not None:
            self._waiter.stop()  # the waiter ends after the wait it may be in
        if self._broken is None:
            self._broken = "closed"

        def post() -> None:
            try:
                self._store.add(self._key("closed", self.rank), 1)
            except Exception as e:  # the store host may be gone already
                log.debug("could not post the closed key: %s", e)

        # Bounded: a frozen store host must not hang close() (or interpreter exit).
        t = threading.Thread(target=post, daemon=True, name="hipress-close")
        t.start()
        t.join(2.0)


_FAILED_PREFIX = "hipress/failed"  # + global rank: the process saw a collective fail
_DEAD_KEY = "hipress/dead"  # + global rank: a survivor's diagnosis found it dead (item 6)


class _Deaths:
    """The peers (global ranks) survivors' diagnoses found dead, with each finding
    (module docstring, item 6): posted once per process, read by every transport's
    heartbeat."""

    def __init__(self) -> None:
        self.found: Dict[int, str] = {}
        self.posted: set = set()
        self.read = 0
        self._lock = threading.Lock()

    def post(self, store, ranks: List[int], text: str) -> None:
        """Post ``ranks`` as dead (those not posted yet by this process)."""
        with self._lock:
            new = [g for g in ranks if g not in self.posted]
            self.posted.update(new)
        for g in new:
            post_abort(store, _DEAD_KEY, g, text, _ABORT_REASON_CHARS)

    def read_from(self, store) -> None:
        """Read the counter; when it moved, every finding (each transport picks its own
        members' from ``found``)."""
        n = int(store.add(_DEAD_KEY, 0))
        if n <= self.read:
            return
        found = read_aborts(store, _DEAD_KEY, dist.get_world_size(), -1)
        with self._lock:
            self.read = n
            self.found.update(found)


_deaths = _Deaths()


def forget_failures() -> None:
    """Forget this process's failure state (the deaths read, that a collective failed):
    for a process that leaves its world and joins a new one (``runtime.reform``), where
    ranks are numbered afresh and the store is new."""
    global _deaths
    _deaths = _Deaths()
    _failed_here.clear()


class _Aborted(TransportError):
    """A peer, or this rank, aborted while this rank waited (internal to ``_run``, which
    turns it into the ``PeerError`` that names them)."""


class _Aborts:
    """The aborts one family of channels (a transport and its splits) has seen:
    ``peers`` (rank -> reason, from the store), ``own`` (this rank's reason, once it
    aborted), ``posted`` (the store has it), ``read`` (the counter last read), and
    ``dead``: peers a failure diagnosis found no longer heartbeating."""

    def __init__(self) -> None:
        self.dead: set = set()
        self.peers: Optional[Dict[int, str]] = None
        self.own: Optional[str] = None
        self.posted = False
        self.read = 0

    @property
    def stop(self) -> bool:
        """No wait of the family can complete any more."""
        return self.peers is not None or self.own is not None


# abort key -> its family's aborts (every rank builds the same families in the same order)
_families: Dict[str, _Aborts] = {}


def _undiagnosed(t: TorchDistTransport, seen: Dict[tuple, tuple], now: float) -> List[int]:
    """Peers of ``t`` that neither posted a failure nor aborted nor closed and still
    heartbeat."""
    failed = (set(t._read_failed()) | set(t._aborts.peers or ()) | t._aborts.dead
              | set(t._dead_peers()))
    closed = {r for r, v in t._read_counters("closed").items() if v}
    beats = t._read_counters("hb")
    out = []
    for r in range(t.size):
        if r == t.rank or r in failed or r in closed:
            continue
        last = seen.get((id(t), r))
        if last is None or last[0] != beats[r]:
            seen[(id(t), r)] = (beats[r], now)
        elif now - last[1] > 3 * t._interval + 0.05:
            continue  # no beat for three intervals: dead, nothing to wait for
        out.append(r)
    return out


def _linger_as_store_host() -> None:
    """At exit of the store's host (global rank 0) after a failed collective: keep
    the store up until every peer has posted its own failure, closed, or stopped
    heartbeating, for ``_STORE_LINGER`` seconds at most.

    Without it, rank 0 reacting quickly to rank 3's death exits and takes the
    store with it, and a survivor still diagnosing finds the store unreachable
    and blames rank 0 instead of rank 3. Registered at import, so it runs after
    the transports' own ``_close_at_exit`` (atexit runs in reverse order).
    """
    if not _failed_here.is_set() or not dist.is_initialized() or dist.get_rank() != 0:
        return
    transports = list(_live)
    seen: Dict[tuple, tuple] = {}
    deadline = time.monotonic() + _STORE_LINGER
    try:
        while time.monotonic() < deadline:
            now = time.monotonic()
            if not any(_undiagnosed(t, seen, now) for t in transports):
                return
            time.sleep(0.02)
        log.debug("store host: peers still undiagnosed after %.1fs; exiting", _STORE_LINGER)
    except Exception as e:  # the store itself failed: nothing to keep up
        log.debug("store host linger: %s", e)


atexit.register(_linger_as_store_host)


def _release_at_exit() -> None:
    """At exit after a failure, once no waiter thread is inside a wait (the waiter's
    ``when_idle_at_exit``): destroy each transport's own group whose collective works
    have all ended, which closes its connections now. A peer whose wait was given up
    (it reacted to the same failure) is held inside that wait until this rank's
    connections close; they would otherwise close only when this interpreter ends,
    which under load is seconds after the last exit handler, and each survivor's exit
    would wait for the one before it. A collective work still running (a timed-out
    wait) keeps its group: gloo's group destructor would wait for it. Point-to-point
    works do not hold the destructor."""
    if not _failed_here.is_set() or not dist.is_initialized():
        return
    for t in list(_live):
        group = t.group
        if not t._owns_group or group is None:
            continue
        if not all(w.is_completed() for w in t._collective_works):
            continue
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # already destroyed, or the package is shutting down
            log.debug("could not release the group at exit: %s", e)
            continue
        t._owns_group, t.group, t._collective_works = False, None, []
        t._broken = t._broken or "its group was released at exit"


when_idle_at_exit.append(_release_at_exit)


def _close_at_exit(ref: "weakref.ref[TorchDistTransport]") -> None:
    transport = ref()
    if transport is not None:
        transport.close()
