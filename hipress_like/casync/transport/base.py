"""The one small interface CaSync talks to (DESIGN.md, "Transports").

Every collective takes a ``timeout`` in seconds. A peer that dies or stalls
makes the call raise ``PeerError`` naming the peer(s) on every surviving rank,
so nothing hangs. Only ``torch.uint8`` payloads and int64/float tensors cross
the wire; nothing received is unpickled.

Besides the collectives, a transport may offer ``store(prefix)``: a small
key-value store shared by its ranks (atomic counters, compare-and-set), for
protocols that agree on something without a collective (partial
aggregation's step closing, ``hipress_like.partial``). Transports without
one raise ``NoStoreError``.

Implementations: ``inproc`` (threads, for fast unit tests), ``torch_dist``
(torch.distributed; gloo on CPU, NCCL on GPU), ``mpi`` (mpi4py) and
``horovod``. One transport instance is used by one thread at a time (the
engine's communication executor); callers serialise access.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ...errors import HipressError

__all__ = ["Transport", "TransportError", "PeerError", "DEFAULT_TIMEOUT", "KeyValueStore",
           "NoStoreError"]

# Long enough for a 1 GB exchange on a slow link, short enough that a dead
# peer is reported within minutes rather than never.
DEFAULT_TIMEOUT = 300.0


class TransportError(HipressError, RuntimeError):
    """A collective failed (timeout, closed connection, misuse)."""


class PeerError(TransportError):
    """A collective failed because of specific peer(s); ``ranks`` names them."""

    def __init__(self, message: str, ranks: Sequence[int] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class NoStoreError(TransportError, NotImplementedError):
    """The transport has no key-value store shared by its ranks (``Transport.store``)."""


class KeyValueStore(ABC):
    """A key-value store shared by a transport's ranks, under one key prefix.

    Every rank that opens it with the same prefix sees the same keys. A call
    that cannot reach the store raises ``PeerError`` naming the rank that
    hosts it (when the transport knows which), so a protocol built on it
    can say which rank is gone. ``where`` describes the store for messages.
    """

    where: str = "the key-value store"

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 when unset) atomically; the new value."""

    @abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """True when every key in ``keys`` is set (never waits)."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The value at ``key`` (set: call ``check`` first; an unset key may wait)."""

    @abstractmethod
    def compare_set(self, key: str, expected: Union[str, bytes],
                    desired: Union[str, bytes]) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: unset); the value
        it holds afterwards, so every rank reads the first writer's value."""

    @abstractmethod
    def delete_key(self, key: str) -> bool:
        """Remove ``key``; True if it was set."""


