"""Building a CaSync engine for the PyTorch front ends (optimizer and DDP hook).

One place turns the user's ``compression=``, ``strategy=`` and ``plan=``
into an ``EngineConfig``, opens a transport of its own and registers the
gradients. It also decides each gradient's wire dtype: fp16/bf16 gradients
are reduced in float32 (the compressors' maths and the averaging are done
at full precision, then cast back), float32/float64 go as they are, and
anything else is refused with a message. ``online_planner`` gives a face
that re-plans (``plan="adaptive"``) the planner to call after each step.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ..cost_model.plan import STRATEGIES
from .adaptive_start import AdaptiveStart
from .compression import is_auto, resolve_compression
from .runtime import _require, check_timeout, default_timeout, engine_transport

__all__ = ["build_engine", "close_engine", "device_type_of", "EngineHolder", "wire_dtype",
           "resolve_plan", "adaptive_settings", "online_planner", "refuse_adaptive",
           "STRATEGIES"]

log = logging.getLogger(__name__)

# Tests may swap the engine class (``factory(transport, config)``); None: the real one.
_engine_factory: Optional[Callable[[Any, Any], Any]] = None


def wire_dtype(dtype: torch.dtype, name: str) -> torch.dtype:
    """The dtype gradient ``name`` is reduced in.

    Raises:
        TypeError: a non-floating or complex parameter.
    """
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32  # reduce and compress at full precision, cast back after
    if dtype in (torch.float32, torch.float64):
        return dtype
    raise TypeError(f"parameter {name!r} has dtype {dtype}; DistributedOptimizer reduces "
                    "float32/float64 gradients (fp16/bf16 are reduced in float32). "
                    "Keep complex or integer tensors out of the optimizer's param groups, or "
                    "store complex parameters as real views (torch.view_as_real)")


def resolve_plan(plan: Any) -> Any:
    """``"auto"``, ``None``, a ``Plan`` or a path to a plan JSON file -> engine argument
    (``"adaptive"`` -> an ``Adaptive``; an ``Adaptive`` or ``AdaptiveStart`` as it is).

    Raises:
        hipress_like.cost_model.PlanError: an unreadable or invalid plan file.
        TypeError: anything else.
    """
    from ..cost_model import Plan
    from ..tuning.online import Adaptive

    if plan is None or isinstance(plan, (Plan, AdaptiveStart)) or plan == "auto":
        return plan  # an AdaptiveStart: a face's own first plan (adaptive_start.py)
    if plan == "adaptive":
        return Adaptive()
    if isinstance(plan, Adaptive):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    raise TypeError(f"plan must be 'auto', 'adaptive', hpt.Adaptive(...), None, a Plan or a "
                    f"path to a plan file, found {type(plan).__name__}")


def adaptive_settings(plan: Any) -> Any:
    """The ``Adaptive`` settings of a ``plan=`` argument ("adaptive", an instance, or
    an ``AdaptiveStart``'s), else None (the option is off: nothing of
    ``tuning/online.py`` runs)."""
    from ..tuning.online import Adaptive

    if isinstance(plan, AdaptiveStart):
        return plan.settings
    if isinstance(plan, Adaptive):
        return plan
    return Adaptive() if isinstance(plan, str) and plan == "adaptive" else None


def refuse_adaptive(plan: Any, face: str,
                    expected: str = "plan='auto', None, a Plan or a plan file",
                    use: str = "plan='auto' (planned once at start) on this face") -> None:
    """Refuse ``plan="adaptive"`` (or an ``Adaptive``) on a face that does not re-plan.

    A face that runs the online planner after each step (``tuning/online.py``:
    PyTorch's and TensorFlow's optimizers, the TensorFlow tape, the Gluon
    trainer, the BytePS-style faces; ``online_planner`` builds it) takes the
    option; one that does not (the DDP comm hook)
    would keep its first plan and silently not adapt, so it calls this where it
    is built, before any transport opens.

    Args:
        plan: the face's ``plan=`` argument.
        face: the face's name, for the message.
        expected: the plans the face takes; use: what to pass there instead.

    Raises:
        ValueError: naming the face, what it takes, what was found and what to use.
    """
    if adaptive_settings(plan) is None:
        return
    raise ValueError(f"{face}: plan='adaptive' re-plans at step boundaries, which this face "
                     f"does not do; expected {expected} here, found {plan!r}; use {use}, or "
                     f"hipress_like.torch.DistributedOptimizer(..., plan='adaptive')")


def online_planner(engine: Any, plan: Any, snapshot: Any = None) -> Any:
    """The ``tuning.online.OnlinePlanner`` that re-plans ``engine`` for a face's ``plan=``
    argument, or None: the option is off, or there is nothing to adapt (one rank,
    nothing compressed; logged by ``OnlinePlanner.for_engine``).

    The face calls its ``after_step(engine)`` once per synchronised step, on every
    rank at the same step, and keeps its ``state_dict(engine)`` with the
    compressor state (``load_state_dict(engine, d)`` before the compressor state
    is restored: it switches to the saved plan first). ``snapshot``: the face's
    ``(checkpoint, restore)`` of its training state in memory, for AR-Topk's
    ratio search (``tuning/ratio_search.py``), or ``ratio_search.TRAIN_ON`` when it
    cannot rewind (the search's steps train on); None: no ratio search.
    """
    settings = adaptive_settings(plan)
    if settings is None:
        return None
    from ..tuning.online import OnlinePlanner

    return OnlinePlanner.for_engine(engine, settings, snapshot=snapshot)


def build_engine(specs: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]], *,
                 compression: Any, strategy: str, plan: Any, nonfinite: str,
                 timeout: Optional[float], seed: int, compression_back: Any = None,
                 collective: Optional[str] = None, joining: Any = None,
                 online: bool = False, error_feedback: Any = "auto",
                 own_push: bool = False, device_type: str = "cpu") -> Any:
    """Open a transport, build an engine and register ``specs`` (collective).

    Args:
        specs: (name, shape, wire dtype) for every gradient, in the same
            order on every rank.
        compression: what the user passed (name, spec, Compressor or None);
            None means the plan's compressor if a ``Plan`` is given, else none;
            "auto" (with ``plan="auto"``) lets the cost model choose a
            compressor per gradient among ``tuning.auto.default_candidates``
            for ``device_type``, and none.
        strategy: "ps" or "ring".
        plan: "auto", "adaptive" or an ``Adaptive`` (planned like "auto" at
            ``register``, or from ``Adaptive.profile``; the front end then
            re-plans online, ``tuning/online.py``), None, a ``Plan`` or a path.
        nonfinite: "propagate", "skip" or "raise" (``EngineConfig.nonfinite``).
        timeout: seconds for any wait (default: ``init``'s timeout).
        seed: compressor RNG seed (identical on every rank).
        compression_back: the master compressor that encodes each aggregate
            on its way back (bidirectional compression, Natural Compression
            Alg. 1), as a name, spec or instance; None: the aggregate goes
            back encoded by the worker's compressor.
        collective: how compressed gradients travel (``EngineConfig.collective``;
            None: the strategy's PS or Ring).
        joining: the construction's ``Joining`` (``joining.py``): its
            ``ready()`` is called once every local check passed, just before
            the transport opens. None: no meeting.
        online: the caller re-plans online (``tuning.online.OnlinePlanner``
            after each step), so ``plan="adaptive"`` is accepted; the faces
            that do not are refused it rather than left on a fixed plan.
        error_feedback: ``EngineConfig.error_feedback`` ("auto", True or
            False; BytePS's face passes False when ``ef`` is not asked for).
        own_push: ``EngineConfig.own_push`` (the BytePS-style faces: the PS
            aggregator compresses its own partition too, as BytePS's server
            sees every push compressed).
        device_type: where the gradients live ("cpu", "cuda"); it picks
            ``compression="auto"``'s candidates (``tuning.auto.default_candidates``).

    Returns:
        The registered engine.
    """
    from ..cost_model import Plan

    _require()
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, found {strategy!r}")
    if nonfinite not in ("propagate", "skip", "raise"):
        raise ValueError(f"nonfinite must be 'propagate' (NaN/Inf reach every rank's "
                         f"gradients, as in DDP), 'skip' or 'raise', found {nonfinite!r}")
    plan = resolve_plan(plan)
    adaptive = adaptive_settings(plan)
    if not online:  # the faces refuse it when built; this guards any other caller
        refuse_adaptive(plan, "this front end")
    if adaptive is not None and compression_back is not None:
        raise ValueError("plan='adaptive' re-plans with one compressor each way; "
                         "compression_back is not supported with it yet: drop "
                         "compression_back, or use plan='auto'")
    candidates = None
    if is_auto(compression):
        # a compressor per gradient, chosen by the cost model among the defaults
        if plan != "auto" and adaptive is None:
            raise ValueError("compression='auto' chooses a compressor per gradient by "
                             "profiling, which needs plan='auto'; pass a compressor name with "
                             "a fixed plan, or plan='auto'")
        from ..tuning.auto import default_candidates

        candidates = default_candidates(device_type)
        name, params = "onebit", {}  # the fallback rule's compressor until the plan is fixed
    elif compression is None and isinstance(plan, Plan):
        name, params = plan.compressor, dict(plan.params)
    else:
        name, params = resolve_compression(compression)
    back, back_params = (None, {}) if compression_back is None else resolve_compression(
        compression_back)
    if back is not None and compression is None and not isinstance(plan, Plan):
        raise ValueError("compression_back sets the compressor of the aggregates; it needs a "
                         "worker compressor (compression=...)")
    timeout = check_timeout(timeout) if timeout is not None else default_timeout()
    if _engine_factory is not None:
        factory, config_cls = _engine_factory, None
    else:
        from ..casync.engine import Engine, EngineConfig

        factory, config_cls = Engine, EngineConfig
    replay = os.environ.get("HIPRESS_REPLAY", "1")
    if replay not in ("0", "1"):
        raise ValueError(f"HIPRESS_REPLAY must be 0 or 1, found {replay!r}")
    if plan == "auto":
        from ..tuning.auto import auto_plan

        plan = auto_plan(candidates=candidates)  # profiles inside register()
    elif adaptive is not None:
        from ..tuning.online import source_for

        # plans inside register(); an AdaptiveStart starts on the face's own plan
        plan = plan.start if isinstance(plan, AdaptiveStart) else source_for(adaptive, candidates)
    # collective="auto" (from the argument or a plan entry) measures links in register()
    from ..tuning.link import collective_links

    cfg_kwargs = dict(compressor=name, params=params, compressor_back=back,
                      params_back=back_params, strategy=strategy, plan=plan,
                      timeout=timeout, coordinator=True, nonfinite=nonfinite, seed=int(seed),
                      replay=replay == "1", collective=collective,
                      link_source=collective_links, error_feedback=error_feedback,
                      own_push=own_push)
    cfg = config_cls(**cfg_kwargs) if config_cls is not None else cfg_kwargs
    if joining is not None:
        joining.ready()
    transport = engine_transport(timeout)  # HIPRESS_TRANSPORT, else the launcher's
    try:
        engine = factory(transport, cfg)
        engine.register(list(specs))
    except BaseException:
        transport.close()
        raise
    log.info("engine: %d gradients, compressor=%s%s%s, strategy=%s, plan=%s", len(specs), name,
             params or "", f", back={back}{back_params or ''}" if back is not None else "",
             strategy, plan if not isinstance(plan, Plan) else "Plan")
    return engine


def specs_of(named: List[Tuple[str, torch.Tensor]]
             ) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    """(name, shape, wire dtype) per parameter, in the order given (the model's).

    The engine's collective lane fills its buckets in reverse registration
    order, as DDP does, because backward produces gradients roughly in
    reverse of the model's parameter order. Sorting by name broke that: a
    ResNet's ``stem`` sorts after its ``layers``, so the first bucket waited
    for the stem's gradient, the last one backward produces, and nothing was
    reduced during backward. Every rank must pass the same order; the
    engine checks it before any data moves.
    """
    return [(n, tuple(p.shape), wire_dtype(p.dtype, n)) for n, p in named]


def device_type_of(params: Sequence[torch.Tensor]) -> str:
    """Where a model's parameters live for ``build_engine(device_type=...)``: "cuda" when
    any is on a GPU (its gradients are), else "cpu"."""
    return "cuda" if any(p.device.type == "cuda" for p in params) else "cpu"


def close_engine(engine: Any) -> None:
    """Close ``engine`` and free the transport ``build_engine`` opened for it: its
    process group, threads and sockets, which ``close`` alone left to process exit
    (a build and close leaked 3 threads and 7 descriptors a rank: bench/soak.py).
    Every face's ``close``; ``shutdown()`` calls those."""
    engine.free_transport()


class EngineHolder:
    """A face that owns one CaSync engine, kept in ``_hp_engine`` (None until built).

    ``engine`` reads it (for introspection: plan, timeline); ``_hp_close_engine``
    closes it and its transport once (``close_engine``), leaving None.
    """

    _hp_engine: Any = None

    @property
    def engine(self) -> Any:
        """The CaSync engine (None until it is built)."""
        return self._hp_engine

    def _hp_close_engine(self) -> None:
        """Close the engine and its transport, if any; later calls do nothing."""
        eng, self._hp_engine = self._hp_engine, None
        if eng is not None:
            close_engine(eng)
