"""``plan="adaptive"`` from a face's own first plan: ``AdaptiveStart(settings, start)``.

``plan="adaptive"`` (``tuning/online.py``) starts where ``plan="auto"`` would
(the cost model's plan on a profile taken at start-up, or on
``Adaptive(profile=...)``). A face whose own rules make the first plan
(BytePS's knobs, ``hipress_like.byteps``) passes ``plan=AdaptiveStart(settings,
start)`` instead, and everything else of ``plan="adaptive"`` stays as it is:

1. ``engine_builder.resolve_plan`` passes it through and ``adaptive_settings``
   returns its ``settings``, so the face's online planner is built and run as
   for ``plan="adaptive"``;
2. ``engine_builder.build_engine`` gives the engine ``start`` (a ``Plan``, a
   plan source called once in ``register``, or None when nothing is
   compressed) where ``plan="adaptive"`` would give it ``tuning.online.source_for``;
3. ``OnlinePlanner.for_engine`` then prices from the start plan's
   ``meta["profile"]`` (unless ``settings.profile`` gives one) over its
   ``meta["candidates"]`` (labels of that profile's compressors), so a start
   plan must carry them.

Example (what ``hipress_like.byteps.torch.DistributedOptimizer(plan="adaptive")``
builds; ``knobs_start`` is its plan source)::

    plan = AdaptiveStart(Adaptive(check_every=20), knobs_start(knob_plan, "ef", None))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AdaptiveStart"]


@dataclass(frozen=True)
class AdaptiveStart:
    """``plan="adaptive"`` whose first plan is ``start`` (module docstring).

    Attributes:
        settings: the ``tuning.online.Adaptive`` knobs of the re-planning.
        start: the first plan: a ``Plan``, a plan source
            (``source(transport, sizes, config) -> Plan``, called in ``register``),
            or None (nothing compressed: nothing to adapt).

    Raises:
        TypeError: ``settings`` is not an ``Adaptive``, or ``start`` is none of those.
    """

    settings: Any
    start: Any

    def __post_init__(self) -> None:
        from ..cost_model.plan import Plan
        from ..tuning.online import Adaptive

        if not isinstance(self.settings, Adaptive):
            raise TypeError(f"AdaptiveStart(settings=...) takes an Adaptive, found "
                            f"{type(self.settings).__name__}")
        if not (self.start is None or isinstance(self.start, Plan) or callable(self.start)):
            raise TypeError(f"AdaptiveStart(start=...) takes a Plan, a plan source (a "
                            f"callable) or None, found {type(self.start).__name__}")
