"""The job's rendezvous store as a ``KeyValueStore``, for every transport.

``hpt.init()`` sets torch.distributed up under every launcher (torchrun,
mpirun, horovodrun), so its rendezvous store (a c10d TCPStore hosted by
global rank 0) is there for protocols built on any transport: the
coordinator's quorum rounds, heartbeats, abort keys. ``C10dStore`` wraps
it so that a call that cannot reach it raises ``PeerError`` naming its
host; ``rendezvous_store`` opens one over a client connection of its own
(``own_store_client``: a blocking call in the main thread must not hold up
this rank's heartbeats); ``RendezvousStoreMixin`` gives the MPI and Horovod
transports ``Transport.store`` from it.
"""
from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch.distributed as dist

from .base import KeyValueStore, NoStoreError, PeerError

__all__ = ["C10dStore", "RendezvousStoreMixin", "own_store_client", "rendezvous_store",
           "store_address", "post_abort", "read_aborts"]

log = logging.getLogger(__name__)


def rendezvous_store(prefix: str, host_rank: Optional[int] = 0) -> "C10dStore":
    """The job's rendezvous store under ``prefix``, over a client connection of its own.

    ``hpt.init()`` sets torch.distributed up under every launcher, so the MPI
    and Horovod transports hand out the same store as this one.

    Args:
        prefix: key prefix.
        host_rank: the store host's rank in the caller's group (global rank 0).

    Raises:
        NoStoreError: torch.distributed is not initialised (no rendezvous store).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise NoStoreError(
            "no rendezvous store: torch.distributed is not initialised in this process; "
            "expected hpt.init() (or dist.init_process_group) to have run first")
    return C10dStore(dist.PrefixStore(prefix, own_store_client()), host_rank=host_rank,
                     where=store_address())


def post_abort(store: Any, key: str, rank: int, reason: str, limit: int = 2000,
               wait: float = 2.0) -> bool:
    """Post this rank's abort: ``reason`` (its first ``limit`` characters) at
    ``key/<rank>``, then the counter at ``key`` moves (the torch.distributed and Horovod
    transports' ``abort``). From a daemon thread, waited for ``wait`` seconds at most:
    a dead store host must not hold up the error.

    Returns:
        Whether both writes landed.
    """
    posted = threading.Event()

    def post() -> None:
        try:
            store.set(f"{key}/{rank}", reason[:limit].encode("utf-8", "replace"))
            store.add(key, 1)
            posted.set()
        except Exception as e:  # the store host may be gone
            log.debug("could not post the abort: %s", e)

    t = threading.Thread(target=post, daemon=True, name="hipress-abort")
    t.start()
    t.join(wait)
    return posted.is_set()


def read_aborts(store: Any, key: str, size: int, me: int) -> Dict[int, str]:
    """The reasons the other ranks posted with ``post_abort`` under ``key`` (rank -> text)."""
    found = {}
    for r in range(size):
        k = f"{key}/{r}"
        if r != me and store.check([k]):
            found[r] = store.get(k).decode("utf-8", "replace")
    return found


class RendezvousStoreMixin:
    """``Transport.store`` for transports that are not torch.distributed's (MPI,
    Horovod): the job's rendezvous store, which ``hpt.init()`` sets up under
    every launcher, hosted by global rank 0."""

    def store(self, prefix: str) -> "C10dStore":
        """The job's rendezvous store under ``prefix`` (``rendezvous_store``)."""
        return rendezvous_store(prefix)


class C10dStore(KeyValueStore):
    """``KeyValueStore`` over a c10d store (``TorchDistTransport.store``).

    Args:
        store: the c10d store (usually a ``dist.PrefixStore``).
        host_rank: the rank (of the transport's group) hosting the store,
            named when a call cannot reach it; None if it is not a member.
        where: the store's address, for messages.
    """

    def __init__(self, store: dist.Store, host_rank: Optional[int], where: str) -> None:
        self._store = store
        self.host_rank = host_rank
        self.where = f"the rendezvous store ({where}, hosted by global rank 0)"

    def _call(self, op: str, fn: Callable[[], Any]) -> Any:
        """Run one store operation; a failure to reach the store names its host.

        Raises:
            PeerError: the store cannot be reached (``ranks``: its host).
        """
        try:
            return fn()
        except (dist.DistError, ConnectionError, TimeoutError, OSError) as e:
            cause = str(e).splitlines()[0] if str(e) else type(e).__name__
            ranks = [] if self.host_rank is None else [self.host_rank]
            raise PeerError(
                f"{self.where}: {op} failed ({type(e).__name__}: {cause[:300]}); expected "
                "the store to answer, found it unreachable: its host, global rank 0, has "
                "died or stalled (see rank 0's log for why); the ranks cannot agree on "
                "anything without it, so restart the job (from a checkpoint)",
                ranks=ranks) from e

    def add(self, key: str, amount: int) -> int:
        """``Transport.store``'s atomic counter add; the new value."""
        return int(self._call(f"add({key!r})", lambda: self._store.add(key, amount)))

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key is set (never waits)."""
        return bool(self._call(f"check({list(keys)!r})", lambda: self._store.check(list(keys))))

    def get(self, key: str) -> bytes:
        """The value at ``key``."""
        return self._call(f"get({key!r})", lambda: self._store.get(key))

    def compare_set(self, key: str, expected: Union[str, bytes],
                    desired: Union[str, bytes]) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; the value it holds after."""
        return self._call(f"compare_set({key!r})",
                          lambda: self._store.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; True if it was set."""
        return bool(self._call(f"delete_key({key!r})", lambda: self._store.delete_key(key)))


def store_address() -> str:
    """host:port of the default group's store when it is a TCPStore, else its type."""
    base = dist.distributed_c10d._get_default_store()
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return f"{base.host}:{base.port}"
    return type(base).__name__


def own_store_client() -> dist.Store:
    """A client connection of our own to the default group's store, if it is a TCPStore.

    A store client runs one operation at a time; with a shared client, a
    blocking ``get``/``wait`` in the main thread (e.g. another ``new_group``)
    would hold up our heartbeats and make this rank look dead.
    """
    default = dist.distributed_c10d._get_default_store()
    base = default
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        try:
            return dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=30))
        except Exception as e:  # fall back to sharing the default client
            log.debug("could not open a second store client: %s", e)
    return default
