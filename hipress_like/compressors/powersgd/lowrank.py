"""PowerSGD's fused kernels and products: forming M = g + (e - P' Q'^T) with the previous
step's error, P = M Q, Q = M^T P, Gram-Schmidt and P Q^T.

Compiled through ``_build.fused.Kernel`` under the same rules as the quantizers'
kernels (``_build/fused.py``'s module docstring): the compiled and the eager version
round alike, so every rank gets the same bits whichever runs. Kept apart
from the quantizers' kernels so each file holds one compressor family's loops.

For float32 on the CPU everything runs as C (``native.py``): the sweeps write
with streaming stores (the matrices are larger than any cache, and an
ordinary store first reads the line it writes, a third more traffic for a
sweep into a buffer other than the one just read), and every sum runs in the
lane order CompLL's matrix operators define (``compll/matrices.py``), so the
PowerSGD program written in CompLL (``powersgd.compll``) gives the same bits.
Elsewhere (other dtypes, other devices) the products go through torch's
BLAS: the same values up to rounding, the ranks still agreeing with each other.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .._build import native as _native
from .._build.fused import Kernel
from ..ops import matmul, orthogonalize_
from . import cuda as _gpu
from . import native as _c

__all__ = ["powersgd_form_m", "powersgd_lowrank", "powersgd_mq", "powersgd_mtp",
           "powersgd_orthogonalize"]


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
                        qt_prev: torch.Tensor, qt: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # one loop: M = g + (e - P' Q'^T) into out, and the rank row reductions P = M Q
            if prev_rank:
                m = g.to(e.dtype) + (e - _outer_sum(p_prev, qt_prev, prev_rank))
            else:
                m = g.to(e.dtype) + e
            out.copy_(m)
            return torch.stack([(m * qt[k:k + 1, :]).sum(1) for k in range(rank)], 1)
        # eager: no gradient-sized temporaries, BLAS for the products (x + g rounds
        # as g + x: the sum commutes bit for bit)
        if prev_rank:
            if out is e:
                e.addmm_(p_prev, qt_prev, alpha=-1.0)
            else:
                torch.addmm(e, p_prev, qt_prev, alpha=-1.0, out=out)
            out.add_(g)
        elif out is e:
            e.add_(g)
        else:
            torch.add(e, g, out=out)
        return matmul(out, qt.t())
    return powersgd_form_m


def _powersgd_lowrank_fn(rank: int, dtype: torch.dtype) -> Callable:
    def powersgd_lowrank(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(_outer_sum(p, qt, rank))
    return powersgd_lowrank


def _form_m_widened(e: torch.Tensor, g: torch.Tensor, p_prev, qt_prev, qt: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """Round 0 for an M kept in a narrower dtype than the factors (bfloat16 M, float32
    P and Q; no native kernel: another device): ``g + (e - P' Q'^T)`` in the factors'
    dtype, stored into ``out`` (rounding as the C kernel does), and ``P`` from the
    stored values."""
    wide = qt.dtype
    m = g.to(wide) + (e.to(wide) - _outer_sum(p_prev, qt_prev, int(p_prev.shape[1]))
                      if p_prev is not None else e.to(wide))
    out.copy_(m)
    return matmul(out.to(wide), qt.t())


_K_PSGD_FORM_M = Kernel(_powersgd_form_m_fn, "powersgd form M")
_K_PSGD_LOWRANK = Kernel(_powersgd_lowrank_fn, "powersgd decompress")


def powersgd_form_m(e: torch.Tensor, g: torch.Tensor, p_prev, qt_prev,
                    qt: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PowerSGD's error feedback and first product in one sweep (Vogels et al. 2019, Alg. 2).

    ``M = g + (e - P' Q'^T)`` is written into ``out`` (default: ``e`` itself;
    ``e`` is the previous step's error kept in factored form, see
    ``PowerSGD``) and ``P = M Q`` is returned,
    computed as ``rank`` row reductions in the same loop, so the matrix is
    read once for both instead of twice (a sum, then ``M @ Q``).
    On float32 CPU tensors P sums in the lane order (``native.psgd_form_m``);
    compiled and eager results agree with it to rounding (the sums' order
    differs), not bit for bit: ``P`` is a local payload, ranks need not agree
    on it.

    Args:
        e: (rows, cols) contiguous accumulator.
        g: (rows, cols) gradient view (any float dtype).
        p_prev, qt_prev: the pending factors (rows, r) and (r, cols), or None.
        qt: (r, cols) contiguous: Q transposed.
        out: (rows, cols) contiguous, ``e``'s dtype: receives M, leaving ``e``
            as it was (double buffering, ``PowerSGD.detach_state``); the
            same bits as writing into ``e``.
            ``e`` and ``out`` may both be bfloat16 with float32 factors (M kept
            in 16 bits, ``PowerSGD(error_dtype="bfloat16")``): P then sums the
            stored values.

    Returns:
        P, (rows, r).
    """
    prev = 0 if p_prev is None else int(p_prev.shape[1])
    out = e if out is None else out
    if _native_form_m(e, g, p_prev, qt_prev, qt, out):  # CPU tensors only: never a GPU's
        # C's streaming stores skip the read for ownership of a second buffer, and
        # in place or not the bits are the same (_c.psgd_form_m)
        return _c.psgd_form_m(e, g, p_prev.contiguous() if prev else None,
                              qt_prev.contiguous() if prev else None, qt, out)
    if out.dtype != qt.dtype:
        return _form_m_widened(e, g, p_prev, qt_prev, qt, out)  # a bfloat16 M elsewhere
    if max(int(qt.shape[0]), prev) <= _c.PSGD_MAX_RANK and _gpu.usable(e, g, qt, out) and (
            not prev or _gpu.usable(p_prev.contiguous(), qt_prev.contiguous(), e)):
        facs = (p_prev.contiguous(), qt_prev.contiguous()) if prev else (None, None)
        _gpu.psgd_form_m(e, g, *facs, out)  # the lane order on the GPU (cuda.py)
        return _gpu.psgd_mq(out, qt)
    return _K_PSGD_FORM_M(e, g, p_prev, qt_prev, qt, out,
                          spec=(int(qt.shape[0]), prev, g.dtype, e.dtype), numel=e.numel())


