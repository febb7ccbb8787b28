"""The threshold and stochastic quantizers: TBQ (Strom 2015, ``tbq.py``) and
TernGrad (Wen et al. 2017, ``terngrad.py``), with their fused kernels (``fused.py``)."""
from . import tbq, terngrad  # noqa: F401  (registers them)
