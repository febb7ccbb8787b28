"""PowerSGD's native CPU kernels (``powersgd.c``): round 0's ``M = g + (e - P' Q'^T)``
with ``P = M Q``, round 1's ``Q = M^T P`` and Gram-Schmidt, and the decode's ``P Q^T``.

Idea: every sum runs in the lane order CompLL's matrix operators define
(``compll/matrices.py``), so the hand-written compressor and the DSL program
give the same bits, and the order depends on nothing but the index (not on
BLAS, the thread count or an address). The sweeps over a gradient-sized
matrix write with streaming stores, which torch's kernels never use: a store
to a line not in the cache reads it first, so a sweep into another buffer
moves a third more bytes (``lowrank.py`` picks these for float32 CPU tensors;
``tests/unit/test_native_powersgd.py`` checks them).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .._build import native
from .._build.native import load as _load
from .._build.native import parallel as _map
from .._build.native import rows as _rows

__all__ = ["PSGD_MAX_RANK", "psgd_form_m", "psgd_lowrank", "psgd_lowrank_sgd", "psgd_mq",
           "psgd_mtp", "psgd_orthogonalize"]

_P, _I64, _I32, _U32, _F32 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32,
                              ctypes.c_float)


def _declare(lib: ctypes.CDLL) -> None:
    lib.hp_psgd_form_m.argtypes = [_P, _P, _P, _P, _I32, _P, _I32, _P, _P, _I64, _I64, _I64,
                                   _I32]
    lib.hp_psgd_form_m.restype = None
    lib.hp_psgd_lowrank.argtypes = [_P, _P, _I32, _P, _I64, _I64, _I64]
    lib.hp_psgd_lowrank.restype = None
    lib.hp_psgd_lowrank_sgd.argtypes = [_P, _P, _I32, _P, _P, _P, _I64, _I64, _I64, _F32, _F32,
                                        _F32, _F32, _I32, _I32, _I32]
    lib.hp_psgd_lowrank_sgd.restype = None
    lib.hp_psgd_mq.argtypes = [_P, _P, _I32, _P, _I64, _I64, _I64]
    lib.hp_psgd_mq.restype = None
    lib.hp_psgd_mtp.argtypes = [_P, _P, _I32, _P, _I64, _I64, _I64, _I64, _I32]
    lib.hp_psgd_mtp.restype = _I32
    lib.hp_psgd_orthogonalize.argtypes = [_P, _I64, _I64]
    lib.hp_psgd_orthogonalize.restype = _I32

native.bind(_declare)


#: The largest rank (and pending rank) ``psgd_form_m`` takes.
PSGD_MAX_RANK = 8

#: The dtypes M (the error memory) may have on the native path: float32, or
#: bfloat16 (``PowerSGD(error_dtype="bfloat16")``; ``powersgd.c`` rounds as torch).
M_DTYPES = (torch.float32, torch.bfloat16)


def _half(m: torch.Tensor) -> int:
    if m.dtype not in M_DTYPES:
        raise TypeError(f"powersgd native kernels take M in {M_DTYPES}, found {m.dtype}")
    return int(m.dtype == torch.bfloat16)


def psgd_form_m(e: torch.Tensor, g: torch.Tensor, p_prev: Optional[torch.Tensor],
                qt_prev: Optional[torch.Tensor], qt: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """PowerSGD's round 0 into a second buffer: ``out = g + (e - P' Q'^T)`` with the
    bits of ``lowrank.py``'s pointwise formula, written with streaming stores,
    and ``P = out Q`` (the lane order) returned (rows, rank) from the same sweep
    (``powersgd.c`` says why). All contiguous float32 (rows, cols) / (rows, r') / (r', cols) /
    (rank, cols) on the CPU, ranks at most ``PSGD_MAX_RANK``; ``e`` and ``out`` may
    instead both be bfloat16 (M kept in 16 bits: ``out`` receives M rounded as torch
    rounds float32 to bfloat16, and P sums the rounded values)."""
    lib = _load()
    half = _half(out)
    if e.dtype != out.dtype:
        raise TypeError(f"powersgd: e is {e.dtype}, out {out.dtype}; they must match")
    rows, cols = out.shape
    rank = int(qt.shape[0])
    prev = 0 if p_prev is None else int(p_prev.shape[1])
    p = torch.empty(rows, rank, dtype=torch.float32)
    ep, gp, qtp, op, pp = e.data_ptr(), g.data_ptr(), qt.data_ptr(), out.data_ptr(), p.data_ptr()
    ppp = p_prev.data_ptr() if prev else None
    qpp = qt_prev.data_ptr() if prev else None
    _map(lambda r0, r1, last: lib.hp_psgd_form_m(ep, gp, ppp, qpp, prev, qtp, rank, op, pp,
                                                  cols, r0, r1, half), _rows(rows, cols))
    return p


def psgd_lowrank(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor) -> None:
    """PowerSGD's decode ``out = P Q^T`` with the bits of ``lowrank.py``'s
    outer-product sum, written with streaming stores: contiguous float32 (rows, r),
    (r, cols) and (rows, cols) on the CPU, r at least 1."""
    lib = _load()
    rows, cols = out.shape
    rank = int(p.shape[1])
    pp, qtp, op = p.data_ptr(), qt.data_ptr(), out.data_ptr()
    _map(lambda r0, r1, last: lib.hp_psgd_lowrank(pp, qtp, rank, op, cols, r0, r1),
         _rows(rows, cols))


def psgd_lowrank_sgd(p: torch.Tensor, qt: torch.Tensor, grad: torch.Tensor,
                     param: torch.Tensor, buf: Optional[torch.Tensor], *, lr: float,
                     momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                     nesterov: bool = False, maximize: bool = False, init: bool = False) -> None:
    """PowerSGD's decode ``grad = P Q^T`` (``psgd_lowrank``'s bits, streamed) and
    ``torch.optim.SGD``'s step of ``param`` on it, in one sweep (``powersgd.c``
    says which roundings make the bits torch's ``_single_tensor_sgd``'s).

    Args:
        p, qt: contiguous float32 (rows, r) and (r, cols) on the CPU.
        grad, param: contiguous float32 tensors of rows * cols elements; ``grad``
            receives the decode, ``param`` the update.
        buf: the momentum buffer (``param``'s shape), None when ``momentum`` is 0;
            with ``init`` it receives the first step's buffer (torch's clone).
        lr, momentum, dampening, weight_decay, nesterov, maximize: the group's
            SGD settings.
    """
    lib = _load()
    rows, cols = int(p.shape[0]), int(qt.shape[1])
    rank = int(p.shape[1])
    bp = buf.data_ptr() if momentum else None
    pp, qtp, gp, wp = p.data_ptr(), qt.data_ptr(), grad.data_ptr(), param.data_ptr()
    _map(lambda r0, r1, last: lib.hp_psgd_lowrank_sgd(
        pp, qtp, rank, gp, wp, bp, cols, r0, r1, lr, momentum, 1.0 - dampening, weight_decay,
        int(nesterov), int(maximize), int(init)), _rows(rows, cols))


def psgd_mq(m: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """``P = M Q`` in the lane order (``psgd_form_m``'s sums, for a matrix already
    formed): contiguous float32 (rows, cols) and (rank, cols) on the CPU, rank at
    most ``PSGD_MAX_RANK``; returns (rows, rank)."""
    lib = _load()
    rows, cols = m.shape
    rank = int(qt.shape[0])
    p = torch.empty(rows, rank, dtype=torch.float32)
    mp, qtp, pp = m.data_ptr(), qt.data_ptr(), p.data_ptr()
    _map(lambda r0, r1, last: lib.hp_psgd_mq(mp, qtp, rank, pp, cols, r0, r1),
         _rows(rows, cols))
    return p


def psgd_mtp(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``Q = M^T P`` in the lane order over M's rows: contiguous float32 (or, for M,
    bfloat16) (rows, cols) and float32 (rows, rank) on the CPU; returns (cols, rank).
    Column blocks run on the native thread pool.

    Raises:
        MemoryError: the per-call lane buffer could not be allocated.
    """
    lib = _load()
    half = _half(m)
    rows, cols = m.shape
    rank = int(p.shape[1])
    q = torch.empty(cols, rank, dtype=torch.float32)
    mp, pp, qp = m.data_ptr(), p.data_ptr(), q.data_ptr()
    res = _map(lambda c0, c1, last: lib.hp_psgd_mtp(mp, pp, rank, qp, rows, cols, c0, c1,
                                                     half),
               _rows(cols, rows))
    if any(res):
        raise MemoryError(f"powersgd: no memory for the lanes of a {rows}x{cols} M^T P")
    return q


def psgd_orthogonalize(a: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of a contiguous float32 CPU matrix, in place, every
    sum in the lane order (``ops.orthogonalize_``'s steps); returns ``a``.

    Raises:
        MemoryError: the projection buffer could not be allocated.
    """
    rows, cols = a.shape
    if _load().hp_psgd_orthogonalize(a.data_ptr(), rows, cols):
        raise MemoryError(f"powersgd: no memory to orthogonalize a {rows}x{cols} matrix")
    return a
