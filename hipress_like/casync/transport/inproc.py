"""In-process transport: ``size`` ranks as threads of one process.

The scheduler's unit tests need real collectives without process start-up
costs or network nondeterminism. ``InProcGroup(size)`` creates ``size``
``InProcTransport`` objects sharing one rendezvous table; each rank runs in
its own thread (``run_threads`` does that for you).

The idea: every rank numbers its collective calls ``0, 1, 2, ...``. Call
``k`` of every rank meets in slot ``k`` of the table:

1. A rank deposits a *copy* of its contribution into slot ``k`` (copies,
   because after returning a rank may overwrite its tensor in place while a
   slower peer is still reading), then waits on the group's condition
   variable until all ``size`` contributions are there.
2. Each rank computes its own result from the deposits, always combining
   them in rank order, so every rank gets bitwise-identical sums.
3. The last rank to read slot ``k`` deletes it.

Failures are explicit state: a rank that raised or whose thread ended is
recorded in ``failed`` / ``exited``; waiters wake up and raise ``PeerError``
naming it if it has not deposited into their slot. A rank that neither
arrives nor leaves is named when the waiter's timeout expires (it is the
rank missing from the slot). Mismatched calls (rank 0 in ``allgather``
while rank 1 is in ``broadcast``) raise ``TransportError`` with both names.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .base import DEFAULT_TIMEOUT, PeerError, Transport, TransportError

__all__ = ["InProcGroup", "InProcTransport", "run_threads"]

log = logging.getLogger(__name__)

_REDUCE_OPS = ("sum", "max", "min")


class _Slot:
    """The meeting point of one collective call (call number ``seq``)."""

    __slots__ = ("op", "deposits", "readers")

    def __init__(self, op: str):
        self.op = op
        self.deposits: Dict[int, Any] = {}
        self.readers = 0


class InProcGroup:
    """``size`` in-process ranks sharing one rendezvous table.

    Args:
        size: number of ranks (>= 1).

    Example:
        >>> group = InProcGroup(2)
        >>> t0, t1 = group.transports
    """

    def __init__(self, size: int, _parent: Optional["InProcGroup"] = None):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"InProcGroup size must be an int >= 1, got {size!r}")
        self.size = size
        self._slots: Dict[int, _Slot] = {}
        if _parent is None:
            self._cond = threading.Condition()
            # rank -> reason; a rank in either dict will never deposit again
            # (``exited`` of this channel or of any channel it was split from).
            self.failed: Dict[int, str] = {}
            self.exited: Dict[int, str] = {}
        else:  # a split channel: the same ranks, so the same failures and wake-ups;
            # closing it ends only this channel (a rank's thread ending ends them all)
            self._cond, self.failed = _parent._cond, _parent.failed
            self.exited = {}
        self._parent = _parent
        self._children: Dict[int, "InProcGroup"] = {}
        self.transports = [InProcTransport(self, r) for r in range(size)]

    def _child(self, index: int) -> "InProcGroup":
        with self._cond:
            if index not in self._children:
                self._children[index] = InProcGroup(self.size, _parent=self)
            return self._children[index]

    def __getitem__(self, rank: int) -> "InProcTransport":
        return self.transports[rank]

    def __len__(self) -> int:
        return self.size

    def mark_failed(self, rank: int, reason: str) -> None:
        """Record that ``rank`` raised; peers waiting for it raise ``PeerError``."""
        with self._cond:
            self.failed.setdefault(rank, reason)
            self._cond.notify_all()

    def mark_exited(self, rank: int, reason: str = "its thread finished") -> None:
        """Record that ``rank`` will call no more collectives."""
        with self._cond:
            self.exited.setdefault(rank, reason)
            self._cond.notify_all()

    def _gone(self, rank: int) -> Optional[str]:
        if rank in self.failed:
            return f"raised {self.failed[rank]}"
        group: Optional[InProcGroup] = self
        while group is not None:
            if rank in group.exited:
                return group.exited[rank]
            group = group._parent
        return None

    def _exchange(self, rank: int, seq: int, op: str, value: Any, timeout: float) -> Dict[int, Any]:
        """Deposit ``value`` for call ``seq`` and return every rank's deposit."""
        deadline = time.monotonic() + timeout
        with self._cond:
            slot = self._slots.get(seq)
            if slot is None:
                slot = self._slots[seq] = _Slot(op)
            if slot.op != op:
                others = sorted(slot.deposits)
                raise TransportError(
                    f"collective mismatch at call #{seq}: rank {rank} called {op} but "
                    f"rank(s) {others} called {slot.op}; every rank must issue the same "
                    "collectives in the same order")
            slot.deposits[rank] = value
            self._cond.notify_all()
            while len(slot.deposits) < self.size:
                missing = [r for r in range(self.size) if r not in slot.deposits]
                gone = {r: self._gone(r) for r in missing if self._gone(r) is not None}
                if gone:
                    why = "; ".join(f"rank {r} {g}" for r, g in sorted(gone.items()))
                    raise PeerError(
                        f"rank {rank}: {op} (call #{seq}) cannot complete: {why}",
                        ranks=sorted(gone))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerError(
                        f"rank {rank}: {op} (call #{seq}) timed out after {timeout:.3g}s "
                        f"waiting for rank(s) {missing}, which did not join it (stalled "
                        "or issuing a different number of collectives)", ranks=missing)
                self._cond.wait(remaining)
            deposits = dict(slot.deposits)
            slot.readers += 1
            if slot.readers == self.size:
                del self._slots[seq]
            return deposits


