"""The uncompressed baselines: ``identity``/``none`` (the raw gradient) and ``fp16``.

Re-exports ``identity.py``'s public names, so ``hipress_like.compressors.identity``
(once a module) keeps working.
"""
from .identity import *  # noqa: F401,F403
from .identity import __all__  # noqa: F401
