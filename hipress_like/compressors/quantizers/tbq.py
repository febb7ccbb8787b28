"""TBQ: threshold binary quantization (Strom 2015), 2-bit codes {0, +tau, -tau}.

Strom ("Scalable distributed DNN training using commodity GPU cloud
computing", Interspeech 2015, Sec. 3) sends only the gradient elements whose
magnitude exceeds a threshold tau, each as +tau or -tau; everything else is
0 this step. The residual (g minus what was sent) is kept and added to the
next gradient: that is error feedback, which here is the generic
``ErrorFeedback`` wrapper (the engine wraps biased compressors in it by
default), so this compressor stays pure. HiPress (Sec. 4.4, Table 5) builds
TBQ from the filter/map/concat operators; here it is one fused kernel
(``quantizers/fused.tbq_encode``), dense 2-bit codes instead of an index list, so the
payload size is fixed (ratio 1/16 for float32).

Payload (after the common header): extra = tau as float64; body =
ceil(n / 4) bytes of 2-bit codes (0: 0, 1: +tau, 2: -tau) in the planar
layout of ``_build/fused.py``.
"""
from __future__ import annotations

import struct
from typing import Any, Dict, Optional, Tuple

import torch

from .._build.fused import compute_dtype
from ..base import Capabilities, Compressor, State, check_gradient, header_nbytes
from ..kernels import FusedDecode
from ..ops import packed_nbytes
from ..params import check_real
from ..registry import register
from . import fused as _fused

__all__ = ["TBQ"]

_EXTRA = struct.Struct("<d")  # tau


@register("tbq")
class TBQ(FusedDecode, Compressor):
    """Threshold binary quantization (biased; wrap it in error feedback).

    Algorithm (Strom 2015, Sec. 3):
        1. code_i = 1 if g_i > tau, 2 if g_i < -tau, else 0
        2. send the 2-bit codes and tau
        3. decode g'_i = +tau, -tau or 0.

    Args:
        threshold: tau > 0, in gradient units. The default 0.01 suits
            gradients of magnitude ~1e-3..1e-2 under error feedback (the
            residual grows until it crosses tau); Strom tuned tau per model,
            and MXNet's 2-bit compression (the same scheme) defaults to 0.5.

    Example:
        >>> import hipress_like as hp
        >>> c = hp.compressors.get("tbq", threshold=0.5)
        >>> g = torch.tensor([0.7, -0.2, -0.9, 0.5])
        >>> p, s = c.encode(g, c.init(g))
        >>> c.decode(p).tolist()
        [0.5, 0.0, -0.5, 0.0]
    """

    name = "tbq"
    algo_id = 11
    capabilities = Capabilities("quantization", aggregatable=False, fixed_size=True,
                                unbiased=False, stateful=False,
                                checks_finite=True)  # the encode sweep's max|g|

    def __init__(self, threshold: float = 0.01) -> None:
        # the magnitude sent for large elements
        self.threshold = check_real("tbq", "threshold", threshold, low=0.0, low_open=True,
                                    example=0.01)

    def params(self) -> Dict[str, Any]:
        """Constructor parameters."""
        return {"threshold": self.threshold}

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Compress ``grad`` to 2-bit threshold codes.

        Raises:
            TypeError: non-tensor or non-float input.
            ValueError: empty input, or NaN/Inf in it.
        """
        check_gradient(grad, nonfinite="ignore")  # NaN/Inf: caught by the kernel's max|g|
        g = grad.detach().contiguous().reshape(-1)
        n = g.numel()
        payload, body = self.frame_payload(grad, _EXTRA.pack(self.threshold), packed_nbytes(n, 2))
        tau = torch.tensor(self.threshold, dtype=compute_dtype(g.dtype), device=g.device)
        amax = _fused.tbq_encode(g, body, tau)
        if not bool(torch.isfinite(amax)):
            check_gradient(grad, nonfinite="always")  # raises the standard NaN/Inf error
        return payload, state

    def _decode(self, payload: torch.Tensor, out: Optional[torch.Tensor], mode: str,
                d: float) -> torch.Tensor:
        """Codes -> {0, +tau, -tau} in the original shape and dtype, by ``mode``
        (``FusedDecode``; tau from the payload)."""
        h, (tau,), body, out = self.unframe_payload(
            payload, _EXTRA, lambda h, tau: packed_nbytes(h.numel, 2), out)
        tau_t = torch.tensor(tau, dtype=h.dtype, device=payload.device)
        _fused.tbq_decode(body, out.view(-1), tau_t, mode, d)
        return out

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Header (with 8 bytes for tau) plus ceil(numel / 4) bytes of codes."""
        return header_nbytes(ndim, _EXTRA.size) + packed_nbytes(numel, 2)
