"""CaSync workflows: how one gradient partition becomes tasks (HiPress Sec. 3, Fig. 1).

Each builder takes the engine's task-building interface (``compute``,
``send``, ``recv``; see ``engine._StepBuilder``) and a *codec*, and adds the
partition's tasks with their data dependencies:

CaSync-PS, co-located (every rank aggregates a byte-balanced share):
    worker:      encode -> send(agg)           ...  recv(agg) -> decode -> write
    aggregator:  recv(each) -> merge: add each decoded payload into its own
                 (raw) partition in rank order (``decode_add_``) -> encode
                 -> send(all) ; decode(own copy) -> write
    aggregatable codecs merge the payloads directly (no decode/encode).

CaSync-Ring, on N chunks of the partition:
    reduce, N-1 steps:  recv(prev) -> decode, add into own chunk -> encode -> send(next)
    gather, N-1 steps:  forward the owner's encoded sum unchanged; decode -> write
    aggregatable codecs merge payloads; sparsifiers re-select after each merge
    (HiPress Sec. 5.3) because the merged sum is encoded again.

Multi-round compressors (PowerSGD's P then Q): each round is a PS exchange
whose payloads are merged by summation; see ``rounds_workflow``.

Every rank's final value is ``decode(the same bytes) / N``: the aggregator
(PS) or chunk owner (Ring) decodes its own encoded result rather than using
its raw sum, so all ranks hold bitwise-identical averages.
"""
from __future__ import annotations

import zlib
from typing import Any, Dict, List, Optional

import torch

from ..compressors.base import Compressor, State, assume_finite

__all__ = ["RawCodec", "CompressorCodec", "ps_workflow", "ring_workflow", "rounds_workflow",
           "rounds_collective_workflow", "chunk_bounds"]


def chunk_bounds(n: int, k: int) -> List[tuple]:
    """Split ``n`` elements into ``k`` contiguous near-equal (start, end) ranges."""
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


