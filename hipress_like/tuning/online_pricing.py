"""The plans ``plan="adaptive"`` prices and starts from: the cost model's best plan
on a profile, a plan's predicted synchronisation time, and the plan source
``register`` calls (``source_for``).

Pricing is per gradient (``price_plan``): the planner of the gradient's
compressor prices its Eq. 2 time at its K, an uncompressed gradient its Eq. 1
time (HiPress Sec. 3.3, ``cost_model.planner``).
"""
from __future__ import annotations

import json
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

from ..cost_model.plan import Plan
from ..cost_model.planner import Planner, plan_per_gradient
from ..cost_model.profile import Profile
from .online_settings import Adaptive

__all__ = ["profile_plan", "price_plan", "best_plan", "adaptive_plan", "source_for",
           "compressor_key", "planners_for"]


def compressor_key(name: str, params: Mapping[str, Any]) -> Tuple[str, str]:
    """What makes two compressors the same: the name and the parameters, as JSON."""
    return name, json.dumps(dict(params), sort_keys=True)


def planners_for(profile: Profile, labels: Sequence[str], n: int, strategy: str,
                 raw_collective: bool) -> List[Planner]:
    """One cost-model ``Planner`` per compressor label of ``profile``."""
    return [Planner(profile, c, n, strategy, raw_collective=raw_collective) for c in labels]


def profile_plan(profile: Profile, labels: Sequence[str], sizes: Mapping[str, int], n: int,
                 strategy: str, raw_collective: bool = True,
                 meta: Optional[Mapping[str, Any]] = None) -> Plan:
    """The cost model's best plan for ``sizes`` on ``profile`` (its link as it is),
    per gradient over the compressors ``labels`` (``plan_per_gradient``)."""
    planners = planners_for(profile, labels, n, strategy, raw_collective)
    if len(planners) == 1:
        return planners[0].plan(dict(sizes), meta=meta)
    return plan_per_gradient(planners, dict(sizes), meta=meta)


def price_plan(plan: Plan, planners: Sequence[Planner], sizes: Mapping[str, int], n: int
               ) -> Optional[float]:
    """Predicted seconds of one synchronisation of every gradient under ``plan``: per
    gradient, the planner of its compressor's ``t_cpr`` at its K, or ``t_orig``
    (the strategy's workflow: a top-k entry's named collective is priced as PS
    or Ring, alike for the plans compared).

    Returns:
        The sum, or None when a gradient's compressor is not among the planners.
    """
    by_key = {compressor_key(p.cp.name, p.cp.params): p for p in planners}
    total = 0.0
    for name, nbytes in sizes.items():
        dec = plan.decide(name, nbytes, n)
        k = max(1, int(dec.partitions))
        if not dec.compress:
            total += planners[0].t_orig(float(nbytes), k)
            continue
        comp, params = plan.compressor_of(dec)
        p = by_key.get(compressor_key(comp, params))
        if p is None:
            return None
        total += p.t_cpr(float(nbytes), k)
    return total


def best_plan(planners: Sequence[Planner], sizes: Mapping[str, int],
              meta: Mapping[str, Any], fit_rule: bool) -> Plan:
    """The cost model's best plan over the candidates' planners (``plan_per_gradient``;
    one candidate: its planner's plan)."""
    if len(planners) > 1:
        return plan_per_gradient(planners, sizes, meta=meta, fit_rule=fit_rule)
    return planners[0].plan(sizes, meta=meta, fit_rule=fit_rule)


class adaptive_plan:  # noqa: N801 - a callable used like a function, as auto_plan
    """The plan source of ``plan="adaptive"`` with a given profile: the cost model's
    best plan on the profile's own link, planned inside ``register`` without
    profiling (every rank plans from the same file, so every rank gets the same
    plan; the engine checks it). Without a profile the front ends use
    ``auto_plan``, whose measured profile the online planner then reuses.

    Args:
        profile: the ``Profile``.
        labels: compressors to choose from per gradient (default: all the
            profile's).
    """

    def __init__(self, profile: Profile, labels: Optional[Sequence[str]] = None) -> None:
        self.profile = profile
        self.labels = list(labels) if labels else sorted(profile.compressors)

    def __call__(self, transport: Any, sizes: Mapping[str, int], config: Any) -> Plan:
        return profile_plan(self.profile, self.labels, sizes, transport.size, config.strategy,
                            config.raw_collective,
                            meta={"adaptive": "start", "candidates": self.labels,
                                  "profile": self.profile.to_dict()})

    def __repr__(self) -> str:
        return f"adaptive_plan(labels={self.labels!r})"


def source_for(settings: Union[Adaptive, str], candidates: Any = None) -> Any:
    """The plan source ``register`` calls for ``plan="adaptive"``: ``adaptive_plan``
    on a given profile, else ``auto_plan`` (profiles at start-up)."""
    settings = Adaptive() if isinstance(settings, str) else settings
    profile = settings.load_profile()
    if profile is not None:
        return adaptive_plan(profile, list(candidates) if candidates else None)
    from .auto import auto_plan

    return auto_plan(candidates=candidates)
