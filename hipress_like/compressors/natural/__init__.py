"""Natural compression and dithering (Horvath et al. 2019): ``natural.py`` (C_nat,
with its C loops in ``natural.c``, bound in ``native.py``) and ``dithering.py``
(natural_dithering, dithering).

Re-exports ``natural.py``'s public names, so ``hipress_like.compressors.natural``
(once a module) keeps working.
"""
from . import dithering  # noqa: F401  (registers natural_dithering and dithering)
from .natural import *  # noqa: F401,F403
from .natural import __all__  # noqa: F401
