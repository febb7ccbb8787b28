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
stay importable through ``OLD_PATHS`` below.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

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
from .registry import ENTRY_POINT_GROUP, available, get, register
from .rounds import MultiRoundCompressor
from .wrappers.error_feedback import ErrorFeedback, needs_error_feedback, with_error_feedback
from .wrappers.wrapper import Wrapper

__all__ = [
    "CATEGORIES", "HEADER_VERSION", "Capabilities", "Compressor", "MultiRoundCompressor",
    "Round", "Wrapper", "PayloadError", "State", "check_gradient",
    "check_body_nbytes", "header_nbytes", "pack_payload", "unpack_fields", "unpack_payload",
    "ErrorFeedback", "ENTRY_POINT_GROUP", "ParamError", "ParamTypeError", "available", "get",
    "register", "needs_error_feedback", "with_error_feedback",
]

#: The module paths of the flat layout (one file per algorithm, before the
#: algorithm folders) and the modules now holding that code. Users' imports and
#: pickled compressors and plans name the old paths; each resolves to the new
#: module through ``sys.modules`` (the packages that kept an old module's name,
#: ``identity``, ``onebit``, ``natural``, ``powersgd``, ``thc`` and ``sparse``,
#: re-export its public names instead).
OLD_PATHS = {
    "tbq": "quantizers.tbq",
    "terngrad": "quantizers.terngrad",
    "dithering": "natural.dithering",
    "thc_kernels": "thc.kernels",
    "thc_payload": "thc.payload",
    "thc_tables": "thc.tables",
    "_fused_lowrank": "powersgd.lowrank",
    "artopk": "sparse.artopk",
    "bloom": "sparse.bloom",
    "bloom_filter": "sparse.bloom_filter",
    "curvefit": "sparse.curvefit",
    "dgc": "sparse.dgc",
    "graddrop": "sparse.graddrop",
    "sparse_codecs": "sparse.codecs",
    "compose": "wrappers.compose",
    "error_feedback": "wrappers.error_feedback",
    "_native": "_build.native",
    "_fused": "_build.fused",
}


#: Old paths of command-line modules (``python -m``), which no code imports: they
#: load from the new module's file on first import instead of being imported
#: here (importing a ``-m`` target beforehand makes runpy warn, and an alias
#: in ``sys.modules`` cannot be run by ``-m`` at all).
OLD_CLI_PATHS = {"thc_tables_cli": "thc.tables_cli"}


class _OldCliFinder(importlib.abc.MetaPathFinder):
    """Finds ``OLD_CLI_PATHS``' modules: the new module's source under the old name."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix, _, old = fullname.rpartition(".")
        if prefix != __name__ or old not in OLD_CLI_PATHS:
            return None
        new = importlib.util.find_spec(f"{__name__}.{OLD_CLI_PATHS[old]}")
        if new is None or new.origin is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, new.origin, loader=importlib.machinery.SourceFileLoader(fullname,
                                                                              new.origin))


def _install_old_paths() -> None:
    for old, new in OLD_PATHS.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules[f"{__name__}.{old}"] = module
        globals()[old] = module
    if not any(isinstance(f, _OldCliFinder) for f in sys.meta_path):
        sys.meta_path.append(_OldCliFinder())


_install_old_paths()
