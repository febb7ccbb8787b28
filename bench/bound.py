"""The lower bound on a configuration's step with a core per rank (issue 50, item 1).

The idea: with one core per rank, everything a compressor does runs on the
core that also runs backward, so no step can be shorter than the compute
plus the arithmetic that rank must do for the synchronisation, however well
communication and the engine are hidden. This script times, on one thread in
one process, per configuration of ``bench/train.py`` at world size N:

1. the floor: the model's training step (forward, backward, SGD with
   momentum) on a batch of 8 32x32 images, as bench/train.py's floor row;
2. the compressor arithmetic ONE rank does per step: every gradient the
   engine's default plan compresses (``SizeRule``, the rule ``plan=None``
   runs, with its K partitions), cut into the pieces the strategy works on,
   each operation timed on a piece and multiplied by how many such
   operations the rank does (``rank_ops``); the uncompressed gradients'
   fused allreduce (copy into the bucket, the reduction's adds, the average);
3. where ``step()`` fuses a PowerSGD layer's decode into SGD's update
   (``hipress_like/adapters/torch/fused_update.py``: float32 on the CPU, the
   rows' plain SGD with momentum), the difference it makes (kind "fused",
   negative): the fused sweep's time less that layer's decode and the floor's
   SGD step on it, both timed here;
4. the NaN/Inf scans the default non-finite mode (``propagate``) runs
   (``all_finite``): over the uncompressed gradients (the allreduce lane
   checks its bucket in one pass, ``Engine._flush_lane``) and over the
   compressed gradients whose compressor does not find NaN/Inf in its own
   first pass (``Capabilities.checks_finite``, ``Engine.submit``); the
   others' scan is fused into their encode and timed with it.

Each part keeps the fastest of ``--repeats`` timings: on a shared host other
jobs only add time, and the parts are timed at different moments.

Which operations a rank does (``rank_ops``) follows the workflows of
``hipress_like.casync.workflows`` and counts the same operators as HiPress's
cost model (Eq. 1-2; alpha/beta/gamma of Table 3 and Sec. 6.1, in
``hipress_like.cost_model.model``), but per rank and per byte rather than
on the critical path: with the aggregators byte-balanced (co-located PS) or
the chunks spread over the ring, every rank encodes each value of its
gradient once, decodes-and-adds (or merges) the other ranks' payloads of a
1/N share, and decodes the aggregate of every value once. The two
strategies do the same arithmetic in different pieces (PS: partitions of
m/K; Ring: chunks of m/(K N)), which is what the per-call overhead sees.

    python bench/bound.py --model vgg --nprocs 2                # every hp- row
    python bench/bound.py --configs hp-ring-powersgd1,hp-ps-onebit --nprocs 4

Writes results/bound_<model>_n<N>.json and prints a table. ``bound_x_floor``
is a lower bound on a row's ``x floor`` in ``bench/train.py --nprocs N``
with a core per rank; ``bench/train.py`` prints each row's step over it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

# Every measurement keeps the fastest of its repetitions: another job on a shared host
# only ever adds time, the floor and the arithmetic are timed at different moments, and
# a lower bound wants each part's own cost (their ratio is then steady under load).
# the kinds of per-rank work a bound adds up, in the order the table prints them
KINDS = ("encode", "decode_add", "merge", "decode", "lane", "fused", "scan")


@dataclass(frozen=True)
class Op:
    """``calls`` operations of one kind per step on one rank, each on one piece.

    Attributes:
        kind: "encode", "decode_add" (``acc += decode(payload)``: a PS
            aggregator's or Ring hop's sum of a non-aggregatable payload),
            "merge" (sum ``fan_in`` payloads without decoding), "decode" (the
            aggregate written back as the average).
        pieces: the gradient is cut into this many equal pieces; each call
            works on one (PS: the K partitions; Ring: K x N chunks).
        calls: calls per step on this rank; fractional where a rank's share
            of the aggregations is 1/N of the partitions on average.
        round: the communication round (multi-round compressors), else 0.
        fan_in: payloads a merge sums (N at a PS aggregator, 2 at a ring hop).
    """

    kind: str
    pieces: int
    calls: float
    round: int = 0
    fan_in: int = 1

    @property
    def fraction(self) -> float:
        """The share of the gradient's values these calls touch (calls / pieces)."""
        return self.calls / self.pieces


