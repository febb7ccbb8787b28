"""The quorum lane: a step closes once a quorum of ranks has contributed.

THC Sec. 6.1 and 8.3 (../shared/papers/000_43c153e10c254c2a.txt): the
aggregator proceeds once it holds the payloads of a fraction of the workers
(the paper waits for the top 90%), drops what arrives later, and every
worker applies the same partial aggregate; periodic model synchronisation
guards against anything that could still make replicas differ.

Where the aggregators sit. The paper's aggregator is a switch or a
dedicated PS, which a slow worker cannot hold up. Here every rank
aggregates, in a lane thread beside its training loop, so a rank whose
*computation* is late (Sec. 8.3's straggler) still serves every exchange on
time: its lane sits the step out, joins the exchange with an empty slot,
and decodes the same aggregate as everyone else. Co-located aggregation
therefore needs no dedicated ranks as long as a straggler's process keeps
running; a rank whose process stops altogether stalls every exchange until
the transport's timeout names it (no quorum can help there: its lane is
one of the aggregators). The store below is the transport's
(``transport.store``, the rendezvous store for torch.distributed); its host
is global rank 0, so when rank 0 dies every survivor's lane fails at its
next store call, and the error names rank 0 and the store.

One step s on every rank's lane, in step order (the states of a step:
open -> closed, contributor set fixed -> done, aggregate decoded; the
optimizer then applies it):

1. open: the lane waits until its rank submits step s's gradient, or until
   s is closed. A rank that submits registers in the store with
   ``add(m/s, 2^rank)``: each rank adds its own bit once, so the counter is
   the set of registered ranks.
2. close: every waiting rank reads the set. The step closes when every rank
   is in, or when at least q = ceil(fraction * N) are and ``deadline``
   seconds have passed since this rank first saw q. Closing is
   ``compare_set(c/s, "", set)``: the first writer wins and every rank reads
   that one value, so all agree on the contributors M even when a late rank
   registers while another rank closes.
3. exchange: the compressor's rounds, each an allgather over the lane's own
   transport (members send their payload, the others an empty slot of the
   same size; a round's sizes travel first unless the compressor declares
   ``fixed_size`` and one exchange taught them), and every rank merges the
   members' payloads in rank order with ``merge_round`` (THC: integer sums
   of table values, never decoded), so every rank holds the same bytes.
   Ranks outside M get what decoding needs from ``absent_round``.
   Single-round compressors: the members' payloads decoded and summed in
   rank order (any compressor; its decode needs no state).
4. done: the sum divided by |M| (``missing="rescale"``, the count actually
   summed) or by N (``missing="zeros"``, a missing rank counts as zeros).
   A gradient submitted after its step closed is dropped and counted.

Every rank thus applies the same aggregates in the same order, so replicas
stay bitwise identical; the optimizer front end (``adapters/torch/quorum``)
lets a late rank apply the steps that closed without it instead of
computing them, which is how it catches up.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import statistics
import threading
import time
import zlib
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..casync.transport.base import PeerError
from ..compressors.base import CONTRIBUTORS, STEP_SEED, Compressor, State, mix_seed
from ..errors import HipressError
from .settings import Quorum, check_compressor

__all__ = ["Quorum", "QuorumLane", "QuorumError", "check_compressor"]

log = logging.getLogger(__name__)

# Lanes are created collectively in the same order on every rank, so this
# per-process counter gives every rank the same store prefix for one lane.
_instances = itertools.count()


_MOVED = ("moved",)  # ``_close``: load_state_dict moved the step count


class QuorumError(HipressError, RuntimeError):
    """The lane failed (a peer vanished, a payload was refused); training cannot go on.

    Attributes:
        ranks: the ranks found gone or stalled (from the transport's or the
            store's ``PeerError``); empty when the cause names none.
    """

    def __init__(self, message: str, ranks: Tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


def _lane_failed(rank: int, cause: BaseException) -> QuorumError:
    """The error the training loop gets when the lane failed because of ``cause``:
    it names this rank and, when the transport or its store knows them
    (``PeerError.ranks``), the ranks that are gone; the store's host (global
    rank 0) when the store could not be reached."""
    ranks = tuple(getattr(cause, "ranks", ())) if isinstance(cause, PeerError) else ()
    who = f" because rank(s) {list(ranks)} are gone or stalled" if ranks else ""
    return QuorumError(f"rank {rank}: partial aggregation failed{who}: {cause}", ranks=ranks)


@dataclasses.dataclass
class _Done:
    """A finished step: its aggregate (flat, the gradient's dtype) and contributor set."""

    aggregate: Optional[torch.Tensor]  # None: no rank contributed, the step is skipped
    members: Tuple[int, ...]


class QuorumLane:
    """Synchronises one flat gradient per step under a quorum (module docstring).

    Args:
        comp: the compressor (single-round, or multi-round declaring
            ``capabilities.absent_rounds``).
        numel, dtype: the flat gradient's size and dtype.
        transport: a transport of the lane's own (its allgathers run on the
            lane thread only), with a key-value store (``transport.store``):
            the lane opens one of its own there, shared by all ranks.
        rank, size: this rank and N.
        quorum: the settings.
        seed: compressor seed (the same on every rank; mixed with the rank).
        timeout: seconds a registered rank waits for a step to close before
            the lane fails (a peer that never arrives).

    Raises:
        ValueError: a multi-round compressor that cannot sit a step out.
        hipress_like.casync.transport.NoStoreError: the transport has no
            key-value store.
    """

    def __init__(self, comp: Compressor, numel: int, dtype: torch.dtype, transport: Any,
                 rank: int, size: int, quorum: Quorum, seed: int = 0,
                 timeout: float = 300.0) -> None:
        check_compressor(comp)
        self.comp, self.numel, self.dtype = comp, int(numel), dtype
        self.transport, self.rank, self.size = transport, rank, size
        self.quorum, self.timeout = quorum, float(timeout)
        self.store = transport.store(f"hipress/quorum/{next(_instances)}/")
        self.needed = quorum.needed(size)
        self._out = torch.zeros(self.numel, dtype=dtype)
        self._shared = mix_seed(seed, 0x7175)  # "qu": the steps' shared seeds derive from it
        kw: Dict[str, Any] = {"world_size": size}
        caps = comp.capabilities
        if caps.shared_randomness:
            kw["shared_seed"] = self._shared
        self._state: State = comp.init(self._out, seed=mix_seed(seed, rank), **kw)
        self._sizes: Dict[int, int] = {}  # round -> payload bytes (fixed-size compressors)
        self._cond = threading.Condition()
        self._store_lock = threading.Lock()  # the store client is shared with ``awaited``
        self._grads: Dict[int, torch.Tensor] = {}
        self._abstain: set = set()  # steps this rank sends nothing for (NaN/Inf)
        self._done: Dict[int, _Done] = {}
        self._next = 0  # the step the lane works on
        self._durations: List[float] = []
        self._error: Optional[BaseException] = None
        self._stop = False
        self.counters = {"steps": 0, "contributed": 0, "dropped": 0, "sat_out": 0,
                         "partial": 0, "missing": 0}
        self._check_peers()
        self._thread = threading.Thread(target=self._run, name="hipress-quorum", daemon=True)
        self._thread.start()

    def _check_peers(self) -> None:
        """Every rank must run the same lane: the gradient's size and dtype, the
        compressor and the quorum settings are compared once (an allgather).

        Raises:
            ValueError: naming what differs and on which ranks.
        """
        def crc(obj: Any) -> int:
            return zlib.crc32(repr(obj).encode())

        mine = (self.numel, crc(self.dtype), crc(self.comp), crc(self.quorum))
        got = self.transport.allgather(torch.tensor(mine, dtype=torch.int64), self.timeout)
        rows = [tuple(int(v) for v in t.tolist()) for t in got]
        for i, what in enumerate(("gradient elements", "dtype", "compressor", "Quorum")):
            if len({r[i] for r in rows}) > 1:
                detail = (f": {[r[0] for r in rows]} by rank" if i == 0 else
                          f" (this rank: {[self.numel, self.dtype, self.comp, self.quorum][i]})")
                raise ValueError(f"stragglers: the ranks' {what} differ{detail}; every rank "
                                 "must build DistributedOptimizer with the same parameters, "
                                 "compression and stragglers settings")

    # -- the training loop's side ------------------------------------------------------
    def submit(self, step: int, flat: torch.Tensor) -> None:
        """Hand in this rank's gradient of ``step`` (kept until the step is done;
        do not change it before ``result(step)`` returns)."""
        with self._cond:
            self._raise()
            if step < self._next:
                self.counters["dropped"] += 1  # that step closed without us
                return
            self._grads[step] = flat
            self._cond.notify_all()

    def abstain(self, step: int) -> None:
        """Say that this rank sends nothing for ``step`` (its gradient was NaN/Inf), so
        the step may close without waiting for it; a step every rank abstains from
        closes with no contributor and is skipped (``result`` gives None)."""
        with self._cond:
            self._raise()
            if step >= self._next:
                self._abstain.add(step)
                self._cond.notify_all()

    def ready(self, step: int) -> bool:
        """True when ``step`` is done (``result`` would not wait)."""
        with self._cond:
            return step in self._done

    def awaited(self, step: int) -> bool:
        """True when some rank has submitted ``step`` (so every rank will train it and it
        will close): a late rank may then wait for it instead of computing it.

        Raises:
            QuorumError: the store could not be reached (naming its host).
        """
        try:
            with self._store_lock:
                return self.store.add(f"m/{step}", 0) != 0
        except PeerError as e:
            raise _lane_failed(self.rank, e) from e

    def result(self, step: int) -> Tuple[Optional[torch.Tensor], Tuple[int, ...]]:
        """Wait for ``step``: (its averaged flat gradient, or None when no rank
        contributed, and the contributing ranks).

        Raises:
            QuorumError: the lane failed.
        """
        t0 = time.monotonic()
        with self._cond:
            while step not in self._done:
                self._raise()
                if not self._thread.is_alive():
                    raise QuorumError("the quorum lane stopped (the optimizer was closed)")
                if time.monotonic() - t0 > self.timeout:
                    raise QuorumError(
                        f"step {step} was not done within {self.timeout:.0f} s (the lane is "
                        f"at step {self._next}; fewer than {self.needed} ranks arrive)")
                self._cond.wait(0.5)
            d = self._done.pop(step)
            mine = self._grads.pop(step, None)
            if mine is not None and self.rank not in d.members:
                self.counters["dropped"] += 1  # submitted, but the step closed first
            return d.aggregate, d.members

    def close(self) -> None:
        """Stop the lane thread (every rank, after its last step)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10.0)

    def state_dict(self) -> Dict[str, Any]:
        """The compressor state and the step count (this rank's own)."""
        with self._cond:
            return {"state": self._state, "next": self._next, "counters": dict(self.counters)}

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """Resume: the compressor state and the step count (``saved["applied"]``; every
        rank must resume at the same step). Only before the first step.

        Raises:
            RuntimeError: a step was already submitted or done.
        """
        with self._cond:
            if self._grads or self._done or self.counters["steps"]:
                raise RuntimeError("stragglers: load the state dict before the first step()")
            self._state = saved["state"]
            self._next = int(saved.get("applied", saved.get("next", 0)))
            self._cond.notify_all()

    # -- the lane thread -------------------------------------------------------------------
    def _raise(self) -> None:
        if self._error is not None:
            raise _lane_failed(self.rank, self._error) from self._error

    def _run(self) -> None:
        try:
            while True:
                members = self._close(self._next)
                if members is None:
                    return
                if members is _MOVED:  # load_state_dict moved the step count: wait on that step
                    continue
                agg = self._exchange(self._next, members)
                with self._cond:
                    self._done[self._next] = _Done(agg, members)
                    self._next += 1
                    self._cond.notify_all()
        except BaseException as e:  # surfaced to the training loop by result()/submit()
            with self._cond:
                self._error = e
                # a lane waiting on a step nobody submitted (after the last step) sees
                # the job's store go as ranks exit: that is no failure of anyone's
                idle = not self._grads
                self._cond.notify_all()
            (log.debug if idle else log.error)("quorum lane stopped: %s", e)

    def _deadline(self) -> float:
        if self.quorum.deadline is not None:
            return float(self.quorum.deadline)
        if len(self._durations) < 3:
            return math.inf  # warm-up: wait for everyone
        return max(0.002, 0.25 * statistics.median(self._durations[-16:]))

    def _close(self, s: int) -> Optional[Tuple[int, ...]]:
        """Wait until step ``s`` closes; its contributors (None: stopping)."""
        mkey, ckey, akey = f"m/{s}", f"c/{s}", f"a/{s}"
        registered, seen_q, t_reg = False, None, None
        t0 = time.monotonic()
        deadline = self._deadline()
        while True:
            with self._cond:
                if self._stop:
                    return None
                if self._next != s:
                    return _MOVED
                mine = s in self._grads
                out = s in self._abstain
            with self._store_lock:
                closed = self.store.check([ckey])
                if closed:
                    members = self._members(self.store.get(ckey))
                    break
                if (mine or out) and not registered:  # a contribution, or an abstention
                    self.store.add(mkey if mine else akey, 1 << self.rank)
                    registered, t_reg = True, time.monotonic()
                mask = self.store.add(mkey, 0)
                absent = self.store.add(akey, 0)
                n = bin(mask).count("1")
                now = time.monotonic()
                if n >= self.needed and seen_q is None:
                    seen_q = now
                # close when every rank is accounted for (contributed or abstained:
                # waiting cannot add anyone), or at the deadline once the quorum is in
                if (n + bin(absent).count("1") == self.size
                        or (seen_q is not None and now - seen_q >= deadline)):
                    members = self._members(self.store.compare_set(ckey, "", str(mask)))
                    break
            if registered and now - t_reg > self.timeout:
                raise QuorumError(
                    f"step {s} did not close within {self.timeout:.0f} s: only ranks "
                    f"{self._members(str(mask))} arrived and {self.needed} are needed")
            with self._cond:
                if not self._stop and (registered or (s not in self._grads
                                                      and s not in self._abstain)):
                    self._cond.wait(self.quorum.poll)
        self._durations.append(time.monotonic() - t0)
        return members

    @staticmethod
    def _members(value: Any) -> Tuple[int, ...]:
        mask = int(value.decode() if isinstance(value, bytes) else value)
        return tuple(i for i in range(mask.bit_length()) if mask >> i & 1)

    def _allgather(self, r: int, payload: Optional[torch.Tensor]) -> List[torch.Tensor]:
        """Every rank's round-``r`` payload (non-members' slots hold zeros)."""
        mine = 0 if payload is None else payload.numel()
        n = self._sizes.get(r)
        sizes = None
        if n is None:
            count = torch.tensor([mine], dtype=torch.int64)
            sizes = [int(t.item()) for t in self.transport.allgather(count, self.timeout)]
            n = max(sizes)
            if self.comp.capabilities.fixed_size and n:  # the same choice on every rank
                self._sizes[r] = n  # every member's payload has this size from now on
        elif mine and mine != n:
            raise QuorumError(f"{self.comp.name} declares fixed_size, but its round-{r} "
                              f"payload has {mine} bytes where an earlier one had {n}")
        buf = torch.zeros(n, dtype=torch.uint8)
        if payload is not None:
            buf[:mine] = payload.view(torch.uint8).reshape(-1)
        parts = self.transport.allgather(buf, self.timeout)
        if sizes is not None:  # sizes may differ: each slot cut to its own payload
            parts = [p[:k] for p, k in zip(parts, sizes)]
        return parts

    def _exchange(self, s: int, members: Tuple[int, ...]) -> Optional[torch.Tensor]:
        """Run step ``s``'s rounds over ``members``; the averaged flat gradient, or None
        when no rank contributed (every rank abstained: the step is skipped)."""
        if not members:
            self._count(s, contributed=False, n=0)
            return None
        comp, caps = self.comp, self.comp.capabilities
        x = self._grads.get(s) if self.rank in members else None
        template = x if x is not None else self._out
        state = dict(self._state)
        if len(members) < self.size:
            state[CONTRIBUTORS] = len(members)
        else:
            state.pop(CONTRIBUTORS, None)
        if caps.shared_randomness:
            state[STEP_SEED] = mix_seed(self._shared, s)
        out = torch.empty(self.numel, dtype=self.dtype)
        if caps.rounds == 1:
            payload = None
            if x is not None:
                payload, state = comp.encode(x, state)
            parts = self._allgather(0, payload)
            out.zero_()
            for i in members:
                out.add_(comp.decode(parts[i]).reshape(-1).to(self.dtype))
        else:
            agg = None
            for r in range(caps.rounds):
                if x is not None:
                    payload, state = comp.encode_round(r, x, state, agg)
                else:
                    payload, state = None, comp.absent_round(r, template, state, agg)
                parts = self._allgather(r, payload)
                agg = comp.merge_round(r, [parts[i] for i in members])
            out, state = comp.decode_rounds(template, state, agg, out=out, average=False)
            out = out.reshape(-1)
        out.div_(len(members) if self.quorum.missing == "rescale" else self.size)
        state.pop(CONTRIBUTORS, None)
        self._state = state
        self._count(s, contributed=x is not None, n=len(members))
        return out

    def _count(self, s: int, contributed: bool, n: int) -> None:
        """Step ``s`` is done with ``n`` contributors: the counters, and rank 0 drops
        the store keys of step s - 1 (every lane is past them by now)."""
        c = self.counters
        c["steps"] += 1
        c["contributed" if contributed else "sat_out"] += 1
        if n < self.size:
            c["partial"] += 1
            c["missing"] += self.size - n
        with self._cond:
            self._abstain.discard(s)
        if self.rank == 0 and s >= 1:
            with self._store_lock:
                for k in ("m", "c", "a"):
                    self.store.delete_key(f"{k}/{s - 1}")
