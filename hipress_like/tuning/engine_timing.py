"""Timing whole synchronisations through the CaSync engine (the profiler's engine half).

``measure_engine_sync`` and ``engine_points`` give the samples the
planner's ``EngineTerm`` fits (what Eq. 2 leaves out: tasks, rounds,
metadata) and, with ``with_cpu``, the CPU seconds a rank spends on each
synchronisation (all its threads: the caller's submit and scan, the
engine's compute, communication and round threads, the transport's), which
the advisor's host-CPU bound adds up; ``measure_sync_overhead`` is the
constant fallback;
``time_engine_steps`` times a plan's real engine steps (``plan="auto"``'s
trials, beside a compute load). Split from ``profiler.py``, which re-exports
them.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from ..cost_model.model import Link
from ..cost_model.profile import CompressorProfile, Profile, Progress

__all__ = ["measure_engine_sync", "time_engine_steps", "time_engine_steps_cpu", "engine_points",
           "top_points", "measure_sync_overhead", "profile_shape"]


def _iterate(items: Sequence[Any], progress: Progress, desc: str) -> Iterable[Any]:
    """``items``, through the caller's progress wrapper when it gave one."""
    return progress(items, desc, len(items)) if progress else items


def measure_engine_sync(transport: Any, strategy: str = "ps",
                        points: Sequence[Tuple[int, int]] = ((4, 1),), *,
                        compressor: Optional[CompressorProfile] = None, repeats: int = 5,
                        timeout: float = 300.0,
                        engine_config: Optional[Mapping[str, Any]] = None,
                        progress: Progress = None,
                        with_cpu: bool = False) -> Tuple[Tuple[Any, ...], ...]:
    """Time whole synchronisations of one gradient through the CaSync engine. Collective.

    For each ``(bytes, K)`` point, an engine with a one-gradient plan
    (compressed with ``compressor`` into K partitions, or uncompressed when
    ``compressor`` is None) synchronises a float32 gradient of that size
    ``repeats`` times after one warm-up step; a sample is the median of the
    slowest rank's ``submit``-to-``synchronize`` time. This is what the
    cost model predicts, measured as a whole, so the planner can charge
    the engine's work that HiPress Eq. 1/2 leave out (coordination rounds,
    per-partition tasks, the aggregator's re-encode; see
    ``planner.EngineTerm``).

    Args:
        transport: the transport every rank uses.
        strategy: the engine's strategy.
        points: ``(bytes, K)`` pairs (bytes rounded down to whole floats).
        compressor: the profiled compressor, or None for the uncompressed path.
        repeats: timed synchronisations per point.
        timeout: seconds for each collective.
        engine_config: extra ``EngineConfig`` fields (as the engine will run).
        progress: ``progress(iterable, desc, total)`` wrapper (rank 0 only).
        with_cpu: also return the CPU seconds per synchronisation of the mean
            rank (``time_engine_steps_cpu``).

    Returns:
        ``(bytes, K, seconds)`` per point (``(bytes, K, seconds, cpu_seconds)``
        with ``with_cpu``), rank 0's numbers on every rank.
    """
    from ..cost_model.plan import GradientPlan, Plan

    name = compressor.name if compressor else "identity"
    params = dict(compressor.params) if compressor else {}
    out: List[Tuple[int, int, float, float]] = []
    desc = f"engine sync ({name if compressor else 'uncompressed'})"
    for nbytes, k in _iterate(list(points), progress if transport.rank == 0 else None, desc):
        numel = max(1, int(nbytes) // 4)
        plan = Plan(compressor=name, params=params, strategy=strategy,
                    gradients={"_probe": GradientPlan(compress=compressor is not None,
                                                      partitions=int(k))})
        cfg = dict(engine_config or {})
        cfg.update(compressor=name, params=params)
        t, cpu = time_engine_steps_cpu(transport, plan, {"_probe": 4 * numel}, strategy,
                                       repeats=repeats, timeout=timeout, engine_config=cfg)
        out.append((4 * numel, int(k), t, cpu))
    agreed = torch.tensor([[t, c] for _, _, t, c in out], dtype=torch.float64)
    transport.broadcast(agreed, 0, timeout)
    if with_cpu:
        return tuple((m, k, float(t), float(c))
                     for (m, k, _, _), (t, c) in zip(out, agreed.tolist()))
    return tuple((m, k, float(t)) for (m, k, _, _), (t, _) in zip(out, agreed.tolist()))


def time_engine_steps(transport: Any, plan: Any, sizes: Mapping[str, int], strategy: str, *,
                      repeats: int = 3, timeout: float = 300.0,
                      engine_config: Optional[Mapping[str, Any]] = None,
                      load: Any = None,
                      shapes: Optional[Mapping[str, Sequence[int]]] = None) -> float:
    """Median seconds of the slowest rank to synchronise (``time_engine_steps_cpu``'s
    first figure). Collective."""
    return time_engine_steps_cpu(transport, plan, sizes, strategy, repeats=repeats,
                                 timeout=timeout, engine_config=engine_config, load=load,
                                 shapes=shapes)[0]


def time_engine_steps_cpu(transport: Any, plan: Any, sizes: Mapping[str, int], strategy: str,
                          *, repeats: int = 3, timeout: float = 300.0,
                          engine_config: Optional[Mapping[str, Any]] = None,
                          load: Any = None,
                          shapes: Optional[Mapping[str, Sequence[int]]] = None
                          ) -> Tuple[float, float]:
    """Median seconds of the slowest rank to synchronise float32 gradients of
    ``sizes`` ({name: bytes}, registration order) through an engine running
    ``plan``, over ``repeats`` steps after one warm-up step. Collective.

    A gradient has its shape from ``shapes`` when that holds one with as many
    entries as its bytes say, else the profile's (``profile_shape``): a
    compressor such as PowerSGD costs what its matrix view costs, not what
    the byte count does.

    Every rank submits every gradient at once. Without ``load`` nothing else
    runs, so this times the synchronisation alone, as the cost model
    predicts it. With a ``load`` (``compute.ComputeLoad``) the caller's
    thread then does its work before waiting, so the time is that of a step
    whose backward overlaps the synchronisation and shares the CPU.

    Returns:
        ``(seconds, cpu_seconds)``: the slowest rank's median wall time, and
        the mean over ranks of each rank's median process CPU time (every
        thread of the process, the load's included) over the same window.
    """
    from ..casync.engine import Engine, EngineConfig

    cfg = dict(engine_config or {})
    cfg.update(plan=plan, strategy=strategy, timeline=False, timeout=timeout)
    eng = Engine(transport, EngineConfig(**cfg))
    try:
        specs = [(name, _shape_of(name, int(nb), shapes or {}), torch.float32)
                 for name, nb in sizes.items()]
        eng.register(specs)
        gen = torch.Generator().manual_seed(transport.rank)
        src = {name: torch.randn(shape, generator=gen) for name, shape, _ in specs}
        work = {name: v.clone() for name, v in src.items()}
        ts, cpus = [], []
        for i in range(repeats + 1):
            for name, v in work.items():
                v.copy_(src[name])
            transport.barrier(timeout)
            t0, c0 = time.perf_counter(), time.process_time()
            for name, v in work.items():
                eng.submit(name, v)
            if load is not None:
                load.run()
            eng.synchronize()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            cpu = time.process_time() - c0
            transport.allreduce(dt, "max", timeout)
            if i:  # the first step warms up buffers, threads and compressor state
                ts.append(float(dt.item()))
                cpus.append(cpu)
        mean_cpu = torch.tensor([statistics.median(cpus)], dtype=torch.float64)
        transport.allreduce(mean_cpu, "sum", timeout)
    finally:
        eng.close()
    return statistics.median(ts), float(mean_cpu.item()) / transport.size


def profile_shape(numel: int) -> Tuple[int, ...]:
    """The shape a profile gives a gradient of ``numel`` entries: the most nearly
    square exact (rows, cols), rows <= cols, else flat when that has one row or
    is skinnier than 1 : 256.

    Real gradients that matrix-based compressors compress are weights of two
    or more dimensions; PowerSGD pads a flat vector into a near-square matrix
    and takes a slower path for it (a flat gradient synchronises in about
    twice the time of the matrix it stands for), so a flat profile
    overpriced it. Element-wise compressors do not see the shape.

    Example:
        >>> profile_shape(1024), profile_shape(6), profile_shape(1031)
        ((32, 32), (2, 3), (1031,))
    """
    rows = max(1, math.isqrt(numel))
    while numel % rows:
        rows -= 1
    if rows == 1 or rows * 256 < numel // rows:
        return (numel,)
    return (rows, numel // rows)


def _shape_of(name: str, nbytes: int, shapes: Mapping[str, Sequence[int]]) -> Tuple[int, ...]:
    """The float32 shape a trial gives gradient ``name`` of ``nbytes`` bytes: its own
    shape when known and of that many entries, else ``profile_shape``'s."""
    numel = max(1, nbytes // 4)
    shape = tuple(int(d) for d in shapes.get(name, ()))
    return shape if shape and math.prod(shape) == numel else profile_shape(numel)


def engine_points(max_bytes: int, n: int, lo: int = 64 << 10) -> List[Tuple[int, int]]:
    """The (bytes, K) grid ``profile_transport`` times compressed syncs at.

    Four sizes spaced by 8x from ``lo`` up to ``max_bytes`` (fewer when the
    range is short), each with K = 1, 2, N and 3N: enough to fit the
    engine's fixed, per-partition and per-byte costs (``planner.EngineTerm``).
    K = 2 is there because syncs over a few partitions often measure
    fastest, and a fit sampled only at 1, N and 3N misses them.
    """
    sizes = [s for s in (lo << (3 * i) for i in range(4)) if s <= max_bytes] or [max_bytes]
    return [(s, k) for s in sizes for k in sorted({1, min(2, n), n, 3 * n})]


def top_points(top: int, n: int) -> List[Tuple[int, int]]:
    """The (bytes, K) grid ``plan="auto"`` times compressed syncs at (``tuning/auto.py``).

    Three sizes 8x apart ending at ``top`` (the largest profiled size; none
    under 4 KB), each with K = 1, 2, N and 3N: the engine's costs near the
    sizes a model's large gradients have, where ``engine_points`` starts
    from small ones.

    Example:
        >>> top_points(1 << 20, 4)[:4]
        [(16384, 1), (16384, 2), (16384, 4), (16384, 12)]
    """
    return [(m, k) for m in sorted({max(4096, top >> 6), max(4096, top >> 3), top})
            for k in sorted({1, 2, n, 3 * n})]


def measure_sync_overhead(transport: Any, link: Link, strategy: str = "ps", *,
                          compressor: Optional[CompressorProfile] = None, repeats: int = 10,
                          timeout: float = 300.0,
                          engine_config: Optional[Mapping[str, Any]] = None,
                          allreduce: Optional[Link] = None) -> float:
    """The engine's fixed cost per synchronisation, beyond Eq. 1 (or Eq. 2). Collective.

    HiPress's Eq. 1/2 count the rounds that move gradient bytes and the
    encode/decode operators. The CaSync engine also runs coordination rounds
    that carry no bytes: a step opens and closes with a round of reports, and
    each compute stage of a compressed workflow (encode, aggregate, decode)
    leaves rounds waiting for it. This synchronises a tiny gradient (1 float
    uncompressed; 1024 floats through ``compressor``) through the engine
    ``repeats`` times (``measure_engine_sync``) and returns the slowest
    rank's median time minus the equation's prediction for it (>= 0).

    Args:
        transport: the transport every rank uses.
        link: the fitted link (T_send).
        strategy: the engine's strategy.
        compressor: measure the compressed path of this profiled compressor
            (Eq. 2); None measures the uncompressed path (Eq. 1).
        repeats: timed synchronisations.
        timeout: seconds for each collective.
        engine_config: extra ``EngineConfig`` fields (as the engine will run).
        allreduce: the allreduce fit; with the engine's collective lane
            (``raw_collective``, default on) the uncompressed model is that
            allreduce (or Table I's Ring-AR on ``link``), not Eq. 1.
    """
    from ..cost_model.model import sync_params, t_sync_cpr, t_sync_orig
    from ..cost_model.planner import ENGINE_TO_MODEL

    m = 4096 if compressor else 4
    ((m, _, t),) = measure_engine_sync(transport, strategy, [(m, 1)], compressor=compressor,
                                       repeats=repeats, timeout=timeout,
                                       engine_config=engine_config)
    n = transport.size
    cfg = dict(engine_config or {})
    if compressor is None and cfg.get("raw_collective", True):
        model = Profile(link=link, allreduce=allreduce).allreduce_time(m, n)
    elif compressor is None:
        model = t_sync_orig(m, 1, n, link, sync_params(ENGINE_TO_MODEL[strategy], "none"))
    else:
        model = t_sync_cpr(m, 1, n, compressor.rate(m), link, compressor.encode,
                           compressor.decode,
                           sync_params(ENGINE_TO_MODEL[strategy], compressor.category))
    return max(0.0, t - model)
