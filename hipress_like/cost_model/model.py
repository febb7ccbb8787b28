"""HiPress's cost model of one gradient's synchronisation (Sec. 3.3, Eq. 1 and 2).

The idea: synchronising an ``m``-byte gradient split into ``K`` partitions
costs ``alpha`` serial link transfers of one partition; compressing it
shrinks each transfer to ``r * m / K`` bytes but adds ``beta`` encodes and
``gamma`` decodes that do not overlap with the transfers:

    T_orig(m, K) = alpha * T_send(m / K)                                  (Eq. 1)
    T_cpr(m, K)  = alpha * T_send(r*m/K) + beta * T_enc(m/K)
                   + gamma * T_dec(r*m/K)                                 (Eq. 2)

``alpha``, ``beta`` and ``gamma`` depend on the synchronisation strategy and
the compressor's category (HiPress Table 3, and Sec. 6.1 for the co-located
PS the engine implements); they are data here (``SYNC_PARAMS``), each entry a
linear count ``a*N + b*K + c``. ``T_send``, ``T_enc`` and ``T_dec`` are not
constants of this module: they come from measured curves (``Curve``, one per
compressor operation) and a measured or given link (``Link``: latency plus
bytes over bandwidth), so no hardware number is hard-coded.

Partitions beyond ``N``: HiPress groups ``K`` partitions into ``ceil(K/N)``
batches (Sec. 3.3, last paragraph). We read that as batches of ``min(K, N)``
partitions of ``m/K`` bytes that run one after another through CaSync's
pipeline, each batch's compression overlapping the previous batch's
transfers (``t_sync_cpr``); for ``K <= N`` the formulas reduce exactly to
Eq. 1 and Eq. 2.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Sequence, Tuple

from ..compressors.base import CATEGORIES

__all__ = [
    "Count",
    "SyncParams",
    "SYNC_PARAMS",
    "MODEL_STRATEGIES",
    "CATEGORIES",
    "sync_params",
    "n_batches",
    "t_sync_orig",
    "t_sync_homomorphic",
    "t_sync_cpr",
    "t_sync_bidi",
    "bidi_counts",
    "Link",
    "Curve",
    "fit_link",
    "concurrent_link",
]

TimeFn = Callable[[float], float]

# Cost-model strategies. The engine's "ps" is co-located (every node is a
# worker and an aggregator), which HiPress evaluates with the Sec. 6.1 values.
MODEL_STRATEGIES = ("ps", "ps-colocated", "ring")


@dataclass(frozen=True)
class Count:
    """A number of serial operators, linear in N and K: ``n*N + k*K + c``.

    HiPress Table 3 writes alpha, beta and gamma this way (``2(N-1)`` is
    ``Count(n=2, c=-2)``, ``K+1`` is ``Count(k=1, c=1)``).
    """

    n: int = 0
    k: int = 0
    c: int = 0

    def __call__(self, n: int, k: int) -> int:
        """Evaluate for ``N = n`` nodes and ``K = k`` partitions."""
        return self.n * n + self.k * k + self.c

    def __str__(self) -> str:
        terms = []
        if self.n:
            terms.append(("" if self.n == 1 else str(self.n)) + "N")
        if self.k:
            terms.append(("" if self.k == 1 else str(self.k)) + "K")
        if self.c or not terms:
            terms.append(str(self.c))
        return "+".join(terms).replace("+-", "-")


@dataclass(frozen=True)
class SyncParams:
    """alpha, beta, gamma of HiPress Eq. 1/2 for one (strategy, category).

    Attributes:
        alpha: serial communication steps.
        beta: encode operators not overlapped with transfers.
        gamma: decode operators not overlapped with transfers.
        source: where the values come from (paper section or table).
    """

    alpha: Count
    beta: Count
    gamma: Count
    source: str

    def values(self, n: int, k: int) -> Tuple[int, int, int]:
        """(alpha, beta, gamma) for ``N = n`` and ``K = k``."""
        return self.alpha(n, k), self.beta(n, k), self.gamma(n, k)


def _table() -> Dict[Tuple[str, str], SyncParams]:
    two_n_minus_2 = Count(n=2, c=-2)
    one = Count(c=1)
    t = {}
    for cat in ("quantization", "sparsification"):
        # Ring: N-1 reduce steps each decode->merge->encode, then one encode
        # and N-1 decodes of which only the last is exposed.
        t["ring", cat] = SyncParams(two_n_minus_2, Count(n=1), Count(n=1),
                                    "HiPress Table 3, CaSync-Ring, Spars./Quant.")
        t["ps", cat] = SyncParams(Count(n=2), Count(k=1, c=1), Count(n=1, c=1),
                                  "HiPress Table 3, CaSync-PS, Spars./Quant.")
        # Co-located aggregators: a worker's own partition never crosses the
        # network, so 2(N-1) transfers; K encodes, N decodes (Sec. 6.1).
        t["ps-colocated", cat] = SyncParams(two_n_minus_2, Count(k=1), Count(n=1),
                                            "HiPress Sec. 6.1, co-located CaSync-PS")
    # Low-rank payloads aggregate without decoding: one encode, one decode.
    t["ring", "lowrank"] = SyncParams(two_n_minus_2, one, one,
                                      "HiPress Table 3 / Sec. 6.1, CaSync-Ring, Low-rank")
    t["ps", "lowrank"] = SyncParams(Count(n=2), one, one, "HiPress Table 3, CaSync-PS, Low-rank")
    # Sec. 6.1 gives only the Ring values for PowerSGD; co-located PS keeps its
    # 2(N-1) transfers and, payloads being aggregatable, one encode and decode.
    t["ps-colocated", "lowrank"] = SyncParams(two_n_minus_2, one, one,
                                              "HiPress Sec. 6.1 (Ring low-rank values), "
                                              "co-located CaSync-PS")
    # "none" (identity) payloads are aggregatable too: treated like low-rank.
    for strat in MODEL_STRATEGIES:
        lr = t[strat, "lowrank"]
        t[strat, "none"] = SyncParams(lr.alpha, lr.beta, lr.gamma,
                                      lr.source + "; aggregatable identity treated as low-rank")
    return t


SYNC_PARAMS: Mapping[Tuple[str, str], SyncParams] = _table()


def sync_params(strategy: str, category: str) -> SyncParams:
    """Look up alpha/beta/gamma (HiPress Table 3, Sec. 6.1).

    Args:
        strategy: "ps" (Table 3's separate aggregators), "ps-colocated"
            (Sec. 6.1; what the engine's "ps" is) or "ring".
        category: the compressor's category ("quantization", ...).

    Raises:
        ValueError: unknown strategy or category.

    Example:
        >>> sync_params("ring", "quantization").values(4, 2)
        (6, 4, 4)
    """
    if (strategy, category) not in SYNC_PARAMS:
        if strategy not in MODEL_STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; expected one of {MODEL_STRATEGIES}")
        raise ValueError(f"unknown compressor category {category!r}; expected one of "
                         f"{CATEGORIES}")
    return SYNC_PARAMS[strategy, category]


def n_batches(k: int, n: int) -> int:
    """Number of partition batches, ``ceil(K/N)`` (HiPress Sec. 3.3)."""
    _check_kn(k, n)
    return -(-k // n)


def _check_kn(k: int, n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"N must be an integer >= 1, found {n!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"K must be an integer >= 1, found {k!r}")


def t_sync_orig(m: float, k: int, n: int, t_send: TimeFn, params: SyncParams) -> float:
    """Synchronisation time without compression, HiPress Eq. 1.

    ``T_orig(m, K) = alpha * T_send(m/K)`` for ``K <= N``. For ``K > N`` the
    partitions go in ``B = ceil(K/N)`` batches of ``N``, one after another:
    ``B * alpha * T_send(m/K)`` (alpha evaluated at ``min(K, N)``).

    Args:
        m: gradient size in bytes.
        k: number of partitions K.
        n: number of nodes N.
        t_send: seconds to send a given number of bytes over one link.
        params: alpha/beta/gamma (only alpha is used).

    Returns:
        Seconds.

    Example:
        >>> p = sync_params("ring", "quantization")
        >>> t_sync_orig(8e6, 2, 4, lambda b: 1e-3 + b / 1e9, p)  # 6 * (1ms + 4ms)
        0.03
    """
    _check_kn(k, n)
    kb = min(k, n)
    return n_batches(k, n) * params.alpha(n, kb) * t_send(m / k)


def t_sync_cpr(m: float, k: int, n: int, r: float, t_send: TimeFn, t_enc: TimeFn,
               t_dec: TimeFn, params: SyncParams) -> float:
    """Synchronisation time with compression, HiPress Eq. 2.

    For ``K <= N``:
    ``T_cpr(m, K) = alpha*T_send(r*m/K) + beta*T_enc(m/K) + gamma*T_dec(r*m/K)``.

    For ``K > N`` (``B = ceil(K/N)`` batches, Sec. 3.3): with one batch's
    transfers ``C = alpha*T_send(r*m/K)`` and its compression work
    ``E = beta*T_enc(m/K) + gamma*T_dec(r*m/K)`` (counts at ``min(K, N)``),
    the batches pipeline: ``C + E + (B-1) * max(C, E)``.

    Args:
        m: gradient size in bytes.
        k: number of partitions K.
        n: number of nodes N.
        r: compression rate, compressed bytes over original bytes.
        t_send: seconds to send a given number of bytes over one link.
        t_enc: seconds to encode a partition of the given (original) size.
        t_dec: seconds to decode a payload of the given (compressed) size.
        params: alpha/beta/gamma for the strategy and compressor category.

    Returns:
        Seconds.

    Example:
        >>> p = sync_params("ring", "quantization")
        >>> lin = lambda a, b: (lambda x: a + b * x)
        >>> round(t_sync_cpr(8e6, 1, 4, 1 / 32, lin(1e-3, 1e-9), lin(0, 1e-9),
        ...                  lin(0, 1e-9), p), 6)  # 6*1.25ms + 4*8ms + 4*0.25ms
        0.0405
    """
    _check_kn(k, n)
    if not r > 0:
        raise ValueError(f"compression rate r must be > 0, found {r!r}")
    a, b, g = params.values(n, min(k, n))
    part = m / k
    comm = a * t_send(r * part)
    comp = b * t_enc(part) + g * t_dec(r * part)
    return comm + comp + (n_batches(k, n) - 1) * max(comm, comp)


def bidi_counts(params: SyncParams, n: int, k: int, aggregatable: bool
                ) -> Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]]:
    """Eq. 2's counts split by direction for bidirectional compression.

    Natural Compression's Alg. 1 sends workers' payloads with C_W and the
    aggregate back with C_M. Of HiPress's ``alpha`` transfers, half carry
    worker payloads (pushes, Ring's reduce hops) and half the aggregate
    (pulls, Ring's gather hops); of its ``beta`` encodes and ``gamma``
    decodes, one each is the aggregate's (its encode at the aggregator or
    chunk owner, the exposed final decode), the rest C_W's, at least one
    each: the workers' own encode and the aggregator's decode happen
    before the aggregate exists, so they never overlap C_M's (HiPress's
    co-located ``beta = K`` folds them together at K = 1). An aggregatable
    C_W (``beta = gamma = 1``: no decode at the aggregator) gains one C_W
    decode (the merged sum) and one C_M encode.

    Returns:
        ((alpha_w, alpha_m), (beta_w, beta_m), (gamma_w, gamma_m)).

    Example:
        >>> bidi_counts(sync_params("ring", "quantization"), 4, 1, False)
        ((3, 3), (3, 1), (3, 1))
    """
    a, b, g = params.values(n, k)
    split = ((a + 1) // 2, a // 2)
    if aggregatable:
        return split, (b, 1), (g, 1)
    return split, (max(b - 1, 1), 1), (max(g - 1, 1), 1)


def t_sync_bidi(m: float, k: int, n: int, r_w: float, r_m: float, t_send: TimeFn,
                enc_w: TimeFn, dec_w: TimeFn, enc_m: TimeFn, dec_m: TimeFn,
                params: SyncParams, aggregatable: bool = False) -> float:
    """HiPress Eq. 2 with a master compressor on the way back (bidirectional).

    With ``bidi_counts``' split (subscript w: worker compressor C_W at rate
    ``r_w``; m: master compressor C_M at rate ``r_m``), for ``K <= N``:

    ``T = a_w*T_send(r_w*m/K) + a_m*T_send(r_m*m/K) + b_w*T_enc_w(m/K)
    + b_m*T_enc_m(m/K) + g_w*T_dec_w(r_w*m/K) + g_m*T_dec_m(r_m*m/K)``,

    and batches pipeline as in ``t_sync_cpr``. With C_M = C_W (same rate and
    curves), a non-aggregatable C_W and ``beta, gamma >= 2`` this is
    exactly Eq. 2.

    Example:
        >>> p = sync_params("ring", "quantization")
        >>> lin = lambda a, b: (lambda x: a + b * x)
        >>> f = lin(0, 1e-9)
        >>> one = t_sync_cpr(8e6, 1, 4, 1 / 32, lin(1e-3, 1e-9), f, f, p)
        >>> two = t_sync_bidi(8e6, 1, 4, 1 / 32, 1 / 32, lin(1e-3, 1e-9), f, f, f, f, p)
        >>> abs(one - two) < 1e-15
        True
    """
    _check_kn(k, n)
    if not (r_w > 0 and r_m > 0):
        raise ValueError(f"compression rates must be > 0, found {r_w!r} and {r_m!r}")
    (aw, am), (bw, bm), (gw, gm) = bidi_counts(params, n, min(k, n), aggregatable)
    part = m / k
    comm = aw * t_send(r_w * part) + am * t_send(r_m * part)
    comp = (bw * enc_w(part) + bm * enc_m(part) + gw * dec_w(r_w * part)
            + gm * dec_m(r_m * part))
    return comm + comp + (n_batches(k, n) - 1) * max(comm, comp)


def t_sync_homomorphic(m: float, k: int, n: int, r_up: float, r_down: float, t_send: TimeFn,
                       t_enc: TimeFn, t_dec: TimeFn, params: SyncParams,
                       ring: bool = False) -> float:
    """HiPress Eq. 2 for a quantizer whose payloads the aggregator sums without decoding.

    THC (Sec. 4) sums table values as integers: no decode, merge and
    re-encode at the aggregator, so the counts are HiPress Table 3's
    low-rank row (``params``: one encode, one decode), but the sums are
    wider than the indices (Sec. 6.2: b-bit indices, w-bit sums), so the
    transfers carrying sums move ``r_down * m / K`` bytes, not
    ``r_up * m / K``. PS: half of ``alpha`` are pushes of indices, half
    pulls of sums. Ring (``ring=True``): only the first reduce hop carries
    indices; every later hop a partial or whole sum. Then

    ``T = a_up*T_send(r_up*m/K) + a_down*T_send(r_down*m/K) + beta*T_enc(m/K)
    + gamma*T_dec(r_down*m/K)``,

    batches pipelining as in ``t_sync_cpr``. The aggregator's integer sums
    are not priced, as HiPress leaves out low-rank merges. With
    ``r_up == r_down`` this is ``t_sync_cpr`` with the same ``params``.

    Example:
        >>> p = sync_params("ring", "lowrank")
        >>> lin = lambda a, b: (lambda x: a + b * x)
        >>> f = lin(0, 1e-9)  # hops: 1 MB of indices (2 ms), 5 x 2 MB of sums (3 ms each),
        >>> # then one 8 MB encode (8 ms) and one 2 MB decode (2 ms)
        >>> round(t_sync_homomorphic(8e6, 1, 4, 1 / 8, 1 / 4, lin(1e-3, 1e-9), f, f, p,
        ...                          ring=True), 6)
        0.027
    """
    _check_kn(k, n)
    if not (r_up > 0 and r_down > 0):
        raise ValueError(f"compression rates must be > 0, found {r_up!r} and {r_down!r}")
    a, b, g = params.values(n, min(k, n))
    a_up = min(a, 1) if ring else (a + 1) // 2
    part = m / k
    comm = a_up * t_send(r_up * part) + (a - a_up) * t_send(r_down * part)
    comp = b * t_enc(part) + g * t_dec(r_down * part)
    return comm + comp + (n_batches(k, n) - 1) * max(comm, comp)


@dataclass(frozen=True)
class Link:
    """The alpha-beta model of one link: ``T_send(m) = latency + m / bandwidth``.

    (HiPress Table 2's ``T_send``; the flexible-communication paper's Table I
    calls ``latency`` alpha and ``1/bandwidth`` beta.)

    Attributes:
        latency: seconds per message.
        bandwidth: bytes per second.
    """

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not (isinstance(self.latency, (int, float)) and self.latency >= 0
                and math.isfinite(self.latency)):
            raise ValueError(f"link latency must be a finite number >= 0 seconds, "
                             f"found {self.latency!r}")
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0):
            raise ValueError(f"link bandwidth must be > 0 bytes/s, found {self.bandwidth!r}")

    def __call__(self, nbytes: float) -> float:
        """Seconds to send ``nbytes``."""
        return self.latency + nbytes / self.bandwidth

    @property
    def alpha(self) -> float:
        """Latency in seconds (Table I's alpha)."""
        return self.latency

    @property
    def beta(self) -> float:
        """Seconds per byte (Table I's beta)."""
        return 1.0 / self.bandwidth


def concurrent_link(one: Link, every: Link, n: int, c: int) -> Link:
    """``T_send`` of one link while ``c`` of the ``n`` links are busy at once.

    Not in HiPress, which assumes dedicated links (``one == every``). When
    links share a bottleneck (the CPU moving loopback bytes, a switch), the
    aggregate throughput ``n * every.bandwidth`` is split among the ``c``
    busy links, and no link is faster than it is alone:
    ``bandwidth = min(one.bandwidth, every.bandwidth * n / c)``. With dedicated
    links this is ``every`` for any ``c``.

    Args:
        one: fit with a single busy link.
        every: fit with all ``n`` links busy.
        n: number of nodes.
        c: busy links (1..n).

    Example:
        >>> concurrent_link(Link(1e-3, 4e9), Link(2e-3, 1e9), 4, 2).bandwidth
        2000000000.0
    """
    if c <= 1:
        return one
    return Link(latency=every.latency,
                bandwidth=min(one.bandwidth, every.bandwidth * n / min(c, n)))


def fit_link(sizes: Sequence[float], times: Sequence[float]) -> Link:
    """Fit ``t = latency + bytes / bandwidth`` to measured transfers.

    Minimises the squared *relative* error, so 4 KB and 64 MB samples weigh
    alike (an ordinary least squares fit would ignore the latency).

    Raises:
        ValueError: fewer than two distinct sizes, or non-positive times.
    """
    if len(sizes) != len(times) or len(set(sizes)) < 2:
        raise ValueError("fit_link needs samples at two or more distinct sizes")
    if any(not t > 0 for t in times):
        raise ValueError(f"transfer times must be > 0, found {list(times)}")
    # Weighted least squares with weights 1/t^2 on t = a + b*x.
    xs, ts = [float(x) for x in sizes], [float(t) for t in times]
    w = [1.0 / (t * t) for t in ts]
    sw = sum(w)
    sx = sum(w[i] * xs[i] for i in range(len(xs)))
    sy = sum(w[i] * ts[i] for i in range(len(xs)))
    sxx = sum(w[i] * xs[i] ** 2 for i in range(len(xs)))
    sxy = sum(w[i] * xs[i] * ts[i] for i in range(len(xs)))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    if b <= 0:  # time does not grow with size: bandwidth unmeasurable here
        b = max(times) / max(sizes) * 1e-3
    return Link(latency=max(0.0, a), bandwidth=1.0 / b)


@dataclass(frozen=True)
class Curve:
    """A measured cost curve ``t(bytes)``, e.g. T_enc or T_dec of one compressor.

    Between measured sizes the curve is piecewise-linear in log-log space
    (per-call overheads dominate small sizes, throughput large ones, and a
    log-log interpolation follows both). Below the smallest size it stays at
    the smallest time (the fixed overhead does not shrink); above the largest
    it grows linearly in bytes (constant throughput).

    Attributes:
        sizes: strictly increasing sizes in bytes (> 0).
        times: seconds at those sizes (> 0).
    """

    sizes: Tuple[float, ...]
    times: Tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(float(s) for s in self.sizes))
        object.__setattr__(self, "times", tuple(float(t) for t in self.times))
        if not self.sizes or len(self.sizes) != len(self.times):
            raise ValueError(f"a curve needs as many times as sizes (>= 1), found "
                             f"{len(self.sizes)} sizes and {len(self.times)} times")
        if any(s <= 0 for s in self.sizes) or any(not t > 0 for t in self.times):
            raise ValueError("curve sizes and times must be > 0")
        if any(self.sizes[i + 1] <= self.sizes[i] for i in range(len(self.sizes) - 1)):
            raise ValueError(f"curve sizes must be strictly increasing, found {self.sizes}")

    def __call__(self, nbytes: float) -> float:
        """Seconds at ``nbytes``."""
        s, t = self.sizes, self.times
        if nbytes <= s[0]:
            return t[0]
        if nbytes >= s[-1]:
            return t[-1] * nbytes / s[-1]
        i = bisect.bisect_right(s, nbytes)
        x0, x1 = math.log(s[i - 1]), math.log(s[i])
        y0, y1 = math.log(t[i - 1]), math.log(t[i])
        f = (math.log(nbytes) - x0) / (x1 - x0)
        return math.exp(y0 + f * (y1 - y0))

    @classmethod
    def linear(cls, fixed: float, per_byte: float, sizes: Sequence[float]) -> "Curve":
        """Sample ``t = fixed + per_byte * bytes`` at ``sizes`` (for given, not measured, costs)."""
        return cls(tuple(sizes), tuple(fixed + per_byte * s for s in sizes))

    def to_dict(self) -> Dict[str, list]:
        """JSON-ready form."""
        return {"sizes": list(self.sizes), "times": list(self.times)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Sequence[float]]) -> "Curve":
        """Inverse of ``to_dict``; raises ``ValueError`` on bad data."""
        if not isinstance(d, Mapping) or set(d) != {"sizes", "times"}:
            raise ValueError(f"a curve is {{'sizes': [...], 'times': [...]}}, found {d!r:.80}")
        return cls(tuple(d["sizes"]), tuple(d["times"]))
