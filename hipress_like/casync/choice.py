"""What each gradient gets: the plan's decision and the compressor instance.

The engine asks three questions per gradient when it fixes its layout
(``layout.build_layout``): does the plan compress it, into how many
partitions (``decide``), with which compressor instance
(``compressor_for``), and which master compressor encodes its aggregate on
the way back (``back_for``: None unless the plan entry or the config names
one, Natural Compression's bidirectional Alg. 1). Instances are built once
per distinct compressor and parameters and shared by the gradients that use
them; each one's error-feedback wrapping follows
``EngineConfig.error_feedback``.

A compressing decision may also name how its payloads travel
(``GradientPlan.collective``, else ``EngineConfig.collective``). "auto"
is the flexible-communication paper's selection (Sec. 3-D, Eq. 5a-5c;
``cost_model.collectives.select_collective``) made per gradient: for a
top-k gradient of M bytes at ratio c among N ranks, with alpha and beta
measured on this very transport at ``register`` (``measure``, by the
config's link source: ring steps for beta, one-way steps for the tree
terms' ``beta_one_way``, the refinement ``cost_model.collectives``
explains), it becomes
an Allgather of top-k values and indices (``topk``, ``collective=
"allgather"``: LWTopk), or AR-Topk (``star_topk``, or ``var_topk`` when
that is the compressor) whose values are summed by a ring ("ring": ART-Ring)
or a tree ("tree": ART-Tree). Each pick is logged with its predicted costs
(``selected``).

The plan comes from ``EngineConfig.plan``: a ``Plan``, a plan file, None
(HiPress's size rule), or a *plan source* called once, collectively,
inside ``register`` (``fix_plan``): ``source(transport, sizes, config) ->
Plan``, where ``sizes`` maps gradient names to bytes in registration order
(a source that takes a ``shapes`` keyword also gets {name: shape}).
The engine never imports a planner: the front ends turn ``plan="auto"``
into ``hipress_like.tuning.auto_plan(...)``.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import time
from typing import Any, Dict, Mapping, Optional, Tuple

from .. import compressors as _comp
from ..compressors.base import Compressor
from ..compressors.wrappers.error_feedback import needs_error_feedback, with_error_feedback
from ..cost_model.collectives import TOPK_FAMILY, ratio_of, select_decision, topk_costs
from ..cost_model.model import Link
from ..cost_model.plan import GradientPlan, Plan, SizeRule
from .config import EngineConfig
from .transport.base import Transport

__all__ = ["Choice", "build_compressor", "build_master"]

_log = logging.getLogger(__name__)


def build_compressor(spec: Any, params: Mapping[str, Any], error_feedback: Any) -> Compressor:
    """A compressor from a registry name or an instance (wrapped ones included).

    Args:
        spec: a registered name or a ``Compressor`` instance (then ``params``
            must be empty).
        params: the compressor's parameters.
        error_feedback: "auto" wraps biased single-round compressors that keep
            no memory of their own (onebit, TBQ, top-k, ...) in error feedback;
            True wraps any compressor that keeps no memory (an ErrorFeedback
            instance is never wrapped twice); False never wraps.

    Raises:
        ValueError: an instance with parameters, or a multi-round compressor
            whose payloads cannot be merged.
    """
    if isinstance(spec, Compressor):
        if params:
            raise ValueError(f"compressor instance {spec!r} was given with parameters "
                             f"{dict(params)}; pass a name with parameters, or the instance alone")
        comp = spec
    else:
        comp = _comp.get(spec, **dict(params))
    caps = comp.capabilities
    wrap = needs_error_feedback(comp) if error_feedback == "auto" else error_feedback
    if wrap:
        comp = with_error_feedback(comp)  # never wraps twice: declared keeps_memory
    if caps.rounds > 1 and not caps.aggregatable:
        raise ValueError(f"compressor {comp.name!r} has {caps.rounds} rounds but its "
                         "payloads are not aggregatable; CaSync cannot run it")
    return comp


def build_master(spec: Any, params: Mapping[str, Any], error_feedback: Any) -> Compressor:
    """A master compressor (Natural Compression Alg. 1's C_M), checked at setup.

    The aggregator encodes the aggregate with it alone, once per partition:
    it must be a single-round compressor; its error feedback follows the
    same rule as the worker's (the aggregator's residual is its own site).

    Raises:
        ValueError: a multi-round compressor (its rounds need every rank),
            or an unknown name / bad parameters.
    """
    comp = build_compressor(spec, params, error_feedback)
    if comp.capabilities.rounds > 1:
        raise ValueError(f"compressor {comp.name!r} cannot encode an aggregate as a master "
                         f"compressor: it has {comp.capabilities.rounds} rounds, which need "
                         "every rank; use a single-round compressor for compression_back")
    return comp


class Choice:
    """The plan and the compressor instances of one engine.

    Args:
        config: the engine's settings (compressor, params, plan, error_feedback).
        size: the world size.

    Attributes:
        plan: the fixed ``Plan``, or None (the size rule, or not yet fixed).
        default: the compressor gradients get when the plan does not name one.
    """

    def __init__(self, config: EngineConfig, size: int):
        self.config = config
        self.size = size
        self.plan: Optional[Plan] = None
        if isinstance(config.plan, Plan):
            self.plan = config.plan
        elif not (config.plan is None or callable(config.plan)):
            self.plan = Plan.load(config.plan)
        name, params = config.compressor, dict(config.params)
        if name is None:
            name = self.plan.compressor if self.plan else "onebit"
            if self.plan and not params:
                params = dict(self.plan.params)
        self.default = build_compressor(name, params, config.error_feedback)
        self._instances: Dict[Any, Compressor] = {}
        self.link: Optional[Link] = None  # measured for collective="auto" (``measure``)
        self.link_one_way: Optional[Link] = None  # the same with one-way steps
        self.selected: Dict[str, str] = {}  # gradient -> the selector's pick
        self._not_selected: set = set()  # compressors "auto" left alone (logged once)
        self.default_back: Optional[Compressor] = None
        if config.compressor_back is not None:
            self.default_back = build_master(config.compressor_back, config.params_back,
                                             config.error_feedback)

    def saves_no_bytes(self) -> bool:
        """The default compressor sends values as they are (category "none": identity)."""
        return self.default.capabilities.category == "none"

    def decide(self, name: str, nbytes: int) -> GradientPlan:
        """The plan's decision for gradient ``name`` of ``nbytes`` bytes, with its
        collective resolved (the config's default where the entry names none;
        "auto" turned into the selector's pick)."""
        dec = self._decide(name, nbytes)
        if not dec.compress or self.size < 2:
            return dec
        coll = dec.collective or self.config.collective
        if coll == "auto":
            return self._select(name, nbytes, dec, explicit=dec.collective == "auto")
        if coll != dec.collective:
            dec = dataclasses.replace(dec, collective=coll)
        return dec

    def _decide(self, name: str, nbytes: int) -> GradientPlan:
        if self.plan is not None:
            return self.plan.decide(name, nbytes, self.size)
        dec = SizeRule().decide(nbytes, self.size)
        if self.saves_no_bytes():
            # the rule's "compress" would only send the raw bytes through PS/Ring
            # instead of the allreduce lane (the path of Horovod's default,
            # Compression.none). A Plan can still ask for it.
            dec = GradientPlan(compress=False, partitions=dec.partitions)
        return dec

    def needs_link(self) -> bool:
        """Some gradient may take collective="auto" (the selector needs alpha, beta)."""
        if self.size < 2:
            return False
        if self.config.collective == "auto":
            return True
        return self.plan is not None and any(g.collective == "auto"
                                             for g in self.plan.gradients.values())

    def measure(self, transport: Transport) -> None:
        """Measure alpha and beta of ``transport`` when the selector will need them
        (collectively, inside ``register``: every rank has the same settings)."""
        if self.link is None and self.needs_link():
            t0 = time.perf_counter()
            if self.config.link_source is None:
                raise ValueError("collective='auto' selects from alpha and beta measured on "
                                 "this transport, but the engine was given no link source "
                                 "(EngineConfig.link_source is None); pass link_source="
                                 "hipress_like.tuning.collective_links, or name the collective")
            self.link, self.link_one_way = self.config.link_source(transport,
                                                                   self.config.timeout)
            _log.info("rank %d: link for collective='auto' measured in %.2f s: alpha %.3g s, "
                      "%.3g Gbit/s (ring steps), %.3g Gbit/s (one-way steps)", transport.rank,
                      time.perf_counter() - t0, self.link.alpha, 8e-9 / self.link.beta,
                      8e-9 / self.link_one_way.beta)

    def _select(self, name: str, nbytes: int, dec: GradientPlan,
                explicit: bool) -> GradientPlan:
        """collective="auto" for one gradient: Eq. 5a-5c's pick, as a decision."""
        comp = self.compressor_for(dec)
        inner = getattr(comp, "inner", comp)
        if self.link is None:
            raise RuntimeError("collective='auto' needs the link measured first "
                               "(Choice.measure, called by Engine.register)")
        a, b = self.link.alpha, self.link.beta
        bo = self.link_one_way.beta if self.link_one_way is not None else None
        params = inner.params()
        got = select_decision(dec, nbytes, self.size, a, b, bo, inner.name, params)
        if got is None:
            if explicit:
                raise ValueError(f"gradient {name!r}: collective='auto' chooses how top-k "
                                 f"travels (Allgather, ART-Ring, ART-Tree), but its compressor "
                                 f"is {inner!r}; use one of {', '.join(TOPK_FAMILY)} with no "
                                 "parameter but its ratio, or name the collective")
            if repr(inner) not in self._not_selected:  # once per compressor, not per gradient
                self._not_selected.add(repr(inner))
                _log.info("collective='auto' leaves %r on the strategy's workflow: the "
                          "selection chooses among top-k collectives (%s, ratio only)",
                          inner, ", ".join(TOPK_FAMILY))
            return dataclasses.replace(dec, collective=None)
        self.selected[name], new = got
        c = ratio_of(params)
        _log.info("%s (%d bytes, c=%g, N=%d): %s; predicted ms %s", name, nbytes, c,
                  self.size, got[0], {k: round(v * 1e3, 3) for k, v in
                                      topk_costs(float(nbytes), self.size, a, b, c,
                                                 bo).items()})
        return new

    def compressor_for(self, dec: GradientPlan) -> Compressor:
        """The instance for a decision that compresses: the one its plan entry names
        (plan format 2), else the default; one instance per distinct compressor
        and parameters, shared by the gradients that use it."""
        if dec.compressor is None:
            return self.default
        key = (dec.compressor, json.dumps(dict(dec.params), sort_keys=True))
        comp = self._instances.get(key)
        if comp is None:
            comp = build_compressor(dec.compressor, dec.params, self.config.error_feedback)
            self._instances[key] = comp
        return comp

    def back_for(self, dec: GradientPlan, worker: Compressor) -> Optional[Compressor]:
        """The master compressor of a compressing decision (its plan entry's, else the
        config's), or None when the aggregate goes back with the worker's compressor.

        Raises:
            ValueError: a master compressor for a multi-round worker compressor
                (its rounds are reduced, not re-encoded at an aggregator).
        """
        if dec.compressor_back is not None:
            key = ("back", dec.compressor_back,
                   json.dumps(dict(dec.params_back), sort_keys=True))
            back = self._instances.get(key)
            if back is None:
                back = build_master(dec.compressor_back, dec.params_back,
                                    self.config.error_feedback)
                self._instances[key] = back
        else:
            back = self.default_back
            if back is not None and worker.capabilities.rounds > 1 and worker is not self.default:
                return None  # a plan's multi-round choice: its rounds are reduced, not re-encoded
        if back is not None and worker.capabilities.rounds > 1:
            raise ValueError(f"a master compressor ({back.name}) re-encodes an aggregate, "
                             f"but {worker.name} has {worker.capabilities.rounds} rounds "
                             "whose payloads are reduced, not re-encoded; drop "
                             "compression_back for it or use a single-round compressor")
        return back

    def fix_plan(self, transport: Transport, sizes: Mapping[str, int],
                 shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> None:
        """Call the plan source, if any, collectively (inside ``register``).

        A source whose signature takes ``shapes`` also gets the gradients'
        shapes ({name: shape}): a compressor's cost can depend on the shape as
        well as the bytes (PowerSGD's matrix view, ``compressors.powersgd``).
        """
        source = self.config.plan
        if self.plan is not None or source is None:
            return
        if self.saves_no_bytes():
            # nothing to decide: every gradient takes the allreduce lane
            _log.info("plan='auto' with %s: nothing to compress, no profile", self.default.name)
            return
        t0 = time.perf_counter()
        kwargs = {"shapes": dict(shapes)} if shapes is not None and _takes(source, "shapes") \
            else {}
        plan = source(transport, dict(sizes), self.config, **kwargs)
        if not isinstance(plan, Plan):
            raise TypeError(f"the plan source {source!r} returned {type(plan).__name__}; a "
                            "plan source must return a hipress_like.cost_model.Plan")
        self.plan = plan
        _log.info("rank %d: plan fixed in %.1f s", transport.rank, time.perf_counter() - t0)


def _takes(fn: Any, name: str) -> bool:
    """Whether callable ``fn`` accepts keyword ``name`` (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
