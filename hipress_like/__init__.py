"""hipress-like: compression-aware data-parallel training.

Subpackages: ``compressors`` (CompLL), ``casync`` (the scheduler),
``cost_model`` (selective compression and partitioning), ``launch`` (starting
ranks), ``tuning`` (live measurement), ``adapters`` (framework front ends).
``hipress_like.torch`` is the PyTorch face. ``errors.HipressError`` is the
base of every error the library raises.
"""
from . import _compat, compressors
from .errors import HipressError

_compat.install()  # old module names that moved (hipress_like.casync.launch, ...)

__version__ = "0.1.0"
__all__ = ["compressors", "HipressError", "__version__"]
