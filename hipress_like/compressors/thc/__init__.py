"""THC (Li et al., NSDI 2024): the compressor (``thc.py``), its kernels
(``kernels.py``, C loops in ``thc.c`` bound in ``native.py``), payload layout
(``payload.py``) and lookup tables (``tables.py``, ``tables/``, ``cli_tables.py``).

Re-exports ``thc.py``'s public names, so ``hipress_like.compressors.thc`` (once a
module) keeps working.
"""
from .thc import *  # noqa: F401,F403
from .thc import __all__  # noqa: F401