def powersgd_lowrank(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor) -> None:
    """``out = P Q^T``: PowerSGD's decompression as one write of ``out``.

    A pointwise sum of ``rank`` outer products instead of a matmul with
    inner size ``rank``: one streaming write of ``out``, which a matmul of
    inner size ``rank`` cannot make efficient. Bit for bit the
    same compiled and eager, so ranks that decode the same sums agree even
    if one of them fell back to eager kernels.

    Args:
        p: (rows, r); qt: (r, cols) contiguous; out: (rows, cols) contiguous.
    """
    if int(p.shape[1]) >= 1 and _native.usable(p, qt, out, dtypes=(torch.float32,)):
        _c.psgd_lowrank(p, qt, out)  # the same bits, streaming stores
        return
    _K_PSGD_LOWRANK(p, qt, out, spec=(int(p.shape[1]), out.dtype), numel=out.numel())


def _native_lanes(*tensors: torch.Tensor) -> bool:
    return _native.usable(*tensors, dtypes=(torch.float32,))


def powersgd_mq(m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``P = M Q`` (rows, r) for a formed (rows, cols) matrix: in the lane order on
    float32 CPU tensors (``native.psgd_mq``, ``powersgd_form_m``'s sums) and float32
    CUDA tensors with cupy (``cuda.psgd_mq``), else ``ops.matmul``."""
    qt = q.t().contiguous()
    if int(qt.shape[0]) <= _c.PSGD_MAX_RANK:
        if _native_lanes(m, qt):
            return _c.psgd_mq(m, qt)
        if _gpu.usable(m, qt):
            return _gpu.psgd_mq(m, qt)
    return matmul(m, q)


def powersgd_mtp(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``Q = M^T P`` (cols, r), PowerSGD's round-1 product: in the lane order over
    M's rows on float32 CPU tensors (``native.psgd_mtp``; M may be bfloat16) and
    float32 CUDA tensors with cupy (``cuda.psgd_mtp``), else ``ops.matmul``."""
    if _native.usable(m, dtypes=_c.M_DTYPES) and _native_lanes(p):
        return _c.psgd_mtp(m, p)  # a bfloat16 M widens as it is read
    if m.dtype != p.dtype:  # a bfloat16 M elsewhere: widened first
        m = m.to(p.dtype)
    if int(p.shape[1]) <= _c.PSGD_MAX_RANK and _gpu.usable(m, p):
        return _gpu.psgd_mtp(m, p)
    return matmul(m.t(), p)


def powersgd_orthogonalize(a: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``a``, in place (Vogels et al. 2019, Alg. 1
    ORTHOGONALIZE; ``ops.orthogonalize_``'s steps): every sum in the lane order on a
    contiguous float32 CPU matrix (``native.psgd_orthogonalize``) or CUDA matrix with
    cupy (``cuda.psgd_orthogonalize``), else ``ops.orthogonalize_``. Returns ``a``."""
    if a.dim() == 2 and _native_lanes(a):
        return _c.psgd_orthogonalize(a)
    if a.dim() == 2 and _gpu.usable(a):
        return _gpu.psgd_orthogonalize(a)
    return orthogonalize_(a)


def _native_form_m(e, g, p_prev, qt_prev, qt, out) -> bool:
    """``_c.psgd_form_m`` takes these: float32 CPU tensors (the factors may be
    views: the caller makes them contiguous), ranks it handles."""
    if int(qt.shape[0]) > _c.PSGD_MAX_RANK or (
            p_prev is not None and int(p_prev.shape[1]) > _c.PSGD_MAX_RANK):
        return False
    facs = () if p_prev is None else (p_prev, qt_prev)
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" for t in facs)
            and e.dtype == out.dtype and _native.usable(e, out, dtypes=_c.M_DTYPES)
            and _native.usable(g, qt, dtypes=(torch.float32,)))