class Transport(ABC):
    """Collectives over bytes between ``size`` ranks; this process is ``rank``."""

    rank: int
    size: int

    @abstractmethod
    def alltoallv(
        self, send: Sequence[Optional[torch.Tensor]], recv_nbytes: Sequence[int],
        timeout: float = DEFAULT_TIMEOUT, tag: Optional[str] = None,
    ) -> List[Optional[torch.Tensor]]:
        """Bulk exchange with per-peer sizes.

        Args:
            send: for each peer p, a 1-D uint8 tensor to send to p (or None /
                empty for nothing). ``send[self.rank]`` is returned as is.
            recv_nbytes: for each peer p, how many bytes p sends here (0 for
                none); every rank must agree with its peers' ``send`` sizes.
            timeout: seconds before raising ``PeerError``.
            tag: optional name of the exchange's whole shape (every link's
                bytes), the same on every rank; transports that match calls
                by name (Horovod) use it to reuse the set-up of an exchange
                of the same shape. Others ignore it.

        Returns:
            For each peer, the received 1-D uint8 tensor (None where 0 bytes).
        """

    def _alltoallv_counts(self, send: Sequence[Optional[torch.Tensor]],
                          recv_nbytes: Sequence[int]) -> Tuple[List[int], List[int]]:
        """Check ``alltoallv``'s arguments (every transport's, in this one place) and
        size the exchange.

        Returns:
            ``(send_counts, recv_counts)`` in bytes per peer, 0 for this rank's
            own slot (it never crosses the wire: ``_own_message``).

        Raises:
            ValueError: not one entry per rank, or a negative count.
            TypeError: a send entry that is not a 1-D uint8 tensor.
        """
        if len(send) != self.size or len(recv_nbytes) != self.size:
            raise ValueError(f"alltoallv needs {self.size} send entries and recv sizes (one "
                             f"per rank), got {len(send)} and {len(recv_nbytes)}")
        counts = []
        for p, t in enumerate(send):
            if t is not None and (t.dtype != torch.uint8 or t.dim() != 1):
                raise TypeError(f"alltoallv send[{p}] must be a 1-D torch.uint8 tensor, got "
                                f"{t.dtype} with shape {tuple(t.shape)}; send payload bytes "
                                "(tensor.view(torch.uint8).reshape(-1))")
            counts.append(0 if t is None or p == self.rank else t.numel())
        rcounts = [0 if p == self.rank else int(n) for p, n in enumerate(recv_nbytes)]
        if any(n < 0 for n in rcounts):
            raise ValueError(f"recv_nbytes must be >= 0 (bytes expected from each rank), got "
                             f"{list(recv_nbytes)}")
        return counts, rcounts

    def _own_message(self, send: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """What ``alltoallv`` returns in this rank's own slot: its send entry, or None
        when that is missing or empty (as for a peer that sends nothing)."""
        own = send[self.rank]
        return None if own is None or own.numel() == 0 else own

    @staticmethod
    def _copy_back(tensor: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """Finish an in-place collective run on ``buf``, ``tensor`` itself or its
        staging copy (contiguous, on the host or the transport's device): copy the
        result into ``tensor`` when they differ; return ``tensor``."""
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def _check_root(self, root: int) -> None:
        """``broadcast``'s root must be a rank of this transport."""
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast root must be in [0, {self.size}), got {root}")

    @staticmethod
    def _check_op(op: str, ops: Sequence[str]) -> None:
        """``allreduce``'s op must be one this transport has (``ops``)."""
        if op not in ops:
            raise ValueError(f"unknown reduce op {op!r}; available: {', '.join(ops)}")

    @abstractmethod
    def allgather(self, tensor: torch.Tensor, timeout: float = DEFAULT_TIMEOUT
                  ) -> List[torch.Tensor]:
        """Gather an equally-shaped tensor from every rank; list index = rank."""

    def allgather_bytes(self, data: bytes, timeout: float = DEFAULT_TIMEOUT) -> List[bytes]:
        """Gather variable-length byte strings (two allgathers: sizes, then padded data)."""
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [int(s.item()) for s in self.allgather(n, timeout)]
        buf = torch.zeros(max(sizes) or 1, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = self.allgather(buf, timeout)
        return [p[:s].numpy().tobytes() for p, s in zip(parts, sizes)]

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        """Broadcast ``tensor`` from ``root`` in place; return it."""

    @abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: str = "sum", timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        """Reduce ``tensor`` in place across ranks (op: sum, max, min); return it."""

    @abstractmethod
    def barrier(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Wait until every rank arrives."""

    def _begin_call(self, timeout: float) -> int:
        """The prologue of every collective: refuse a broken transport, check the
        timeout, and number the call (peers' calls with the same number meet).

        Implementations keep ``_broken`` (None, or why the transport is unusable)
        and ``_seq`` (the next call number).
        """
        broken = getattr(self, "_broken", None)
        if broken is not None:
            raise TransportError(f"rank {self.rank}: transport unusable: {broken}")
        if timeout is None or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        seq = getattr(self, "_seq", 0)
        self._seq = seq + 1
        return seq

    def store(self, prefix: str) -> KeyValueStore:
        """A key-value store shared by this transport's ranks, its keys under ``prefix``.

        Not a collective: every rank opens its own client, and ranks that use the
        same ``prefix`` share the keys. Each call opens a new client, so callers on
        different threads do not wait on each other's store operations.

        Raises:
            NoStoreError: this transport has none (the default).
        """
        raise NoStoreError(
            f"{type(self).__name__} has no key-value store shared by its ranks, and partial "
            "aggregation (stragglers=Quorum(...)) agrees on each step's contributors through "
            "one; found a transport without it, expected one that has it: run the job over "
            "torch.distributed (HIPRESS_TRANSPORT=torch)")

    def split(self) -> "Transport":
        """A new, independent channel over the same ranks (collective: every rank calls it).

        The engine exchanges round metadata on one channel while the bulk data
        of the previous round moves on another (HiPress Sec. 3.2: planning
        round r+1 overlaps executing round r). Transports that cannot open a
        second channel raise ``NotImplementedError`` and the engine runs the
        two phases one after the other.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot open a second channel")

    def free(self, timeout: float = 10.0, watch: Sequence["Transport"] = ()) -> bool:
        """Close, and release what the backend holds for this channel once every rank has.

        Every rank calls it when it is done with the channel. Transports whose
        channels hold backend resources (a process group's connections and
        threads) wait up to ``timeout`` for all ranks to have closed, by a
        side channel rather than a collective (a collective could pair up
        with a peer's unfinished operation), and then release them. The engine frees
        the channel it opened with ``split()`` this way: a process that builds
        many engines (the profiler, benchmarks) would otherwise keep one
        backend group per engine until it exits.

        Args:
            timeout: seconds to wait for the peers to close.
            watch: other transports of this rank whose peers, if found waiting
                in a collective this rank left (``peers_waiting``), end the
                wait at once.

        Returns:
            True if released (or nothing to release); False if a peer did not
            close in time (the resources are left to process exit).
        """
        self.close()
        return True

    def peers_waiting(self) -> List[int]:
        """Peers known to wait in a collective this rank has not entered (a transport
        that cannot tell returns [])."""
        return []

    def abort(self, reason: str) -> bool:
        """Tell every peer, at once and by a side channel, that this rank failed and why.

        Called by the engine when an error arises on this rank inside its
        communication (an exception in the bulk exchange, a damaged message):
        peers blocked in a collective that this rank will never complete then
        raise ``PeerError`` naming this rank and ``reason`` within about a
        heartbeat, instead of at their timeout. Channels from ``split()``
        share their parent's abort. Not a collective, never blocks for long.
        A transport without a side channel does nothing (the default): its
        peers learn of the failure by their timeout and diagnosis.

        Returns:
            Whether the peers were told (then this rank need not report its
            error in a metadata round, which the peers, gone, would not join).
        """
        return False

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release resources; further calls raise ``TransportError``."""
