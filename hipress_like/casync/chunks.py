"""Cutting n elements into k contiguous near-equal ranges: the one chunking rule.

PS partitions, Ring chunks (``layout``, ``workflows``) and the point-to-point
ring allreduce (``collectives``) cut tensors the same way, so this sits
below all of them (``layout`` imports the lane, which reaches
``collectives``; the rule cannot live in ``layout`` without a circle).
"""
from __future__ import annotations

from typing import List, Tuple

__all__ = ["chunk_bounds"]


def chunk_bounds(n: int, k: int) -> List[Tuple[int, int]]:
    """Split ``n`` elements into ``k`` contiguous near-equal (start, end) ranges.

    The first ``n % k`` ranges hold one element more than the rest.

    Example:
        >>> chunk_bounds(7, 3)
        [(0, 3), (3, 5), (5, 7)]
    """
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out
