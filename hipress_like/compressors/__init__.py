"""CompLL: the compressor library (HiPress Sec. 4).

    import hipress_like as hp
    c = hp.compressors.get("terngrad", bitwidth=2)
    hp.compressors.available()

Algorithms register themselves on import; this package imports them all.
Each family lives in its own folder with its Python, its C and its kernels
(onebit/, quantizers/, natural/, thc/, powersgd/, sparse/, identity/); the
wrappers (error feedback, composition) in wrappers/, what they share to build
kernels in _build/. A new algorithm derives from ``Compressor`` (one round:
``init``, ``encode``, ``decode``, ``params`` and declared ``capabilities``) or
``MultiRoundCompressor`` (``rounds.py``), and registers with ``register``.
The flat layout's module paths (``compressors.tbq``, ``.sparse_codecs``, ...)
stay importable (``hipress_like._compat.MOVED``).
"""
import importlib
from typing import Any

from .. import _compat

# Importing the algorithm families registers them (identity/none, fp16, onebit,
# tbq, terngrad, topk, randomk, dgc, graddrop, powersgd, ef, natural,
# natural_dithering, dithering, compose, thc, star_topk, var_topk, mstopk), and the
# sparse payload's codecs (sparse.codecs: plain, rle; bloom; curvefit).
from . import (  # noqa: F401
    identity,
    natural,
    onebit,
    powersgd,
    quantizers,
    sparse,
    thc,
    wrappers,
)
from .base import (
    CATEGORIES,
    HEADER_VERSION,
    Capabilities,
    Compressor,
    PayloadError,
    Round,
    State,
    check_body_nbytes,
    check_gradient,
    header_nbytes,
    pack_payload,
    unpack_fields,
    unpack_payload,
)
from .params import ParamError, ParamTypeError
from .registry import ENTRY_POINT_GROUP, available, register
from .registry import get as _get
from .rounds import MultiRoundCompressor
from .wrappers.error_feedback import ErrorFeedback, needs_error_feedback, with_error_feedback
from .wrappers.wrapper import Wrapper

__all__ = [
    "CATEGORIES", "HEADER_VERSION", "Capabilities", "Compressor", "MultiRoundCompressor",
    "Round", "Wrapper", "PayloadError", "State", "check_gradient",
    "check_body_nbytes", "header_nbytes", "pack_payload", "unpack_fields", "unpack_payload",
    "ErrorFeedback", "ENTRY_POINT_GROUP", "ParamError", "ParamTypeError", "available", "get",
    "register", "needs_error_feedback", "with_error_feedback", "register_dsl",
]


def __getattr__(name: str) -> Any:
    """``hp.compressors.tbq`` and the other flat-layout names (``_compat.MOVED``),
    imported on first use as the module now holding that code."""
    if f"{__name__}.{name}" in _compat.MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(name, **params):
    """``registry.get``, plus the path of a CompLL program (``*.compll``, registered as
    ``<stem>.compll`` on first use) as a name, so plans, the engine and the cost
    model's profiler take DSL programs like built-ins."""
    if isinstance(name, str) and name.strip().endswith(".compll"):
        from .compll.compressor import get_program

        return get_program(name.strip(), **params)
    return _get(name, **params)


def register_dsl(path_or_source, name=None, replace=False):
    """Compile a CompLL program (a ``.compll`` path or its text) and register it as ``name``.

    See ``compll.compressor.register_dsl`` (imported on first use, so lark loads only
    for programs).
    """
    from .compll import register_dsl as _register_dsl

    return _register_dsl(path_or_source, name=name, replace=replace)
