"""The layout: what ``Engine.register`` fixes for each gradient, from the plan.

Per gradient (HiPress Sec. 3.3: selective compression and partitioning):
compressed or not, by which compressor instance, its workflow, and its K
partitions (views, never copies) with the aggregator of each, chosen to
balance bytes across ranks. Uncompressed gradients go to the collective
lane's static buckets (``lane.py``); multi-round compressors whose rounds
are plain sums get static *round groups*: the same gradients' round-r
payloads are always summed by one fused allreduce, in one order, so the
result never depends on which payloads happened to be ready together
(gloo sums each chunk of a fused buffer in a ring order that depends on
the chunk's offset: a timing-dependent fusion made 3-rank PowerSGD runs
differ in their last bits from run to run).

A compressed gradient whose decision names a ``collective`` (the
flexible-communication paper's choice, made executable) travels the lane
with that algorithm, each of its collectives alone (``Layout.solo``):
"backend", "ring" or "tree" for its sum rounds (max rounds stay on the
transport's allreduce), a binomial tree for its broadcast rounds ("backend":
the transport's broadcast), and "allgather" (``Workflow.GATHER``) gathers a
single-round compressor's payload from every rank (``Layout.ops``: the
round's reduction, ``Layout.algos``: the algorithm, when not the
transport's fused allreduce).

Message keys pack (gradient, partition, phase, source) into one int64 that
every rank computes alike (``msg_key``); ``KEY_LIMITS`` bounds each field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..compressors.base import Compressor
from ..cost_model.plan import GradientPlan
from .chunks import chunk_bounds
from .lane import LaneBucket, plan_lane_buckets

__all__ = ["Workflow", "GradLayout", "Layout", "KEY_LIMITS", "msg_key", "split_key", "digest_of",
           "check_specs", "describe_mismatch", "build_layout", "chunk_bounds", "row_chunks",
           "part_view", "numel_of"]

KEY_LIMITS = {"gradients": 1 << 20, "partitions": 1 << 12, "phases": 1 << 12, "ranks": 1 << 10}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

Spec = Tuple[str, Tuple[int, ...], torch.dtype]


class Workflow(str, Enum):
    """How a gradient is synchronised."""

    PS = "ps"  # CaSync-PS, co-located aggregators (HiPress Sec. 3)
    RING = "ring"  # CaSync-Ring
    ROUNDS = "rounds"  # a multi-round compressor, each round a PS exchange
    ROUNDS_RING = "rounds-ring"  # a multi-round compressor, each round a ring allreduce
    ALLREDUCE = "allreduce"  # uncompressed, in a static lane bucket
    ROUNDS_ALLREDUCE = "rounds-allreduce"  # a multi-round compressor summed by allreduce
    GATHER = "gather"  # a single-round compressor's payloads, gathered by every rank

    def __str__(self) -> str:
        return self.value


@dataclass
class GradLayout:
    """One gradient's place in the layout.

    Attributes:
        idx: registration index; name, shape, dtype, numel: as registered.
        compressor: the instance that encodes it, None when uncompressed.
        workflow: a ``Workflow``.
        parts: (start, end, aggregator) per partition; aggregator -1 for
            allreduce workflows (every rank reduces).
        back: the master compressor that encodes the aggregate on its way
            back (bidirectional compression); None: ``compressor`` does.
        collective: the lane algorithm its decision named ("backend",
            "ring", "tree", "allgather"), or None.
    """

    idx: int
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    numel: int
    compressor: Optional[Compressor]
    workflow: Workflow
    parts: List[Tuple[int, int, int]]
    back: Optional[Compressor] = None
    collective: Optional[str] = None

    @property
    def compress(self) -> bool:
        """The gradient is compressed."""
        return self.compressor is not None


@dataclass
class Layout:
    """The whole layout: gradients by name, the lane's buckets, the round groups."""

    grads: Dict[str, GradLayout] = field(default_factory=dict)
    lane: List[LaneBucket] = field(default_factory=list)
    # message key of a summed round payload -> the keys of its static group, in order
    groups: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    # message key of a round payload reduced by another op than "sum" -> that op
    # ("max", "broadcast", "gather")
    ops: Dict[int, str] = field(default_factory=dict)
    # message key -> its algorithm when not the transport's fused allreduce
    # ("ring", "tree": casync.collectives; "backend": the transport's broadcast)
    algos: Dict[int, str] = field(default_factory=dict)
    # keys of the collectives of gradients with a named collective: each alone
    solo: frozenset = frozenset()

    def describe(self) -> Dict[str, Dict[str, Any]]:
        """Per gradient: compress?, compressor, master compressor (``back``), workflow,
        named collective, partitions and aggregators (``Engine.layout``)."""
        return {n: {"compress": g.compress, "workflow": g.workflow.value,
                    "collective": g.collective,
                    "partitions": list(g.parts), "back": repr(g.back) if g.back else None,
                    "compressor": repr(g.compressor) if g.compressor is not None else None}
                for n, g in self.grads.items()}

    def collectives(self) -> Dict[str, str]:
        """Gradient -> the collective it travels by, for gradients whose decision
        names one ("backend", "ring", "tree", "allgather")."""
        return {n: g.collective for n, g in self.grads.items() if g.collective is not None}

    def grouped_round_keys(self, submitted: Any) -> List[int]:
        """The round payload keys of grouped gradients not in ``submitted``: reported
        absent, so their static groups can leave without them (``coordinator``)."""
        return [msg_key(g.idx, 0, r, 0) for g in self.grads.values()
                if g.workflow is Workflow.ROUNDS_ALLREDUCE and g.collective is None
                and g.name not in submitted for r in range(g.compressor.capabilities.rounds)]

    def lane_of(self) -> Dict[int, LaneBucket]:
        """Gradient index -> its lane bucket."""
        return {idx: b for b in self.lane for idx in b.slots}

    def compressor_instances(self) -> List[Compressor]:
        """The distinct compressor instances the compressed gradients encode with."""
        seen: Dict[int, Compressor] = {}
        for g in self.grads.values():
            if g.compressor is not None:
                seen.setdefault(id(g.compressor), g.compressor)
        return list(seen.values())

    def compressors(self) -> Dict[str, str]:
        """Compressed gradient -> its compressor's repr (saved in engine states)."""
        return {n: repr(g.compressor) + (f" back {g.back!r}" if g.back is not None else "")
                for n, g in self.grads.items() if g.compressor is not None}

    def compressor_mismatch(self, saved: Optional[Dict[str, str]]) -> Optional[str]:
        """Why a state saved with per-gradient compressors ``saved`` does not fit this
        layout (None when it fits, or when either side is not known yet)."""
        now = self.compressors()
        if not saved or not self.grads:
            return None
        bad = sorted(n for n in set(saved) | set(now) if saved.get(n) != now.get(n))
        if not bad:
            return None
        n = bad[0]
        return (f"state was saved with another plan: gradient {n!r} was compressed by "
                f"{saved.get(n) or 'nothing'}, this engine uses {now.get(n) or 'nothing'} "
                f"({len(bad)} gradient(s) differ); load it under the plan it was saved with")

    def check_saved(self, d: Any, compressor: Any) -> None:
        """Refuse an engine ``state_dict`` that does not fit this layout.

        Raises:
            ValueError: not an engine state, another version, another engine
                compressor or, per gradient, another plan.
        """
        if not isinstance(d, Mapping) or d.get("format") != "hipress-like-engine":
            raise ValueError("not a hipress-like engine state_dict")
        if d.get("version") != 1:
            raise ValueError(f"engine state version {d.get('version')!r} is not supported")
        if d.get("compressor") != repr(compressor):
            raise ValueError(f"state was saved with compressor {d.get('compressor')}, this "
                             f"engine uses {compressor!r}")
        if (why := self.compressor_mismatch(d.get("compressors"))) is not None:
            raise ValueError(why)

    def replayable(self) -> bool:
        """Every gradient travels by the transport's fused allreduce (no PS or Ring
        links, no named collective: a replayed bucket carries its status words
        in its sum, which a broadcast or a gather cannot)."""
        return not self.solo and all(
            g.workflow in (Workflow.ALLREDUCE, Workflow.ROUNDS_ALLREDUCE)
            for g in self.grads.values())