def rank_ops(strategy: str, n: int, k: int, *, aggregatable: bool = False, rounds: int = 1,
             back: bool = False) -> List[Op]:
    """The compressor operations one rank does per step for one gradient of K partitions.

    Derived from ``casync.workflows`` (``ps_workflow``, ``ring_workflow``,
    ``rounds_workflow``, ``rounds_ring_workflow``); the operators are
    HiPress's (Eq. 2's encodes and decodes, Table 3), counted per rank with
    the aggregations byte-balanced: a rank aggregates 1/N of the partitions
    (co-located PS, HiPress Sec. 6.1) or reduces N-1 of the N chunks of
    each partition (Ring).

    Args:
        strategy: "ps" (co-located CaSync-PS), "ring" (CaSync-Ring) or
            "allreduce": a multi-round compressor whose rounds sum on the
            collective lane (``Workflow.ROUNDS_ALLREDUCE``, what the engine
            runs for PowerSGD under either strategy by default): the whole
            gradient (K = 1) encoded each round, the payload summed by a ring
            allreduce ((N-1)/N of it added per rank), decoded once.
        n: world size N (>= 2).
        k: partitions K of the gradient (>= 1).
        aggregatable: payloads merge without decoding (PowerSGD, THC, identity).
        rounds: communication rounds (PowerSGD: 2); more than one needs
            ``aggregatable``.
        back: a master compressor re-encodes the aggregate (Natural
            Compression Alg. 1); for aggregatable payloads that costs a decode
            and an encode where the aggregate starts back.

    Returns:
        The operations, each with its piece count and calls per step.

    Raises:
        ValueError: unknown strategy, N < 2, K < 1, or several rounds of
            non-aggregatable payloads (CaSync cannot run them).

    Example:
        >>> [(o.kind, o.calls) for o in rank_ops("ps", 4, 4)]
        [('encode', 4), ('decode_add', 3.0), ('decode', 4)]
        >>> [(o.kind, o.pieces, o.calls) for o in rank_ops("ring", 2, 1)]
        [('encode', 2, 2), ('decode_add', 2, 1), ('decode', 2, 2)]
    """
    if strategy not in ("ps", "ring", "allreduce"):
        raise ValueError(f"strategy: expected 'ps', 'ring' or 'allreduce', found {strategy!r}")
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"n: expected an integer world size >= 2, found {n!r} "
                         "(one rank synchronises nothing: its bound is the floor)")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an integer number of partitions >= 1, found {k!r}")
    if rounds > 1 and not aggregatable:
        raise ValueError(f"{rounds} rounds of non-aggregatable payloads: CaSync runs "
                         "multi-round compressors only when their payloads merge; "
                         "pass aggregatable=True")
    if strategy == "allreduce":
        if rounds < 2 or not aggregatable:
            raise ValueError("strategy 'allreduce' is the lane of multi-round aggregatable "
                             f"compressors; found rounds={rounds}, aggregatable={aggregatable}")
        ops = []
        for r in range(rounds):
            ops += [Op("encode", 1, 1, r), Op("merge", 1, (n - 1) / n, r, 2)]
        return ops + [Op("decode", 1, 1, rounds - 1)]
    share = k / n  # partitions one rank aggregates (PS), byte-balanced
    if strategy == "ps":
        pieces, encodes, decodes = k, k, k
        merges, fan = share, n  # the aggregator sums N payloads of each partition it owns
        adds = share * (n - 1)  # ... or decodes-and-adds the N-1 others' into its own
        reencodes = share  # bidirectional: the aggregate re-encoded once per owned partition
    else:
        pieces = k * n  # chunks: own encode + N-2 hop encodes + the owner's final encode
        encodes, decodes = k * n, k * n  # every chunk's aggregate written back
        merges, fan = k * (n - 1), 2  # one merge per hop, N-1 hops per partition
        adds = k * (n - 1)
        reencodes = k  # the last hop of each partition
    if rounds > 1:
        ops = []
        for r in range(rounds):
            ops += [Op("encode", pieces, encodes, r), Op("merge", pieces, merges, r, fan)]
        return ops + [Op("decode", pieces, decodes, rounds - 1)]
    if aggregatable:
        ops = [Op("encode", pieces, encodes), Op("merge", pieces, merges, 0, fan)]
        if back:
            ops += [Op("decode", pieces, reencodes), Op("encode", pieces, reencodes)]
        return ops + [Op("decode", pieces, decodes)]
    return [Op("encode", pieces, encodes), Op("decode_add", pieces, adds),
            Op("decode", pieces, decodes)]


