"""The sparsifiers and the sparse payload's codecs: top-k and random-k (``topk.py``),
DGC, GradDrop, AR-Topk, and the index/value codecs (``codecs.py``: plain, rle;
``bloom.py``; ``curvefit.py``), with the C loops of ``topk.c`` and ``bloom.c``
(bound in ``native.py``).

Re-exports ``topk.py``'s public names, so ``hipress_like.compressors.sparse`` (once
the module that is now ``topk.py``) keeps working.
"""
from . import artopk, bloom, codecs, curvefit, dgc, graddrop  # noqa: F401  (register them)
from .topk import *  # noqa: F401,F403
from .topk import __all__  # noqa: F401
