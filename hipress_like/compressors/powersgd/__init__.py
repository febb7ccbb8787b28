"""PowerSGD (Vogels et al. 2019): the compressor (``powersgd.py``), its low-rank
kernels (``lowrank.py``) and their C sweeps (``powersgd.c``, bound in ``native.py``).

Re-exports ``powersgd.py``'s public names, so ``hipress_like.compressors.powersgd``
(once a module) keeps working.
"""
from .powersgd import *  # noqa: F401,F403
from .powersgd import __all__  # noqa: F401