def lane_fraction(n: int) -> Dict[str, float]:
    """Passes over the uncompressed gradients' bytes one rank makes in their fused allreduce.

    Copy into the bucket (1), the ring reduction's adds ((N-1)/N of the
    values, HiPress Table 3's Ring / the flexible-communication paper's
    Table I), the average written back (1).

    Example:
        >>> lane_fraction(4)
        {'copy': 1.0, 'add': 0.75, 'div': 1.0}
    """
    if n < 2:
        raise ValueError(f"n: expected a world size >= 2, found {n!r}")
    return {"copy": 1.0, "add": (n - 1) / n, "div": 1.0}


def median_spread(values: Sequence[float]) -> Tuple[float, float, float]:
    """(median, min, max) of repeated measurements.

    Raises:
        ValueError: no values.

    Example:
        >>> median_spread([3.0, 1.0, 2.0, 10.0])
        (2.5, 1.0, 10.0)
    """
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("median_spread: expected at least one value, found none")
    return statistics.median(vals), min(vals), max(vals)


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> Tuple[float, float, float]:
    """(median, min, max) of ``num[i] / den[i]`` over alternated runs i.

    Runs of two configurations alternate, so run i of each saw the same host
    load; their ratio run by run is steadier than a ratio of medians. With
    unequal counts (a run failed) the common prefix is used.

    Raises:
        ValueError: no pair, or a zero denominator.

    Example:
        >>> paired_ratio([2.0, 4.0, 3.0], [1.0, 2.0, 2.0])
        (2.0, 1.5, 2.0)
    """
    pairs = list(zip(num, den))
    if not pairs:
        raise ValueError("paired_ratio: expected at least one pair of runs, found none")
    if any(d == 0 for _, d in pairs):
        raise ValueError("paired_ratio: a denominator run is 0 ms; expected positive times")
    return median_spread([a / b for a, b in pairs])


# -- configurations ------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """A train.py row as the bound needs it: strategy, compressor, parameters, master."""

    strategy: str
    compressor: Optional[str]  # None: every gradient in the allreduce lane
    params: Dict[str, Any]
    back: Optional[str] = None


