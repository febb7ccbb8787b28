"""Transport over Horovod (``horovod.torch``), for jobs run by ``horovodrun``.

A thin mapping: ``alltoallv`` -> ``hvd.alltoall_async`` with ``splits``,
``allgather`` -> ``hvd.allgather_async`` (on a leading axis of 1),
``broadcast`` -> ``hvd.broadcast_async_``, ``allreduce`` ->
``hvd.allreduce_async_`` (op Sum/Max/Min), ``barrier`` -> a one-element
allreduce. Horovod is imported when the transport is constructed, never when
this module is imported, and is an optional extra (``pip install
'hipress-like[horovod]'``; see ENVIRONMENT.md for building it against torch 2.x).

Channels: Horovod matches operations by name, not by order, so one
transport is a *channel*, a name prefix: the k-th transport a process
builds is ``hipress_like.t<k>`` and its ``split()`` children
``hipress_like.t<k>.s<j>``; every call is named ``<channel>.<op>`` (a
channel's calls are sequential, so a name is never in flight twice, and a
recurring name hits Horovod's response cache). Ranks build transports and split them in
the same order (both are collective), so names meet; two channels run
concurrently (the engine plans round r+1 on one while round r's data moves
on the other, as over gloo), and a script's own ``horovod.torch`` calls,
named by Horovod, never collide with them.

Timeouts: every call is asynchronous and polled (``hvd.poll``) against a
deadline. Horovod itself cannot say which rank is
missing (its stall inspector only logs it on rank 0), so:

- with a ``store`` (any ``torch.distributed.Store``, e.g. a ``TCPStore``),
  every call bumps this rank's counter in the store (from a background
  thread, ``counters.py``: a synchronous round trip per call slowed Ring
  by 17%), and a failure names the ranks whose counter shows, after a
  short settle for pushes in flight, that they never entered the call;
- without one, the ``PeerError`` says the culprit is unknown and points to
  ``HOROVOD_STALL_CHECK_TIME_SECONDS``.

A ``HorovodInternalError`` (a peer died) becomes ``PeerError`` too. After
any failure the transport is unusable.

Aborts (with a store): a rank whose engine fails inside the exchange calls
``abort(reason)``, which posts the reason under its abort key and moves the
family's abort counter (every channel of the process shares them). A call
still waiting after ``_ABORT_POLL`` seconds reads that counter every
``_ABORT_POLL`` seconds, and raises ``PeerError`` naming the failed rank and
its reason at once instead of at its timeout.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any, List, Optional, Sequence

import torch

from .base import DEFAULT_TIMEOUT, PeerError, Transport, TransportError
from .c10d_store import RendezvousStoreMixin, post_abort, read_aborts
from .counters import PUBLISHER, settled_counts

__all__ = ["HorovodTransport", "restart_channel_numbers"]

log = logging.getLogger(__name__)

_SPIN_SECONDS = 0.002
_MAX_SLEEP = 1e-3  # Horovod's background thread makes progress; polling is cheap
# How long a diagnosis re-reads counters while a peer looks behind (its push may be in
# flight; it lands within milliseconds). After a timeout there is time; after a peer's
# death horovodrun stops the survivors at once, so they answer within a few round trips.
_SETTLE_SECONDS = 0.3
_SETTLE_ON_FAILURE = 0.02
# A waiting call reads the abort counter this often (a store round trip each; calls
# that finish sooner never read it)
_ABORT_POLL = 0.05
_ABORT_REASON_CHARS = 4000

# the k-th top-level transport of this process is channel "hipress_like.t<k>"
_channel_numbers = itertools.count()


def restart_channel_numbers() -> None:
    """Number top-level channels from ``t0`` again: after an elastic re-formation
    (``adapters.runtime.reform``) the world holds new processes, whose first channel
    is ``t0``, beside old ones that must name theirs alike."""
    global _channel_numbers
    _channel_numbers = itertools.count()


def _shape_name(t: torch.Tensor) -> str:
    """``float32.4x3``: a tensor's dtype and shape, for a name (the same on every rank)."""
    return f"{str(t.dtype).replace('torch.', '')}.{'x'.join(map(str, t.shape))}"


def _import_horovod():
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise ImportError(
            "HorovodTransport needs Horovod built with PyTorch support, which is not "
            "installed in this environment. Install it with scripts/env_horovod.sh (builds "
            "horovod==0.28.1 with HOROVOD_WITH_PYTORCH=1, cmake<4 and a C++17 compiler "
            "wrapper), or choose another backend: "
            "make_transport('gloo') or make_transport('mpi')") from e
    return hvd


