"""TernGrad as formulated in HiPress Fig. 5: unbiased stochastic rounding to 2**b levels.

Wen et al. (NeurIPS 2017) quantize each gradient element to {-s, 0, +s}
(s = max|g|) with probabilities that keep it unbiased. HiPress's CompLL
(Sec. 4.3, Fig. 5) writes TernGrad with a ``bitwidth`` parameter b and the
range [min, max] of the gradient:

    gap  = (max - min) / (2**b - 1)                    (Fig. 5 line 13)
    code = floor((g - min) / gap + u),  u ~ U[0, 1)   (Fig. 5 lines 6-7)
    g'   = min + code * gap                            (the decode)

E[code] = (g - min) / gap, so E[g'] = g: the compressor is unbiased. b = 2
gives four levels (Fig. 5's default). This module implements that
formulation with b in {1, 2, 4, 8}.

Randomness is the counter-based hash RNG of ``ops.uniform``: element i uses
number i of the stream keyed by ``hash(state["seed"], state["step"])``, so a
payload is reproducible from (seed, step) on any device or thread count, and
the stream fuses into the kernel (``quantizers/fused.terngrad_encode``). ``encode``
advances ``state["step"]`` so consecutive steps draw fresh numbers.

Payload (after the common header): extra = (bitwidth: uint8, 7 pad bytes,
min: float64, max: float64), Fig. 5's ``concat(bitwidth, ..., min, max, Q)``;
Fig. 5's ``tail`` is not needed because the header carries the shape. Body =
the codes, b bits each, in the planar layout of ``_build/fused.py``.
"""
from __future__ import annotations

import struct
from typing import Any, Dict, Optional, Tuple

import torch

from .._build.fused import compute_dtype
from ..base import Capabilities, Compressor, PayloadError, State, check_gradient, header_nbytes
from ..kernels import FusedDecode
from ..ops import VALID_BITS, _fmix32, mix_seed, packed_nbytes
from ..params import check_int
from ..registry import register
from . import fused as _fused

__all__ = ["TernGrad"]

_EXTRA = struct.Struct("<B7xdd")  # bitwidth, min, max


def _gap(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Fig. 5 line 13, ``(max - min) / (2**b - 1)``; 1 when max == min (all codes are 0).

    The divisor is a tensor on ``lo``'s device: a Python float would let torch's CUDA
    kernel multiply by its reciprocal instead of dividing, a gap an ulp away from the
    CPU's (and the generated C's and CUDA's), so other codes on a GPU."""
    levels = torch.full((), float((1 << bits) - 1), dtype=lo.dtype, device=lo.device)
    gap = (hi - lo) / levels
    return torch.where(gap > 0, gap, torch.ones_like(gap))


def _body_nbytes(h: Any, b: int, lo: float, hi: float) -> int:
    """Bytes of a payload's codes: b bits per element (b checked: one of ``VALID_BITS``)."""
    if b not in VALID_BITS:
        raise PayloadError(f"terngrad payload declares bitwidth {b}, expected one of "
                           f"{VALID_BITS}")
    return packed_nbytes(h.numel, b)


def step_seed(seed: int, step: int) -> int:
    """The RNG stream key of (seed, step): two fmix32 rounds (MurmurHash3 finaliser)."""
    return _fmix32(_fmix32(seed & 0xFFFFFFFF) ^ (step & 0xFFFFFFFF) ^ 0x85EBCA6B)


@register("terngrad")
class TernGrad(FusedDecode, Compressor):
    """TernGrad (Wen et al. 2017) in HiPress's Fig. 5 formulation; unbiased.

    Algorithm (HiPress Fig. 5):
        1. min, max = reduce(g, smaller), reduce(g, greater)
        2. gap = (max - min) / (2**bitwidth - 1)
        3. code_i = floor((g_i - min) / gap + u_i), u_i ~ U[0, 1)
        4. send (bitwidth, min, max, codes); decode g'_i = min + code_i * gap.

    Args:
        bitwidth: bits per element, one of 1, 2, 4, 8 (default 2, as Fig. 5).

    Example:
        >>> import hipress_like as hp
        >>> c = hp.compressors.get("terngrad", bitwidth=2)
        >>> g = torch.tensor([0.0, 1.0, 2.0, 3.0])
        >>> p, s = c.encode(g, c.init(g, seed=1))
        >>> c.decode(p).tolist()      # exact: every element sits on a level
        [0.0, 1.0, 2.0, 3.0]
    """

    name = "terngrad"
    algo_id = 12
    capabilities = Capabilities("quantization", aggregatable=False, fixed_size=True,
                                unbiased=True, stateful=True,
                                checks_finite=True)  # the min/max pass

    def __init__(self, bitwidth: int = 2) -> None:
        self.bitwidth = check_int("terngrad", "bitwidth", bitwidth, choices=VALID_BITS,
                                  example=2)

    def params(self) -> Dict[str, Any]:
        """Constructor parameters."""
        return {"bitwidth": self.bitwidth}

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Stochastically quantize ``grad``; the new state has ``step`` + 1.

        Raises:
            TypeError: non-tensor or non-float input.
            ValueError: empty input, NaN/Inf in it, or a state without
                ``seed``/``step`` (create it with ``init``).
        """
        check_gradient(grad, nonfinite="ignore")  # NaN/Inf: caught by min/max below
        if not isinstance(state, dict) or "seed" not in state or "step" not in state:
            raise ValueError("terngrad needs the state from init(grad, seed) with 'seed' and "
                             f"'step', found {state!r}")
        g = grad.detach().contiguous().reshape(-1)
        n, b = g.numel(), self.bitwidth
        cdt = compute_dtype(g.dtype)
        lo, hi = _fused.minmax(g)
        lo, hi = lo.to(cdt), hi.to(cdt)
        lo_f, hi_f = float(lo), float(hi)
        if not (abs(lo_f) < float("inf") and abs(hi_f) < float("inf")):
            check_gradient(grad, nonfinite="always")  # raises the standard NaN/Inf error
        payload, body = self.frame_payload(grad, _EXTRA.pack(b, lo_f, hi_f), packed_nbytes(n, b))
        seed = mix_seed(step_seed(int(state["seed"]), int(state["step"])))
        _fused.terngrad_encode(g, body, lo, _gap(lo, hi, b), seed, b)
        new_state = dict(state)
        new_state["step"] = int(state["step"]) + 1
        return payload, new_state

    def _decode(self, payload: torch.Tensor, out: Optional[torch.Tensor], mode: str,
                d: float) -> torch.Tensor:
        """``min + code * gap`` in the original shape and dtype, by ``mode``
        (``FusedDecode``; bitwidth from the payload)."""
        h, (b, lo_f, hi_f), body, out = self.unframe_payload(
            payload, _EXTRA, _body_nbytes, out, lambda b, lo, hi: f" of {b} bits")
        dev = payload.device
        cdt = compute_dtype(h.dtype)
        lo = torch.tensor(lo_f, dtype=cdt, device=dev)
        hi = torch.tensor(hi_f, dtype=cdt, device=dev)
        _fused.affine_decode(body, out.view(-1), lo, _gap(lo, hi, b), b, mode, d)
        return out

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Header (with 24 bytes of bitwidth/min/max) plus ceil(numel * bitwidth / 8) bytes."""
        return header_nbytes(ndim, _EXTRA.size) + packed_nbytes(numel, self.bitwidth)