def spec_of(config: str) -> Optional[Spec]:
    """The ``Spec`` of a bench/train.py configuration name, or None when it has no bound here.

    ``floor`` has no synchronisation (its bound is itself); ``ddp`` and
    ``hp-none`` run every gradient through an allreduce; ``hp-<ps|ring>-<c>``
    a fixed compressor (``powersgd<R>`` is PowerSGD of rank R, ``powersgd<R>bf`` the
    same with its error memory in bfloat16). Rows chosen at
    run time (``-auto``, ``-plan``), DDP's hooks, AR-Topk and Horovod's rows
    give None.

    Example:
        >>> spec_of("hp-ring-powersgd1")
        Spec(strategy='ring', compressor='powersgd', params={'rank': 1}, back=None)
        >>> spec_of("hp-ps-powersgd4bf").params
        {'rank': 4, 'error_dtype': 'bfloat16'}
        >>> spec_of("hp-ps-auto") is None
        True
    """
    import train

    if config in ("ddp", "hp-none"):
        return Spec("ps", None, {})
    parts = config.split("-", 2)
    if len(parts) != 3 or parts[0] != "hp" or parts[1] not in ("ps", "ring"):
        return None
    comp = parts[2]
    if comp.startswith("powersgd") and comp[8:].removesuffix("bf").isdigit():
        extra = {"error_dtype": "bfloat16"} if comp.endswith("bf") else {}
        return Spec(parts[1], "powersgd", {"rank": int(comp[8:].removesuffix("bf")), **extra})
    if comp not in train.HP_COMPRESSORS:
        return None
    params = dict(train.PARAMS.get(comp, {}))
    name = train.REGISTRY_NAME.get(comp, comp)
    return Spec(parts[1], name, params, train.BACK.get(comp))


# -- timing --------------------------------------------------------------------------------

