"""``plan="adaptive"`` on the BytePS-style faces: BytePS's knobs start, the online planner re-plans.

BytePS plans with two knobs: gradients from ``BYTEPS_MIN_COMPRESS_BYTES`` up
are compressed by the compressor ``compression_params`` names, in partitions
of ``BYTEPS_PARTITION_BYTES``. With ``plan="adaptive"`` (or an ``Adaptive``)
that plan is where the job starts, and the engine-level online planner
(``tuning/online.py``, as on ``hipress_like.torch.DistributedOptimizer``)
re-plans from there at step boundaries, every rank at the same step:

1. **Candidate.** The compressor ``compression_params`` names, with its
   parameters (``k`` as a ratio, the error-feedback wrapper of ``ef``), is the
   one candidate the cost model prices per gradient (compress it or not, and
   into how many partitions); the online planner never picks another one.
2. **Profile.** Its curves come from ``Adaptive(profile=...)`` (a
   ``hipress-profile profile`` file or a ``Profile``), matched by compressor
   name and parameters (``candidate_of``, at construction: a profile without
   them is an error saying how to make one); without a profile, the start
   plan's source profiles that compressor inside ``register`` as
   ``plan="auto"`` profiles it (``tuning.auto.auto_plan``: its encode/decode
   curves, the link, the engine's own timings; rank 0's figures on every
   rank) and keeps the profile, not ``plan="auto"``'s plan.
3. **Start.** ``knobs_start``, the plan source, returns the knobs' plan with
   the profile and the candidate in its ``meta`` (what
   ``OnlinePlanner.for_engine`` reads); the face passes it as
   ``adapters.adaptive_start.AdaptiveStart(settings, knobs_start(...))``.

Refused at construction, with the fix: an integer ``k`` (top-k/random-k
keeping a count of elements per gradient, a different ratio for every
gradient, where the cost model prices one configuration), and a ``plan=``
other than None, "adaptive" or an ``Adaptive`` (BytePS's knobs plan).

Example::

    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression_params={"compressor": "onebit",
                                                       "ef": "vanilla"},
                                   plan=bps.Adaptive(check_every=20))
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional, Sequence, Tuple

from ..adapters.adaptive_start import AdaptiveStart
from ..adapters.compression import CompressionSpec
from ..adapters.engine_builder import adaptive_settings
from ..cost_model.plan import Plan
from ..cost_model.profile import Profile
from ..tuning.online_pricing import compressor_key

__all__ = ["settings_of", "candidate_of", "knobs_start", "start"]

log = logging.getLogger(__name__)

_KNOBS = "BYTEPS_MIN_COMPRESS_BYTES, BYTEPS_PARTITION_BYTES"


def settings_of(plan: Any, face: str, use: str) -> Any:
    """The ``Adaptive`` settings of a BytePS face's ``plan=`` argument, or None for
    ``plan=None`` (BytePS's knobs, fixed).

    Args:
        plan: the face's ``plan=``.
        face: the face's name; use: the face to take any other plan, for the message.

    Raises:
        ValueError: any other plan (BytePS's knobs plan), saying what to do.
    """
    if plan is None:
        return None
    settings = adaptive_settings(plan)
    if settings is None:
        raise ValueError(f"{face} plans from BytePS's knobs ({_KNOBS}); expected plan=None, "
                         f"found {plan!r}; set the knobs, or use {use}; plan='adaptive' (or "
                         f"an Adaptive) re-plans from the knobs' plan while training runs")
    return settings


def candidate_of(settings: Any, spec: CompressionSpec, count: Optional[int]
                 ) -> Tuple[str, Optional[Profile]]:
    """The candidate the online planner prices and the profile it prices it on
    (None: profiled at start by ``knobs_start``). Checked at construction.

    Args:
        settings: the ``Adaptive`` settings.
        spec: the compressor (``compression_params`` mapped, or ``compression=``).
        count: BytePS's ``k`` as a count of elements (``Mapped.count``), or None.

    Returns:
        (label, profile): the label of the compressor's curves in the profile
        given by ``settings.profile``, or ``spec.name`` and None without one.

    Raises:
        ValueError: an integer ``k``, or a given profile without curves for the
            compressor with these parameters (the message lists what it has).
    """
    if count is not None:
        raise ValueError(f"plan='adaptive' prices one configuration of the compressor for "
                         f"every gradient, and compression_params['k'] = {count} keeps a count "
                         f"of elements (another ratio for every gradient); pass 'k' as a ratio "
                         f"in (0, 1) (e.g. {{'compressor': {spec.name!r}, 'k': 0.01}}), or "
                         f"plan=None to keep BytePS's knobs plan")
    profile = settings.load_profile()
    if profile is None or spec.name == "identity":
        return spec.name, profile
    want = compressor_key(spec.name, spec.params)
    for label, cp in sorted(profile.compressors.items()):
        if compressor_key(cp.name, cp.params) == want:
            return label, profile
    have = ", ".join(f"{k}: {c.name}{dict(c.params)}" for k, c in
                     sorted(profile.compressors.items())) or "none"
    raise ValueError(f"Adaptive(profile=...) has no curves for the compressor "
                     f"compression_params chooses, {spec.name}{dict(spec.params)} (it has "
                     f"{have}); profile that one (hipress_like.tuning.profiler."
                     f"profile_compressor({spec.name!r}, {dict(spec.params)!r}) in a Profile), "
                     f"or leave profile= out to profile it at start")


class knobs_start:  # noqa: N801 - a callable used like a function, as tuning's auto_plan
    """The plan source of ``plan="adaptive"`` on a BytePS face: BytePS's knobs' plan,
    carrying the profile and the candidate the online planner prices with.

    Called once in ``register`` (collective). Without a given profile, and
    with more than one rank, it profiles the candidate as ``plan="auto"``
    does (``auto_plan``; every rank returns rank 0's profile) and keeps that
    profile, starting on the knobs' plan all the same. On one rank there is
    nothing to re-plan: the knobs' plan is returned as it is.

    Args:
        plan: the knobs' plan (``Knobs.rule()`` with the compressor).
        label: the candidate's label (``candidate_of``).
        profile: the given profile, or None.
    """

    def __init__(self, plan: Plan, label: str, profile: Optional[Profile] = None) -> None:
        self.plan = plan
        self.label = label
        self.profile = profile

    def __call__(self, transport: Any, sizes: Mapping[str, int], config: Any,
                 shapes: Optional[Mapping[str, Sequence[int]]] = None) -> Plan:
        profile = None if self.profile is None else self.profile.to_dict()
        if profile is None and transport.size > 1:
            from ..tuning.auto import auto_plan

            params = dict(self.plan.params, compressor=self.plan.compressor)
            fixed = auto_plan(candidates={self.label: params})(transport, sizes, config,
                                                               shapes=shapes)
            profile = fixed.meta["profile"]  # rank 0's, broadcast with the plan
            log.info("plan='adaptive': profiled %s at start; starting on BytePS's knobs "
                     "plan", self.label)
        meta = dict(self.plan.meta, byteps="knobs", candidates=[self.label])
        if profile is not None:
            meta["profile"] = profile
        return dataclasses.replace(self.plan, meta=meta)

    def __repr__(self) -> str:
        return f"knobs_start(label={self.label!r}, profile={'given' if self.profile else None})"


def start(settings: Any, plan: Optional[Plan], label: str,
          profile: Optional[Profile]) -> AdaptiveStart:
    """The face's ``plan=`` for the engine: ``plan="adaptive"`` starting on the knobs'
    ``plan`` (None: nothing compressed, nothing to adapt)."""
    return AdaptiveStart(settings, None if plan is None else knobs_start(plan, label, profile))
