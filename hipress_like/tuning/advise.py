"""Predicted step times of the ways to run one model, ranked (``hipress-profile advise``).

The idea: HiPress's cost model (Sec. 3.3, Eq. 1 and 2) prices one
gradient's synchronisation; a training step also computes, and CaSync starts
synchronising a gradient as soon as backward produces it (Sec. 5, Fig. 8b).
What a configuration costs per step is therefore how far synchronisation
runs past the end of backward. ``advise`` predicts that for every
configuration a user can run, and ranks them:

- no compression (every gradient in the engine's allreduce lane);
- each profiled compressor under CaSync-PS and CaSync-Ring, with the
  engine's default size rule (``plan=None``; ``compressor_plans="rule"``)
  or with the cost model's plan for that compressor alone ("model");
- the per-gradient plan (``planner.plan_per_gradient``): per gradient the
  cheapest of the candidate compressors or none, under PS and under Ring.

How each row is predicted is the step-time model (``step_model``): the
compute timeline, the synchronisation jobs of the row's plan, three servers
(backward, the engine's compute thread, the link) and the host's cores.
``paper_profile`` is the built-in ``--profile paper``: Table 3's
alpha/beta/gamma (which the model always uses) driven by curves taken from
the paper's own figures.

Example:
    >>> from hipress_like.cost_model.model import Link
    >>> from hipress_like.cost_model.presets import preset
    >>> sizes = preset("vgg19")
    >>> adv = advise(sizes, 4, paper_profile(Link(10e-6, 1.25e9)),
    ...              ComputeTimeline.spread(sizes, 0.3))
    >>> adv.best.label != "none"
    True
    >>> [r.label for r in adv.close_to_best()]  # within CLOSE: time them too
    ['onebit/ring', 'tbq/ps', 'terngrad/ps']
    >>> adv.same_as(adv.row("per-gradient/ps")).label  # it chose onebit throughout
    'onebit/ps'
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from ..cost_model.model import Curve, Link
from ..cost_model.plan import GradientPlan, Plan, SizeRule
from ..cost_model.planner import NEVER, Planner, plan_per_gradient
from ..cost_model.profile import CompressorProfile, Profile, ProfileError
from .compute import ComputeTimeline, infer_input_shape, load_module, measure_compute
from .step_model import Sizes, _predict, cpu_share_of, host_bound, predict_step

# the step model's and compute's names are re-exported: ``advise`` is the module
# users (and the CLI) import the advisor's whole surface from
__all__ = ["ComputeTimeline", "Row", "Advice", "advise", "predict_step", "host_bound",
           "paper_profile", "measure_compute", "optimizer_line", "cpu_share_of",
           "load_module", "infer_input_shape", "PAPER_COMPRESSORS", "CLOSE"]

# -- the paper's values (--profile paper) ---------------------------------------------
# HiPress Sec. 6.4: CompLL-TBQ encodes 256 MB >12x faster than OSS-TBQ's 38.17 ms.
_PAPER_BYTES_PER_S = 256 * 2**20 / (38.17e-3 / 12)
# rows predicted this close to the best are named beside it: the model's median
# error against bench/train.py was 3-21% here (README, "the advisor")
CLOSE = 0.05
# Payload bytes per input byte of the paper's quantizers: onebit (Table 7's
# algorithm) 1 bit of 32, TBQ at Fig. 14's r = 1/16, TernGrad's 2 bits.
PAPER_COMPRESSORS: Mapping[str, float] = {"onebit": 1 / 32, "tbq": 1 / 16, "terngrad": 1 / 16}


def _paper_fixed_cost() -> float:
    """Seconds per encode or decode beyond the bytes, so that Eq. 2 breaks even with
    Eq. 1 at 1 MB as HiPress Fig. 14a finds (N = 16, r = 1/16, K = 1, 56 Gbit/s,
    co-located CaSync-PS: alpha = 2(N-1), beta = K, gamma = N, Sec. 6.1). The
    latencies cancel (same alpha on both sides): alpha * (m - r m) / bw =
    (beta + gamma) * c + beta * m / v + gamma * m / v."""
    n, m, r, bw = 16, float(1 << 20), 1 / 16, 56e9 / 8
    alpha, beta, gamma = 2 * (n - 1), 1, n
    saved = alpha * (m - r * m) / bw
    return (saved - (beta + gamma) * m / _PAPER_BYTES_PER_S) / (beta + gamma)


def paper_profile(link: Link) -> Profile:
    """The built-in profile of ``--profile paper``: HiPress's published values.

    The alpha, beta, gamma of Table 3 (and Sec. 6.1 for the co-located PS)
    are the cost model's own (``cost_model.model.SYNC_PARAMS``); this adds
    the curves they multiply, from the paper's figures, for the quantizers of
    ``PAPER_COMPRESSORS``: encode and decode at the speed of CompLL-TBQ
    (Sec. 6.4) plus a fixed cost per operator chosen so that compression
    starts to pay at 1 MB as in Fig. 14a; headers are ignored as the paper
    does. The link is the caller's (the paper's clusters ran 56 and 100
    Gbit/s). GPU kernels, so not this machine's costs.

    Args:
        link: the link to price transfers with.

    Returns:
        A ``Profile`` whose meta names its source.
    """
    fixed = _paper_fixed_cost()
    sizes = [float(4 << (2 * i)) for i in range(1, 15)]  # 16 B .. 1 GB, every 4x
    comps = {}
    for name, r in PAPER_COMPRESSORS.items():
        comps[name] = CompressorProfile(
            name=name, category="quantization", ratio=r, header_bytes=0,
            encode=Curve.linear(fixed, 1 / _PAPER_BYTES_PER_S, sizes),
            # a decode writes m = payload / r bytes
            decode=Curve.linear(fixed, 1 / (r * _PAPER_BYTES_PER_S), [s * r for s in sizes]))
    return Profile(link=link, compressors=comps,
                   meta={"source": "HiPress Table 3 / Sec. 6.1 counts; curves from Sec. 6.4 "
                         "(TBQ speed) and Fig. 14a (1 MB break-even)", "link_source": "given"})


# -- predicting one configuration -------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One configuration's prediction.

    Attributes:
        label: e.g. "none", "onebit/ps", "per-gradient/ring".
        kind: "none", "compressor" or "per-gradient".
        strategy: "ps" or "ring".
        plan: the plan the engine would run.
        plan_source: "rule" (the engine's size rule, ``plan=None``) or
            "model" (a cost-model plan to write and pass as a file).
        sync_s: sum of every synchronisation job's time (no overlap).
        step_s: predicted step time with backward overlap.
        compressed: gradients compressed.
        compressed_bytes: their bytes.
        speedup: the no-compression step time over this one.
        cpu_s: CPU seconds one rank spends synchronising per step (the
            profile's ``engine_cpu_by`` and ``lane_cpu``); None when the
            profile has no CPU figures for a part of the plan.
        decisions: what the engine does with each gradient under ``plan``
            (its ``GradientPlan``, naming its compressor), in registration
            order: rows with the same strategy and decisions run alike.
    """

    label: str
    kind: str
    strategy: str
    plan: Plan
    plan_source: str
    sync_s: float
    step_s: float
    compressed: int
    compressed_bytes: int
    speedup: float = 1.0
    cpu_s: Optional[float] = None
    decisions: Tuple[GradientPlan, ...] = ()


