"""Measured exploration: when the world changes, try the plausible plans on real steps
and keep the one that measured fastest (``Adaptive(explore=...)``).

The cost model prices a plan from a profile; on a host whose compressors
share the cores that run backward its errors are large (issue 50: on the
2-core test host it priced "nothing compressed" 10-25 % faster than a 1-bit
plan at 10 Gbit/s where it measured 1.6x faster, and at 1 Gbit/s it
compressed only the largest weight where 1-bit on every large gradient
measured faster). A switch judged only against the plan it replaced
(``online.py``'s trial) cannot find a plan the model did not propose. Here
the model proposes a short list and the steps decide, as autotuners in this
field measure rather than trust a model (Horovod's autotune samples fusion
settings on real steps, Bayesian search over measured step times):

1. **Candidates** (``alternatives``): the model's best plan on the agreed
   link; its best plans on that link with the bandwidth scaled by each of
   ``SCALES`` (a hundredth, a quarter and four times: what the model would
   choose were the network slower or faster than it believes, which is
   where its error on a CPU-bound host lies: more, or less, compression);
   the model's plan with nothing compressed (``uncompressed``: where the
   compressors' CPU time, not the link, bounds the step, as under a CPU
   hog); with one partition per gradient (``one_partition``: the tasks
   and messages partitions add are not in the model); and each candidate
   compressor on every gradient the engine's default size rule compresses
   (``size_rule``: the layout a user runs without a planner, which the
   model, priced on a start-up profile, may never propose; on the test
   host the fixed 1-bit plan measured 125 ms a step at 1 Gbit/s on 4 ranks
   where every plan the model proposed measured 155-163 ms). Plans equal to the
   current one, or to each other, are dropped, and so is a candidate the
   model prices more than ``within`` times the best (2x by default: past
   the model's worst measured error on the test host, it would only cost
   steps). Before them come the *recalled* plans: a plan an earlier decision
   kept on a link like this one (within 2x in bandwidth; the online planner
   remembers each decision's link and plan), whatever the model now prices
   it at. A link that comes back (10 Gbit/s, then 200 Mbit/s, then 10 Gbit/s
   again) so gets back the plan measured best on it, which the model, priced
   on a profile moved twice, may no longer propose (``bench/adaptive.py``'s
   fourth phase: 1.14-1.19x its best fixed plan without this).
2. **Trials** (``Exploration``): each candidate runs for ``steps`` real
   steps; the ranks agree (median over ranks) on the mean step time of each
   window without its first step (the switch's rebuild), so every rank sees
   the same numbers. The current plan's time is the agreed mean of the
   steps just before the exploration (the online planner measures both).
3. **Choice** (``Exploration.choose``): the fastest measured plan, the plan
   in force before the exploration keeping its place unless another measured
   faster by more than ``margin`` (the hysteresis of the switch rule, on
   measured times).

The trials are real training steps (the gradients are synchronised
exactly, or compressed as each plan says): exploring costs the slower
candidates' steps and resets the compressor state of the gradients a trial
re-plans (``Engine.set_plan``), never the model's consistency across ranks.

Example:
    >>> from hipress_like.tuning.explore import Exploration
    >>> ex = Exploration(before="A", t_before=1.0, candidates=[("x", "B"), ("y", "C")],
    ...                  steps=5, start=10, margin=0.1)
    >>> ex.next_plan()
    ('x', 'B')
    >>> ex.record(0.7); ex.next_plan()
    ('y', 'C')
    >>> ex.record(0.8); ex.next_plan() is None
    True
    >>> ex.choose()
    ('x', 'B', 0.7)
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..cost_model.model import Link
from ..cost_model.plan import Plan

__all__ = ["SCALES", "alternatives", "uncompressed", "one_partition", "size_rule",
           "Exploration", "plan_key"]

# the bandwidths the model's plan is made at besides the agreed one: a quarter and four
# times (the model's errors on the test host moved its choice by about that much), and
# a hundredth (the most the model would ever compress: 1-bit on every large gradient
# measured best at 1 Gbit/s where the model compressed only the largest)
SCALES = (0.01, 0.25, 4.0)


def plan_key(plan: Plan) -> str:
    """What makes two plans the same plan: every gradient's decision."""
    return json.dumps({n: g.to_dict() for n, g in plan.gradients.items()}, sort_keys=True)


