"""onebit: 1-bit SGD quantization (Seide et al. 2014), one sign bit per element.

Encode sends, per element, whether it is >= 0 (the quantization threshold of
1-bit SGD is 0) and, per tensor, two reconstruction values: the mean of the
elements that quantized to 1 and the mean of those that quantized to 0. This
is the error-minimising reconstruction of Seide et al. (Sec. 2), applied
tensor-wise instead of column-wise. Decode writes one of the two values per
element.

The compressor is *pure*: 1-bit SGD relies on error feedback (the
quantization error is added to the next gradient), but that is the generic
``ErrorFeedback`` wrapper (``hipress_like/compressors/error_feedback.py``),
which the engine applies to biased compressors by default. Use
``get("onebit")`` inside it, not a flag here (STYLE.md 1).

Payload (after the common header): extra = (value for bit 1, value for bit 0)
as two float64; body = ceil(n / 8) bytes of bits, little-endian within a
byte (``ops.pack_bits`` layout). Compression ratio ~1/32 for float32.
The means are computed from fixed-point sums (see ``fused._onebit_sums_fn``),
exact and independent of reduction order, so payloads are reproducible bit
for bit across eager/compiled runs and thread counts.
"""
from __future__ import annotations

import struct
from typing import Any, Optional, Sequence, Tuple

import torch

from ..base import (
    Capabilities,
    Compressor,
    State,
    check_gradient,
    header_nbytes,
    unpack_fields,
)
from ..kernels import FusedDecode, FusedDecodeKernels
from ..ops import packed_nbytes
from ..payload import write_extra_f64
from ..registry import register
from . import fused as _fused

__all__ = ["OneBit"]

_EXTRA = struct.Struct("<dd")  # value for bit 1 (x >= 0), value for bit 0 (x < 0)


def _body_nbytes(h: Any, v1: float, v0: float) -> int:
    """Bytes of a payload's sign bits: one bit per element."""
    return packed_nbytes(h.numel, 1)


@register("onebit")
class OneBit(FusedDecode, Compressor):
    """1-bit SGD quantizer (biased; wrap it in error feedback).

    Algorithm (Seide et al. 2014, Sec. 2, tensor-wise):
        1. b_i = [g_i >= 0]                          (threshold 0)
        2. v1 = mean(g_i : b_i = 1), v0 = mean(g_i : b_i = 0)
        3. send bits b and (v1, v0); decode g'_i = v1 if b_i else v0.

    Example:
        >>> import hipress_like as hp
        >>> c = hp.compressors.get("onebit")
        >>> g = torch.tensor([0.5, -1.0, 1.5, -3.0])
        >>> p, s = c.encode(g, c.init(g))
        >>> c.decode(p).tolist()
        [1.0, -2.0, 1.0, -2.0]
    """

    name = "onebit"
    algo_id = 10
    capabilities = Capabilities("quantization", aggregatable=False, fixed_size=True,
                                unbiased=False, stateful=False,
                                checks_finite=True)  # the packing sweep's max|x|
    kernels_class: type  # _OneBitKernels, set below the class

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Compress ``grad`` to sign bits plus two float64 reconstruction values.

        Raises:
            TypeError: non-tensor or non-float input.
            ValueError: empty input, or NaN/Inf in it.
        """
        return self._pack(grad, grad, lambda g, body: _fused.onebit_encode(g, body)), state

    def _pack(self, grad: torch.Tensor, encoded: torch.Tensor, kernel) -> torch.Tensor:
        """The payload of ``kernel(flat grad, body) -> (pos, neg, max|x|)``, which packs
        the signs of ``encoded`` (``grad`` itself, or the memory it is added into)."""
        check_gradient(grad, nonfinite="ignore")  # NaN/Inf: caught by the kernel's max|x|
        g = grad.detach().contiguous().reshape(-1)
        payload, body = self.frame_payload(grad, bytes(_EXTRA.size), packed_nbytes(g.numel(), 1))
        pos, neg, amax = kernel(g, body)
        if not bool(torch.isfinite(amax)):
            check_gradient(encoded, nonfinite="always")  # raises the standard NaN/Inf error
        write_extra_f64(payload, grad.dim(), 0, (pos, neg))
        return payload

    def _decode(self, payload: torch.Tensor, out: Optional[torch.Tensor], mode: str,
                d: float) -> torch.Tensor:
        """Expand bits to the two reconstruction values, in the original shape and
        dtype, by ``mode`` (``FusedDecode``)."""
        h, (v1, v0), body, out = self.unframe_payload(payload, _EXTRA, _body_nbytes, out)
        dev = payload.device
        _fused.onebit_decode(body, out.view(-1), torch.tensor(v1, dtype=h.dtype, device=dev),
                             torch.tensor(v0, dtype=h.dtype, device=dev), mode, d)
        return out

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Header (with 16 bytes of values) plus ceil(numel / 8) bytes of bits."""
        return header_nbytes(ndim, _EXTRA.size) + packed_nbytes(numel, 1)