class HorovodTransport(RendezvousStoreMixin, Transport):
    """``Transport`` over horovod.torch's collectives.

    Args:
        store: optional ``torch.distributed.Store`` shared by all ranks; lets
            a timeout name the ranks that never entered the call.
        key_prefix: namespace for this transport's keys in ``store``.
        expected: optional (rank, size[, launcher]) the job's launcher gave;
            a Horovod world that differs (not started by horovodrun) is an
            error naming the fix instead of a world of one.
        channel: the name prefix (``split`` passes it); None numbers a new
            top-level channel.

    Raises:
        ImportError: Horovod is not installed (the message says how to get it).
        TransportError: Horovod's world is not ``expected``.

    Example:
        >>> t = HorovodTransport()          # under horovodrun -np 4
        >>> t.allreduce(torch.ones(3))
    """

    def __init__(self, store: Any = None, *, key_prefix: str = "hipress/horovod",
                 expected: Optional[tuple] = None, channel: Optional[str] = None):
        hvd = _import_horovod()
        if not hvd.is_initialized():
            hvd.init()
        self._hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        if expected is not None and (expected[0], expected[1]) != (self.rank, self.size):
            launcher = expected[2] if len(expected) > 2 else "the launcher"
            raise TransportError(
                f"the Horovod transport was asked for (HIPRESS_TRANSPORT=horovod), but Horovod "
                f"sees rank {self.rank} of {self.size} while this job is rank {expected[0]} of "
                f"{expected[1]} ({launcher}): Horovod only reaches the ranks horovodrun "
                "started. Fix: start the job with horovodrun, or unset HIPRESS_TRANSPORT "
                "(or set it to torch)")
        if channel is None:
            channel = f"hipress_like.t{next(_channel_numbers)}"
        self._channel = channel
        self._store = store
        self._prefix = f"{key_prefix}/{self._channel}"
        self._seq = 0
        self._splits = 0
        self._broken: Optional[str] = None
        self._ops = {"sum": hvd.Sum, "max": getattr(hvd, "Max", None),
                     "min": getattr(hvd, "Min", None)}
        self._key_root = key_prefix
        self._abort_key = f"{key_prefix}/abort"  # one per process family: every channel
        self._aborted = False

    def _name(self, op: str, seq: int) -> str:
        # No call number in the name: a channel's calls are sequential on every
        # rank, so a name is never in flight twice, and a name that recurs with
        # the same shape hits Horovod's response cache (no negotiation round).
        # Each name holds one shape there, so an op whose shape changes from
        # call to call carries it in its name (allreduce) or a tag (alltoallv).
        return f"{self._channel}.{op}"

    def split(self) -> "HorovodTransport":
        """A second channel over the same ranks: a new name prefix (no communication)."""
        if self._broken is not None:
            raise TransportError(f"rank {self.rank}: transport unusable: {self._broken}")
        self._splits += 1
        return HorovodTransport(self._store, key_prefix=self._key_root,
                                channel=f"{self._channel}.s{self._splits}")

    def abort(self, reason: str) -> bool:
        """Tell every peer that this rank failed and why (``Transport.abort``): the
        reason goes under this rank's abort key in the store, then the abort counter
        moves. Bounded (2 s): a dead store host must not hold up the error.

        Returns:
            Whether the abort is posted (False: no store, or it could not be reached).
        """
        if self._store is None:
            return False
        if self._aborted:
            return True
        self._aborted = True
        return post_abort(self._store, self._abort_key, self.rank, reason, _ABORT_REASON_CHARS)

    def _peer_abort(self) -> Optional[PeerError]:
        """The peers' aborts posted in the store, as ``PeerError`` (None: none)."""
        try:
            if int(self._store.add(self._abort_key, 0)) <= 0:
                return None
            found = read_aborts(self._store, self._abort_key, self.size, self.rank)
        except Exception:  # the store host is gone: the timeout's diagnosis names it
            return None
        if not found:
            return None
        ranks = sorted(found)
        why = "; ".join(f"rank {r}: {found[r]}" for r in ranks)
        return PeerError(f"rank {self.rank}: rank(s) {ranks} failed and told their peers why: "
                         f"{why}", ranks=ranks)

    def _run(self, op: str, start, timeout: float) -> Any:
        """``start(name)`` returns a Horovod handle; poll it until done or ``timeout``,
        or until a peer's abort shows in the store."""
        seq = self._begin_call(timeout)
        if self._store is not None:
            PUBLISHER.bump(self._store, f"{self._prefix}/seq/{self.rank}")
        hvd = self._hvd
        t0 = time.monotonic()
        next_look = t0 + _ABORT_POLL
        try:
            handle = start(self._name(op, seq))
            sleep = 0.0
            while not hvd.poll(handle):
                now = time.monotonic()
                if self._store is not None and now > next_look:
                    next_look = now + _ABORT_POLL
                    err = self._peer_abort()
                    if err is not None:
                        self._broken = f"{op} (call #{seq}) aborted: {err}"
                        raise err
                if time.monotonic() - t0 > timeout:
                    err = self._diagnose(op, seq, f"timed out after {timeout:.3g}s",
                                         _SETTLE_SECONDS)
                    self._broken = f"{op} (call #{seq}) failed: {err}"
                    raise err
                if time.monotonic() - t0 > _SPIN_SECONDS:
                    sleep = min(_MAX_SLEEP, sleep * 2 or 5e-5)
                time.sleep(sleep)
            return hvd.synchronize(handle)
        except TransportError:
            raise
        except Exception as e:  # HorovodInternalError: a peer failed mid-operation
            err = (self._peer_abort() if self._store is not None else None) or self._diagnose(
                op, seq, f"{type(e).__name__}: {str(e)[:300]}", _SETTLE_ON_FAILURE)
            self._broken = f"{op} (call #{seq}) failed: {err}"
            raise err from e

    def _diagnose(self, op: str, seq: int, cause: str, settle: float) -> TransportError:
        where = f"rank {self.rank}: {op} (call #{seq}) failed ({cause})"
        if self._store is None:
            return PeerError(
                f"{where}; Horovod cannot tell which rank is missing. Pass a store to "
                "HorovodTransport to name it, or set HOROVOD_STALL_CHECK_TIME_SECONDS so "
                "Horovod's stall inspector logs the missing ranks on rank 0", ranks=())

        def read():
            return {r: int(self._store.add(f"{self._prefix}/seq/{r}", 0))
                    for r in range(self.size)}

        def lagging(counts):
            return [r for r, c in counts.items() if r != self.rank and c <= seq]

        PUBLISHER.flush(settle)  # this rank's own count, for peers diagnosing too
        try:
            counts = settled_counts(read, lagging, settle=settle)
        except Exception as e:
            # the store lives on rank 0 (horovodrun jobs: runtime's rendezvous store)
            return PeerError(f"{where}; the store is unreachable too ({e}): its host, rank 0, "
                             "has died", ranks=(0,) if self.rank != 0 else ())
        behind = lagging(counts)
        if behind:
            return PeerError(f"{where}: rank(s) {behind} never entered this collective "
                             f"(they entered {[counts[r] for r in behind]} so far)", ranks=behind)
        return TransportError(f"{where}; every peer entered it: the exchange is slower than "
                              "the timeout, or a peer failed inside Horovod")

    @staticmethod
    def _contiguous(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_contiguous() else t.contiguous()

    def alltoallv(self, send: Sequence[Optional[torch.Tensor]], recv_nbytes: Sequence[int],
                  timeout: float = DEFAULT_TIMEOUT, tag: Optional[str] = None
                  ) -> List[Optional[torch.Tensor]]:
        counts, rcounts = self._alltoallv_counts(send, recv_nbytes)
        device = next((t.device for t in send if t is not None), torch.device("cpu"))
        parts = [t.to(device) for t, n in zip(send, counts) if n]
        inp = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        splits = torch.tensor(counts, dtype=torch.int32)
        # a tag names the exchange's shape on every rank: Horovod then reuses the
        # negotiation of the last exchange of that shape (its response cache)
        res = self._run("alltoallv" if tag is None else f"alltoallv.{tag}",
                        lambda name: self._hvd.alltoall_async(inp, splits=splits, name=name),
                        timeout)
        out, got = res if isinstance(res, tuple) else (res, None)
        if got is not None and [int(x) for x in got] != rcounts:
            raise TransportError(f"rank {self.rank}: alltoallv expected {rcounts} bytes from the "
                                 f"ranks but received {[int(x) for x in got]}")
        result: List[Optional[torch.Tensor]] = []
        offset = 0
        for p, n in enumerate(rcounts):
            if p == self.rank:
                result.append(self._own_message(send))
            else:
                result.append(out[offset:offset + n] if n else None)
            offset += n
        return result

    def allgather(self, tensor: torch.Tensor, timeout: float = DEFAULT_TIMEOUT
                  ) -> List[torch.Tensor]:
        src = self._contiguous(tensor).unsqueeze(0)  # Horovod concatenates on dim 0
        out = self._run(f"allgather.{_shape_name(src)}",
                        lambda name: self._hvd.allgather_async(src, name=name), timeout)
        return [out[r] for r in range(self.size)]

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        self._check_root(root)
        buf = self._contiguous(tensor)
        self._run(f"broadcast{root}.{_shape_name(buf)}", lambda name: self._hvd.broadcast_async_(
            buf, root, name=name), timeout)
        return self._copy_back(tensor, buf)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        self._check_op(op, self._ops)
        if self._ops[op] is None:
            raise TransportError(f"this Horovod version has no {op!r} reduction; upgrade to "
                                 "horovod>=0.26")
        buf = self._contiguous(tensor)
        self._run(f"allreduce_{op}.{_shape_name(buf)}", lambda name: self._hvd.allreduce_async_(
            buf, name=name, op=self._ops[op]), timeout)
        return self._copy_back(tensor, buf)

    def barrier(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        one = torch.zeros(1)
        self._run("barrier", lambda name: self._hvd.allreduce_async_(
            one, name=name, op=self._hvd.Sum), timeout)

    def close(self) -> None:
        """Mark the transport closed (Horovod itself is left running)."""
        if self._broken is None:
            self._broken = "closed"