def msg_key(g: int, p: int, phase: int, src: int) -> int:
    """A message key, identical on every rank: gradient, partition, phase, source."""
    return (((g << 12) | p) << 12 | phase) << 10 | src


def split_key(key: int) -> Tuple[int, int, int, int]:
    """The inverse of ``msg_key``: (gradient, partition, phase, source).

    Example:
        >>> split_key(msg_key(5, 3, 1, 2))
        (5, 3, 1, 2)
    """
    return key >> 34, (key >> 22) & 0xFFF, (key >> 10) & 0xFFF, key & 0x3FF


def digest_of(idx: int) -> int:
    """A gradient's fingerprint in a step's digest (XOR of the submitted ones)."""
    return (idx * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & ((1 << 62) - 1)


def row_chunks(shape: Sequence[int], k: int) -> List[Tuple[int, int]]:
    """``k`` contiguous flat ranges of a tensor of ``shape``, made of whole rows
    (``shape[0]`` rows of ``prod(shape[1:])`` elements) when it has two or
    more dimensions and at least ``k`` rows; near-equal element ranges
    otherwise. A multi-round compressor's partitions and Ring chunks use
    them, so a low-rank compressor sees a block of rows of the same matrix.

    Example:
        >>> row_chunks((5, 3), 2), row_chunks((7,), 2)
        ([(0, 9), (9, 15)], [(0, 4), (4, 7)])
    """
    if len(shape) >= 2 and shape[0] >= k:
        row = numel_of(shape[1:])
        return [(s * row, e * row) for s, e in chunk_bounds(shape[0], k)]
    return chunk_bounds(numel_of(shape), k)


def part_view(flat: torch.Tensor, s: int, e: int, shape: Sequence[int]) -> torch.Tensor:
    """Elements ``[s, e)`` of a gradient of ``shape`` (``flat``: its flat view), shaped
    as whole rows when the range is (``row_chunks``), flat otherwise."""
    x = flat[s:e]
    if len(shape) >= 2:
        row = numel_of(shape[1:])
        if s % row == 0 and e % row == 0:
            return x.view(-1, *shape[1:])
    return x


def check_specs(specs: Sequence[Spec]) -> None:
    """Reject what no rank can synchronise: duplicate names, non-float dtypes,
    empty tensors, too many gradients.

    Raises:
        ValueError: naming the gradient and the fix.
    """
    names = [n for n, _, _ in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate gradient names: {dup}")
    if 2 * len(specs) >= KEY_LIMITS["gradients"]:  # keys for gradients, then buckets
        raise ValueError(f"at most {KEY_LIMITS['gradients'] // 2 - 1} gradients are supported")
    for n, shape, dt in specs:
        if dt not in FLOAT_DTYPES:
            raise ValueError(f"gradient {n!r} has dtype {dt}; only floating dtypes can be "
                             "synchronised")
        if any(s == 0 for s in shape):
            raise ValueError(f"gradient {n!r} is empty (shape {shape})")


def describe_mismatch(lists: List[list]) -> str:
    """Name the first gradient where the ranks' registered lists differ."""
    ref = lists[0]
    for r, lst in enumerate(lists[1:], start=1):
        if lst == ref:
            continue
        if len(lst) != len(ref):
            a, b = {x[0] for x in ref}, {x[0] for x in lst}
            return (f"gradient sets differ across ranks: rank 0 has {len(ref)} gradients, "
                    f"rank {r} has {len(lst)} (only on rank 0: {sorted(a - b)[:5]}, only on "
                    f"rank {r}: {sorted(b - a)[:5]}); every rank must register the same "
                    "parameters in the same order")
        for x, y in zip(ref, lst):
            if x != y:
                return (f"gradient sets differ across ranks: rank 0 has {x[0]!r} "
                        f"shape {tuple(x[1])} {x[2]}, rank {r} has {y[0]!r} shape "
                        f"{tuple(y[1])} {y[2]}; every rank must register the same "
                        "parameters in the same order")
    return "gradient sets differ across ranks"


def numel_of(shape: Sequence[int]) -> int:
    """The number of elements of a tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return n


def _lane_rounds(comp: Compressor, numel: int = 0, ndim: int = 1,
                 broadcast: bool = False) -> bool:
    """Every round's payloads reduce elementwise on ``kernels.summable_view`` by a
    sum or a max (declared: ``Capabilities.summable``, ``round_reductions``), so
    the collective lane's allreduces can carry them; with ``broadcast``, a
    broadcast round also may, when its payload size is known to every rank
    (``Compressor.broadcast_nbytes``)."""
    caps = comp.capabilities
    for r, (red, summable) in enumerate(zip(caps.round_reductions, caps.summable)):
        if red == "broadcast":
            if not broadcast or comp.broadcast_nbytes(r, numel, ndim) is None:
                return False
        elif not summable:
            return False
    return True


def _named_collective(name: str, comp: Compressor, collective: str, numel: int,
                      ndim: int) -> Workflow:
    """The workflow of a gradient whose decision names ``collective``.

    Raises:
        ValueError: the compressor cannot travel that way (the message says why).
    """
    caps = comp.capabilities
    if collective == "allgather":
        if caps.rounds != 1 or not caps.fixed_size:
            raise ValueError(f"gradient {name!r}: collective='allgather' gathers one payload "
                             f"of the same size from every rank; {comp.name} has "
                             f"{caps.rounds} round(s) and "
                             f"{'fixed' if caps.fixed_size else 'data-dependent'}-size "
                             "payloads (AR-Topk's Allgather counterpart is 'topk')")
        return Workflow.GATHER
    if not _lane_rounds(comp, numel, ndim, broadcast=True):
        raise ValueError(f"gradient {name!r}: collective={collective!r} reduces each round "
                         f"on the collective lane, which needs rounds summed or maxed on a "
                         f"summable payload, or broadcast with a size every rank knows; "
                         f"{comp.name} has rounds {list(caps.round_reductions)} (summable "
                         f"{list(caps.summable)}); use collective='allgather' for a "
                         "single-round compressor of fixed size, or none")
    return Workflow.ROUNDS_ALLREDUCE


def _named_ops(g: "GradLayout") -> Tuple[Dict[int, str], Dict[int, str]]:
    """(ops, algos) of the collectives of gradient ``g`` with a named collective."""
    ops: Dict[int, str] = {}
    algos: Dict[int, str] = {}
    assert g.compressor is not None and g.collective is not None
    if g.workflow is Workflow.GATHER:
        ops[msg_key(g.idx, 0, 0, 0)] = "gather"  # always Bruck's allgather
        return ops, algos
    for r, red in enumerate(g.compressor.capabilities.round_reductions):
        key = msg_key(g.idx, 0, r, 0)
        if red != "sum":
            ops[key] = red
        if red == "broadcast":
            algos[key] = "backend" if g.collective == "backend" else "tree"
        elif red == "sum" and g.collective in ("ring", "tree"):
            algos[key] = g.collective
    return ops, algos


def build_layout(specs: Sequence[Spec], decide: Callable[[str, int], GradientPlan],
                 compressor_for: Callable[[GradientPlan], Optional[Compressor]], *,
                 size: int, strategy: str, raw_collective: bool, fusion_bytes: int,
                 fuse: bool,
                 back_for: Optional[Callable[[GradientPlan, Compressor], Optional[Compressor]]]
                 = None) -> Layout:
    """Fix every gradient's workflow and partitions (see the module docstring).

    Args:
        specs: (name, shape, dtype) in registration order, checked equal on
            every rank.
        decide: the plan's decision for (name, bytes).
        compressor_for: the compressor instance for a decision that
            compresses (one instance per distinct compressor and parameters).
        size: world size; strategy: "ps" or "ring".
        raw_collective: uncompressed gradients and summable round payloads
            take allreduce (``EngineConfig.raw_collective``).
        fusion_bytes: a static bucket or round group closes at this many bytes.
        fuse: False gives every lane gradient its own bucket.
        back_for: the master compressor for a compressing decision and its
            worker compressor, or None (the worker's encodes the aggregate).
    """
    n = size
    load = [0] * n
    grads: Dict[str, GradLayout] = {}
    for idx, (name, shape, dt) in enumerate(specs):
        numel = numel_of(shape)
        nbytes = numel * dt.itemsize
        dec = decide(name, nbytes)
        comp = compressor_for(dec) if dec.compress else None
        back = back_for(dec, comp) if comp is not None and back_for is not None else None
        k = max(1, min(dec.partitions, numel, KEY_LIMITS["partitions"] - 1))
        named = dec.collective if comp is not None and n > 1 else None
        if named is not None:
            if named == "auto":
                raise ValueError(f"gradient {name!r}: collective='auto' must be resolved "
                                 "before the layout (casync.choice)")
            wf = _named_collective(name, comp, named, numel, len(shape))
            grads[name] = GradLayout(idx, name, shape, dt, numel, comp, wf,
                                     [(0, numel, -1)], back, named)
            continue
        if comp is None and raw_collective and n > 1:
            wf, k = Workflow.ALLREDUCE, 1
        elif comp is not None and comp.capabilities.rounds > 1:
            if raw_collective and n > 1 and _lane_rounds(comp):
                wf, k = Workflow.ROUNDS_ALLREDUCE, 1
            elif strategy == "ring" and numel // k >= n and n > 1:
                wf = Workflow.ROUNDS_RING
                if 2 * (n - 1) * comp.capabilities.rounds >= KEY_LIMITS["phases"]:
                    raise ValueError(f"{comp.name}: {comp.capabilities.rounds} ring rounds "
                                     f"need 2(N-1) phases each; world size {n} is too large "
                                     "(use strategy='ps')")
            else:
                wf = Workflow.ROUNDS
        elif strategy == "ring" and numel // k >= n and n > 1:
            wf = Workflow.RING
        else:
            wf = Workflow.PS
        if wf in (Workflow.ALLREDUCE, Workflow.ROUNDS_ALLREDUCE):  # no aggregator
            grads[name] = GradLayout(idx, name, shape, dt, numel, comp, wf, [(0, numel, -1)])
            continue
        parts = []
        multi = wf in (Workflow.ROUNDS, Workflow.ROUNDS_RING)
        for s, e in (row_chunks(shape, k) if multi else chunk_bounds(numel, k)):
            agg = min(range(n), key=lambda r: (load[r], r))
            load[agg] += e - s
            parts.append((s, e, agg))
        grads[name] = GradLayout(idx, name, shape, dt, numel, comp, wf, parts, back)
    if n >= KEY_LIMITS["phases"] // 2:
        raise ValueError(f"ring phases need world size < {KEY_LIMITS['phases'] // 2}")
    lane = plan_lane_buckets([(g.idx, g.numel, g.dtype) for g in grads.values()
                              if g.workflow is Workflow.ALLREDUCE], fusion_bytes, fuse=fuse)
    for b in lane:
        b.key = msg_key(len(specs) + b.index, 0, 0, 0)
    groups = {b.key: (b.key,) for b in lane}
    lane_rounds = [g for g in grads.values()
                   if g.workflow is Workflow.ROUNDS_ALLREDUCE and g.collective is None]
    groups.update(_round_groups(lane_rounds, fusion_bytes if fuse else 1))
    ops = {msg_key(g.idx, 0, r, 0): op for g in lane_rounds
           for r, op in enumerate(g.compressor.capabilities.round_reductions) if op != "sum"}
    algos: Dict[int, str] = {}
    solo = set()
    for g in grads.values():
        if g.collective is not None:
            o, a = _named_ops(g)
            ops.update(o)
            algos.update(a)
            solo.update(msg_key(g.idx, 0, r, 0) for r in range(g.compressor.capabilities.rounds))
    return Layout(grads, lane, groups, ops, algos, frozenset(solo))


def _round_groups(grads: List[GradLayout], fusion_bytes: int) -> Dict[int, Tuple[int, ...]]:
    """Static groups of summed round payloads: in reverse registration order (as
    backward produces them), one compressor instance and dtype per group, a
    group closing once its members' payloads reach ``fusion_bytes``; one
    group per round of the same members."""
    out: Dict[int, Tuple[int, ...]] = {}
    members: List[List[GradLayout]] = []
    open_: Dict[tuple, Tuple[List[GradLayout], List[int]]] = {}
    for g in reversed(grads):
        assert g.compressor is not None
        sig = (id(g.compressor), g.dtype)
        cur = open_.get(sig)
        if cur is None:
            cur = ([], [0])
            members.append(cur[0])
            open_[sig] = cur
        cur[0].append(g)
        cur[1][0] += g.compressor.payload_nbytes(g.numel, len(g.shape))
        if cur[1][0] >= fusion_bytes:
            del open_[sig]
    for group in members:
        assert group[0].compressor is not None
        for r in range(group[0].compressor.capabilities.rounds):
            # members in key order inside the fused buffer: what the coordinator's
            # run-time fusion gave when a round's payloads were ready together
            keys = tuple(sorted(msg_key(g.idx, 0, r, 0) for g in group))
            for k in keys:
                out[k] = keys
    return out
