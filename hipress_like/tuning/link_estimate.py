"""The link as the engine measures it while training runs, agreed across ranks.

``plan="adaptive"`` (``online``) re-plans from this estimate. Every bulk
round and fused allreduce bucket the engine runs is on its timeline with its
bytes and seconds (``timeline_samples`` turns them into bytes one way on
this rank's link). ``LinkEstimator`` fits ``t = alpha + m beta`` to each
step's samples (``cost_model.fit_link``: least squares on relative error)
and smooths the fits with an exponentially weighted moving average (the
smoothing TCP uses for its round-trip time, RFC 6298 Sec. 2). ``agree``
makes one estimate of every rank's: the median over ranks, so every rank
decides from the same numbers (``agree_values`` for any numbers).
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..cost_model.model import Link, fit_link

__all__ = ["LinkEstimator", "agree", "agree_values", "timeline_samples"]


class LinkEstimator:
    """A running estimate of the link's ``alpha + m beta`` from per-step samples.

    Each step's samples (wire bytes, seconds) are fitted by ``fit_link``
    (least squares on relative error) when they span two sizes; otherwise
    the latency is kept and the bandwidth is the bytes over the time left
    after it. Each step's fit moves the estimate by ``gain`` (an
    exponentially weighted moving average, RFC 6298 Sec. 2's smoothing;
    latency and the time per byte are averaged, so slow and fast steps
    weigh as the time they cost).

    Args:
        gain: weight of a new step's fit, in (0, 1].
    """

    def __init__(self, gain: float = 0.25) -> None:
        self.gain = gain
        self.alpha: Optional[float] = None  # seconds
        self.beta: Optional[float] = None  # seconds per byte
        self.steps = 0

    @property
    def link(self) -> Optional[Link]:
        """The estimate, or None before any sample."""
        if self.alpha is None or self.beta is None:
            return None
        return Link(self.alpha, 1.0 / self.beta)

    def update(self, samples: Sequence[Tuple[float, float]]) -> Optional[Link]:
        """Fold one step's (bytes, seconds) samples into the estimate; returns it."""
        pts = [(float(m), float(t)) for m, t in samples if m > 0 and t > 0]
        if not pts:
            return self.link
        if len({m for m, _ in pts}) >= 2:
            fit = fit_link([m for m, _ in pts], [t for _, t in pts])
            a, b = fit.latency, 1.0 / fit.bandwidth
        else:
            a = self.alpha or 0.0
            m = sum(x for x, _ in pts)
            t = sum(y for _, y in pts)
            busy = t - a * len(pts)
            b = (busy if busy > 0 else t) / m
        if self.alpha is None:
            self.alpha, self.beta = a, b
        else:
            g = self.gain
            self.alpha += g * (a - self.alpha)
            self.beta += g * (b - self.beta)
        self.steps += 1
        return self.link


def timeline_samples(events: Sequence[Any], step: int, world_size: int
                     ) -> List[Tuple[float, float]]:
    """(bytes one way on this rank's link, seconds) of one step's timeline events.

    A bulk ``round`` records the bytes sent plus received: half go each way
    on a full-duplex link. A fused allreduce ``bucket`` of m bytes moves
    ``2 (N-1) / N m`` bytes each way in a ring allreduce (the
    flexible-communication paper, Table I, Ring-AR), the formula the cost
    model prices uncompressed gradients with.
    """
    n = max(2, world_size)
    out = []
    for e in events:
        if e.step != step or e.nbytes <= 0 or e.end <= e.start:
            continue
        if e.kind == "round":
            out.append((e.nbytes / 2.0, e.end - e.start))
        elif e.kind == "bucket":
            out.append((2.0 * (n - 1) / n * e.nbytes, e.end - e.start))
    return out


def agree_values(transport: Any, values: Sequence[Optional[float]], timeout: float
                 ) -> Optional[List[float]]:
    """Per position, the median over ranks of ``values`` (the lower middle for an
    even count), the same list on every rank. Collective.

    Returns:
        The medians, or None when some rank has a value missing (None or NaN).
    """
    mine = torch.tensor([math.nan if v is None else float(v) for v in values],
                        dtype=torch.float64)
    rows = [t.tolist() for t in transport.allgather(mine, timeout)]
    if any(math.isnan(v) for r in rows for v in r):
        return None
    mid = (len(rows) - 1) // 2
    return [sorted(r[i] for r in rows)[mid] for i in range(len(values))]


def agree(transport: Any, link: Optional[Link], timeout: float) -> Optional[Link]:
    """One estimate every rank holds: the median over ranks of latency and of the
    time per byte (``agree_values``). Collective.

    Returns:
        The agreed link, or None when some rank has no estimate yet.
    """
    got = agree_values(transport, [None, None] if link is None else
                       [link.latency, 1.0 / link.bandwidth], timeout)
    if got is None:
        return None
    return Link(max(0.0, got[0]), 1.0 / got[1])
