"""Horovod's own TensorFlow module, for the calls this face hands to it under horovodrun.

The plugin rule (issue 48): what this project implements itself (the
gradients' compressed, fused synchronisation: ``DistributedGradientTape``,
``DistributedOptimizer``, and collectives asked to compress with one of its
compressors) stays its own; a plain collective or a call it does not
implement is handed to Horovod's own module when the job runs under
``horovodrun`` and Horovod was built with its TensorFlow ops. There,
``horovod.tensorflow``'s ops give what a TensorFlow user of Horovod relies
on and this face's torch-based calls do not: every dtype Horovod takes, a
``tf.compat.v1`` session's negotiation by name, Horovod's error types
(``FailedPreconditionError`` for ranks that disagree),
``BroadcastGlobalVariablesHook``, ``PartialDistributedOptimizer`` and the
rest of its namespace (reached through the face's module ``__getattr__``).
Horovod's TensorFlow core and its PyTorch core (which the engine's transport
uses under horovodrun) run side by side in one process, each initialised once.

Elsewhere (torchrun, mpirun, a Horovod without TF ops, TensorFlow 2.16+,
whose headers Horovod 0.28.1 does not compile against) this returns None and
the face's own implementations run; a name only Horovod has is then an
``AttributeError`` that says how to get it.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Dict, Optional

from .. import collectives as _tc
from .. import horovod_calls as _hc
from ..runtime import _require, is_initialized

__all__ = ["horovod_tf", "handed", "missing", "face_getattr"]

log = logging.getLogger(__name__)

_cache: dict = {}  # runtime identity -> horovod.tensorflow or None


def horovod_tf() -> Optional[Any]:
    """``horovod.tensorflow``, initialised, when this job runs under ``horovodrun``
    and Horovod's TensorFlow ops load; else None. Decided once per runtime (``init``)."""
    rt = _require()
    key = id(rt)
    if key in _cache:
        return _cache[key]
    mod = None
    if rt.launcher in ("horovodrun-gloo", "horovodrun-mpi"):
        try:
            import horovod.tensorflow as mod  # noqa: F811 (its ops library loads here)

            mod.init()
        except Exception as e:  # no Horovod, or built without TensorFlow
            log.debug("horovod.tensorflow is not usable here (%s); this face's own calls run",
                      e)
            mod = None
    _cache.clear()
    _cache[key] = mod
    return mod


def missing(name: str) -> AttributeError:
    """The error for ``hvd.<name>`` that only ``horovod.tensorflow`` has."""
    return AttributeError(
        f"hipress_like.tensorflow has no {name!r}: it is horovod.tensorflow's, which this face "
        "hands such calls to when the job runs under horovodrun with Horovod built with its "
        "TensorFlow ops (HIPRESS_VENV=<a TensorFlow 2.15-or-older venv> scripts/env_horovod.sh; "
        "TensorFlow 2.16+ headers do not compile with Horovod 0.28.1)")


def _horovod_kwargs(h: Any, sig: inspect.Signature, target: Any, args: Any,
                    kwargs: Any) -> Optional[Dict[str, Any]]:
    """The arguments of a call as ``horovod.tensorflow``'s ``target`` takes them (by
    keyword), or None when the call is this project's: a compressor of its own, a
    process set of its own (``adapters.horovod_calls.ProcessSet``), an argument
    Horovod's call has no name for."""
    try:
        bound = sig.bind(*args, **kwargs)
        params = _parameters(target)
    except (TypeError, ValueError):
        return None
    out: Dict[str, Any] = {}
    for k, v in bound.arguments.items():
        if k == "process_set":
            if v is None or getattr(v, "process_set_id", None) == 0:
                continue
            if isinstance(v, _hc.ProcessSet):
                return None  # a process set of this project's: its own call
            # Horovod's own set: horovod.common.process_sets registers every set with
            # the core of the framework imported last, here TensorFlow's, so its
            # collectives must be TensorFlow's too (the torch core does not know it)
        if k == "compression":
            name = getattr(v, "name", None)
            if v is None or name in ("identity", "none"):
                v = h.Compression.none
            elif name == "fp16":
                v = h.Compression.fp16
            else:
                return None  # one of this project's compressors
        if k == "op" and isinstance(v, str):
            v = _tc._hop(h, v)  # the shared calls' name -> Horovod's constant
        if k not in params:
            return None
        out[k] = v
    return out


@functools.lru_cache(maxsize=None)
def _parameters(target: Callable[..., Any]) -> Any:
    """``target``'s parameter names (read once per Horovod call, not per call made)."""
    return inspect.signature(target).parameters


def handed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` as ``horovod.tensorflow``'s call of the same name where ``horovod_tf()``
    gives that module and the arguments are Horovod's (``_horovod_kwargs``), else as
    itself. The decorated call's signature and docstring stay ``fn``'s."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        h = horovod_tf()
        target = getattr(h, fn.__name__, None) if h is not None else None
        if target is not None:
            kw = _horovod_kwargs(h, sig, target, args, kwargs)
            if kw is not None:
                return target(**kw)
        return fn(*args, **kwargs)

    return call


def face_getattr(name: str, module: str = "horovod.tensorflow") -> Any:
    """A face module's ``__getattr__``: a name the face does not define, taken from
    Horovod's ``module`` (``horovod.tensorflow`` or ``horovod.tensorflow.keras``) where
    ``horovod_tf()`` gives Horovod, else an ``AttributeError`` saying how to get it."""
    if name.startswith("__"):
        raise AttributeError(name)
    if is_initialized() and horovod_tf() is not None:
        import importlib

        value = getattr(importlib.import_module(module), name, None)
        if value is not None:
            return value
    raise missing(name)
