"""Selective compression and partitioning: per gradient, <compress?, K> (HiPress Sec. 3.3).

The planner evaluates HiPress Eq. 1 (no compression) and Eq. 2 (compression)
for every partition count ``K = 1 .. max_partitions`` with the measured
curves of a ``Profile``, and keeps the cheapest. When the engine averages
uncompressed gradients with its collective lane (``raw_collective``, the
engine's default), "no compression" costs an allreduce instead of Eq. 1,
for any K: the profile's measured allreduce fit, or else
``2(N-1) alpha + 2(N-1)/N m beta`` (flexible-communication paper, Table I,
Ring-AR) on the all-links fit. The choice is then: compress if the best
Eq. 2 time beats the best uncompressed time, with the ``K`` that achieves
it. Both
expressions are convex in K (Sec. 3.3), so the scan finds the optimum; among
near-equal times (``k_tolerance``) the smaller K wins, because fewer
partitions mean fewer tasks and messages the model does not charge for.

Top-k family compressors (``topk``, ``star_topk``, ``var_topk``, with no
parameter but the ratio: ``collectives.selectable``) are not left on PS or
Ring: for each compressed one, the flexible-communication
paper's selection (Sec. 3-D, Eq. 5a-5c; ``collectives.select_collective``
with the profile's all-links fit for alpha and beta and its one-link fit
for the one-way steps) picks an Allgather of top-k, ART-Ring or ART-Tree,
and the entry names that collective (``collectives.decision_for``;
``meta["collectives"]`` lists the picks). ``collectives=False`` keeps them
on the strategy's workflow.

The result is a ``Plan`` (plan.py) with an explicit entry per gradient and a
``SizeRule`` derived from the model, for gradients the plan does not name:

1. the compression threshold is the smallest size from which compression
   wins at every larger size (a log-spaced scan refined by bisection);
2. ``bytes_per_partition`` is the candidate (``m / K`` of an optimal choice)
   whose rule ``K = ceil(m / bytes_per_partition)`` loses the least predicted
   time over a log-spaced range of sizes.

Example:
    >>> from hipress_like.cost_model import Profile, Planner      # doctest: +SKIP
    >>> planner = Planner(Profile.load("profile.json"), "onebit", n=4,  # doctest: +SKIP
    ...                   strategy="ps")
    >>> plan = planner.plan({"fc.weight": 64 << 20, "fc.bias": 4096})  # doctest: +SKIP
    >>> plan.save("plan.json")                                        # doctest: +SKIP
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .collectives import select_decision
from .engine_term import EngineTerm
from .model import (
    Link,
    SyncParams,
    concurrent_link,
    n_batches,
    sync_params,
    t_sync_bidi,
    t_sync_cpr,
    t_sync_homomorphic,
    t_sync_orig,
)
from .plan import STRATEGIES, GradientPlan, Plan, SizeRule
from .profile import CompressorProfile, Profile

__all__ = ["ENGINE_TO_MODEL", "Choice", "EngineTerm", "Planner", "NEVER", "plan_per_gradient"]

_log = logging.getLogger(__name__)

# The engine's PS co-locates aggregators with workers: HiPress evaluates that
# with the Sec. 6.1 values, not Table 3's.
ENGINE_TO_MODEL = {"ps": "ps-colocated", "ring": "ring"}

# Threshold meaning "never compress" (JSON-safe integer beyond any tensor).
NEVER = 1 << 62

Gradients = Union[Mapping[str, int], Iterable[Tuple[str, int]]]


@dataclass(frozen=True)
class Choice:
    """The planner's decision for one gradient size, with the predictions behind it.

    Attributes:
        nbytes: gradient size m.
        compress: whether to compress.
        partitions: the chosen K.
        t_orig: best Eq. 1 time (seconds), reached at ``k_orig``.
        k_orig: K minimising Eq. 1.
        t_cpr: best Eq. 2 time (seconds), reached at ``k_cpr``.
        k_cpr: K minimising Eq. 2.
    """

    nbytes: int
    compress: bool
    partitions: int
    t_orig: float
    k_orig: int
    t_cpr: float
    k_cpr: int

    @property
    def time(self) -> float:
        """Predicted seconds of the chosen option."""
        return self.t_cpr if self.compress else self.t_orig

    @property
    def speedup(self) -> float:
        """Best uncompressed time over the chosen time (>= 1)."""
        return self.t_orig / self.time if self.time > 0 else 1.0

    def gradient_plan(self) -> GradientPlan:
        """The plan entry for this choice."""
        return GradientPlan(compress=self.compress, partitions=self.partitions)


def _cpu_fit(samples: Sequence[Tuple[int, int, float]]) -> Optional[EngineTerm]:
    """``EngineTerm``'s linear form fitted to CPU samples (no Eq. 2 under them);
    None without a sample above zero.

    Example:
        >>> t = _cpu_fit([(1000, 1, 0.0), (1000, 1, 2e-3), (4000, 1, 5e-3)])
        >>> round(t(2000, 1) * 1e3, 6), _cpu_fit([(1000, 1, 0.0)])
        (3.0, None)
    """
    usable = [x for x in samples if x[2] > 0]
    return EngineTerm.fit(usable, lambda m, k: 0.0) if usable else None


class Planner:
    """HiPress Eq. 1/2 for one compressor, strategy and world size, and the plans they imply.

    Args:
        profile: measured link and compressor curves.
        compressor: name of a compressor in ``profile``.
        n: number of nodes N (>= 1).
        back: name of a master compressor in ``profile`` that encodes the
            aggregate on its way back (bidirectional compression, Natural
            Compression Alg. 1); None: ``compressor`` both ways. Priced by
            ``model.t_sync_bidi``; the plan's compressing entries name it.
        strategy: the engine's strategy, "ps" (co-located) or "ring".
        max_partitions: largest K considered (default ``4 * N``; beyond N,
            partitions are batched, Sec. 3.3).
        model_strategy: cost-model row of alpha/beta/gamma ("ps",
            "ps-colocated", "ring"); default from ``ENGINE_TO_MODEL``.
        k_tolerance: relative time within which a smaller K is preferred.
        raw_collective: the engine's ``EngineConfig.raw_collective`` (default
            True): uncompressed gradients cost a ring allreduce; False: HiPress
            Eq. 1 (raw bytes through the PS or Ring workflow).
        partitions: the K values to choose from (default every K from 1 to
            ``max_partitions``), e.g. the K a measured sweep covers.

    Raises:
        ValueError: bad N, strategy or max_partitions; ``ProfileError``:
            the profile lacks the compressor.
    """

    def __init__(self, profile: Profile, compressor: str, n: int, strategy: str = "ps", *,
                 max_partitions: Optional[int] = None, model_strategy: Optional[str] = None,
                 k_tolerance: float = 0.01, raw_collective: bool = True,
                 partitions: Optional[Sequence[int]] = None,
                 back: Optional[str] = None, collectives: bool = True) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"the number of nodes N must be an integer >= 1, found {n!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
        if max_partitions is not None and (not isinstance(max_partitions, int)
                                           or max_partitions < 1):
            raise ValueError(f"max_partitions must be an integer >= 1, found {max_partitions!r}")
        if not 0 <= k_tolerance < 1:
            raise ValueError(f"k_tolerance must be in [0, 1), found {k_tolerance!r}")
        self.profile = profile
        self.label = str(compressor)  # the profile's key: a name, or a candidate's label
        self.cp: CompressorProfile = profile.compressor(compressor)
        # bidirectional compression: the aggregate goes back by another compressor
        self.back: Optional[CompressorProfile] = (
            profile.compressor(back) if back is not None else None)
        self.n = n
        self.strategy = strategy
        self.model_strategy = model_strategy or ENGINE_TO_MODEL[strategy]
        # The engine's Ring runs each of its K partitions as a ring allreduce over
        # N chunks (``casync.workflows.ring_workflow``): HiPress's Ring with K*N
        # partitions, N per batch (Sec. 3.3). Eq. 1/2 take K*N. Pricing the engine's
        # K as HiPress's K put a whole 32 MB gradient through every hop at K = 1
        # (Ring + onebit: 218 ms where the engine took 113 ms, 4 ranks at 1 Gbit/s).
        self.chunks = n if strategy == "ring" and self.model_strategy == "ring" else 1
        # A quantizer whose payloads sum without decoding (THC Sec. 4) is priced by
        # Table 3's low-rank counts (no decode-merge-encode at the aggregator), its
        # widened sums on the way back (``model.t_sync_homomorphic``).
        self.homomorphic = self.cp.aggregatable and self.cp.category not in ("lowrank", "none")
        self.params: SyncParams = sync_params(
            self.model_strategy, "lowrank" if self.homomorphic else self.cp.category)
        self._merged_nbytes: Optional[Callable[[int, int], int]] = None
        if partitions is not None:
            ks = sorted(set(partitions))
            if not ks or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
                raise ValueError(f"partitions must be integers >= 1, found {partitions!r}")
            if max_partitions is not None and ks[-1] > max_partitions:
                raise ValueError(f"partitions {ks} exceed max_partitions={max_partitions}")
            max_partitions = ks[-1]
        self.max_partitions = max_partitions or 4 * n
        self.partitions: List[int] = (ks if partitions is not None
                                      else list(range(1, self.max_partitions + 1)))
        self.k_tolerance = k_tolerance
        self.raw_collective = bool(raw_collective)
        self.collectives = bool(collectives)
        # Not in HiPress: the engine's measured fixed cost per synchronisation
        # (0 unless profiled); compressed paths have their own when measured.
        self._overhead = profile.sync_overhead
        self._overhead_cpr = self.cp.sync_overhead or profile.sync_overhead
        # ... and, when the profile timed whole engine synchronisations with
        # this N, the fitted EngineTerm replaces the constant.
        self.engine_term: Optional[EngineTerm] = None
        # Only timings of this strategy: PS and Ring differ beyond Eq. 2 (a Ring term
        # fitted to PS timings priced Ring + onebit 0.75x PS where training took 1.26x).
        samples = self.cp.samples_for(strategy)
        if samples and profile.meta.get("ranks") == n and n > 1:
            self.engine_term = EngineTerm.fit(samples, self.eq2)
        elif samples and n > 1:
            _log.warning("the profile's engine timings are for %s ranks, not N=%d: using "
                         "Eq. 2 with a constant overhead", profile.meta.get("ranks"), n)
        elif self.cp.engine_samples and n > 1:
            _log.info("the profile timed %s's engine with %s only; %s uses Eq. 2 with a "
                      "constant overhead (hipress-profile profile --strategy both)",
                      self.label, self.cp.engine_strategy, strategy)
        # CPU seconds per synchronisation, when the profile recorded them with this N
        same_n = profile.meta.get("ranks") == n and n > 1
        self.cpu_term = _cpu_fit(self.cp.engine_cpu_by.get(strategy, ())) if same_n else None
        self.lane_cpu_term = (_cpu_fit([(m, 1, c) for m, c in profile.lane_cpu]) if same_n
                              else None)

    # -- the two equations ---------------------------------------------------
    def busy_links(self, k: int) -> int:
        """Links busy at once with K partitions: PS keeps min(K, N) aggregators
        receiving (one sender each per round); Ring keeps all N."""
        return self.n if self.model_strategy == "ring" else min(k, self.n)

    def link(self, k: int) -> Link:
        """The ``T_send`` fit for K partitions (``model.concurrent_link``)."""
        prof = self.profile
        if prof.link_one is None:
            return prof.link
        return concurrent_link(prof.link_one, prof.link, self.n, self.busy_links(k))

    def t_orig(self, m: float, k: int) -> float:
        """Uncompressed synchronisation time plus the measured sync overhead (seconds).

        With ``raw_collective`` K does not matter: the profile's timed engine
        lane (``Profile.lane``) when it has one; else an allreduce of the
        whole gradient (the measured allreduce fit, or Table I's Ring-AR on
        the all-links fit) plus the constant sync overhead. Otherwise HiPress
        Eq. 1 plus that overhead.
        """
        if self._timed_lane:
            return self.profile.lane(m)
        if self.raw_collective:
            t = self.profile.allreduce_time(m, self.n)
        else:
            t = t_sync_orig(m, k * self.chunks, self.n, self.link(k), self.params)
        return t + self._overhead if self.n > 1 else t

    def eq2(self, m: float, k: int) -> float:
        """HiPress Eq. 2 alone with the profile's curves (seconds); ``r`` includes the header.
        With a master compressor (``back``), Eq. 2 priced in both directions
        (``model.t_sync_bidi``). Under the engine's Ring, K partitions are K*N
        chunks (``chunks``)."""
        kc = k * self.chunks
        if self.back is not None:
            mb = self.back
            return t_sync_bidi(m, kc, self.n, self.cp.rate(m / kc), mb.rate(m / kc),
                               self.link(k), self.cp.encode, self.cp.decode, mb.encode,
                               mb.decode, self.params, self.cp.aggregatable)
        if self.homomorphic and self.n > 1:
            return t_sync_homomorphic(m, kc, self.n, self.cp.rate(m / kc),
                                      self.merged_rate(m / kc), self.link(k), self.cp.encode,
                                      self.cp.decode, self.params, self.model_strategy == "ring")
        return t_sync_cpr(m, kc, self.n, self.cp.rate(m / kc), self.link(k),
                          self.cp.encode, self.cp.decode, self.params)

    def merged_rate(self, nbytes: float) -> float:
        """Bytes of the merged payload of N ranks per input byte, for an ``nbytes``
        partition: the compressor's own ``kernels.merged_nbytes`` (THC's sums are
        w/b times its indices, THC Sec. 6.2); the payload rate when merges keep the size."""
        if self._merged_nbytes is None:
            from .. import compressors  # the layer below: builds the profiled compressor

            self._merged_nbytes = compressors.get(self.cp.name, **dict(self.cp.params)
                                                  ).kernels.merged_nbytes
        payload = max(1, int(round(self.cp.payload_bytes(nbytes))))
        return self._merged_nbytes(payload, self.n) / nbytes

    def t_cpr(self, m: float, k: int) -> float:
        """Compressed synchronisation time: Eq. 2 plus the engine's cost beyond it (seconds).

        The fitted ``EngineTerm`` when the profile timed the engine, else the
        constant sync overhead. Never less than one partition's encode,
        transfer and decode, whatever the fit says.
        """
        t = self.eq2(m, k)
        if self.n == 1:
            return t
        if self.engine_term is None:
            return t + self._overhead_cpr
        part = m / (k * self.chunks)
        back = self.back or self.cp
        floor = (self.cp.encode(part) + self.link(k)(self.cp.payload_bytes(part))
                 + back.decode(back.payload_bytes(part)))
        return max(t + self.engine_term(m, k), floor)

    @property
    def _timed_lane(self) -> bool:
        """Uncompressed gradients cost the profile's timed engine lane (``t_orig``)."""
        return self.raw_collective and self.profile.lane is not None and self.n > 1

    def wire_time_orig(self, m: float) -> float:
        """Seconds ``m`` uncompressed bytes keep the link busy: the timed lane's
        bytes over its bandwidth, its latency left out; without a timed lane,
        the whole ``t_orig``."""
        if not self._timed_lane:
            return self.t_orig(m, 1)
        return min(self.t_orig(m, 1), m / self.profile.lane.bandwidth)

    def wire_time(self, m: float, k: int) -> float:
        """Seconds the payload bytes of a compressed synchronisation keep this rank's
        link busy: Eq. 2's ``alpha`` transfers per batch times its batches, each of
        one partition's payload at the fit's bandwidth, latency left out (it delays
        the synchronisation without occupying the link). Transfers carrying the
        aggregate (half of them; Ring's gather) move the merged payload of an
        aggregatable quantizer or the master compressor's."""
        kc = k * self.chunks
        part = m / kc
        a, _, _ = self.params.values(self.n, min(kc, self.n))
        up = self.cp.payload_bytes(part)
        if self.back is not None:
            down = self.back.payload_bytes(part)
        elif self.homomorphic and self.n > 1:
            down = self.merged_rate(part) * part
        else:
            down = up
        return a * n_batches(kc, self.n) * (up + down) / 2 / self.link(k).bandwidth

    def cpu_cpr(self, m: float, k: int) -> Optional[float]:
        """CPU seconds one rank spends on a compressed synchronisation of ``m`` bytes
        in ``k`` partitions (every thread: encodes, decodes, merges, copies, the
        transport), from the profile's ``engine_cpu_by`` by ``EngineTerm``'s
        linear form; None when the profile did not record them for this
        strategy and N. Not in HiPress, whose compression runs on spare GPU cores."""
        return None if self.cpu_term is None else max(0.0, self.cpu_term(m, k))

    def cpu_orig(self, m: float) -> Optional[float]:
        """CPU seconds one rank spends on ``m`` uncompressed bytes in the engine's
        collective lane (``Profile.lane_cpu``, fitted ``a + b m``); None when not
        recorded for this N."""
        return None if self.lane_cpu_term is None else max(0.0, self.lane_cpu_term(m, 1))

    def _best_k(self, f, m: float) -> Tuple[int, float]:
        times = [(k, f(m, k)) for k in self.partitions]
        t_min = min(t for _, t in times)
        for k, t in times:  # smallest K within tolerance of the optimum
            if t <= t_min * (1 + self.k_tolerance):
                return k, t
        raise AssertionError("unreachable")

    def choose(self, nbytes: int) -> Choice:
        """The best <compress?, K> for an ``nbytes`` gradient.

        Raises:
            ValueError: ``nbytes`` < 1.
        """
        if not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"gradient size must be an integer >= 1 byte, found {nbytes!r}")
        k_o, t_o = self._best_k(self.t_orig, nbytes)
        k_c, t_c = self._best_k(self.t_cpr, nbytes)
        compress = t_c < t_o
        return Choice(nbytes, compress, k_c if compress else k_o, t_o, k_o, t_c, k_c)

    # -- derived size rule ----------------------------------------------------
    def threshold(self, lo: int = 1 << 10, hi: int = 1 << 30) -> int:
        """Where compression starts to win: the start of the largest-size winning run in [lo, hi].

        Scans log-spaced sizes, takes the largest size at which compression
        wins, walks down while it keeps winning, and bisects the boundary.
        (Beyond the profiled sizes curves are extrapolated, so a loss at the
        very top of the range does not erase the threshold below it.)

        Returns:
            Bytes; ``lo`` if compression wins from the start, ``NEVER`` if it
            wins nowhere in the range.
        """
        grid = _grid(lo, max(lo, hi), 4)
        wins = [self.choose(s).compress for s in grid]
        if not any(wins):
            return NEVER
        i = max(j for j, w in enumerate(wins) if w)
        while i > 0 and wins[i - 1]:
            i -= 1
        if i == 0:
            return lo
        a, b = grid[i - 1], grid[i]  # loses at a, wins at b: bisect
        while b - a > max(4, a // 256):
            mid = (a + b) // 2
            if self.choose(mid).compress:
                b = mid
            else:
                a = mid
        return b

    def size_rule(self, lo: int = 1 << 10, hi: int = 1 << 30) -> SizeRule:
        """The ``SizeRule`` that best imitates the model over [lo, hi] (see module doc)."""
        thr = self.threshold(lo, hi)
        grid = _grid(lo, hi, 2)
        choices = [self.choose(s) for s in grid]
        cands = sorted({max(1, math.ceil(c.nbytes / c.partitions)) for c in choices}
                       | {hi})
        cap = self.max_partitions
        memo: Dict[Tuple[bool, int, int], float] = {}  # candidate rules share most times

        def loss(bpp: int) -> float:
            # evaluate the rule exactly as the engine will apply it (SizeRule.decide)
            rule = SizeRule(min_compress_bytes=int(thr), bytes_per_partition=int(bpp),
                            max_partitions=cap)
            total = 0.0
            for c in choices:
                d = rule.decide(c.nbytes, self.n)
                key = (d.compress, c.nbytes, d.partitions)
                if key not in memo:
                    memo[key] = (self.t_cpr if d.compress else self.t_orig)(c.nbytes,
                                                                            d.partitions)
                t = memo[key]
                total += t / c.time - 1.0 if c.time > 0 else 0.0
            return total

        best = min(cands, key=lambda b: (loss(b), -b))
        return SizeRule(min_compress_bytes=int(thr), bytes_per_partition=int(best),
                        max_partitions=cap)

    # -- plans ------------------------------------------------------------------
    def plan(self, gradients: Gradients, *, meta: Optional[Mapping[str, object]] = None,
             fit_rule: bool = True) -> Plan:
        """A ``Plan`` with one entry per gradient and the derived size rule.

        Args:
            gradients: {name: nbytes} or (name, nbytes) pairs.
            meta: extra provenance stored in the plan.
            fit_rule: fit the size rule for gradients the plan does not name (most
                of a plan's time); False leaves them uncompressed (``NEVER``), for
                a plan only priced or used on the gradients it names.

        Raises:
            ValueError: an empty model, a duplicate name or a size < 1.
        """
        items = list(gradients.items() if isinstance(gradients, Mapping) else gradients)
        if not items:
            raise ValueError("the model has no gradients to plan")
        names = [n for n, _ in items]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate gradient names: {dup[:5]}")
        cache: Dict[int, Choice] = {}
        entries, predicted = {}, {}
        for name, nbytes in items:
            if nbytes not in cache:
                cache[nbytes] = self.choose(nbytes)
            c = cache[nbytes]
            entries[str(name)] = c.gradient_plan()
            if self.back is not None and c.compress:
                entries[str(name)] = GradientPlan(
                    True, c.partitions, self.cp.name, dict(self.cp.params),
                    self.back.name, dict(self.back.params))
            predicted[str(name)] = round(c.time, 9)
        picks = (_select_collectives(entries, items, self.n, self.profile, self.cp.name,
                                     self.cp.params) if self.collectives else {})
        # The rule is fitted over the model's own size range (beyond the
        # profiled sizes the curves are extrapolations).
        rule = (self.size_rule(hi=max(1 << 20, max(int(s) for _, s in items))) if fit_rule
                else SizeRule(min_compress_bytes=NEVER))
        a, b, g = self.params.alpha, self.params.beta, self.params.gamma
        info = {
            "model_strategy": self.model_strategy,
            "sync_params": {"alpha": str(a), "beta": str(b), "gamma": str(g),
                            "source": self.params.source},
            "link": {"latency": self.profile.link.latency,
                     "bandwidth": self.profile.link.bandwidth},
            "threshold_bytes": rule.min_compress_bytes,
            "predicted_total_s": {
                "plan": sum(cache[s].time for _, s in items),
                "no_compression": sum(cache[s].t_orig for _, s in items),
                "compress_all": sum(cache[s].t_cpr for _, s in items),
            },
            "predicted_s": predicted,
        }
        if picks:
            info["collectives"] = picks
        info.update(meta or {})
        return Plan(compressor=self.cp.name, params=dict(self.cp.params), strategy=self.strategy,
                    world_size=self.n, rule=rule, gradients=entries, meta=info)

    def table(self, sizes: Sequence[int]) -> List[Choice]:
        """Choices for distinct sizes, ascending (rows of a HiPress Table 7-like table)."""
        return [self.choose(int(s)) for s in sorted(set(sizes))]


def plan_per_gradient(planners: Sequence[Planner], gradients: Gradients, *,
                      meta: Optional[Mapping[str, object]] = None,
                      fit_rule: bool = True) -> Plan:
    """A plan that picks, per gradient, the cheapest of several compressors or none.

    HiPress Sec. 3.3 decides <compress?, K> per gradient for one algorithm;
    here each gradient also gets the algorithm: for every candidate's
    ``Planner`` (same profile, N and strategy) the best Eq. 2 time over K,
    against the best uncompressed time (Eq. 1, or the allreduce lane); the
    smallest wins, ties going to the earlier candidate. The plan (format 2)
    names each entry's compressor; its own compressor and size rule, for
    gradients it does not name, are those of the candidate that wins the
    most bytes.

    Args:
        planners: one per candidate compressor, built on the same profile.
        gradients: {name: nbytes} or (name, nbytes) pairs.
        meta: extra provenance stored in the plan.
        fit_rule: as ``Planner.plan``'s (False: gradients not named stay
            uncompressed, and no rule is fitted).

    Raises:
        ValueError: no planner, planners for different N or strategies, an
            empty model or duplicate names.
    """
    if not planners:
        raise ValueError("plan_per_gradient needs at least one candidate planner")
    if len({(p.n, p.strategy) for p in planners}) > 1:
        raise ValueError("the candidate planners must share N and the strategy")
    items = list(gradients.items() if isinstance(gradients, Mapping) else gradients)
    entries, predicted, won = {}, {}, [0] * len(planners)
    all_cpr = [0.0] * len(planners)  # each candidate on every gradient ("compress_all")
    for name, nbytes in items:
        choices = [p.choose(int(nbytes)) for p in planners]
        for j, ch in enumerate(choices):
            all_cpr[j] += ch.t_cpr
        i = min(range(len(choices)), key=lambda j: (choices[j].t_cpr, j))
        c = choices[i]
        if c.t_cpr < c.t_orig:
            pl = planners[i]
            entries[str(name)] = GradientPlan(
                True, c.k_cpr, pl.cp.name, dict(pl.cp.params),
                pl.back.name if pl.back else None, dict(pl.back.params) if pl.back else {})
            predicted[str(name)] = round(c.t_cpr, 9)
            won[i] += int(nbytes)
        else:
            entries[str(name)] = GradientPlan(False, c.k_orig)
            predicted[str(name)] = round(c.t_orig, 9)
    top = max(range(len(planners)), key=lambda j: (won[j], -j))
    # validates the model (no gradients, duplicate names) and fits the rule: only the
    # winner's rule is kept, so only its rule is fitted (the fit is most of a plan's time)
    base = planners[top].plan(items, fit_rule=fit_rule)
    info = dict(base.meta)
    info.pop("collectives", None)
    picks = (_select_collectives(entries, items, base.world_size, planners[0].profile,
                                 base.compressor, base.params)
             if all(p.collectives for p in planners) else {})
    if picks:
        info["collectives"] = picks
    if len({p.label for p in planners}) < len(planners):
        raise ValueError(f"duplicate candidate labels {[p.label for p in planners]}")
    info.update(candidates=[p.label for p in planners], predicted_s=predicted,
                predicted_total_s={"plan": sum(predicted.values()),
                                   "no_compression": base.meta["predicted_total_s"][
                                       "no_compression"],
                                   **{f"all_{p.label}": t
                                      for p, t in zip(planners, all_cpr)}})
    info.update(meta or {})
    return Plan(compressor=base.compressor, params=dict(base.params), strategy=base.strategy,
                world_size=base.world_size, rule=base.rule, gradients=entries, meta=info)


def _select_collectives(entries: Dict[str, GradientPlan], items: Sequence[Tuple[str, int]],
                        n: int, profile: Profile, name: str, params: Mapping[str, object]
                        ) -> Dict[str, str]:
    """Rewrite each compressing top-k family entry to the collective Eq. 5a-5c pick for
    it (module docstring), in place; return {gradient: pick}."""
    if n < 2:
        return {}
    link, one = profile.link, profile.link_one
    picks: Dict[str, str] = {}
    for grad, nbytes in items:
        e = entries[str(grad)]
        comp, cparams = (e.compressor, e.params) if e.compressor else (name, params)
        got = select_decision(e, nbytes, n, link.alpha, link.beta,
                              one.beta if one is not None else None,
                              comp, cparams) if e.compress else None
        if got is not None:
            picks[str(grad)], entries[str(grad)] = got
    return picks


def _grid(lo: int, hi: int, per_octave: int) -> List[int]:
    steps = max(1, round(math.log2(hi / lo) * per_octave))
    out: List[int] = []
    for i in range(steps + 1):
        s = int(round(lo * (hi / lo) ** (i / steps)))
        if not out or s > out[-1]:
            out.append(s)
    return out