def _fastest_ms(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, in ms."""
    fn()  # warm-up: allocations, first touch
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def piece(grad, pieces: int):
    """One of ``pieces`` equal pieces of ``grad``: whole rows of a matrix (as the engine
    partitions one), else a flat slice."""
    if grad.dim() >= 2 and grad.shape[0] >= pieces:
        return grad[: grad.shape[0] // pieces]
    return grad.reshape(-1)[: max(1, grad.numel() // pieces)]


def time_calls(comp, x, fans: Dict[Tuple[str, int], int], n: int, kw: Dict[str, Any],
                repeats: int) -> Dict[Tuple[str, int], List[float]]:
    """Seconds of each (kind, round) call on piece ``x``, ``repeats`` times after a warm-up."""
    import torch

    from hipress_like.compressors.base import assume_finite

    caps = comp.capabilities
    times: Dict[Tuple[str, int], List[float]] = {}
    st = comp.init(x, seed=0, **kw)
    acc, buf = x.clone(), torch.empty_like(x)

    def clock(key, fn):
        t0 = time.perf_counter()
        res = fn()
        times.setdefault(key, []).append(time.perf_counter() - t0)
        return res

    for rep in range(repeats + 1):  # the first pass warms up
        with assume_finite():
            if caps.rounds > 1:
                merged = None
                for r in range(caps.rounds):
                    p, st = clock(("encode", r), lambda r=r, m=merged, s=st:
                                  comp.encode_round(r, x, s, m))
                    f = fans.get(("merge", r), 1)
                    merged = clock(("merge", r), lambda r=r, p=p, f=f:
                                   comp.merge_round(r, [p] * f))
                _, st = clock(("decode", caps.rounds - 1), lambda m=merged, s=st:
                              comp.decode_rounds(x, s, m, out=buf, average=True))
            else:
                p, st = clock(("encode", 0), lambda s=st: comp.encode(x, s))
                if caps.aggregatable:
                    f = fans.get(("merge", 0), 1)
                    p = clock(("merge", 0), lambda p=p, f=f: comp.merge([p] * f))
                else:
                    acc.copy_(x)  # not timed: decode_add_ sums into it
                    clock(("decode_add", 0), lambda p=p: comp.kernels.decode_add_(p, acc))
                clock(("decode", 0), lambda p=p: comp.kernels.decode_div_(p, buf, n))
        if rep == 0:
            times.clear()
    return times


def time_ops(comp, grad, ops: Sequence[Op], n: int, repeats: int) -> Dict[str, float]:
    """Milliseconds per step of ``ops`` on ``grad``: each op timed on its piece, times calls.

    The calls run as the engine runs them: inside ``assume_finite`` (the
    engine's own scan is timed apart), each encode with its state, decodes
    into a buffer of the piece's size, merges of ``fan_in`` payloads.

    Args:
        comp: the compressor as the engine builds it (error feedback included).
        grad: the gradient.
        ops: ``rank_ops`` for it.
        n: world size N (the compressor's ``world_size``; the average's divisor).
        repeats: timed calls per operation (the fastest is kept).

    Returns:
        Milliseconds per kind (``KINDS``; "lane" and "scan" are 0 here).
    """
    out: Dict[str, float] = {k: 0.0 for k in KINDS}
    by_pieces: Dict[int, List[Op]] = {}
    for op in ops:
        by_pieces.setdefault(op.pieces, []).append(op)
    kw: Dict[str, Any] = {"world_size": n, "shared_seed": 1}
    if "broadcast" in comp.capabilities.round_reductions:
        kw["rank"] = 0
    for pieces, group in by_pieces.items():
        x = piece(grad, pieces).contiguous()
        fans = {(o.kind, o.round): o.fan_in for o in group}
        times = time_calls(comp, x, fans, n, kw, repeats)
        for op in group:
            ts = times.get((op.kind, op.round))
            if ts:
                out[op.kind] += min(ts) * 1e3 * op.calls
    return out


def time_lane(tensors, n: int, repeats: int) -> float:
    """Milliseconds per step one rank spends on the fused allreduce's arithmetic (one thread)."""
    import torch

    total = sum(t.numel() for t in tensors)
    if total == 0:
        return 0.0
    buf = torch.empty(total)
    other = torch.randn(total)
    fr = lane_fraction(n)
    m_add = max(1, int(total * fr["add"]))

    def lane():
        torch.cat([t.reshape(-1) for t in tensors], out=buf)
        buf[:m_add].add_(other[:m_add])
        off = 0
        for t in tensors:
            torch.div(buf[off:off + t.numel()].view(t.shape), n, out=t)
            off += t.numel()

    return _fastest_ms(lane, repeats)


def floor_step(model: str, batch: int = 8, lr: float = 1e-4):
    """One floor step of bench/train.py's ``model`` as a callable (forward, backward and SGD
    with momentum on a fixed random batch; no communication), on one torch thread.

    Returns:
        (step, net): the callable and the model it trains.
    """
    import torch
    from models import MODELS

    torch.set_num_threads(1)  # a rank of bench/train.py runs one thread
    torch.manual_seed(0)
    net = MODELS[model](num_classes=10, in_channels=1)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    x, y = torch.randn(batch, 1, 32, 32), torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    return step, net


def time_fused(comp, grad, repeats: int) -> Optional[Tuple[float, float]]:
    """(ms of the floor's SGD step on a parameter shaped like ``grad``, ms of the fused
    decode-and-step sweep on it), or None when ``step()`` would not fuse this
    compressor's decode (not PowerSGD, no native kernels, or a padded matrix view,
    whose decode goes through a buffer)."""
    import torch

    from hipress_like.compressors._build import native
    from hipress_like.compressors.powersgd import PowerSGD, matrix_shape
    from hipress_like.compressors.powersgd import native as c

    rows, cols = matrix_shape(grad.shape)
    if (not isinstance(comp, PowerSGD) or not native.usable(grad, dtypes=(torch.float32,))
            or rows * cols != grad.numel()):
        return None
    rank = max(1, min(comp.rank, rows, cols))
    prm = torch.nn.Parameter(torch.randn(grad.shape))
    prm.grad = grad.clone()
    opt = torch.optim.SGD([prm], lr=1e-4, momentum=0.9)
    opt.step()  # the momentum buffer exists from here, as in a steady step
    sgd = _fastest_ms(opt.step, repeats)
    p, qt = torch.randn(rows, rank), torch.randn(rank, cols)
    buf = opt.state[prm]["momentum_buffer"]
    with torch.no_grad():
        sweep = _fastest_ms(lambda: c.psgd_lowrank_sgd(p, qt, prm.grad, prm, buf, lr=1e-4,
                                                        momentum=0.9), repeats)
    return sgd, sweep


class Bounds:
    """Times the floor once per model and each configuration's bound at world size N.

    Args:
        model: a bench/train.py model name ("vgg", "resnet18").
        repeats: timed repetitions per measurement (the fastest is kept).
        batch: images per rank per step (bench/train.py's --batch).
    """

    def __init__(self, model: str = "vgg", repeats: int = 5, batch: int = 8) -> None:
        import torch

        self.model_name, self.repeats = model, repeats
        step, net = floor_step(model, batch)
        self.floor_ms = _fastest_ms(step, repeats)
        gen = torch.Generator().manual_seed(0)
        self.grads = [(name, torch.randn(p.shape, generator=gen))
                      for name, p in net.named_parameters()]
        self._scan_cache: Dict[Tuple[str, ...], float] = {}
        self.scan_ms = self._scan(tuple(name for name, _ in self.grads))  # every gradient
        self._lane_cache: Dict[Tuple[Tuple[str, ...], int], float] = {}

    def _scan(self, names: Sequence[str]) -> float:
        """ms of the NaN/Inf scan over the gradients ``names`` (cached)."""
        from hipress_like.compressors.base import all_finite

        key = tuple(names)
        if key not in self._scan_cache:
            grads = [g for name, g in self.grads if name in set(names)]
            self._scan_cache[key] = (
                _fastest_ms(lambda: [all_finite(g) for g in grads], self.repeats)
                if grads else 0.0)
        return self._scan_cache[key]

    def _lane(self, names: Sequence[str], n: int) -> float:
        key = (tuple(names), n)
        if key not in self._lane_cache:
            ts = [g.clone() for name, g in self.grads if name in set(names)]
            self._lane_cache[key] = time_lane(ts, n, self.repeats)
        return self._lane_cache[key]

    def bound(self, config: str, n: int) -> Optional[Dict[str, Any]]:
        """The bound of ``config`` (a bench/train.py name) at world size ``n``, or None.

        Returns:
            floor_ms, per-kind ms (``KINDS``), arith_ms (their sum without
            the scan), scan_ms, bound_ms (floor + arith + scan: the default
            non-finite mode), bound_x_floor, the compressed gradients with
            their K, and each gradient's operations.
        """
        from hipress_like.casync.choice import build_compressor
        from hipress_like.cost_model.plan import SizeRule

        row = {"config": config, "nprocs": n, "model": self.model_name,
               "floor_ms": self.floor_ms, "scan_ms": self.scan_ms}
        if config == "floor":
            return dict(row, **{k: 0.0 for k in KINDS}, arith_ms=0.0, bound_ms=self.floor_ms,
                        bound_x_floor=1.0, bound_no_scan_x_floor=1.0, compressed={})
        spec = spec_of(config)
        if spec is None:
            return None
        per = {k: 0.0 for k in KINDS}
        compressed: Dict[str, int] = {}
        ops_of: Dict[str, List[Dict[str, Any]]] = {}
        lane: List[str] = []
        scanned: List[str] = []  # compressed, and scanned by the engine before encoding
        comp = back = None
        if spec.compressor is not None:
            comp = build_compressor(spec.compressor, spec.params, "auto")
        rule = SizeRule()
        for name, g in self.grads:
            d = rule.decide(g.numel() * g.element_size(), n)
            if comp is None or not d.compress:
                lane.append(name)
                continue
            caps = comp.capabilities
            if not caps.checks_finite:
                scanned.append(name)
            back = spec.back is not None
            strategy, k = spec.strategy, d.partitions
            if lane_rounds(comp):
                strategy, k = "allreduce", 1  # as casync.layout lays it out
            ops = rank_ops(strategy, n, k, aggregatable=caps.aggregatable, rounds=caps.rounds,
                           back=back)
            times = time_ops(comp, g, ops, n, self.repeats)
            for kind, ms in times.items():
                per[kind] += ms
            fused = None if config.startswith("ddp") else time_fused(comp, g, self.repeats)
            if fused is not None:  # the sweep replaces the decode and the floor's step
                per["fused"] += fused[1] - fused[0] - times["decode"]
            compressed[name] = k
            ops_of[name] = [asdict(o) for o in ops]
        per["lane"] = self._lane(lane, n)
        # DDP scans nothing (NaN reaches the sums); this project's engine scans what it must
        per["scan"] = 0.0 if config.startswith("ddp") else self._scan(lane + scanned)
        arith = sum(v for k, v in per.items() if k != "scan")
        bound = self.floor_ms + arith + per["scan"]
        return dict(row, **per, arith_ms=arith, bound_ms=bound,
                    bound_x_floor=bound / self.floor_ms,
                    bound_no_scan_x_floor=(self.floor_ms + arith) / self.floor_ms,
                    compressed=compressed, ops=ops_of, lane_gradients=lane)


def lane_rounds(comp) -> bool:
    """True when the engine (raw_collective=True, its default, N > 1) sums this compressor's
    rounds on the collective lane (``casync.layout``: ``Workflow.ROUNDS_ALLREDUCE``)."""
    from hipress_like.casync.layout import _lane_rounds

    return comp.capabilities.rounds > 1 and _lane_rounds(comp)


def default_configs() -> List[str]:
    """Every bench/train.py row with a bound: floor, DDP, hp-none, PS/Ring x compressor."""
    import train

    return ["floor", "ddp", "hp-none"] + [f"hp-{s}-{c}" for s in ("ps", "ring")
                                          for c in train.HP_COMPRESSORS]


def print_table(rows: Sequence[Dict[str, Any]]) -> None:
    """The bounds as a table (ms per step on one thread)."""
    if not rows:
        return
    r0 = rows[0]
    print(f"{r0['model']}, {r0['nprocs']} ranks, one thread: floor {r0['floor_ms']:.1f} ms, "
          f"NaN/Inf scan of every gradient {r0['scan_ms']:.1f} ms")
    print(f"{'configuration':<20}" + "".join(f"{k:>11}" for k in KINDS)
          + f"{'bound ms':>10}{'x floor':>9}")
    for r in rows:
        print(f"{r['config']:<20}" + "".join(f"{r[k]:11.1f}" for k in KINDS)
              + f"{r['bound_ms']:10.1f}{r['bound_x_floor']:9.2f}")


def main(argv=None) -> int:
    """Time the bounds of the configurations at each world size; print; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vgg", choices=["vgg", "resnet18"])
    ap.add_argument("--nprocs", default="2", help="world sizes, comma-separated (e.g. 2,4)")
    ap.add_argument("--configs", default="all", help="comma-separated bench/train.py rows")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed repetitions (the fastest is kept)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in ns.nprocs.split(",") if x]
    except ValueError:
        ap.error(f"--nprocs: expected comma-separated integers, found {ns.nprocs!r}")
    if not sizes or min(sizes) < 2:
        ap.error(f"--nprocs: expected world sizes >= 2, found {ns.nprocs!r}")
    configs = default_configs() if ns.configs == "all" else ns.configs.split(",")
    unknown = [c for c in configs if c != "floor" and spec_of(c) is None]
    if unknown:
        ap.error(f"no bound for {unknown}: expected floor, ddp, hp-none or "
                 f"hp-<ps|ring>-<compressor> (see --configs all: {', '.join(default_configs())})")
    b = Bounds(ns.model, ns.repeats)
    rows = []
    for n in sizes:
        got = [b.bound(c, n) for c in configs]
        print_table(got)
        rows += got
    out = ns.out or os.path.join(ROOT, "results", f"bound_{ns.model}_n"
                                 f"{'-'.join(map(str, sizes))}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": ns.model, "nprocs": sizes, "repeats": ns.repeats, "rows": rows},
                  f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