class _OneBitKernels(FusedDecodeKernels):
    """OneBit's fast paths: fused decode-add/div, a one-pass sum of many payloads,
    and error feedback's residual read off the signs (same bits as the defaults)."""

    def encode_accumulated_(self, mem: torch.Tensor, grad: torch.Tensor, state: State,
                            residual: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                            ) -> Optional[Tuple[torch.Tensor, State]]:
        """``mem += grad`` and ``encode(mem)`` with the addition in the packing sweep
        (same payload and memory as the two steps; error feedback's fast path).
        A ``residual`` token (``deferred_residual``) is taken out of ``mem`` first,
        in the same sweep on the native path."""
        if mem.dtype != grad.dtype or mem.shape != grad.shape or not mem.is_contiguous():
            return None
        flat = mem.view(-1)
        return self.comp._pack(grad, mem, lambda g, body: _fused.onebit_encode_accumulated(
            flat, g, body, residual)), state

    def deferred_residual(self, payload: torch.Tensor, x: torch.Tensor
                          ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(value for 1, value for 0) in ``x``'s dtype: enough to subtract
        ``decode(payload)`` from ``x = encode``'s input later, since the bit of
        ``x_i`` is ``x_i >= 0`` (None when ``subtract_decoded_`` has no fused path)."""
        h, (v1, v0) = unpack_fields(payload, self.comp.algo_id, _EXTRA, "onebit")
        if h.numel != x.numel() or h.dtype != x.dtype or not x.is_contiguous():
            return None
        return (torch.tensor(v1, dtype=x.dtype, device=x.device),
                torch.tensor(v0, dtype=x.dtype, device=x.device))

    def apply_residual_(self, x: torch.Tensor, token: Tuple[torch.Tensor, torch.Tensor]
                        ) -> torch.Tensor:
        """``x -= (token[0] if x >= 0 else token[1])``: ``subtract_decoded_`` from a
        ``deferred_residual`` token, the same bits."""
        if x.is_contiguous():
            _fused.onebit_residual(x.view(-1), token[0], token[1])
        else:
            x.sub_(torch.where(x >= 0, token[0], token[1]))
        return x

    def decode_add_many_(self, payloads: Sequence[torch.Tensor],
                         acc: torch.Tensor) -> torch.Tensor:
        """``acc += decode(p)`` for each payload in order, in one pass over ``acc``.

        Float32 accumulators only (the sums then round exactly as a loop of
        ``decode_add_`` does); other dtypes and mismatched payloads take the loop.
        """
        if len(payloads) < 2 or acc.dtype != torch.float32 or not acc.is_contiguous():
            return super().decode_add_many_(payloads, acc)
        bodies, values = [], []
        for payload in payloads:
            h, (v1, v0) = self.comp.check_payload(payload, _EXTRA, _body_nbytes)
            if h.numel != acc.numel() or h.dtype != acc.dtype or payload.device != acc.device:
                return super().decode_add_many_(payloads, acc)
            bodies.append(h.body)
            values.append((torch.tensor(v1, dtype=acc.dtype, device=acc.device),
                           torch.tensor(v0, dtype=acc.dtype, device=acc.device)))
        _fused.onebit_decode_add_many(bodies, acc.view(-1), values)
        return acc

    def subtract_decoded_(self, x: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """``x -= decode(encode(x))`` in one pass: the bit of x_i is ``x_i >= 0``, so
        the decoded value is ``v1 if x_i >= 0 else v0``, read off x itself (the
        same bits as decoding and subtracting; error feedback's residual)."""
        token = self.deferred_residual(payload, x)
        if token is None:
            return super().subtract_decoded_(x, payload)
        return self.apply_residual_(x, token)


OneBit.kernels_class = _OneBitKernels
