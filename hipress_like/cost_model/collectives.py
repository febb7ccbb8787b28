"""alpha-beta costs of collectives (flexible-communication paper, Table I, Eq. 4).

In these formulas (and only in this module) ``alpha`` is the per-message
latency in seconds and ``beta`` the seconds per byte (1 / bandwidth), as in
the alpha-beta model the paper cites; ``m`` is the message (gradient) size
in bytes exchanged among ``n`` workers. A ``Link`` from ``model.py`` gives
both: ``link.alpha``, ``link.beta``. ``log`` is base 2 (tree depth).

AR-Topk (a later issue) compares Allgather of values and indices against a
Broadcast of indices followed by a Ring or Tree allreduce of values
(Eq. 4a/4b) and picks the cheaper collective for the network at hand.
"""
from __future__ import annotations

import math

__all__ = [
    "ps",
    "ring_allreduce",
    "tree_allreduce",
    "broadcast",
    "allgather",
    "allgather_topk",
    "ar_topk_ring",
    "ar_topk_tree",
    "COLLECTIVES",
]


def _check(m: float, n: int, alpha: float, beta: float) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, found {n!r}")
    if m < 0 or alpha < 0 or beta < 0:
        raise ValueError(f"m, alpha and beta must be >= 0, found m={m}, alpha={alpha}, "
                         f"beta={beta}")


def ps(m: float, n: int, alpha: float, beta: float) -> float:
    """Parameter server (star): ``2*alpha + 2*(N-1)*M*beta`` (Table I, PS).

    Example:
        >>> ps(1e6, 4, 1e-3, 1e-9)  # 2ms + 6 * 1ms
        0.008
    """
    _check(m, n, alpha, beta)
    return 2 * alpha + 2 * (n - 1) * m * beta


def ring_allreduce(m: float, n: int, alpha: float, beta: float) -> float:
    """Ring allreduce: ``2(N-1)*alpha + 2(N-1)/N * M*beta`` (Table I, Ring-AR)."""
    _check(m, n, alpha, beta)
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * m * beta


def tree_allreduce(m: float, n: int, alpha: float, beta: float) -> float:
    """Tree allreduce: ``2*alpha*log(N) + 2*log(N)*M*beta`` (Table I, Tree-AR)."""
    _check(m, n, alpha, beta)
    lg = math.log2(n)
    return 2 * alpha * lg + 2 * lg * m * beta


def broadcast(m: float, n: int, alpha: float, beta: float) -> float:
    """Broadcast: ``alpha*log(N) + log(N)*M*beta`` (Table I, Broadcast)."""
    _check(m, n, alpha, beta)
    lg = math.log2(n)
    return alpha * lg + lg * m * beta


def allgather(m: float, n: int, alpha: float, beta: float) -> float:
    """Allgather of M bytes per worker: ``alpha*log(N) + (N-1)*M*beta`` (Table I, Allgather)."""
    _check(m, n, alpha, beta)
    return alpha * math.log2(n) + (n - 1) * m * beta


def allgather_topk(m: float, n: int, alpha: float, beta: float, c: float) -> float:
    """Allgather of top-k values and indices: ``alpha*log(N) + 2*M*c*beta*(N-1)`` (Sec. 3-D).

    Args:
        m: dense gradient size in bytes.
        c: compression ratio (fraction of elements kept); values and indices
            double the volume.
    """
    _check(m, n, alpha, beta)
    return allgather(2 * m * c, n, alpha, beta)


def ar_topk_ring(m: float, n: int, alpha: float, beta: float, c: float) -> float:
    """AR-Topk with ring reduction, Eq. 4a.

    ``alpha*[2(N-1) + log(N)] + M*c*beta*[2(N-1)/N + log(N)]``: a Broadcast
    of the chosen worker's indices, then a Ring-AR of the values there.
    """
    _check(m, n, alpha, beta)
    lg = math.log2(n)
    return alpha * (2 * (n - 1) + lg) + m * c * beta * (2 * (n - 1) / n + lg)


def ar_topk_tree(m: float, n: int, alpha: float, beta: float, c: float) -> float:
    """AR-Topk with tree reduction, Eq. 4b: ``3*alpha*log(N) + 3*M*c*beta*log(N)``."""
    _check(m, n, alpha, beta)
    lg = math.log2(n)
    return 3 * alpha * lg + 3 * m * c * beta * lg


# Dense collectives by name, for callers choosing the cheapest one.
COLLECTIVES = {
    "ps": ps,
    "ring_allreduce": ring_allreduce,
    "tree_allreduce": tree_allreduce,
    "broadcast": broadcast,
    "allgather": allgather,
}
