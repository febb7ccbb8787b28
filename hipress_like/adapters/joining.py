"""Ranks build a distributed optimizer together: one that fails tells the others.

Building ``DistributedOptimizer`` is a collective: every rank opens the
engine's transport (a new process group) and registers its gradients. A
rank that raised before that point (a bad option, a parameter list that
does not resolve) left its peers waiting in the new group's rendezvous
until a bare ``DistStoreError`` after 20 s, naming no rank. And ranks that
chose different modes (partial aggregation on some ranks only) went into
different first exchanges.

So each construction has one meeting point, ``Joining.ready()``, called
just before the transport opens, after every check a rank can make alone.
Every rank gets there exactly once: on success through ``ready()``, on a
local failure through the ``with`` block's exit, which sends the failure
instead. The meeting is one allgather of a small msgpack record
(``agreement.pack_call``) over the runtime's default group, so it costs
one round trip per optimizer built, and:

- a rank that failed raises its own error; every other rank raises an
  ``EngineError`` naming that rank and its error, within one round trip;
- ranks that agree on everything but a mode (``stragglers``) raise a
  ``CollectiveMismatchError`` naming the mode and the ranks, on every rank.

A failure after ``ready()`` (in the engine's own registration) is the
engine's to report: its transport waits with the timeout and names peers.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from ..casync.errors import EngineError
from .agreement import disagreement
from .collectives import _gather_records, _Wire

__all__ = ["Joining"]

log = logging.getLogger(__name__)

# Room left in the 256-byte record for a failure's text (type and message).
_FAILURE_CHARS = 120


class Joining:
    """One collective construction (``with Joining(...) as j: ...; j.ready()``).

    Args:
        what: the construction, as errors name it (``"DistributedOptimizer"``).
        **fields: what every rank must agree on (plain values), e.g.
            ``stragglers=repr(quorum)``.

    Example:
        >>> with Joining("DistributedOptimizer", stragglers=None) as joining:
        ...     check_options()          # a local failure reaches every peer
        ...     joining.ready()          # all ranks checked out: open the transport
    """

    def __init__(self, what: str, **fields: Any):
        self.what = what
        self.fields: Dict[str, Any] = dict(fields)
        self.done = False

    def __enter__(self) -> "Joining":
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        if isinstance(error, Exception) and not self.done:
            try:
                self._meet(error)
            except Exception as e:  # the peers may be gone too; this rank's error stands
                log.debug("%s: could not tell the peers about this rank's failure: %s",
                          self.what, e)
        return False

    def ready(self) -> None:
        """Meet the other ranks after this rank's local checks passed.

        Raises:
            EngineError: another rank failed while building (names it and its error).
            CollectiveMismatchError: the ranks chose different modes.
        """
        self._meet(None)

    def _meet(self, error: Optional[BaseException]) -> None:
        self.done = True
        wire = _Wire()
        if wire.size == 1:
            return
        record = dict(self.fields, collective=self.what)
        if error is not None:
            record["failed"] = f"{type(error).__name__}: {error}"[:_FAILURE_CHARS]
        records = _gather_records(wire, f"{self.what} (the ranks' meeting)", record)
        if error is not None:
            return  # this rank raises its own error
        failed = {r: rec["failed"] for r, rec in enumerate(records) if "failed" in rec}
        if failed:
            raise EngineError(
                f"{self.what}: rank(s) {sorted(failed)} failed while building it ("
                + "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failed.items()))
                + "), so this rank stops too; fix the error on those ranks (their own "
                "tracebacks have it in full)", ranks=sorted(failed))
        err = disagreement(self.what, records, fix=(
            f"Expected every rank to build {self.what} with the same options; pass the same "
            f"{', '.join(f'{k}=' for k in sorted(self.fields))} on every rank"))
        if err is not None:
            raise err
