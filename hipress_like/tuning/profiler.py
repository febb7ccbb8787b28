"""Measuring profiles: compressors, links and whole engine synchronisations (HiPress Sec. 3.3).

The live half of the cost model: it times compressors on this machine, bulk
rounds over a real transport, and synchronisations through the CaSync
engine, and fills the ``cost_model.profile.Profile`` the pure planner reads.
It sits above ``casync`` (it drives engines), below the front ends. The
timings of whole engine synchronisations live in ``engine_timing.py`` and
are re-exported here, and so is the one link measurement (``link.py``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..compressors.base import assume_finite
from ..cost_model.model import Curve, Link, fit_link
from ..cost_model.profile import (
    CompressorProfile,
    Profile,
    Progress,
    log_sizes,
)
from .engine_timing import (  # noqa: F401 (part of this module's interface)
    _iterate,
    engine_points,
    measure_engine_sync,
    measure_sync_overhead,
    profile_shape,
    time_engine_steps,
)
from .link import measure_link  # noqa: F401 (part of this module's interface)

__all__ = [
    "candidate",
    "memory_bound",
    "profile_compressor",
    "measure_link",
    "profile_transport",
    "measure_sync_overhead",
    "measure_engine_sync",
    "engine_points",
    "broadcast_bytes",
    "monotone",
]

_log = logging.getLogger(__name__)


def candidate(label: str, params: Optional[Mapping[str, Any]]) -> Tuple[str, Dict[str, Any]]:
    """The registry (name, params) of a candidate given as ``{label: params}``.

    A label is the compressor's registry name, or any name when ``params``
    holds ``"compressor"``: ``{"topk-bloom": {"compressor": "topk", "ratio":
    0.01, "index_codec": "bloom"}}`` lets the planner choose between two
    configurations of one compressor (plain and Bloom-coded top-k) per gradient.
    """
    ps = dict(params or {})
    return str(ps.pop("compressor", label)), ps


def _available_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_bound(sizes: Sequence[int], copies: int = 4, fraction: float = 0.5) -> List[int]:
    """Drop sizes whose ``copies`` buffers would not fit in ``fraction`` of free memory."""
    avail = _available_memory()
    if avail is None:
        return list(sizes)
    kept = [s for s in sizes if s * copies <= fraction * avail]
    if len(kept) < len(sizes):
        _log.warning("skipping sizes above %d bytes: not enough free memory (%d bytes)",
                     kept[-1] if kept else 0, avail)
    return kept


def _time(fn: Callable[[], Any], repeats: int, min_time: float) -> float:
    """Median seconds of ``fn`` over at least ``repeats`` calls and ``min_time`` seconds."""
    fn()  # warm up (allocator, lazy init, compilation)
    ts: List[float] = []
    start = time.perf_counter()
    while len(ts) < repeats or (time.perf_counter() - start < min_time and len(ts) < 50):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return max(statistics.median(ts), 1e-9)


def profile_compressor(
    name: str,
    params: Optional[Mapping[str, Any]] = None,
    sizes: Optional[Sequence[int]] = None,
    *,
    repeats: int = 5,
    min_time: float = 0.05,
    progress: Progress = None,
    barrier: Optional[Callable[[], None]] = None,
    error_feedback: Union[bool, str] = False,
) -> CompressorProfile:
    """Time encode and decode of a compressor over sizes (HiPress Sec. 3.3).

    1. For each size, a float32 gradient of that many bytes (standard normal,
       fixed seed) is encoded once to warm up, then timed (median).
    2. The payload is decoded and timed the same way.
    3. ``ratio`` and ``header_bytes`` are fitted to the payload sizes.

    Args:
        name: registry name of the compressor.
        params: its constructor parameters.
        sizes: bytes per gradient (default 4 KB .. 256 MB, bounded by memory).
        repeats: timed calls per size (at least).
        min_time: keep timing small sizes until this many seconds passed.
        progress: ``progress(iterable, desc, total)`` wrapper (e.g. tqdm).
        barrier: called before each size (all ranks time together, so a
            multi-rank profile sees the CPU contention of real training).
        error_feedback: time the compressor inside the error-feedback
            wrapper (True), bare (False), or as the engine runs it ("auto":
            wrapped when biased, stateless and single-round).

    Returns:
        The compressor's profile.

    Raises:
        ValueError: unknown compressor (the message lists the known ones).
    """
    from .. import compressors

    c = compressors.get(name, **dict(params or {}))
    if error_feedback == "auto":
        caps = c.capabilities
        error_feedback = (caps.category != "none" and not caps.unbiased and not caps.stateful
                          and caps.rounds == 1)
    if error_feedback:
        c = compressors.get("ef", inner=c)
    sizes = memory_bound(sorted(set(sizes or log_sizes(4 << 10, 256 << 20))))
    if not sizes:
        raise ValueError("no size to profile fits in memory")
    gen = torch.Generator().manual_seed(0)
    enc_t, dec_t, pay = [], [], []
    encode, decode, sent = _codec(c)
    for nbytes in _iterate(sizes, progress, f"{name} encode/decode"):
        grad = torch.randn(profile_shape(max(1, nbytes // 4)), generator=gen)
        out = torch.empty_like(grad)
        state = c.init(grad, world_size=1)
        if barrier:
            barrier()
        # as the engine runs them: it has scanned the gradient for NaN/Inf already
        # (assume_finite), and it decodes into existing buffers (out=), never into a
        # fresh tensor, whose page faults cost several memory copies here
        with assume_finite():
            enc_t.append(_time(lambda g=grad, s=state: encode(g, s), repeats, min_time))
            payload, _ = encode(grad, state)
        pay.append(sent(payload))
        dec_t.append(_time(lambda p=payload, g=grad, o=out: decode(p, g, o), repeats,
                           min_time))
        del grad, payload, out
    ratio, header = _fit_payload(sizes, pay)
    enc_t, dec_t = monotone(enc_t), monotone(dec_t)
    return CompressorProfile(
        name=name, params=dict(params or {}), category=c.capabilities.category,
        aggregatable=c.capabilities.aggregatable, ratio=ratio, header_bytes=header,
        error_feedback=bool(error_feedback), encode=Curve(tuple(sizes), tuple(enc_t)),
        decode=_curve_by_payload(pay, dec_t))


def _codec(c: Any) -> Tuple[Callable[..., Any], Callable[..., Any], Callable[..., int]]:
    """(encode(grad, state), decode(payload, grad, out), sent(payload)): ``c`` as the
    engine runs it, and the bytes a rank sends for it.

    A single-round compressor: ``encode`` and ``decode(out=)``. A compressor
    with several rounds (PowerSGD's P and Q, THC's range then indices) runs
    them all, each round's aggregate being this rank's own payload merged
    by the round's reduction (a world of one), and decodes with
    ``decode_rounds``: its encode curve holds every round's encode, its
    bytes every round's payload (PowerSGD's P and Q; THC's few bytes of
    range per block and its indices), and its decode curve the work after
    the last merge.
    """
    rounds = c.capabilities.rounds
    if rounds == 1:
        return ((lambda g, s: c.encode(g, s)), (lambda p, g, o: c.decode(p, out=o)),
                lambda p: int(p.numel()))

    last: List[Any] = [None, 0]  # the last encode's state (its decode needs it) and bytes

    def encode(grad: torch.Tensor, state: Any) -> Tuple[torch.Tensor, Any]:
        agg, total = None, 0
        for r in range(rounds):
            payload, state = c.encode_round(r, grad, state, agg)
            total += int(payload.numel())
            if r < rounds - 1:
                agg = c.merge_round(r, [payload])
        last[0], last[1] = state, total
        return payload, state

    def decode(payload: torch.Tensor, grad: torch.Tensor, out: torch.Tensor):
        return c.decode_rounds(grad, last[0], c.merge_round(rounds - 1, [payload]), out=out,
                               average=True)

    return encode, decode, lambda p: last[1]


def monotone(times: Sequence[float]) -> List[float]:
    """The closest non-decreasing sequence (least squares in log time; pool adjacent violators).

    Encoding more bytes never takes less time, so a sample below a smaller
    size's is noise (a descheduled run, a warm cache); pooling keeps one
    stray sample from bending the curve and the planner's K with it.

    Example:
        >>> [round(t, 6) for t in monotone([1.0, 4.0, 1.0, 8.0])]
        [1.0, 2.0, 2.0, 8.0]
    """
    blocks: List[List[float]] = []  # [sum of log times, count]
    for t in times:
        blocks.append([math.log(t), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: List[float] = []
    for s, c in blocks:
        out += [math.exp(s / c)] * int(c)
    return out


def _fit_payload(sizes: Sequence[int], payloads: Sequence[int]) -> Tuple[float, int]:
    """payload = header + ratio * size, from the two largest sizes (headers are fixed)."""
    if len(sizes) == 1:
        return payloads[0] / sizes[0], 0
    (s0, p0), (s1, p1) = (sizes[-2], payloads[-2]), (sizes[-1], payloads[-1])
    ratio = (p1 - p0) / (s1 - s0)
    if ratio <= 0:
        return payloads[-1] / sizes[-1], 0
    return ratio, max(0, int(round(p1 - ratio * s1)))


def _curve_by_payload(payloads: Sequence[int], times: Sequence[float]) -> Curve:
    # Tiny inputs can give equal payload sizes; keep one sample per size.
    pts: Dict[int, float] = {}
    for i, p in enumerate(payloads):
        pts[p] = max(pts.get(p, 0.0), times[i])
    xs = sorted(pts)
    return Curve(tuple(xs), tuple(pts[x] for x in xs))


def profile_transport(
    transport: Any,
    compressors: Mapping[str, Mapping[str, Any]],
    *,
    sizes: Optional[Sequence[int]] = None,
    link_sizes: Optional[Sequence[int]] = None,
    link: Optional[Link] = None,
    repeats: int = 5,
    timeout: float = 300.0,
    progress: Progress = None,
    error_feedback: Union[bool, str] = "auto",
    round_meta_bytes: int = 0,
    engine_overhead: Union[None, str, Sequence[str]] = None,
    raw_collective: bool = True,
    engine_grid: Optional[Sequence[Tuple[int, int]]] = None,
    nonfinite: str = "propagate",
) -> Profile:
    """A full profile on every rank of a transport. Collective.

    Every rank times the compressors at the same moments (so the timings see
    the CPU contention of ``size`` ranks on one host) and the link with all
    links and with one link busy (unless ``link`` is given); rank 0's
    measurements are what every rank returns.

    Args:
        transport: the transport every rank uses.
        compressors: {name: params} to profile; a name may be a label
            (``candidate``), the profile is keyed by it.
        sizes: gradient sizes for the compressor curves.
        link_sizes: message sizes for the link fit.
        link: a given link (skips the link measurement).
        repeats: timed calls per size.
        timeout: seconds for each collective.
        progress: ``progress(iterable, desc, total)`` wrapper (rank 0 only).
        error_feedback: see ``profile_compressor`` (default: as the engine runs it).
        round_meta_bytes: see ``measure_link``.
        engine_overhead: a strategy ("ps", "ring"), or several, to also time
            whole synchronisations through the engine: the first one's fixed
            cost per synchronisation (``measure_sync_overhead``) and
            uncompressed lane over ``link_sizes`` (``Profile.lane``, with
            ``raw_collective``), and each compressor over ``engine_grid``
            with every one of them (``CompressorProfile.engine_samples``,
            ``engine_samples_by``). None measures none of them (HiPress's
            Eq. 1/2 as published).
        raw_collective: the engine's setting (uncompressed gradients by
            allreduce); with a measured link, the allreduce is measured too.
        engine_grid: ``(bytes, K)`` points of the compressed engine timings
            (default ``engine_points`` up to the largest profiled size).
        nonfinite: the engine's ``EngineConfig.nonfinite`` while timing it
            (default "propagate", the front ends' default, which copies
            compressor state each step so that a NaN/Inf step can be undone).

    Returns:
        The same ``Profile`` on every rank.
    """
    prog = progress if transport.rank == 0 else None
    samples: Tuple[Tuple[int, float], ...] = ()
    one, one_samples = None, ()
    if link is None:
        link, samples = measure_link(transport, link_sizes, repeats=repeats, timeout=timeout,
                                     progress=prog, round_meta_bytes=round_meta_bytes)
        one, one_samples = measure_link(transport, link_sizes, repeats=repeats,
                                        timeout=timeout, progress=prog, pattern="one",
                                        round_meta_bytes=round_meta_bytes)
    ar, ar_samples = None, ()
    if samples and raw_collective:
        ar, ar_samples = measure_link(transport, link_sizes, repeats=repeats, timeout=timeout,
                                      progress=prog, pattern="allreduce",
                                      round_meta_bytes=round_meta_bytes)
    overhead = 0.0
    lane, lane_samples = None, ()
    strategies: Tuple[str, ...] = (() if not engine_overhead else (engine_overhead,)
                                   if isinstance(engine_overhead, str)
                                   else tuple(engine_overhead))
    measure = bool(strategies) and transport.size > 1
    ecfg = {"raw_collective": raw_collective, "nonfinite": nonfinite}
    lane_cpu: Tuple[Tuple[int, float], ...] = ()
    if measure:
        engine_overhead = strategies[0]
        overhead = measure_sync_overhead(transport, one or link, engine_overhead,
                                         repeats=2 * repeats, timeout=timeout,
                                         engine_config=ecfg, allreduce=ar)
        if raw_collective:
            lsizes = list(link_sizes or log_sizes(4 << 10, 16 << 20))
            timed = measure_engine_sync(transport, engine_overhead, [(s, 1) for s in lsizes],
                                        repeats=repeats, timeout=timeout, engine_config=ecfg,
                                        progress=prog, with_cpu=True)
            lane_samples = tuple((m, t) for m, _, t, _ in timed)
            lane_cpu = tuple((m, c) for m, _, _, c in timed)
            lane = fit_link([m for m, _ in lane_samples], [t for _, t in lane_samples])
    profs = {}
    for name, params in compressors.items():
        cp = profile_compressor(*candidate(name, params), sizes, repeats=repeats, progress=prog,
                                barrier=lambda: transport.barrier(timeout),
                                error_feedback=error_feedback)
        if measure:
            grid = engine_grid or engine_points(int(cp.encode.sizes[-1]), transport.size)
            timed = {st: measure_engine_sync(transport, st, grid, compressor=cp,
                                             repeats=repeats, timeout=timeout,
                                             engine_config=ecfg, progress=prog, with_cpu=True)
                     for st in strategies}
            cp = dataclasses.replace(
                cp, sync_overhead=measure_sync_overhead(
                    transport, one or link, engine_overhead, compressor=cp,
                    repeats=2 * repeats, timeout=timeout, engine_config=ecfg),
                engine_samples=tuple(x[:3] for x in timed[engine_overhead]),
                engine_strategy=engine_overhead,
                engine_samples_by={st: tuple(x[:3] for x in timed[st])
                                   for st in strategies[1:]},
                engine_cpu_by={st: tuple((m, k, c) for m, k, _, c in timed[st])
                               for st in strategies})
        profs[name] = cp
    prof = Profile(link=link, compressors=profs, link_samples=samples, link_one=one,
                   link_one_samples=one_samples, sync_overhead=overhead, allreduce=ar,
                   allreduce_samples=ar_samples, lane=lane, lane_samples=lane_samples,
                   lane_cpu=lane_cpu,
                   meta={"ranks": transport.size, "transport": type(transport).__name__,
                         "link_source": "measured" if samples else "given",
                         "round_meta_bytes": round_meta_bytes, "nonfinite": nonfinite,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    data = json.dumps(prof.to_dict()).encode() if transport.rank == 0 else b""
    return Profile.from_dict(json.loads(broadcast_bytes(transport, data, timeout)))


def broadcast_bytes(transport: Any, data: bytes, timeout: float = 300.0) -> bytes:
    """Broadcast rank 0's bytes to every rank (length first, then the data)."""
    n = torch.tensor([len(data)], dtype=torch.int64)
    transport.broadcast(n, 0, timeout)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    if transport.rank == 0 and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    transport.broadcast(buf, 0, timeout)
    return buf.numpy().tobytes()