class InProcTransport(Transport):
    """One rank of an ``InProcGroup``; use it from one thread at a time."""

    def __init__(self, group: InProcGroup, rank: int):
        self.group = group
        self.rank = rank
        self.size = group.size
        self._seq = 0
        self._closed: Optional[str] = None

    def _call(self, op: str, value: Any, timeout: float) -> Dict[int, Any]:
        if self._closed is not None:
            raise TransportError(f"rank {self.rank}: transport unusable: {self._closed}")
        if timeout is None or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        seq = self._seq
        self._seq += 1
        try:
            return self.group._exchange(self.rank, seq, op, value, timeout)
        except TransportError as e:
            self._closed = f"an earlier {op} failed: {e}"
            raise

    def alltoallv(self, send: Sequence[Optional[torch.Tensor]], recv_nbytes: Sequence[int],
                  timeout: float = DEFAULT_TIMEOUT, tag: Optional[str] = None
                  ) -> List[Optional[torch.Tensor]]:
        counts, rcounts = self._alltoallv_counts(send, recv_nbytes)
        mine = [t.clone() if n else None for t, n in zip(send, counts)]
        deposits = self._call("alltoallv", (mine, rcounts), timeout)
        out: List[Optional[torch.Tensor]] = []
        for p in range(self.size):
            if p == self.rank:
                out.append(self._own_message(send))
                continue
            got = deposits[p][0][self.rank]
            nbytes = 0 if got is None else got.numel()
            if nbytes != int(recv_nbytes[p]):
                raise TransportError(
                    f"rank {self.rank}: alltoallv expected {int(recv_nbytes[p])} bytes from "
                    f"rank {p} but rank {p} sent {nbytes}; recv_nbytes must match the "
                    "peers' send sizes")
            out.append(got.clone() if got is not None else None)
        return out

    def allgather(self, tensor: torch.Tensor, timeout: float = DEFAULT_TIMEOUT
                  ) -> List[torch.Tensor]:
        deposits = self._call("allgather", tensor.detach().clone(), timeout)
        ref = deposits[0]
        for r in range(self.size):
            d = deposits[r]
            if d.shape != ref.shape or d.dtype != ref.dtype:
                raise TransportError(
                    f"allgather needs equal shapes and dtypes: rank 0 has {tuple(ref.shape)} "
                    f"{ref.dtype}, rank {r} has {tuple(d.shape)} {d.dtype}")
        return [deposits[r].clone().to(tensor.device) for r in range(self.size)]

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        self._check_root(root)
        value = tensor.detach().clone() if self.rank == root else None
        deposits = self._call(f"broadcast(root={root})", value, timeout)
        if self.rank != root:
            src = deposits[root]
            if src.shape != tensor.shape:
                raise TransportError(f"broadcast: root {root} sent shape {tuple(src.shape)}, "
                                     f"rank {self.rank} expected {tuple(tensor.shape)}")
            tensor.copy_(src)
        return tensor

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        self._check_op(op, _REDUCE_OPS)
        deposits = self._call(f"allreduce({op})", tensor.detach().clone(), timeout)
        acc = deposits[0].clone()
        for r in range(1, self.size):  # rank order: bitwise-identical on every rank
            d = deposits[r]
            if d.shape != acc.shape:
                raise TransportError(f"allreduce shapes differ: rank 0 {tuple(acc.shape)}, "
                                     f"rank {r} {tuple(d.shape)}")
            if op == "sum":
                acc.add_(d)
            elif op == "max":
                torch.maximum(acc, d, out=acc)
            else:
                torch.minimum(acc, d, out=acc)
        tensor.copy_(acc)
        return tensor

    def barrier(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._call("barrier", None, timeout)

    def split(self) -> "InProcTransport":
        """An independent channel: this rank's transport in the group's next child group."""
        self._splits = getattr(self, "_splits", 0) + 1
        return self.group._child(self._splits - 1).transports[self.rank]

    def close(self) -> None:
        if self._closed is None:
            self._closed = "closed"
            self.group.mark_exited(self.rank, "closed its transport")


def run_threads(fn: Callable[[InProcTransport], Any], size: int,
                timeout: float = 60.0) -> List[Any]:
    """Run ``fn(transport)`` on ``size`` in-process ranks, one thread each.

    A rank whose ``fn`` raises is marked failed and a rank whose ``fn``
    returns is marked exited, so peers still waiting for it raise
    ``PeerError`` naming it instead of hanging.

    Args:
        fn: called as ``fn(transport)``; ``transport.rank`` tells the rank.
        size: number of ranks.
        timeout: seconds for all threads together.

    Returns:
        ``fn``'s return value for each rank, index = rank.

    Raises:
        Exception: the first exception raised by any rank (in time), re-raised
            as is with ``.rank`` set (and a note on Python 3.11+), so a
            failing rank's ``ValueError`` is still a ``ValueError``.
        TimeoutError: some threads were still running after ``timeout``
            (they are daemon threads and are abandoned).

    Example:
        >>> run_threads(lambda t: t.allreduce(torch.ones(1)).item(), 3)
        [3.0, 3.0, 3.0]
    """
    group = InProcGroup(size)
    results: List[Any] = [None] * size
    errors: List[tuple] = []  # (time, rank, exc), appended in completion order
    lock = threading.Lock()

    def body(rank: int) -> None:
        try:
            results[rank] = fn(group.transports[rank])
        except BaseException as e:  # noqa: B036 - report every failure, then the thread ends
            with lock:
                errors.append((time.monotonic(), rank, e))
            group.mark_failed(rank, f"{type(e).__name__}: {e}")
            return
        group.mark_exited(rank)

    threads = [threading.Thread(target=body, args=(r,), name=f"inproc-rank{r}", daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if errors:
        errors.sort(key=lambda x: x[0])
        # The earliest failure is the cause; later PeerErrors are its echoes.
        _, rank, exc = errors[0]
        for r, e in ((r, e) for _, r, e in errors[1:]):
            log.debug("rank %s also failed: %r", r, e)
        try:
            exc.rank = rank  # type: ignore[attr-defined]
        except AttributeError:
            pass
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised on in-process rank {rank} of {size})")
        raise exc
    if alive:
        raise TimeoutError(f"run_threads: rank(s) {alive} still running after {timeout}s")
    return results