@dataclass(frozen=True)
class Advice:
    """``advise``'s answer: rows ranked by predicted step time, fastest first.

    Attributes:
        rows: the ranked rows.
        nodes: N.
        timeline: the compute timeline used.
        baseline: the no-compression row.
    """

    rows: Tuple[Row, ...]
    nodes: int
    timeline: ComputeTimeline
    baseline: Row

    @property
    def best(self) -> Row:
        """The recommended configuration (the fastest predicted)."""
        return self.rows[0]

    def close_to_best(self, tol: float = CLOSE) -> Tuple[Row, ...]:
        """The other configurations predicted within ``tol`` (relative) of the best
        one's step: closer than the model's error, so worth timing too (example:
        the module's). A row that runs like a faster one (``same_as``) is left out."""
        limit = self.best.step_s * (1 + tol)
        return tuple(r for r in self.rows[1:]  # rows: fastest first
                     if r.step_s <= limit and self.same_as(r) is None)

    def same_as(self, row: Row) -> Optional[Row]:
        """The first-ranked other row that runs like ``row`` (same strategy and the
        same decision for every gradient: a per-gradient plan that chose one
        compressor throughout, say), if it ranks before ``row``; else None."""
        for r in self.rows:
            if r is row:
                return None
            if r.strategy == row.strategy and r.decisions and r.decisions == row.decisions:
                return r
        return None

    def row(self, label: str) -> Row:
        """The row called ``label``; KeyError lists the labels."""
        for r in self.rows:
            if r.label == label:
                return r
        raise KeyError(f"no row {label!r}; rows: {', '.join(r.label for r in self.rows)}")


