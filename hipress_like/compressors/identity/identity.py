"""The identity and fp16 "compressors": the reference points of every comparison.

``identity`` ships the raw values (aggregatable: payload bodies add as floats),
so a synchronisation with it must equal the exact average. ``fp16`` casts to
half precision (what PyTorch's ``fp16_compress_hook`` does); it is not merged
in fp16 because summing halves loses precision, so aggregators decode, sum in
the gradient's dtype, and re-encode.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..base import (
    Capabilities,
    Compressor,
    PayloadError,
    State,
    check_gradient,
    header_nbytes,
    unpack_payload,
    view_as_dtype,
)
from ..payload import NO_FIELDS
from ..registry import register

__all__ = ["Identity", "FP16"]


@register("identity", "none")
class Identity(Compressor):
    """Sends the tensor unchanged (as bytes)."""

    name = "identity"
    algo_id = 1
    capabilities = Capabilities("none", aggregatable=True, fixed_size=True, unbiased=True)

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Copy the values into a payload (one memory copy)."""
        check_gradient(grad, name="identity input")
        g = grad.detach().contiguous()
        payload, body = self.frame_payload(g, b"", g.numel() * g.element_size())
        body.view(g.dtype).copy_(g.reshape(-1))
        return payload, state

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The body as the original dtype and shape, copied out of the payload (into ``out``)."""
        h, _, body, res = self.unframe_payload(payload, NO_FIELDS,
                                               lambda h: h.numel * h.dtype.itemsize, out)
        return res.copy_(view_as_dtype(body, h.dtype).reshape(h.shape))

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Sum payloads as floats in the given order."""
        if not payloads:
            raise ValueError("merge needs at least one payload")
        heads = [unpack_payload(p, self.algo_id) for p in payloads]
        h0 = heads[0]
        for h in heads[1:]:
            if h.shape != h0.shape or h.dtype != h0.dtype:
                raise PayloadError(f"cannot merge payloads of shapes {h0.shape}/{h.shape} "
                                   f"and dtypes {h0.dtype}/{h.dtype}")
        out = payloads[0].clone()
        acc = out[payloads[0].numel() - h0.body.numel():].view(h0.dtype)
        for h in heads[1:]:
            acc.add_(h.body.view(h0.dtype))
        return out

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Header plus 4 bytes per element (float32)."""
        return header_nbytes(ndim, 0) + 4 * numel


@register("fp16")
class FP16(Compressor):
    """Casts to float16 (2x smaller); values beyond fp16's range are clamped."""

    name = "fp16"
    algo_id = 2
    capabilities = Capabilities("quantization", aggregatable=False, fixed_size=True)
    _FMAX = 65504.0

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Round to nearest half; clamp to +-65504 so no Inf appears."""
        check_gradient(grad, name="fp16 input")
        g = grad.detach().contiguous().reshape(-1)
        payload, body = self.frame_payload(grad, b"", 2 * g.numel())
        body.view(torch.float16).copy_(g.clamp(-self._FMAX, self._FMAX))
        return payload, state

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Widen back to the original dtype (into ``out`` when given)."""
        h, _, body, res = self.unframe_payload(payload, NO_FIELDS, lambda h: 2 * h.numel, out)
        return res.copy_(view_as_dtype(body, torch.float16).reshape(h.shape))

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Header plus 2 bytes per element."""
        return header_nbytes(ndim, 0) + 2 * numel