class RawCodec:
    """The uncompressed path: payloads are the values' own bytes (no header, no copy)."""

    aggregatable = True
    rounds = 1

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
    ...), so error-feedback residuals never mix between roles.
    """

    def __init__(self, comp: Compressor, states: Dict[str, State], key: str,
                 seed_of: Any, world_size: int, vouched: bool = False):
        self.comp = comp
        self.vouched = vouched  # the engine scanned the gradient for NaN/Inf already
        self.states = states
        self.key = key
        self.seed_of = seed_of
        self.world_size = world_size
        self.aggregatable = comp.capabilities.aggregatable
        self.rounds = comp.capabilities.rounds

    def state(self, x: torch.Tensor, site: str) -> State:
        """The state for ``site``, initialised on first use."""
        k = f"{self.key}|{site}"
        st = self.states.get(k)
        if st is None:
            st = self.comp.init(x, seed=self.seed_of(k))
            st["world_size"] = self.world_size
            if "shared_seed" in st:  # e.g. PowerSGD's first Q must be equal on every rank
                st["shared_seed"] = zlib.crc32(k.encode()) & 0x7FFFFFFF
            self.states[k] = st
        return st

    def encode(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """Encode with the site's state, storing the new state."""
        st = self.state(x, site)
        with assume_finite(self.vouched):
            payload, self.states[f"{self.key}|{site}"] = self.comp.encode(x, st)
        return payload

    def encode_round(self, r: int, grad: torch.Tensor, site: str,
                     aggregate: Optional[torch.Tensor]) -> torch.Tensor:
        """Round ``r`` of a multi-round compressor with the site's state, storing the new state."""
        st = self.state(grad, site)
        with assume_finite(self.vouched):
            payload, self.states[f"{self.key}|{site}"] = self.comp.encode_round(r, grad, st,
                                                                                aggregate)
        return payload

    def decode_rounds_into(self, grad: torch.Tensor, site: str, aggregate: torch.Tensor) -> None:
        """The average over ranks of a multi-round compressor, decoded straight into
        ``grad`` (its values were taken in round 0; the compressor divides by N in
        the same sweep, ``average=True``)."""
        st = self.state(grad, site)
        _, self.states[f"{self.key}|{site}"] = self.comp.decode_rounds(
            grad, st, aggregate, out=grad, average=True)

    def write_mean(self, payload: torch.Tensor, x: torch.Tensor, n: int) -> None:
        """``x = decode(payload) / n``, straight into ``x`` (fused where the compressor can)."""
        self.comp.decode_div_(payload, x, n)

    def add_decoded(self, payload: torch.Tensor, acc: torch.Tensor) -> None:
        """``acc += decode(payload)`` (fused where the compressor can, else via a workspace)."""
        self.comp.decode_add_(payload, acc)

    def add_decoded_many(self, payloads: List[torch.Tensor], acc: torch.Tensor) -> None:
        """``acc += decode(p)`` for each payload in order (one pass where the compressor can)."""
        self.comp.decode_add_many_(payloads, acc)

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Compressed-domain sum (aggregatable compressors)."""
        return self.comp.merge(payloads)


def ps_workflow(b, g: int, p: int, x: torch.Tensor, codec, agg: int) -> None:
    """Add the CaSync-PS tasks of partition ``p`` of gradient ``g`` (flat view ``x``)."""
    me, n = b.rank, b.size
    box: Dict[str, Any] = {}

    def write(payload_key: str) -> None:
        codec.write_mean(box[payload_key], x, n)

    if me != agg:
        enc = b.compute("encode", g, p, lambda: box.__setitem__("push", codec.encode(x, "push")))
        b.send(g, p, 0, agg, lambda: box["push"], [enc])
        rv = b.recv(g, p, 1, agg, box, "pull")
        b.compute("write", g, p, lambda: write("pull"), [rv])
        return

    recvs = {s: b.recv(g, p, 0, s, box, f"from{s}") for s in range(n) if s != me}
    if codec.aggregatable:
        own = b.compute("encode", g, p,
                        lambda: box.__setitem__(f"from{me}", codec.encode(x, "own")))

        def merge() -> None:
            box["pull"] = codec.merge([box[f"from{s}"] for s in range(n)])

        last = b.compute("merge", g, p, merge, [own, *recvs.values()])
    else:
        def merge_encode() -> None:
            # x + the decoded partitions of the other ranks in rank order, summed in
            # x itself (the pull's decode overwrites x afterwards): no allocation.
            # Only this rank sums, so the order fixes run-to-run reproducibility,
            # not agreement between ranks (they all decode the same pull bytes).
            codec.add_decoded_many([box.pop(f"from{s}") for s in range(n) if s != me], x)
            box["pull"] = codec.encode(x, "pull")

        last = b.compute("merge", g, p, merge_encode, list(recvs.values()))
    for s in range(n):
        if s != me:
            b.send(g, p, 1, s, lambda: box["pull"], [last])
    b.compute("write", g, p, lambda: write("pull"), [last])


def ring_workflow(b, g: int, p: int, x: torch.Tensor, codec) -> None:
    """Add the CaSync-Ring tasks of partition ``p`` (needs ``x.numel() >= N``)."""
    me, n = b.rank, b.size
    nxt, prv = (me + 1) % n, (me - 1) % n
    xs = [x[s:e] for s, e in chunk_bounds(x.numel(), n)]
    box: Dict[str, Any] = {}
    dep = b.compute("encode", g, p, lambda: box.__setitem__("send0", codec.encode(xs[me], "own")))
    for i in range(n - 1):
        b.send(g, p, i, nxt, lambda i=i: box[f"send{i}"], [dep])
        rv = b.recv(g, p, i, prv, box, f"recv{i}")
        c = (me - i - 1) % n
        out = "final" if i == n - 2 else f"send{i + 1}"
        if codec.aggregatable:
            def step(i=i, c=c, out=out) -> None:
                box[out] = codec.merge([box[f"recv{i}"], codec.encode(xs[c], f"own{i}")])
        else:
            def step(i=i, c=c, out=out) -> None:
                # chunk c is read only here before the gather overwrites it: sum in place
                codec.add_decoded(box.pop(f"recv{i}"), xs[c])
                box[out] = codec.encode(xs[c], "final" if out == "final" else f"hop{i}")
        dep = b.compute("merge", g, p, step, [rv])
    own_chunk = (me + 1) % n

    def write_own() -> None:
        codec.write_mean(box["final"], xs[own_chunk], n)

    b.compute("write", g, p, write_own, [dep])
    fwd, fwd_dep = "final", dep
    for j in range(n - 1):
        b.send(g, p, n - 1 + j, nxt, lambda k=fwd: box[k], [fwd_dep])
        rv = b.recv(g, p, n - 1 + j, prv, box, f"gather{j}")
        c = (me - j) % n

        def write(j=j, c=c) -> None:
            codec.write_mean(box[f"gather{j}"], xs[c], n)

        b.compute("write", g, p, write, [rv])
        fwd, fwd_dep = f"gather{j}", rv


def rounds_workflow(b, g: int, grad: torch.Tensor, codec: CompressorCodec, agg: int) -> None:
    """Add a multi-round compressor's tasks (each round a PS exchange merged by sum).

    Round r: every rank encodes ``encode_round(r, grad, state, merged_{r-1})``;
    aggregator ``agg`` merges the N payloads in rank order and sends the sum
    to all; after the last round ``decode_rounds`` gives the summed gradient.
    """
    me, n = b.rank, b.size
    comp, site = codec.comp, "rounds"
    box: Dict[str, Any] = {}
    dep = []
    for r in range(codec.rounds):
        def enc(r=r) -> None:
            box[f"mine{r}"] = codec.encode_round(r, grad, site, box.get(f"agg{r - 1}"))
        e = b.compute("encode", g, 0, enc, dep)
        if me != agg:
            b.send(g, 0, 2 * r, agg, lambda r=r: box[f"mine{r}"], [e])
            dep = [b.recv(g, 0, 2 * r + 1, agg, box, f"agg{r}")]
            continue
        rvs = [b.recv(g, 0, 2 * r, s, box, f"r{r}from{s}") for s in range(n) if s != me]

        def merge(r=r) -> None:
            box[f"agg{r}"] = comp.merge([box[f"mine{r}"] if s == me else box[f"r{r}from{s}"]
                                         for s in range(n)])
        m = b.compute("merge", g, 0, merge, [e, *rvs])
        for s in range(n):
            if s != me:
                b.send(g, 0, 2 * r + 1, s, lambda r=r: box[f"agg{r}"], [m])
        dep = [m]

    def final() -> None:
        codec.decode_rounds_into(grad, site, box[f"agg{codec.rounds - 1}"])

    b.compute("write", g, 0, final, dep)


def rounds_collective_workflow(b, g: int, grad: torch.Tensor, codec: CompressorCodec) -> None:
    """A multi-round compressor whose payloads merge by plain summation, on the collective lane.

    Round r: every rank encodes ``encode_round(r, grad, state, merged_{r-1})``;
    the payload's ``summable_view`` is summed in place by a fused allreduce
    (the coordinator fuses the same round of many gradients, as PyTorch's
    PowerSGD hook batches them), so the payload becomes the merged one on
    every rank: one collective per round instead of a gather at an
    aggregator and a send back (two bulk rounds).
    """
    comp, site = codec.comp, "rounds"
    box: Dict[str, Any] = {}
    dep = []
    for r in range(codec.rounds):
        def enc(r=r) -> None:
            payload = codec.encode_round(r, grad, site, box.get(f"agg{r - 1}"))
            view = comp.summable_view(payload)
            if view is None:
                raise RuntimeError(f"{comp.name}: round {r} payload has no summable view "
                                   "(misaligned); use raw_collective=False")
            box[f"agg{r}"], box[f"view{r}"] = payload, view
        e = b.compute("encode", g, 0, enc, dep)
        dep = [b.collective(g, lambda r=r: box[f"view{r}"], phase=r, deps=[e])]

    def final() -> None:
        codec.decode_rounds_into(grad, site, box[f"agg{codec.rounds - 1}"])

    b.compute("write", g, 0, final, dep)
