"""CaSync workflows: how one gradient partition becomes tasks (HiPress Sec. 3, Fig. 1).

Each builder takes the engine's task-building interface (``compute``,
``send``, ``recv``, ``collective``; see ``builder.StepBuilder``) and a
*codec*, and adds the partition's tasks with their data dependencies. A
task's inputs are the tasks whose results it reads, so data moves from
task to task, never through shared dicts:

CaSync-PS, co-located (every rank aggregates a byte-balanced share):
    worker:      encode -> send(agg)           ...  recv(agg) -> decode -> write
    aggregator:  recv(each) -> merge: add each decoded payload into its own
                 (raw) partition in rank order (``decode_add_``) -> encode
                 -> send(all) ; decode(own copy) -> write
    aggregatable codecs merge the payloads directly (no decode/encode);
    with ``own_push`` (the BytePS-style faces) the aggregator's own partition
    is encoded as a push too and decoded in its rank's place, as a BytePS
    server sees every worker's push compressed.

CaSync-Ring, on N chunks of the partition:
    reduce, N-1 steps:  recv(prev) -> decode, add into own chunk -> encode -> send(next)
    gather, N-1 steps:  forward the owner's encoded sum unchanged; decode -> write
    aggregatable codecs merge payloads; sparsifiers re-select after each merge
    (HiPress Sec. 5.3) because the merged sum is encoded again.

Bidirectional compression (Natural Compression, Alg. 1): with a master
compressor C_M (``GradLayout.back``), the aggregate is encoded with C_M
where it starts its way back: the PS aggregator's pull encode (after an
aggregatable merge, the merged payload is decoded into the partition and
encoded again), and the Ring chunk owner's encode after the last reduce
hop, whose C_M payload the gather forwards unchanged; every final decode
is C_M's. Workers' payloads and the reduce hops stay C_W's.

Multi-round compressors (PowerSGD's P then Q, THC's range then values,
AR-Topk's indices then values) run every round as a full exchange before
the next one starts, each round reduced as the compressor declares (sum,
max, or the owner's payload: ``Compressor.merge_round``):
    PS, per partition:   encode_round(r) -> send(agg) ; agg: merge_round -> send(all)
    Ring, per partition: N chunks, each round a ring allreduce of the chunks'
                         round-r payloads (merge_round at each hop, then the
                         owner's result forwarded unchanged)
    collective lane:     rounds whose payloads reduce elementwise (sum or max)
                         on their ``summable_view``: one fused allreduce per round
                         (``lane_workflows.py``; with a named collective, also
                         broadcast rounds, and the allgather of LWTopk)
and after the last round ``decode_rounds`` writes the average. A gradient
of two or more dimensions is partitioned by whole rows, so a low-rank
compressor sees a block of the same matrix view.

Every rank's final value is ``decode(the same bytes) / N``: the aggregator
(PS) or chunk owner (Ring) decodes its own encoded result rather than using
its raw sum, so all ranks hold bitwise-identical averages.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..compressors.base import (
    STEP_SEED,
    Compressor,
    NonFiniteError,
    State,
    assume_finite,
    mix_seed,
)
from .lane_workflows import gather_workflow, rounds_collective_workflow
from .layout import Workflow, chunk_bounds, part_view, row_chunks
from .tasks import Kind

__all__ = ["RawCodec", "CompressorCodec", "add_gradient_tasks", "ps_workflow", "ring_workflow",
           "rounds_workflow", "rounds_ring_workflow", "rounds_collective_workflow",
           "gather_workflow", "chunk_bounds"]


class RawCodec:
    """The uncompressed path: payloads are the values' own bytes (no header, no copy)."""

    aggregatable = True
    rounds = 1
    back = None  # raw sums go back as they are

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def encode(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """A uint8 view of the (contiguous) values."""
        return x.reshape(-1).view(torch.uint8)

    def write_mean(self, payload: torch.Tensor, x: torch.Tensor, n: int) -> None:
        """``x = values / n`` in one pass."""
        torch.div(payload.view(self.dtype), n, out=x)

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Sum in the given order into a new buffer."""
        acc = payloads[0].view(self.dtype).clone()
        for p in payloads[1:]:
            acc.add_(p.view(self.dtype))
        return acc.view(torch.uint8)


class CompressorCodec:
    """A compressor plus the explicit states of one partition, keyed by site.

    Sites name each place the partition is encoded ("push", "pull", "hop3",
    ...), so error-feedback residuals never mix between roles. ``step`` is
    the engine's step count: with ``capabilities.shared_randomness`` it
    becomes the state's per-step seed (``base.STEP_SEED``). ``back`` is the
    master compressor of bidirectional compression (None: ``comp`` encodes
    the aggregate too): ``encode_back`` and ``write_mean`` use it. ``undo``
    (``nonfinite.StateUndo``) keeps each state as the step found it, so a
    step some rank saw NaN/Inf in can be undone.
    """

    def __init__(self, comp: Compressor, states: Dict[str, State], key: str,
                 seed_of: Any, world_size: int, vouched: bool = False, step: int = 0,
                 rank: int = 0, back: Optional[Compressor] = None, undo: Any = None,
                 on_nonfinite: Optional[Callable[[], None]] = None):
        self.comp = comp
        # the engine did not scan: the compressor's own first pass finds NaN/Inf
        # (Capabilities.checks_finite); this flags the step
        self.on_nonfinite = on_nonfinite
        self.undo = undo
        self.back = back
        self.step = step
        self.rank = rank
        self.vouched = vouched  # the engine scanned the gradient for NaN/Inf already
        self.states = states
        self.key = key
        self.seed_of = seed_of
        self.world_size = world_size
        self.aggregatable = comp.capabilities.aggregatable
        self.rounds = comp.capabilities.rounds

    def state(self, x: torch.Tensor, site: str, comp: Optional[Compressor] = None) -> State:
        """The state for ``site`` (of ``comp``, default the worker compressor),
        initialised on first use."""
        comp = comp or self.comp
        k = f"{self.key}|{site}"
        st = self.states.get(k)
        if self.undo is not None:  # before this step's first change to it
            use = self.undo.save(k, st, comp)
            if use is not st:  # double buffered: the kept state stays untouched
                st = self.states[k] = use
        if st is None:
            st = self.states[k] = self._init(x, k, comp)
        if comp.capabilities.shared_randomness:
            st[STEP_SEED] = mix_seed(_shared_seed(k), self.step)
        return st

    def _init(self, x: torch.Tensor, k: str, comp: Compressor) -> State:
        """A new state for key ``k``."""
        # the run reaches the compressor through init's declared keywords
        # (Compressor.init), never through keys written into its state
        ctx: Dict[str, Any] = {"world_size": self.world_size}
        if comp.capabilities.shared_randomness:  # e.g. PowerSGD's first Q
            ctx["shared_seed"] = _shared_seed(k)
        if "broadcast" in comp.capabilities.round_reductions:  # the owner knows itself
            ctx["rank"] = self.rank
        return comp.init(x, seed=self.seed_of(k), **ctx)

    def _encode(self, x: torch.Tensor, site: str, comp: Compressor,
                fn: Callable[[torch.Tensor, State], Tuple[torch.Tensor, State]]) -> torch.Tensor:
        """``fn(x, state)`` with the site's state, storing the new state. When the
        compressor's own pass finds NaN/Inf (``on_nonfinite`` set), the step is
        flagged and ``x`` zeroed and encoded with a new state instead (keeping
        the old state's ``step``, so the ranks still agree on what depends on
        it), so the exchange stays finite; the step is undone (``nonfinite.py``),
        which puts the state the step found back."""
        k = f"{self.key}|{site}"
        st = self.state(x, site, comp)
        try:
            with assume_finite(self.vouched):
                payload, self.states[k] = fn(x, st)
            return payload
        except NonFiniteError:
            if self.on_nonfinite is None:
                raise
        self.on_nonfinite()
        x.zero_()
        old, st = st, self._init(x, k, comp)
        if isinstance(old, dict) and "step" in old:
            # a counter the ranks agree on stays (AR-Topk's owner is step mod N); the
            # step is undone either way
            st["step"] = old["step"]
        if comp.capabilities.shared_randomness:
            st[STEP_SEED] = mix_seed(_shared_seed(k), self.step)
        with assume_finite(self.vouched):
            payload, self.states[k] = fn(x, st)
        return payload

    def encode(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """Encode with the site's state, storing the new state."""
        return self._encode(x, site, self.comp, self.comp.encode)

    def encode_back(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """Encode an aggregate on its way back: with the master compressor when
        there is one (its own state at ``site``), else as ``encode``."""
        if self.back is None:
            return self.encode(x, site)
        return self._encode(x, site, self.back, self.back.encode)

    def reencode(self, merged: torch.Tensor, x: torch.Tensor, site: str) -> torch.Tensor:
        """A merged (summed) worker payload, decoded into ``x`` and encoded with the
        master compressor (bidirectional compression over an aggregatable C_W)."""
        self.comp.decode(merged, out=x)
        return self.encode_back(x, site)

    def encode_round(self, r: int, grad: torch.Tensor, site: str,
                     aggregate: Optional[torch.Tensor]) -> torch.Tensor:
        """Round ``r`` of a multi-round compressor with the site's state, storing the new state."""
        return self._encode(grad, site, self.comp,
                            lambda g, st: self.comp.encode_round(r, g, st, aggregate))

    def decode_rounds_into(self, grad: torch.Tensor, site: str, aggregate: torch.Tensor) -> None:
        """The average over ranks of a multi-round compressor, decoded straight into
        ``grad`` (its values were taken in round 0; the compressor divides by N in
        the same sweep, ``average=True``)."""
        st = self.state(grad, site)
        _, self.states[f"{self.key}|{site}"] = self.comp.decode_rounds(
            grad, st, aggregate, out=grad, average=True)

    def write_mean(self, payload: torch.Tensor, x: torch.Tensor, n: int, *,
                   back: bool = True) -> None:
        """``x = decode(payload) / n`` for an aggregate's payload (the master
        compressor's when there is one; ``back=False``: a worker's payload),
        straight into ``x`` (fused where the compressor can)."""
        comp = (self.back or self.comp) if back else self.comp
        comp.kernels.decode_div_(payload, x, n)

    def broadcast_root(self, site: str) -> int:
        """The owner rank of the broadcast round just encoded at ``site``."""
        return self.comp.broadcast_root(self.states[f"{self.key}|{site}"])

    def add_decoded(self, payload: torch.Tensor, acc: torch.Tensor) -> None:
        """``acc += decode(payload)`` (fused where the compressor can, else via a workspace)."""
        self.comp.kernels.decode_add_(payload, acc)

    def add_decoded_many(self, payloads: List[torch.Tensor], acc: torch.Tensor) -> None:
        """``acc += decode(p)`` for each payload in order (one pass where the compressor can)."""
        self.comp.kernels.decode_add_many_(payloads, acc)

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Compressed-domain sum (aggregatable compressors)."""
        return self.comp.merge(payloads)


def _shared_seed(key: str) -> int:
    """A partition's seed, equal on every rank: from its state key (name, partition, site)."""
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def add_gradient_tasks(b, work: torch.Tensor, states: Dict[str, State], seed_of: Any, *,
                       vouched: bool, step: int = 0, undo: Any = None,
                       on_nonfinite: Optional[Callable[[], None]] = None,
                       own_push: bool = False) -> None:
    """Add every task of gradient ``b.grad`` (its values in ``work``) for one step.

    Args:
        b: the gradient's ``builder.StepBuilder``.
        work: the gradient, contiguous (the average is written back into it).
        states: the engine's compressor states (keyed by gradient, partition, site).
        seed_of: a state key -> that state's RNG seed.
        vouched: the engine checked the gradient for NaN/Inf already.
        step: the engine's step count (per-step shared seeds).
        undo: a ``nonfinite.StateUndo`` that keeps the states this step
            changes, or None.
        on_nonfinite: called when the compressor's own pass finds NaN/Inf
            (the engine did not scan: ``Capabilities.checks_finite``), or None.
        own_push: a PS aggregator compresses its own partition too
            (``EngineConfig.own_push``).
    """
    g = b.grad
    flat = work.view(-1)
    for p, (s, e, agg) in enumerate(g.parts):
        if g.compressor is not None:
            codec = CompressorCodec(g.compressor, states, f"{g.name}|{p}", seed_of, b.size,
                                    vouched, step, b.rank, g.back, undo, on_nonfinite)
        else:
            codec = RawCodec(g.dtype)
        if g.workflow in (Workflow.ROUNDS, Workflow.ROUNDS_RING, Workflow.ROUNDS_ALLREDUCE):
            x = work if len(g.parts) == 1 else part_view(flat, s, e, g.shape)
            if g.workflow is Workflow.ROUNDS:
                rounds_workflow(b, p, x, codec, agg)
            elif g.workflow is Workflow.ROUNDS_RING:
                rounds_ring_workflow(b, p, x, codec)
            else:
                rounds_collective_workflow(b, x, codec)
        elif g.workflow is Workflow.GATHER:
            gather_workflow(b, work, codec)
        elif g.workflow is Workflow.RING:
            ring_workflow(b, p, flat[s:e], codec)
        else:
            ps_workflow(b, p, flat[s:e], codec, agg, own_push=own_push)


def ps_workflow(b, p: int, x: torch.Tensor, codec, agg: int, *, own_push: bool = False) -> None:
    """Add the CaSync-PS tasks of partition ``p`` (flat view ``x``) aggregated at ``agg``.

    With ``own_push`` the aggregator encodes its own partition as a push (the
    push site's state, error feedback included) and sums the decoded payloads
    of every rank, its own in its rank's place, as a BytePS server does; by
    default it adds its partition as it is (it never crosses the network)."""
    me, n = b.rank, b.size

    def write(pull: torch.Tensor) -> None:
        codec.write_mean(pull, x, n)

    if me != agg:
        enc = b.compute(Kind.ENCODE, p, lambda: codec.encode(x, "push"))
        b.send(p, 0, agg, enc)
        rv = b.recv(p, 1, agg)
        b.compute(Kind.WRITE, p, write, [rv])
        return

    recvs = [b.recv(p, 0, s) for s in range(n) if s != me]  # rank order, without me
    if codec.aggregatable:
        own = b.compute(Kind.ENCODE, p, lambda: codec.encode(x, "own"))
        if codec.back is None:
            def merge(*ps: torch.Tensor) -> torch.Tensor:
                return codec.merge(list(ps))
        else:  # bidirectional: the sum goes back encoded by the master compressor
            def merge(*ps: torch.Tensor) -> torch.Tensor:
                return codec.reencode(codec.merge(list(ps)), x, "pull")
        last = b.compute(Kind.MERGE, p, merge, [*recvs[:me], own, *recvs[me:]])
    elif own_push:
        own = b.compute(Kind.ENCODE, p, lambda: codec.encode(x, "push"))

        def merge_all(*ps: torch.Tensor) -> torch.Tensor:
            # every rank's decoded push in rank order, summed in x (the pull's
            # decode overwrites x afterwards): x = decode(p_0), then += the rest
            codec.write_mean(ps[0], x, 1, back=False)
            codec.add_decoded_many(list(ps[1:]), x)
            return codec.encode_back(x, "pull")

        last = b.compute(Kind.MERGE, p, merge_all, [*recvs[:me], own, *recvs[me:]])
    else:
        def merge_encode(*ps: torch.Tensor) -> torch.Tensor:
            # x + the decoded partitions of the other ranks in rank order, summed in
            # x itself (the pull's decode overwrites x afterwards): no allocation.
            # Only this rank sums, so the order fixes run-to-run reproducibility,
            # not agreement between ranks (they all decode the same pull bytes).
            codec.add_decoded_many(list(ps), x)
            return codec.encode_back(x, "pull")

        last = b.compute(Kind.MERGE, p, merge_encode, recvs)
    for s in range(n):
        if s != me:
            b.send(p, 1, s, last)
    b.compute(Kind.WRITE, p, write, [last])


def ring_workflow(b, p: int, x: torch.Tensor, codec) -> None:
    """Add the CaSync-Ring tasks of partition ``p`` (needs ``x.numel() >= N``)."""
    me, n = b.rank, b.size
    nxt, prv = (me + 1) % n, (me - 1) % n
    xs = [x[s:e] for s, e in chunk_bounds(x.numel(), n)]
    dep = b.compute(Kind.ENCODE, p, lambda: codec.encode(xs[me], "own"))
    for i in range(n - 1):
        b.send(p, i, nxt, dep)
        rv = b.recv(p, i, prv)
        c = (me - i - 1) % n
        last_hop = i == n - 2  # chunk c's sum is complete here: it goes back from this rank
        if codec.aggregatable:
            def step(got: torch.Tensor, i=i, c=c, last_hop=last_hop) -> torch.Tensor:
                merged = codec.merge([got, codec.encode(xs[c], f"own{i}")])
                if last_hop and codec.back is not None:  # bidirectional: C_M from here on
                    return codec.reencode(merged, xs[c], "final")
                return merged
        else:
            def step(got: torch.Tensor, i=i, c=c, last_hop=last_hop) -> torch.Tensor:
                # chunk c is read only here before the gather overwrites it: sum in place
                codec.add_decoded(got, xs[c])
                if last_hop:
                    return codec.encode_back(xs[c], "final")
                return codec.encode(xs[c], f"hop{i}")
        dep = b.compute(Kind.MERGE, p, step, [rv])
    own_chunk = (me + 1) % n
    b.compute(Kind.WRITE, p, lambda final: codec.write_mean(final, xs[own_chunk], n), [dep])
    fwd = dep
    for j in range(n - 1):
        b.send(p, n - 1 + j, nxt, fwd)
        rv = b.recv(p, n - 1 + j, prv)
        c = (me - j) % n
        b.compute(Kind.WRITE, p, lambda got, c=c: codec.write_mean(got, xs[c], n), [rv])
        fwd = rv


def rounds_workflow(b, p: int, x: torch.Tensor, codec: CompressorCodec, agg: int) -> None:
    """Add a multi-round compressor's CaSync-PS tasks for partition ``p`` (values ``x``).

    Round r: every rank encodes ``encode_round(r, x, state, merged_{r-1})``;
    aggregator ``agg`` reduces the N payloads in rank order
    (``merge_round``: sum, max or the owner's) and sends the result to all;
    after the last round ``decode_rounds`` writes the average into ``x``.
    """
    me, n = b.rank, b.size
    comp, site = codec.comp, "rounds"
    prev = None  # the task whose result is the previous round's merged payload
    for r in range(codec.rounds):
        def enc(*merged: torch.Tensor, r=r) -> torch.Tensor:
            return codec.encode_round(r, x, site, merged[0] if merged else None)
        e = b.compute(Kind.ENCODE, p, enc, [prev] if prev is not None else [])
        if me != agg:
            b.send(p, 2 * r, agg, e)
            prev = b.recv(p, 2 * r + 1, agg)
            continue
        rvs = [b.recv(p, 2 * r, s) for s in range(n) if s != me]
        prev = b.compute(Kind.MERGE, p, lambda *ps, r=r: comp.merge_round(r, list(ps)),
                         [*rvs[:me], e, *rvs[me:]])
        for s in range(n):
            if s != me:
                b.send(p, 2 * r + 1, s, prev)
    b.compute(Kind.WRITE, p, lambda merged: codec.decode_rounds_into(x, site, merged), [prev])


def rounds_ring_workflow(b, p: int, x: torch.Tensor, codec: CompressorCodec) -> None:
    """Add a multi-round compressor's CaSync-Ring tasks for partition ``p`` (values ``x``).

    ``x`` is cut into N chunks (whole rows when it has two or more
    dimensions), each with its own state. Round r is a ring allreduce of the
    chunks' round-r payloads: N-1 reduce hops (``merge_round`` of the
    received partial result and this rank's own payload for that chunk),
    then N-1 hops forwarding each chunk owner's result unchanged, so every
    rank holds the same merged bytes for every chunk before round r+1
    encodes. Phases: ``2(N-1)`` per round.
    """
    me, n = b.rank, b.size
    comp = codec.comp
    xs = [part_view(x.view(-1), s, e, x.shape) for s, e in row_chunks(x.shape, n)]
    sites = [f"rounds{c}" for c in range(n)]
    merged: List[Optional[Any]] = [None] * n  # per chunk: the task holding round r-1's result
    for r in range(codec.rounds):
        base = r * 2 * (n - 1)
        own = []
        for c in range(n):
            def enc(*m: torch.Tensor, r=r, c=c) -> torch.Tensor:
                return codec.encode_round(r, xs[c], sites[c], m[0] if m else None)
            own.append(b.compute(Kind.ENCODE, p, enc, [merged[c]] if merged[c] else []))
        nxt, prv = (me + 1) % n, (me - 1) % n
        dep = own[me]
        for i in range(n - 1):  # reduce: chunk (me - i) leaves, chunk (me - i - 1) arrives
            b.send(p, base + i, nxt, dep)
            rv = b.recv(p, base + i, prv)
            c = (me - i - 1) % n
            dep = b.compute(Kind.MERGE, p, lambda got, mine, r=r: comp.merge_round(r, [got, mine]),
                            [rv, own[c]])
        done = [None] * n
        done[(me + 1) % n] = dep  # this rank owns chunk me+1's full result
        fwd = dep
        for j in range(n - 1):  # gather: forward each owner's result unchanged
            b.send(p, base + n - 1 + j, nxt, fwd)
            rv = b.recv(p, base + n - 1 + j, prv)
            done[(me - j) % n] = rv
            fwd = rv
        merged = done
    for c in range(n):
        b.compute(Kind.WRITE, p,
                  lambda m, c=c: codec.decode_rounds_into(xs[c], sites[c], m), [merged[c]])
