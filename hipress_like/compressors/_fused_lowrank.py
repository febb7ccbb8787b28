"""PowerSGD's fused kernels: forming M = E + G with the previous step's error, and P Q^T.

Compiled through ``_fused.Kernel`` under the same rules as the quantizers'
kernels (``_fused``'s module docstring): the compiled and the eager version
round alike, so every rank gets the same bits whichever runs. Kept apart
from ``_fused`` so each file holds one compressor family's loops.
"""
from __future__ import annotations

from typing import Callable

import torch

from ._fused import Kernel
from .ops import matmul

__all__ = ["powersgd_form_m", "powersgd_lowrank"]


def _outer_sum(p: torch.Tensor, qt: torch.Tensor, rank: int) -> torch.Tensor:
    """``P Q^T`` as ``rank`` outer products summed in a fixed order (mul, then add).

    Pointwise, so it fuses into its consumer, and it rounds the same compiled
    or eager (rule 2 of the module docstring).
    """
    a = p[:, 0:1] * qt[0:1, :]
    for r in range(1, rank):
        a = a + p[:, r:r + 1] * qt[r:r + 1, :]
    return a


def _powersgd_form_m_fn(rank: int, prev_rank: int, gdtype: torch.dtype,
                        edtype: torch.dtype) -> Callable:
    # the dtypes only key the compilation cache (one code object per pair)
    def powersgd_form_m(e: torch.Tensor, g: torch.Tensor, p_prev: torch.Tensor,
                        qt_prev: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # one loop: M = g + e - P' Q'^T into e, and the rank row reductions P = M Q
            m = g.to(e.dtype) + e
            if prev_rank:
                m = m - _outer_sum(p_prev, qt_prev, prev_rank)
            e.copy_(m)
            return torch.stack([(m * qt[k:k + 1, :]).sum(1) for k in range(rank)], 1)
        # eager: in place, no gradient-sized temporaries, BLAS for the products
        e.add_(g)
        if prev_rank:
            e.addmm_(p_prev, qt_prev, alpha=-1.0)
        return matmul(e, qt.t())
    return powersgd_form_m


def _powersgd_lowrank_fn(rank: int, dtype: torch.dtype) -> Callable:
    def powersgd_lowrank(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(_outer_sum(p, qt, rank))
    return powersgd_lowrank


_K_PSGD_FORM_M = Kernel(_powersgd_form_m_fn, "powersgd form M")
_K_PSGD_LOWRANK = Kernel(_powersgd_lowrank_fn, "powersgd decompress")


def powersgd_form_m(e: torch.Tensor, g: torch.Tensor, p_prev, qt_prev,
                    qt: torch.Tensor) -> torch.Tensor:
    """PowerSGD's error feedback and first product in one sweep (Vogels et al. 2019, Alg. 2).

    ``M = g + e - P' Q'^T`` is written into ``e`` (the previous step's error
    kept in factored form, see ``PowerSGD``) and ``P = M Q`` is returned,
    computed as ``rank`` row reductions in the same loop, so the matrix is
    read once for both (measured for 4096 x 4096, rank 4, on this machine:
    ~8 ms against ~11 ms for the in-place sum followed by ``M @ Q``).
    Compiled and eager results agree to rounding (the sums' order differs),
    not bit for bit: ``P`` is a local payload, ranks need not agree on it.

    Args:
        e: (rows, cols) contiguous accumulator; becomes M.
        g: (rows, cols) gradient view (any float dtype).
        p_prev, qt_prev: the pending factors (rows, r) and (r, cols), or None.
        qt: (r, cols) contiguous: Q transposed.

    Returns:
        P, (rows, r).
    """
    prev = 0 if p_prev is None else int(p_prev.shape[1])
    return _K_PSGD_FORM_M(e, g, p_prev, qt_prev, qt,
                          spec=(int(qt.shape[0]), prev, g.dtype, e.dtype), numel=e.numel())


def powersgd_lowrank(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor) -> None:
    """``out = P Q^T``: PowerSGD's decompression as one write of ``out``.

    A pointwise sum of ``rank`` outer products instead of a matmul with
    inner size ``rank`` (measured 3.3 ms against 6.8 ms for ``torch.mm``
    into a 4096 x 4096 buffer, rank 4, on this machine). Bit for bit the
    same compiled and eager, so ranks that decode the same sums agree even
    if one of them fell back to eager kernels.

    Args:
        p: (rows, r); qt: (r, cols) contiguous; out: (rows, cols) contiguous.
    """
    _K_PSGD_LOWRANK(p, qt, out, spec=(int(p.shape[1]), out.dtype), numel=out.numel())