def uncompressed(plan: Plan) -> Plan:
    """``plan`` with nothing compressed: every named gradient sent as it is (keeping
    its partitions), the size rule compressing no other."""
    from ..cost_model.plan import GradientPlan, SizeRule
    from ..cost_model.planner import NEVER

    grads = {n: g if not g.compress else GradientPlan(compress=False, partitions=g.partitions)
             for n, g in plan.gradients.items()}
    rule = SizeRule(min_compress_bytes=NEVER, bytes_per_partition=plan.rule.bytes_per_partition,
                    max_partitions=plan.rule.max_partitions)
    return dataclasses.replace(plan, gradients=grads, rule=rule)


def one_partition(plan: Plan) -> Plan:
    """``plan`` with every named gradient in one partition (HiPress Sec. 3.3's K = 1):
    the model prices partitions by Eq. 2, which leaves out the tasks and messages each
    one adds on a host whose cores are busy with backward (its 8 partitions of an 8 MB
    weight at 4 ranks measured slower than one on the 2-core test host)."""
    grads = {n: dataclasses.replace(g, partitions=1) for n, g in plan.gradients.items()}
    return dataclasses.replace(plan, gradients=grads)


def size_rule(like: Plan, compressor: str, params: Mapping[str, Any],
              sizes: Mapping[str, int], n: int) -> Plan:
    """``like`` with every gradient as the engine's default size rule decides it
    (``SizeRule()``: what ``plan=None`` runs), compressed by ``compressor``: the layout a
    user gets without any planner. Every decision is written out, naming its
    compressor, so the plan compares (``plan_key``) and runs as it was priced."""
    from ..cost_model.plan import GradientPlan, SizeRule

    rule = SizeRule()
    grads = {}
    for name, nbytes in sizes.items():
        d = rule.decide(int(nbytes), n)
        grads[name] = (GradientPlan(True, d.partitions, compressor=compressor,
                                    params=dict(params)) if d.compress
                       else GradientPlan(False, d.partitions))
    return dataclasses.replace(like, compressor=compressor, params=dict(params), rule=rule,
                               gradients=grads)


def alternatives(plan_at: Callable[[Link], Plan], price: Callable[[Plan], Optional[float]],
                 link: Link, current: Plan, *, within: float = 2.0,
                 scales: Sequence[float] = SCALES,
                 recalled: Sequence[Tuple[str, Plan]] = (),
                 defaults: Sequence[Tuple[str, Plan]] = ()) -> List[Tuple[str, Plan]]:
    """The plans an exploration tries on ``link`` (item 1 of the module's description).

    Args:
        plan_at: the cost model's best plan on a link (the planner's, priced on
            the profile moved to that link).
        price: a plan's predicted seconds on ``link`` (None: not priceable).
        link: the agreed link.
        current: the plan in force (never a candidate).
        within: drop a candidate priced more than this many times the best.
        scales: bandwidth factors the model's plan is also made at.
        recalled: (why, plan) pairs measured fastest before on a link like this one
            (``OnlinePlanner.kept``): tried first, whatever the model prices them
            at, since a measurement outranks the model that mispriced them.
        defaults: (why, plan) pairs of the engine's default layout (``size_rule``),
            one per candidate compressor: priced and filtered like the model's.

    Returns:
        (why, plan) pairs, distinct and unlike ``current``: the recalled ones, then the
        model's cheapest predicted first; ``why`` says which plan it is ("kept at
        step 5", "model", "model at 0.25x bandwidth", "nothing compressed", "model,
        one partition each").
    """
    made = [("model", plan_at(link))]
    made += [(f"model at {s:g}x bandwidth", plan_at(Link(link.latency, link.bandwidth * s)))
             for s in scales]
    made.append(("nothing compressed", uncompressed(made[0][1])))
    made.append(("model, one partition each", one_partition(made[0][1])))
    made += list(defaults)
    seen = {plan_key(current)}
    first: List[Tuple[str, Plan]] = []
    for why, plan in recalled:
        key = plan_key(plan)
        if key not in seen:
            seen.add(key)
            first.append((why, plan))
    out: List[Tuple[float, str, Plan]] = []
    for why, plan in made:
        key = plan_key(plan)
        if key in seen:
            continue
        seen.add(key)
        t = price(plan)
        if t is not None and math.isfinite(t):
            out.append((t, why, plan))
    if not out:
        return first
    best = min(t for t, _, _ in out)
    cur = price(current)
    floor = min(best, cur) if cur is not None and math.isfinite(cur) else best
    return first + [(why, plan) for t, why, plan in sorted(out, key=lambda x: x[0])
                    if t <= within * floor]


