"""hipress-like: compression-aware data-parallel training.

Subpackages: ``compressors`` (CompLL), ``casync`` (the scheduler),
``cost_model`` (selective compression and partitioning), ``adapters``
(framework front ends). ``hipress_like.torch`` is the PyTorch face.
"""
from . import compressors

__version__ = "0.1.0"
__all__ = ["compressors", "__version__"]
