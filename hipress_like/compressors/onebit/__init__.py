"""onebit (1-bit SGD, Seide et al. 2014): its compressor (``onebit.py``), fused
torch kernels (``fused.py``), C loops (``onebit.c``, bound in ``native.py``).

Re-exports ``onebit.py``'s public names, so ``hipress_like.compressors.onebit``
(once a module) keeps working.
"""
from .onebit import *  # noqa: F401,F403
from .onebit import __all__  # noqa: F401
