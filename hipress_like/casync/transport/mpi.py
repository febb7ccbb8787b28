"""Transport over MPI (mpi4py), for jobs launched with ``mpirun``.

MPI's blocking collectives cannot time out, so every collective here is
the non-blocking variant (``Ialltoallv``, ``Iallgather``, ``Ibcast``,
``Ireduce``/``Iallreduce``, ``Ibarrier``) completed by a polling loop with
a deadline. Polling also drives MPI's progress engine: the loop spins
(yielding the CPU) for the first milliseconds, then sleeps briefly.

Naming the peer on a timeout: MPI cannot tell us who is missing from a
collective, so the transport keeps its own evidence.

1. It works on two duplicates of the given communicator: ``data`` for the
   collectives (so user collectives on the original communicator never
   match the engine's) and ``ctl`` for arrival notices.
2. Entering collective number ``k``, a rank sends a tiny notice ``k`` to
   every peer on ``ctl`` (eager, non-blocking) and drains the notices it
   has received, remembering the highest ``k`` seen from each peer.
3. On a timeout it keeps draining for up to ``diagnose_wait`` seconds;
   peers whose last notice is below ``k`` never entered collective ``k``
   and are named in ``PeerError``. If every peer arrived, the exchange was
   merely too slow (``TransportError``).

Aborts: a rank whose engine fails inside the exchange calls ``abort(reason)``,
which sends the reason to every peer on ``ctl`` (non-blocking). A peer's
polling loop looks for such a message every ``_ABORT_POLL`` seconds and
before each collective, and raises ``PeerError`` naming the sender and its
reason at once, instead of at the timeout.

A process that dies makes ``mpirun`` abort the whole job; that is MPI's
failure model and is not masked here. Afterwards a timed-out transport is
unusable (its request cannot be cancelled): later calls raise
``TransportError``.

Tensors travel as ``uint8`` numpy views (CPU; CUDA tensors are staged
through host memory). Floating-point ``allreduce`` is ``Ireduce`` to rank 0
then ``Ibcast``, because MPI does not promise that every rank's allreduce
result is bitwise identical, and replicas must never drift.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional, Sequence

import numpy as np
import torch

from .base import DEFAULT_TIMEOUT, PeerError, Transport, TransportError
from .c10d_store import RendezvousStoreMixin

__all__ = ["MPITransport"]

log = logging.getLogger(__name__)

_NOTICE_TAG = 7707
_ABORT_TAG = 7708
_ABORT_POLL = 0.02  # seconds between looks for a peer's abort while a collective waits
_SPIN_SECONDS = 0.02  # yield-only polling before sleeping between tests
_MAX_SLEEP = 5e-4  # progress is made only inside MPI calls: keep sleeps short


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            "MPITransport needs mpi4py and an MPI library: apt-get install -y openmpi-bin "
            "libopenmpi-dev, then pip install mpi4py (or pip install 'hipress-like[mpi]')"
        ) from e
    return MPI


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor's storage."""
    return t.reshape(-1).view(torch.uint8).numpy()


