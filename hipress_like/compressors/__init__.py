"""CompLL: the compressor library (HiPress Sec. 4).

    import hipress_like as hp
    c = hp.compressors.get("terngrad", bitwidth=2)
    hp.compressors.available()

Algorithms register themselves on import; this package imports them all.
"""
from .base import (HEADER_VERSION, Capabilities, Compressor, PayloadError, State,
                   check_gradient, header_nbytes, pack_payload, unpack_payload)
from .registry import ENTRY_POINT_GROUP, available, get, register
from . import identity  # noqa: F401  (registers identity/none, fp16)
from . import onebit, tbq, terngrad  # noqa: F401  (registers onebit, tbq, terngrad)
from . import sparse, dgc, graddrop, powersgd  # noqa: F401  (topk, randomk, dgc, graddrop, ...)
from .error_feedback import ErrorFeedback  # noqa: F401  (registers ef)

__all__ = [
    "HEADER_VERSION", "Capabilities", "Compressor", "PayloadError", "State", "check_gradient",
    "header_nbytes", "pack_payload", "unpack_payload", "ENTRY_POINT_GROUP", "available", "get",
    "register",
]