class Exploration:
    """One exploration's state: the plans still to try, and what each measured.

    Args:
        before: the plan in force when it started.
        t_before: its agreed median step time (seconds), or None (then it is
            measured after the candidates, in a window of its own).
        candidates: (why, plan) pairs to try, in order.
        steps: steps each candidate runs.
        start: the step at which it started (the first candidate runs from here).
        margin: a candidate must beat ``before`` by more than this fraction.
        reason: what started it ("link moved", "step time moved"), for the logs.
        link: the link it decides for (kept as the decision's link).

    Attributes:
        at: the step at which the running trial ends (``next_plan`` sets it).
        results: (why, plan, seconds) for ``before`` and every candidate tried.
    """

    def __init__(self, before: Any, t_before: Optional[float],
                 candidates: Sequence[Tuple[str, Any]], *, steps: int, start: int,
                 margin: float, reason: str = "", link: Any = None) -> None:
        self.before, self.t_before = before, t_before
        self._queue = list(candidates)
        self.steps, self.start, self.margin, self.reason = int(steps), int(start), margin, reason
        self.link = link
        self.at = self.start
        self.results: List[Tuple[str, Any, float]] = []
        if t_before is not None and math.isfinite(t_before):
            self.results.append(("in force", before, float(t_before)))
        elif self._queue:  # not timed yet: it is measured last, like the candidates
            self._queue.append(("in force", before))
        self._running: Optional[Tuple[str, Any]] = None

    @property
    def running(self) -> Optional[Tuple[str, Any]]:
        """The candidate being tried, or None."""
        return self._running

    def next_plan(self) -> Optional[Tuple[str, Any]]:
        """The next candidate to try (and the trial's end step, ``at``), or None when
        every candidate was tried."""
        if not self._queue:
            self._running = None
            return None
        self._running = self._queue.pop(0)
        self.at += self.steps
        return self._running

    def record(self, seconds: Optional[float]) -> None:
        """The agreed median step time of the running candidate's window (None or NaN:
        a rank had no times; the candidate is not chosen)."""
        if self._running is None:
            raise RuntimeError("no candidate is running (call next_plan first)")
        if seconds is not None and math.isfinite(seconds):
            why, plan = self._running
            self.results.append((why, plan, float(seconds)))

    def choose(self) -> Tuple[str, Any, Optional[float]]:
        """The plan to keep: the fastest measured; the plan in force before wins unless
        another measured faster by more than ``margin``. (why, plan, seconds)."""
        mine = [t for why, _, t in self.results if why == "in force"]
        if not mine:  # the plan in force has no time: nothing to compare with
            return "in force", self.before, None
        why, plan, t = min(self.results, key=lambda r: r[2])
        if why != "in force" and t < mine[0] * (1 - self.margin):
            return why, plan, t
        return "in force", self.before, mine[0]

    def summary(self) -> List[Dict[str, Any]]:
        """Every plan measured: why it was tried and its agreed step seconds."""
        return [{"why": why, "step_s": t} for why, _, t in self.results]
