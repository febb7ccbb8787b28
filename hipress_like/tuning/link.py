"""Link measurement: alpha and beta of a live transport, measured one way.

Every consumer of a link's constants measures them here: the profiler
(``profile_transport``: the bulk rounds CaSync's coordinator runs, and the
collective lane's allreduce), the engine's ``collective="auto"`` selection
(ring and one-way steps, handed to the engine as a *link source*, the way
its plan source is, so ``casync`` never imports this layer) and the
adaptive-ratio controller's re-measurements.

Model: ``T(m) = alpha + m beta`` per message (the alpha-beta model of the
flexible-communication paper's Table I; HiPress Sec. 3.3 profiles
``T_send`` the same way), fitted to timed exchanges by ``model.fit_link``.

Patterns (which ranks send in one step):

    all        every rank sends to its ring successor and receives from its
               predecessor at once (every link busy: ring allreduce and
               Bruck allgather steps, CaSync's bulk rounds)
    one        only rank 0 sends, to rank 1 (one busy link)
    one_way    rank 2i sends to rank 2i+1 (every host only sends or only
               receives: binomial-tree steps; ``cost_model.collectives``
               prices those with ``beta_one_way``)
    allreduce  the transport's own allreduce of m bytes (the collective
               lane), fitted as a whole to ``alpha' + m beta'``
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..cost_model.model import Link, fit_link
from ..cost_model.profile import Progress, log_sizes
from .engine_timing import _iterate

__all__ = ["measure_link", "collective_links", "PATTERNS", "COLLECTIVE_LINK_SIZES"]

_log = logging.getLogger(__name__)

PATTERNS = ("all", "one", "one_way", "allreduce")
# From 1 KB (latency dominates) to 4 MB (bandwidth dominates): both ends of
# the fit, short enough to measure inside ``register``.
COLLECTIVE_LINK_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)


def _peers(pattern: str, rank: int, n: int) -> Tuple[List[int], List[int]]:
    """(ranks this rank sends to, ranks it receives from) in one step of ``pattern``."""
    if pattern == "all":
        return [(rank + 1) % n], [(rank - 1) % n]
    if pattern == "one":
        return ([1] if rank == 0 else []), ([0] if rank == 1 else [])
    # one_way: pairs (0 -> 1, 2 -> 3, ...); the last rank of an odd world idles
    return ([rank + 1] if rank % 2 == 0 and rank + 1 < n else []), \
        ([rank - 1] if rank % 2 == 1 else [])


def _robust_fit(sizes: Sequence[int], times: Sequence[float]) -> Link:
    """``model.fit_link``, unless it contradicts the two ends of the measurement.

    A bandwidth more than twice the slope between the smallest and largest
    size, or a latency above the smallest size's time, means the small
    messages were noisy (a loaded host once gave 330 Gbit/s for a 1 Gbit/s
    link); then alpha is the smallest size's time and beta that slope.
    """
    link = fit_link(sizes, times)
    slope = (times[-1] - times[0]) / (sizes[-1] - sizes[0])
    if slope > 0 and (link.beta < slope / 2 or link.alpha > times[0]):
        link = Link(latency=max(0.0, times[0] - sizes[0] * slope), bandwidth=1.0 / slope)
    return link


def measure_link(
    transport: Any,
    sizes: Optional[Sequence[int]] = None,
    *,
    repeats: int = 5,
    timeout: float = 300.0,
    progress: Progress = None,
    pattern: str = "all",
    round_meta_bytes: int = 0,
    steps: int = 1,
    warmup: bool = True,
) -> Tuple[Link, Tuple[Tuple[int, float], ...]]:
    """Fit alpha and beta of ``transport``'s links. Collective: every rank calls it.

    1. For each size, one untimed warm-up (``warmup``), then ``repeats``
       times: a barrier, then ``steps`` back-to-back steps, each an
       ``allgather`` of ``round_meta_bytes`` (CaSync's coordinator reports; 0
       skips it) and one exchange of ``pattern`` (module docstring) with
       ``size`` bytes per message. The time per step is kept; back-to-back
       steps include the skew between ranks a multi-step collective pays at
       every step.
    2. Every repetition's time is the slowest rank's (one allreduce of the
       maximum over every repetition's time at the end: a step lasts as long
       as its slowest link), so every rank keeps the same samples; the median
       over repetitions is kept.
    3. The fit: ``model.fit_link`` (relative error, so both ends count),
       guarded against noisy small messages (``_robust_fit``). Rank 0's fit
       is broadcast, so every rank returns identical numbers.

    Args:
        transport: a ``Transport`` (2 or more ranks).
        sizes: message sizes in bytes, two or more distinct (default 4 KB ..
            16 MB; the largest should be bandwidth-bound, ~1 MB or more).
        repeats: timed repetitions per size (>= 1).
        timeout: seconds for each collective.
        progress: ``progress(iterable, desc, total)`` wrapper (rank 0 only).
        pattern: "all", "one", "one_way" or "allreduce".
        round_meta_bytes: metadata allgathered before each step.
        steps: back-to-back steps per repetition (>= 1).
        warmup: one untimed repetition per size first (connections and
            buffers warmed); False where the links already carry a job's
            traffic (``tuning/online.py``'s probes), which saves a third of
            the collectives at ``repeats=3``.

    Returns:
        ``(link, samples)``: the ``Link`` (``.alpha`` seconds per message,
        ``.beta`` seconds per byte) and the (bytes, seconds) medians.

    Raises:
        ValueError: a single rank (no link to measure), fewer than two sizes,
            repeats or steps < 1, or an unknown pattern.

    Examples:
        >>> from hipress_like.casync.transport.inproc import run_threads
        >>> res = run_threads(lambda t: measure_link(t, [1024, 65536], repeats=1), 2)
        >>> res[0][0] == res[1][0]
        True
    """
    n, rank = transport.size, transport.rank
    if n < 2:
        raise ValueError("measuring a link needs at least 2 ranks (a link joins two), found "
                         "1; pass latency and bandwidth instead")
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, found {pattern!r}")
    sizes = sorted({int(s) for s in (sizes or log_sizes(4 << 10, 16 << 20))})
    if len(sizes) < 2 or repeats < 1 or steps < 1:
        raise ValueError(f"measure_link needs two or more distinct sizes, repeats >= 1 and "
                         f"steps >= 1, found sizes={sizes}, repeats={repeats}, steps={steps}")
    to, frm = _peers(pattern, rank, n) if pattern != "allreduce" else ([], [])
    meta = torch.zeros(max(1, round_meta_bytes // 8), dtype=torch.int64)
    local: List[List[float]] = []  # per size, this rank's time per step of each repetition
    for nbytes in _iterate(sizes, progress if rank == 0 else None, f"link ({pattern})"):
        send: List[Optional[torch.Tensor]] = [None] * n
        recv = [0] * n
        values = torch.zeros(max(1, nbytes // 4)) if pattern == "allreduce" else None
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        for d in to:
            send[d] = buf
        for s in frm:
            recv[s] = nbytes
        ts = []
        for i in range(repeats + int(warmup)):
            transport.barrier(timeout)
            t0 = time.perf_counter()
            for _ in range(steps):
                if round_meta_bytes:
                    transport.allgather(meta, timeout)
                if values is not None:
                    transport.allreduce(values, "sum", timeout)
                else:
                    transport.alltoallv(send, recv, timeout)
            if i or not warmup:  # the first round warms up connections and buffers
                ts.append((time.perf_counter() - t0) / steps)
        local.append(ts)
    slowest = torch.tensor(local, dtype=torch.float64)
    transport.allreduce(slowest, "max", timeout)  # every repetition's slowest rank
    samples = [(nbytes, statistics.median(row)) for nbytes, row in zip(sizes, slowest.tolist())]
    link = _robust_fit([s for s, _ in samples], [t for _, t in samples])
    agreed = torch.tensor([link.latency, link.bandwidth], dtype=torch.float64)
    transport.broadcast(agreed, 0, timeout)
    link = Link(latency=float(agreed[0]), bandwidth=float(agreed[1]))
    _log.info("measured link (%s): alpha %.3g s, beta %.3g s/B (%.3g Gbit/s)", pattern,
              link.alpha, link.beta, 8e-9 / link.beta)
    return link, tuple(samples)


def collective_links(transport: Any, timeout: float = 300.0, *,
                     sizes: Sequence[int] = COLLECTIVE_LINK_SIZES, repeats: int = 5,
                     steps: int = 3) -> Tuple[Link, Link]:
    """The link source of ``collective="auto"``: ring steps and one-way steps. Collective.

    The engine calls it once, inside ``register``, when some gradient may take
    ``collective="auto"`` (``EngineConfig.link_source``; the front ends pass
    this function). Beta of ring steps prices Allgather and ART-Ring; beta of
    one-way steps prices the tree terms (``cost_model.collectives``,
    ``beta_one_way``).

    Args:
        transport: the engine's transport (2 or more ranks).
        timeout: seconds for each collective.
        sizes, repeats, steps: as ``measure_link`` (three back-to-back steps:
            a collective pays the skew between ranks at every step).

    Returns:
        ``(ring, one_way)`` links, identical on every rank.
    """
    ring, _ = measure_link(transport, sizes, repeats=repeats, timeout=timeout,
                           pattern="all", steps=steps)
    one_way, _ = measure_link(transport, sizes, repeats=repeats, timeout=timeout,
                              pattern="one_way", steps=steps)
    return ring, one_way
