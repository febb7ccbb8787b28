"""TBQ's and TernGrad's fused kernels: encode, decode, and the min/max sweep, as
torch.compile kernels (``_build/fused.py`` has the machinery and the rules that
make the compiled and the eager version give the same bits).
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch

from .._build.fused import Kernel, _divisor, _emit, _max2, _run_pack, _run_unpack
from ..ops import _as_i32, _pack_planes, _plane_codes, _uniform_from_counter

__all__ = ["affine_decode", "minmax", "terngrad_encode", "tbq_decode", "tbq_encode"]


def _tbq_pack_fn() -> Callable:
    def tbq_pack(x: torch.Tensor, out: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """TBQ codes (Strom 2015, Sec. 3): 1 for x > tau, 2 for x < -tau, else 0.

        Packs 2-bit codes into ``out``; returns max|x| so the caller can reject
        NaN/Inf without another sweep.
        """
        xc = x.view(4, -1).to(tau.dtype)
        codes = torch.where(xc > tau, 1.0, torch.where(xc < -tau, 2.0, 0.0))
        out.copy_(_pack_planes(codes, 2))
        return x.abs().amax()
    return tbq_pack


def _tbq_unpack_fn(mode: str, out_dtype: torch.dtype) -> Callable:
    def tbq_unpack(packed: torch.Tensor, out: torch.Tensor, tau: torch.Tensor,
                   d: torch.Tensor, shift: torch.Tensor) -> None:
        """One plane (field at bit ``shift``): 2-bit codes -> {0, +tau, -tau}.

        Code 3 is never produced; it decodes as 0.
        """
        c = _plane_codes(packed, 2, shift)
        zero = torch.zeros_like(tau)
        _emit(out, torch.where(c == 1, tau, torch.where(c == 2, -tau, zero)), mode, d)
    return tbq_unpack


def _minmax_fn() -> Callable:
    def minmax(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(min, max) of x; NaN propagates (HiPress Fig. 5 lines 11-12)."""
        return x.amin(), x.amax()
    return minmax


def _terngrad_pack_fn(bits: int) -> Callable:
    per = 8 // bits
    top = float((1 << bits) - 1)

    def terngrad_pack(x: torch.Tensor, out: torch.Tensor, lo: torch.Tensor, gap: torch.Tensor,
                      seed: torch.Tensor, base: torch.Tensor) -> None:
        """Stochastic rounding to 2**bits levels (HiPress Fig. 5, ``floatToUint``).

        Fig. 5 lines 6-7: ``r = (g - min) / gap``; ``code = floor(r + u)``, u ~
        U[0, 1). Computed as ``floor(r) + (u < r - floor(r))``: the same random
        variable, but the fraction stays exact (``r + u`` would round), so
        E[code] = r up to u's 2**-24 resolution and decode is unbiased. u is
        ``ops.uniform``'s number ``base + i`` of the stream keyed by ``seed``.
        """
        xv = x.view(per, -1)
        m = xv.shape[1]
        ramp = torch.arange(m, dtype=torch.int32, device=x.device)
        planes = []
        for k in range(per):  # one expression per plane, so inductor fuses it into the packing
            r = ((xv[k].to(lo.dtype) - lo) / gap).clamp(0.0, top)
            fl = torch.floor(r)
            u = _uniform_from_counter(ramp + (base + k * m), seed)
            planes.append(fl.to(torch.float32) + torch.where(u < (r - fl), 1.0, 0.0))
        out.copy_(_pack_planes(planes, bits))
    return terngrad_pack


def _affine_unpack_fn(bits: int, mode: str, out_dtype: torch.dtype) -> Callable:
    def affine_unpack(packed: torch.Tensor, out: torch.Tensor, lo: torch.Tensor,
                      gap: torch.Tensor, d: torch.Tensor, shift: torch.Tensor) -> None:
        """One plane (field at bit ``shift``): ``min + code * gap``, in ``out``'s dtype.

        The decode of Fig. 5's encode.
        """
        _emit(out, lo + _plane_codes(packed, bits, shift).to(lo.dtype) * gap, mode, d)
    return affine_unpack


_K_TBQ_PACK = Kernel(_tbq_pack_fn, "tbq encode")
_K_TBQ_UNPACK = Kernel(_tbq_unpack_fn, "tbq decode")
_K_MINMAX = Kernel(_minmax_fn, "minmax")
_K_TERN_PACK = Kernel(_terngrad_pack_fn, "terngrad encode")
_K_AFFINE_UNPACK = Kernel(_affine_unpack_fn, "affine decode")


def tbq_encode(x: torch.Tensor, body: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Pack TBQ 2-bit codes of flat ``x`` into ``body``; return max|x|."""
    return _max2(*_run_pack(_K_TBQ_PACK, x, body, 4, (tau,), (tau,)))


def tbq_decode(body: torch.Tensor, out: torch.Tensor, tau: torch.Tensor, mode: str = "set",
               d: float = 1.0) -> None:
    """Decode TBQ codes into flat ``out`` (``tau`` in ``out``'s dtype; ``mode`` as
    ``onebit_decode``)."""
    _run_unpack(_K_TBQ_UNPACK, body, out, 4, (tau, _divisor(out, d)), spec=(mode,))


def minmax(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of flat ``x`` in one sweep (NaN propagates)."""
    return _K_MINMAX(x)


def terngrad_encode(x: torch.Tensor, body: torch.Tensor, lo: torch.Tensor, gap: torch.Tensor,
                    seed_mixed: int, bits: int) -> None:
    """Stochastically round flat ``x`` to ``lo + k * gap`` and pack the k into ``body``.

    Args:
        x: flat gradient.
        body: output bytes, ``ops.packed_nbytes(x.numel(), bits)`` of them.
        lo, gap: 0-d tensors in the compute dtype; ``gap > 0``.
        seed_mixed: ``ops.mix_seed(seed)``; element i uses number i of
            ``ops.uniform(n, seed)``.
        bits: code width (1, 2, 4 or 8).
    """
    per = 8 // bits
    dev = x.device
    s = torch.tensor(_as_i32(seed_mixed), dtype=torch.int32, device=dev)
    m = x.numel() // per
    base0 = torch.zeros((), dtype=torch.int32, device=dev)
    base1 = torch.tensor(_as_i32(m * per), dtype=torch.int32, device=dev)
    # padding with lo gives r = 0, i.e. code 0, for the unused fields of the last byte
    _run_pack(_K_TERN_PACK, x, body, per, (lo, gap, s, base0), (lo, gap, s, base1),
              spec=(bits,), pad=float(lo))


def affine_decode(body: torch.Tensor, out: torch.Tensor, lo: torch.Tensor, gap: torch.Tensor,
                  bits: int, mode: str = "set", d: float = 1.0) -> None:
    """``lo + k * gap`` for the packed codes k, stored into flat ``out`` (``mode`` as
    ``onebit_decode``)."""
    _run_unpack(_K_AFFINE_UNPACK, body, out, 8 // bits, (lo, gap, _divisor(out, d)),
                spec=(bits, mode))