def _row(label: str, kind: str, strategy: str, plan: Plan, source: str, sizes: Sizes, n: int,
         planners: Mapping[str, Planner], timeline: ComputeTimeline, fusion_bytes: int,
         cpu_share: Optional[float], cores_per_rank: Optional[float]) -> Row:
    sync, step, cpu = _predict(plan, sizes, n, planners, timeline, fusion_bytes, cpu_share,
                               cores_per_rank)
    decs = [(plan.decide(name, b, n), b) for name, b in sizes]
    return Row(label, kind, strategy, plan, source, sync, step,
               sum(d.compress for d, _ in decs), sum(b for d, b in decs if d.compress),
               cpu_s=cpu, decisions=tuple(_decision(plan, d) for d, _ in decs))


def _decision(plan: Plan, d: GradientPlan) -> GradientPlan:
    """``d`` naming the compressor it runs (the plan's default resolved), so equal
    decisions compare equal whichever plan they came from."""
    if not d.compress:
        return d
    name, params = plan.compressor_of(d)
    return dataclasses.replace(d, compressor=name, params=params)


def advise(sizes: Sizes, n: int, profile: Profile, timeline: ComputeTimeline, *,
           compressors: Optional[Sequence[str]] = None,
           candidates: Optional[Sequence[str]] = None,
           strategies: Sequence[str] = ("ps", "ring"), compressor_plans: str = "model",
           max_partitions: Optional[int] = None, fusion_bytes: int = 25 << 20,
           cpu_share: Optional[float] = None, cores_per_rank: Optional[float] = None,
           meta: Optional[Mapping[str, Any]] = None) -> Advice:
    """Predict and rank every configuration (see the module doc).

    1. No compression: a plan that compresses nothing (every gradient in
       the lane).
    2. For each compressor and strategy: the engine's size rule
       (``compressor_plans="rule"``) or ``Planner.plan`` ("model").
    3. For each strategy: ``plan_per_gradient`` over ``candidates``.
    4. Each plan's step time by ``predict_step``; rows sorted by it, the
       speed-up taken against the no-compression row.

    Args:
        sizes: (gradient name, bytes) in registration order.
        n: number of nodes N (>= 1).
        profile: measured (or ``paper_profile``) costs.
        timeline: the compute timeline (``measure_compute`` or ``spread``).
        compressors: compressors to predict alone (default: all profiled).
        candidates: compressors the per-gradient plan chooses from
            (default: ``compressors``).
        strategies: strategies to predict.
        compressor_plans: "model" or "rule" (step 2).
        max_partitions: the planner's largest K (default 4N).
        fusion_bytes: the engine's lane bucket size.
        cpu_share: see ``predict_step`` (``cpu_share_of`` derives it).
        cores_per_rank: see ``predict_step``.
        meta: provenance stored in every plan.

    Returns:
        The ranked ``Advice``.

    Raises:
        ValueError: bad N, an empty model, an unknown strategy or plan kind;
            ``ProfileError``: a compressor the profile lacks.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"the number of nodes must be an integer >= 1, found {n!r}; "
                         "give --nodes 4 (for example)")
    if not sizes:
        raise ValueError("the model has no gradients")
    if compressor_plans not in ("model", "rule"):
        raise ValueError(f"compressor_plans must be 'model' or 'rule', found "
                         f"{compressor_plans!r}")
    names = list(compressors) if compressors is not None else sorted(profile.compressors)
    cands = list(candidates) if candidates is not None else names
    if not names and not cands:
        raise ProfileError("the profile has no compressor; profile some with: hipress-profile "
                           "profile --compressors onebit,terngrad")
    for c in dict.fromkeys(names + cands):
        profile.compressor(c)  # raises naming the fix
    info = dict(meta or {})
    rows: List[Row] = []
    for s in strategies:
        planners = {c: Planner(profile, c, n, s, max_partitions=max_partitions)
                    for c in dict.fromkeys(names + cands)}
        if not rows:
            first = next(iter(planners))
            none = Plan(compressor=first, params=dict(profile.compressor(first).params),
                        strategy=s, world_size=n, rule=SizeRule(min_compress_bytes=NEVER),
                        gradients={g: GradientPlan(False, 1) for g, _ in sizes}, meta=info)
            rows.append(_row("none", "none", s, none, "model", sizes, n, planners, timeline,
                             fusion_bytes, cpu_share, cores_per_rank))
        for c in names:
            pl = planners[c]
            if compressor_plans == "model":
                plan = pl.plan(sizes, meta=info)
            else:
                plan = Plan(compressor=c, params=dict(pl.cp.params), strategy=s, world_size=n,
                            meta=info)
            rows.append(_row(f"{c}/{s}", "compressor", s, plan, compressor_plans, sizes, n,
                             planners, timeline, fusion_bytes, cpu_share, cores_per_rank))
        if cands:
            plan = plan_per_gradient([planners[c] for c in cands], sizes, meta=info)
            rows.append(_row(f"per-gradient/{s}", "per-gradient", s, plan, "model", sizes, n,
                             planners, timeline, fusion_bytes, cpu_share, cores_per_rank))
    base = rows[0]
    rows = [dataclasses.replace(r, speedup=base.step_s / r.step_s if r.step_s > 0 else 1.0)
            for r in rows]
    ranked = tuple(sorted(rows, key=lambda r: (r.step_s, r.kind != "none")))
    return Advice(ranked, n, timeline, rows[0])


def optimizer_line(row: Row, plan_path: str = "plan.json") -> str:
    """The ``DistributedOptimizer(...)`` call that runs ``row`` (``import
    hipress_like.torch as hpt``; ``opt`` and ``model`` are the user's).

    Example:
        >>> r = Row("onebit/ps", "compressor", "ps", Plan(), "rule", 0.0, 0.0, 1, 4)
        >>> optimizer_line(r)  # doctest: +NORMALIZE_WHITESPACE
        'hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
         compression=hpt.Compression.onebit, strategy="ps", plan=None)'
    """
    head = "hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(), "
    if row.kind == "none":
        return head + "compression=hpt.Compression.none)"
    plan = f'plan="{plan_path}"' if row.plan_source == "model" else "plan=None"
    if row.kind == "per-gradient":  # the plan names each gradient's compressor
        return head + f'strategy="{row.strategy}", {plan})'
    ps = ", ".join(f"{k}={v!r}" for k, v in sorted(row.plan.params.items()))
    spec = f"hpt.Compression.{row.plan.compressor}" + (f"({ps})" if ps else "")
    return head + f'compression={spec}, strategy="{row.strategy}", {plan})'
