"""alpha-beta costs of collectives (flexible-communication paper, Table I, Eq. 4).

In these formulas (and only in this module) ``alpha`` is the per-message
latency in seconds and ``beta`` the seconds per byte (1 / bandwidth), as in
the alpha-beta model the paper cites; ``m`` is the message (gradient) size
in bytes exchanged among ``n`` workers. A ``Link`` from ``model.py`` gives
both: ``link.alpha``, ``link.beta``. ``log`` is base 2 (tree depth).

AR-Topk compares Allgather of values and indices against a Broadcast of
indices followed by a Ring or Tree allreduce of values (Eq. 4a/4b) and
picks the cheaper collective for the network at hand (Eq. 5a-5c).

One refinement, not in the paper, is optional (``beta_one_way``): the
paper's single beta assumes a host sends and receives at full rate at
once. The steps of a ring and of Bruck's allgather have every host sending
and receiving; the steps of a binomial tree (broadcast, reduce) have each
host only sending or only receiving. Where the two share a bottleneck (a
``tc tbf``-shaped link here, a shared core), one-way steps move their bytes
faster, which the paper's model cannot see: Eq. 5c never picks ART-Tree for
N <= 4, yet it can measure fastest (bench/artopk_select.py). Given
``beta_one_way`` (``tuning.link.measure_link(..., pattern="one_way")``), the
tree and broadcast terms of Eq. 4a/4b use it, and the choice is the argmin
of the costs; without it, everything is the paper's.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple

from .plan import GradientPlan

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


def ar_topk_ring(m: float, n: int, alpha: float, beta: float, c: float,
                 beta_one_way: Optional[float] = None) -> float:
    """AR-Topk with ring reduction, Eq. 4a.

    ``alpha*[2(N-1) + log(N)] + M*c*beta*[2(N-1)/N + log(N)]``: a Broadcast
    of the chosen worker's indices, then a Ring-AR of the values there.
    With ``beta_one_way`` (module docstring) the Broadcast's term uses it.
    """
    _check(m, n, alpha, beta)
    lg = math.log2(n)
    bo = beta if beta_one_way is None else beta_one_way
    return alpha * (2 * (n - 1) + lg) + m * c * (beta * 2 * (n - 1) / n + bo * lg)


def ar_topk_tree(m: float, n: int, alpha: float, beta: float, c: float,
                 beta_one_way: Optional[float] = None) -> float:
    """AR-Topk with tree reduction, Eq. 4b: ``3*alpha*log(N) + 3*M*c*beta*log(N)``
    (``beta_one_way`` in place of beta when given: every step is one-way)."""
    _check(m, n, alpha, beta)
    lg = math.log2(n)
    bo = beta if beta_one_way is None else beta_one_way
    return 3 * alpha * lg + 3 * m * c * bo * lg


# Dense collectives by name, for callers choosing the cheapest one.
COLLECTIVES = {
    "ps": ps,
    "ring_allreduce": ring_allreduce,
    "tree_allreduce": tree_allreduce,
    "broadcast": broadcast,
    "allgather": allgather,
}


# -- choosing the collective of top-k (Sec. 3-D, Eq. 5a-5c) ---------------------------

# The three ways to synchronise a top-k compressed gradient the paper compares.
SELECTABLE = ("allgather", "art_ring", "art_tree")

__all__ += ["SELECTABLE", "check_collective", "topk_costs", "eq5a_threshold", "eq5b_threshold",
            "eq5c_threshold", "select_collective", "select_per_gradient"]


def check_collective(name: str) -> str:
    """``name`` if it is one of ``SELECTABLE``; else a ValueError listing them."""
    if name not in SELECTABLE:
        raise ValueError(f"unknown collective {name!r}; available: {', '.join(SELECTABLE)}")
    return name


def _check_select(m: float, n: int, alpha: float, beta: float, c: float) -> None:
    _check(m, n, alpha, beta)
    if n < 2:
        raise ValueError(f"choosing a collective needs n >= 2 workers, found {n}: with one "
                         "worker nothing is exchanged, and log(1) = 0 leaves Eq. 5a-5c "
                         "undefined")
    if not (isinstance(c, (int, float)) and 0.0 < c <= 1.0):
        raise ValueError(f"c (the compression ratio) must be in (0, 1], found {c!r}")


def topk_costs(m: float, n: int, alpha: float, beta: float, c: float,
               beta_one_way: Optional[float] = None) -> dict:
    """Predicted seconds of each ``SELECTABLE`` way: Sec. 3-D's Allgather of values
    and indices, Eq. 4a (ART-Ring) and Eq. 4b (ART-Tree) (with ``beta_one_way``,
    the module docstring's refinement).

    Example:
        >>> {k: round(v, 6) for k, v in topk_costs(1e6, 4, 1e-3, 1e-9, 0.1).items()}
        {'allgather': 0.0026, 'art_ring': 0.00835, 'art_tree': 0.0066}
    """
    _check_select(m, n, alpha, beta, c)
    if beta_one_way is not None and not beta_one_way >= 0:
        raise ValueError(f"beta_one_way must be >= 0, found {beta_one_way!r}")
    return {"allgather": allgather_topk(m, n, alpha, beta, c),
            "art_ring": ar_topk_ring(m, n, alpha, beta, c, beta_one_way),
            "art_tree": ar_topk_tree(m, n, alpha, beta, c, beta_one_way)}


def eq5a_threshold(m: float, n: int, c: float) -> float:
    """Eq. 5a's bound on ``alpha/beta`` under which ART-Ring beats ART-Tree:
    ``(log N - (N-1)/N) / (N - 1 - log N) * M c`` (``inf`` at N = 2, where both
    pay 3 alpha and the ring's beta term is the smaller)."""
    _check_select(m, n, 0.0, 0.0, c)
    lg = math.log2(n)
    num, den = lg - (n - 1) / n, n - 1 - lg
    if den <= 0:
        return math.inf if num > 0 else -math.inf
    return num / den * m * c


def eq5b_threshold(m: float, n: int, c: float) -> float:
    """Eq. 5b's bound on ``alpha/beta`` under which ART-Ring beats Allgather:
    ``(1 - 1/N - log N / (2 (N-1))) * M c``."""
    _check_select(m, n, 0.0, 0.0, c)
    return (1 - 1 / n - math.log2(n) / (2 * (n - 1))) * m * c


def eq5c_threshold(m: float, n: int, c: float) -> float:
    """Eq. 5c's bound on ``alpha/beta`` under which ART-Tree beats Allgather:
    ``((N-1) / log N - 3/2) * M c``."""
    _check_select(m, n, 0.0, 0.0, c)
    return ((n - 1) / math.log2(n) - 1.5) * m * c


def _below(alpha: float, beta: float, bound: float) -> bool:
    """``alpha / beta < bound`` without dividing (beta may be 0: infinite bandwidth)."""
    if math.isinf(bound):
        return bound > 0
    return alpha < bound * beta


def select_collective(m: float, n: int, alpha: float, beta: float, c: float,
                      beta_one_way: Optional[float] = None) -> str:
    """The collective for an ``m``-byte gradient at compression ratio ``c`` (Sec. 3-D).

    1. Eq. 5a picks the allreduce of AR-Topk: ART-Ring if ``alpha/beta`` is
       under its bound, else ART-Tree.
    2. That one is used if ``alpha/beta`` is under its bound against
       Allgather (Eq. 5b for the ring, Eq. 5c for the tree), else Allgather.

    The result is the argmin of ``topk_costs`` (ties go to Allgather, then
    ART-Tree: the inequalities are strict). With ``beta_one_way`` (the module
    docstring's refinement) it is that argmin, with the refined costs.

    Args:
        m: dense gradient size in bytes (M).
        n: workers (N >= 2).
        alpha: seconds per message; beta: seconds per byte (1 / bandwidth).
        c: compression ratio in (0, 1].
        beta_one_way: seconds per byte of a one-way step (None: beta).

    Returns:
        "allgather", "art_ring" or "art_tree".

    Raises:
        ValueError: n < 2, c outside (0, 1], negative m, alpha or beta.

    Example:
        >>> select_collective(100e6, 4, 1e-3, 1e-9, 0.1)  # big message: bandwidth-bound
        'art_ring'
        >>> select_collective(1e6, 4, 5e-3, 1e-9, 0.01)   # small message, high latency
        'allgather'
    """
    _check_select(m, n, alpha, beta, c)
    if beta_one_way is not None and beta_one_way != beta:
        costs = topk_costs(m, n, alpha, beta, c, beta_one_way)
        order = {"allgather": 0, "art_tree": 1, "art_ring": 2}  # ties, as Eq. 5a-5c
        return min(costs, key=lambda w: (costs[w], order[w]))
    if _below(alpha, beta, eq5a_threshold(m, n, c)):
        return "art_ring" if _below(alpha, beta, eq5b_threshold(m, n, c)) else "allgather"
    return "art_tree" if _below(alpha, beta, eq5c_threshold(m, n, c)) else "allgather"


def select_per_gradient(gradients, n: int, alpha: float, beta: float, c: float,
                        beta_one_way: Optional[float] = None) -> dict:
    """``select_collective`` for each gradient: ``{name: collective}``.

    Args:
        gradients: a mapping, or (name, bytes) pairs, of dense gradient sizes.
        n, alpha, beta, c, beta_one_way: as ``select_collective``.
    """
    items = gradients.items() if hasattr(gradients, "items") else gradients
    return {name: select_collective(float(nbytes), n, alpha, beta, c, beta_one_way)
            for name, nbytes in items}


# -- the pick as a plan decision (the planner's and the engine's) ---------------------

# compressors whose synchronisation the selection chooses (Sec. 3-D: LWTopk, AR-Topk)
TOPK_FAMILY = ("topk", "star_topk", "var_topk")
# their registry default compression ratio, when a plan's params do not name one
DEFAULT_RATIO = 0.01
# the plan's collective of each pick
PICK_COLLECTIVE = {"allgather": "allgather", "art_ring": "ring", "art_tree": "tree"}

__all__ += ["TOPK_FAMILY", "DEFAULT_RATIO", "PICK_COLLECTIVE", "ratio_of", "decision_for",
            "selectable", "select_decision"]


def selectable(compressor: Optional[str], params: Mapping[str, Any]) -> bool:
    """The selection may re-express this compressor: plain top-k of the family, with
    no parameter but its ratio (a top-k with a Bloom or RLE index codec, or with
    curve-fitted values, has no AR-Topk counterpart: it keeps its own path)."""
    return compressor in TOPK_FAMILY and set(params) <= {"ratio"}


def ratio_of(params: Mapping[str, Any]) -> float:
    """The compression ratio c of a top-k family compressor's ``params``."""
    return float(params.get("ratio", DEFAULT_RATIO))


def decision_for(dec: GradientPlan, pick: str, compressor: str,
                 params: Mapping[str, Any]) -> GradientPlan:
    """``dec`` (a compressing decision for ``compressor``, a ``TOPK_FAMILY`` member,
    with ``params``) turned into what ``pick`` runs, in one partition:

    * "allgather": ``topk`` at the same ratio, gathered by every rank (LWTopk);
    * "art_ring", "art_tree": ``star_topk`` (``var_topk`` when that is the
      compressor) at the same ratio, summed by a ring or a tree.

    Raises:
        ValueError: an unknown pick or a compressor outside the family.
    """
    check_collective(pick)
    if compressor not in TOPK_FAMILY:
        raise ValueError(f"{compressor!r} is not one of {TOPK_FAMILY}")
    if pick == "allgather":
        name = "topk"
    else:
        name = compressor if compressor != "topk" else "star_topk"
    return dataclasses.replace(dec, compress=True, partitions=1, compressor=name,
                               params={"ratio": ratio_of(params)},
                               collective=PICK_COLLECTIVE[pick])


def select_decision(dec: GradientPlan, nbytes: float, n: int, alpha: float, beta: float,
                    beta_one_way: Optional[float], compressor: str,
                    params: Mapping[str, Any]) -> Optional[Tuple[str, GradientPlan]]:
    """The selection for one compressing decision (the planner's and
    ``collective="auto"``'s): ``(pick, decision_for(...))`` for an ``nbytes``
    gradient among ``n`` ranks on the link (``alpha``, ``beta``,
    ``beta_one_way``); None when ``compressor`` and ``params`` are not
    ``selectable``."""
    if not selectable(compressor, params):
        return None
    pick = select_collective(float(nbytes), n, alpha, beta, ratio_of(params), beta_one_way)
    return pick, decision_for(dec, pick, compressor, params)

