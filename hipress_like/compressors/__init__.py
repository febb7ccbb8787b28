"""CompLL: the compressor library (HiPress Sec. 4).

    import hipress_like as hp
    c = hp.compressors.get("terngrad", bitwidth=2)
    hp.compressors.available()

Algorithms register themselves on import; this package imports them all.
"""
# Importing the algorithm modules registers them (identity/none, fp16, onebit,
# tbq, terngrad, topk, randomk, dgc, graddrop, powersgd, ef, natural,
# natural_dithering, dithering, compose, thc, star_topk, var_topk, mstopk), and the
# sparse payload's codecs (sparse_codecs: plain, rle; bloom; curvefit).
from . import (  # noqa: F401
    artopk,
    bloom,
    compose,
    curvefit,
    dgc,
    dithering,
    graddrop,
    identity,
    natural,
    onebit,
    powersgd,
    sparse,
    sparse_codecs,
    tbq,
    terngrad,
    thc,
)
from .base import (
    HEADER_VERSION,
    Capabilities,
    Compressor,
    PayloadError,
    State,
    check_body_nbytes,
    check_gradient,
    header_nbytes,
    pack_payload,
    unpack_fields,
    unpack_payload,
)
from .error_feedback import ErrorFeedback, needs_error_feedback, with_error_feedback
from .params import ParamError, ParamTypeError
from .registry import ENTRY_POINT_GROUP, available, register
from .registry import get as _get

__all__ = [
    "HEADER_VERSION", "Capabilities", "Compressor", "PayloadError", "State", "check_gradient",
    "check_body_nbytes", "header_nbytes", "pack_payload", "unpack_fields", "unpack_payload",
    "ErrorFeedback", "ENTRY_POINT_GROUP", "ParamError", "ParamTypeError", "available", "get",
    "register", "needs_error_feedback", "with_error_feedback", "register_dsl",
]


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