class MPITransport(RendezvousStoreMixin, Transport):
    """``Transport`` over an MPI communicator.

    Args:
        comm: the communicator (default ``MPI.COMM_WORLD``); it is duplicated,
            which is collective: every rank constructs its transport at the
            same point.
        diagnose_wait: seconds to keep collecting arrival notices after a
            timeout before naming the missing ranks.

    Raises:
        ImportError: mpi4py is not installed (with install instructions).

    Example:
        >>> t = MPITransport()                   # under mpirun -np 4
        >>> t.allreduce(torch.ones(3))
    """

    def __init__(self, comm: Any = None, *, diagnose_wait: float = 1.0):
        mpi = _import_mpi()
        self._MPI = mpi
        base = comm if comm is not None else mpi.COMM_WORLD
        self._data = base.Dup()
        self._ctl = base.Dup()
        self.rank = self._data.Get_rank()
        self.size = self._data.Get_size()
        self._diagnose_wait = float(diagnose_wait)
        self._seq = 0
        self._last_seen = [-1] * self.size  # highest call number noticed per peer
        self._notice_reqs: List[Any] = []
        self._notice_bufs: List[np.ndarray] = []
        self._recv_buf = np.zeros(1, dtype=np.int64)
        self._broken: Optional[str] = None
        # MPI calls of abort() (any thread) and of the calling thread are serialised
        self._lock = threading.Lock()
        self._abort_sends: List[Any] = []  # (request, buffer): kept alive until sent
        # this transport and the channels split() opens from it: one abort tells them all
        self._family: List["MPITransport"] = [self]
        self._aborted = [False]
        self._ops = {"sum": mpi.SUM, "max": mpi.MAX, "min": mpi.MIN}
        self._types = {
            torch.float32: mpi.FLOAT, torch.float64: mpi.DOUBLE,
            torch.int64: mpi.INT64_T, torch.int32: mpi.INT32_T, torch.int16: mpi.INT16_T,
            torch.int8: mpi.INT8_T, torch.uint8: mpi.UINT8_T,
        }

    # -- arrival notices ------------------------------------------------------------

    def _announce(self, seq: int) -> None:
        # Completed sends can be forgotten; the rest keep their buffers alive.
        if self._notice_reqs:
            keep = [i for i, r in enumerate(self._notice_reqs) if not r.Test()]
            self._notice_reqs = [self._notice_reqs[i] for i in keep]
            self._notice_bufs = [self._notice_bufs[i] for i in keep]
        buf = np.array([seq], dtype=np.int64)
        for p in range(self.size):
            if p != self.rank:
                self._notice_reqs.append(self._ctl.Isend(buf, dest=p, tag=_NOTICE_TAG))
        self._notice_bufs.extend([buf] * (self.size - 1))
        self._drain()

    def _drain(self) -> None:
        status = self._MPI.Status()
        while self._ctl.Iprobe(source=self._MPI.ANY_SOURCE, tag=_NOTICE_TAG, status=status):
            src = status.Get_source()
            self._ctl.Recv(self._recv_buf, source=src, tag=_NOTICE_TAG)
            self._last_seen[src] = max(self._last_seen[src], int(self._recv_buf[0]))

    # -- aborts ---------------------------------------------------------------------

    def abort(self, reason: str) -> bool:
        """Tell every peer that this rank failed and why (``Transport.abort``): the
        reason goes to each peer on the notice communicator of every channel of
        this family (this transport and those ``split()`` opened), non-blocking; a
        peer waiting in a collective on any of them raises ``PeerError`` naming
        this rank within ``_ABORT_POLL`` seconds. Sent once per family.

        Returns:
            True (the messages are on their way).
        """
        if self._aborted[0]:
            return True
        self._aborted[0] = True
        buf = np.frombuffer(reason.encode()[:4000], dtype=np.uint8).copy()
        for t in list(self._family):
            with t._lock:
                for p in range(t.size):
                    if p != t.rank:
                        t._abort_sends.append((t._ctl.Isend(buf, dest=p, tag=_ABORT_TAG), buf))
        return True

    def _peer_abort(self) -> Optional[PeerError]:
        """A peer's abort message, if one arrived (caller holds the lock)."""
        status = self._MPI.Status()
        if not self._ctl.Iprobe(source=self._MPI.ANY_SOURCE, tag=_ABORT_TAG, status=status):
            return None
        src, n = status.Get_source(), status.Get_count(self._MPI.BYTE)
        buf = np.zeros(max(n, 1), dtype=np.uint8)
        self._ctl.Recv([buf, n, self._MPI.BYTE], source=src, tag=_ABORT_TAG)
        reason = bytes(buf[:n]).decode(errors="replace")
        return PeerError(f"rank {self.rank}: rank {src} failed and aborted the job: {reason}",
                         ranks=[src])

    def _check_abort(self, where: str) -> None:
        with self._lock:
            err = self._peer_abort()
        if err is not None:
            self._broken = f"{where}: {err}"
            raise err

    def _diagnose(self, op: str, seq: int, timeout: float) -> TransportError:
        end = time.monotonic() + self._diagnose_wait
        while True:
            self._drain()
            missing = [p for p in range(self.size) if p != self.rank and self._last_seen[p] < seq]
            if not missing or time.monotonic() > end:
                break
            time.sleep(0.01)
        where = f"rank {self.rank}: {op} (call #{seq}) timed out after {timeout:.3g}s"
        if missing:
            at = [self._last_seen[p] + 1 for p in missing]
            return PeerError(f"{where}: rank(s) {missing} never entered this collective "
                             f"(stalled or exited; they entered {at} collectives so far)",
                             ranks=missing)
        return TransportError(f"{where}; every peer entered it, so the exchange is slower than "
                              "the timeout (raise it) or the ranks issued different collectives")

    # -- running one collective -----------------------------------------------------

    def _run(self, op: str, steps, timeout: float) -> None:
        """Run ``steps``: callables each starting one non-blocking request, in order."""
        seq = self._begin_call(timeout)
        self._check_abort(f"{op} (call #{seq})")
        with self._lock:
            self._announce(seq)
        start = time.monotonic()
        deadline = start + timeout
        next_look = start + _ABORT_POLL
        for step in steps:
            with self._lock:
                req = step()
            sleep = 0.0
            while True:
                with self._lock:
                    if req.Test():
                        break
                now = time.monotonic()
                if now > next_look:
                    next_look = now + _ABORT_POLL
                    self._check_abort(f"{op} (call #{seq}) aborted")
                if now > deadline:
                    err = self._diagnose(op, seq, timeout)
                    self._broken = f"{op} (call #{seq}) failed: {err}"
                    raise err
                if now - start > _SPIN_SECONDS:
                    sleep = min(_MAX_SLEEP, sleep * 2 or 5e-5)
                time.sleep(sleep)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous()

    # -- the collectives ------------------------------------------------------------

    def alltoallv(self, send: Sequence[Optional[torch.Tensor]], recv_nbytes: Sequence[int],
                  timeout: float = DEFAULT_TIMEOUT, tag: Optional[str] = None
                  ) -> List[Optional[torch.Tensor]]:
        counts, rcounts = self._alltoallv_counts(send, recv_nbytes)
        parts = [self._host(t) for t, n in zip(send, counts) if n]
        sbuf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        rbuf = torch.empty(sum(rcounts), dtype=torch.uint8)
        sdispl = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        rdispl = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).tolist()
        byte = self._MPI.BYTE
        s_np, r_np = sbuf.numpy(), rbuf.numpy()
        self._run("alltoallv", [lambda: self._data.Ialltoallv(
            [s_np, (counts, sdispl), byte], [r_np, (rcounts, rdispl), byte])], timeout)
        out: List[Optional[torch.Tensor]] = []
        for p in range(self.size):
            if p == self.rank:
                out.append(self._own_message(send))
            else:
                n, d = rcounts[p], rdispl[p]
                out.append(rbuf[d:d + n] if n else None)
        return out

    def allgather(self, tensor: torch.Tensor, timeout: float = DEFAULT_TIMEOUT
                  ) -> List[torch.Tensor]:
        src = self._host(tensor)
        out = torch.empty((self.size,) + tuple(src.shape), dtype=src.dtype)
        s_np, r_np = _bytes_view(src), _bytes_view(out)
        self._run("allgather", [lambda: self._data.Iallgather(s_np, r_np)], timeout)
        return [out[r].to(tensor.device) for r in range(self.size)]

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        self._check_root(root)
        buf = self._host(tensor)
        view = _bytes_view(buf)
        self._run(f"broadcast(root={root})", [lambda: self._data.Ibcast(view, root=root)],
                  timeout)
        return self._copy_back(tensor, buf)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        self._check_op(op, self._ops)
        # float16/bfloat16 have no MPI type: reduce in float32 (exact for max/min).
        wire = tensor.dtype if tensor.dtype in self._types else torch.float32
        if not (tensor.dtype.is_floating_point or tensor.dtype in self._types):
            raise TypeError(f"allreduce supports float and integer tensors, got {tensor.dtype}")
        buf = tensor.detach().to("cpu", wire).contiguous()
        mtype, mop = self._types[wire], self._ops[op]
        arr = buf.reshape(-1).numpy()
        result = np.empty_like(arr)
        name = f"allreduce({op})"
        if wire.is_floating_point:
            # Reduce at rank 0, then broadcast: one rounding, identical bits everywhere.
            steps = [lambda: self._data.Ireduce([arr, mtype], [result, mtype], op=mop, root=0),
                     lambda: self._data.Ibcast([result, mtype], root=0)]
        else:
            steps = [lambda: self._data.Iallreduce([arr, mtype], [result, mtype], op=mop)]
        self._run(name, steps, timeout)
        tensor.copy_(torch.from_numpy(result).reshape(tensor.shape))
        return tensor

    def barrier(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._run("barrier", [self._data.Ibarrier], timeout)

    def split(self) -> "MPITransport":
        """An independent channel: new duplicated communicators (collective). It shares
        this transport's abort (``abort`` on either tells the peers on both)."""
        child = MPITransport(self._data, diagnose_wait=self._diagnose_wait)
        child._family, child._aborted = self._family, self._aborted
        self._family.append(child)
        return child

    def close(self) -> None:
        """Mark the transport closed (the communicators are freed at MPI finalize)."""
        if self._broken is None:
            self._broken = "closed"
