"""PowerSGD's native CPU sweeps (``powersgd.c``): round 0's ``M = g + e - P' Q'^T``
with ``P = M Q``, and the decode's ``P Q^T``.

Idea: both sweep a gradient-sized matrix and write it with streaming stores,
which torch's kernels never use: a store to a line not in the cache reads it
first, so a sweep into another buffer moves a third more bytes
(``lowrank.py`` picks these for float32 CPU tensors;
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

__all__ = ["PSGD_MAX_RANK", "psgd_form_m", "psgd_lowrank"]

_P, _I64, _I32, _U32, _F32 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32,
                              ctypes.c_float)


def _declare(lib: ctypes.CDLL) -> None:
    lib.hp_psgd_form_m.argtypes = [_P, _P, _P, _P, _I32, _P, _I32, _P, _P, _I64, _I64, _I64]
    lib.hp_psgd_form_m.restype = None
    lib.hp_psgd_lowrank.argtypes = [_P, _P, _I32, _P, _I64, _I64, _I64]
    lib.hp_psgd_lowrank.restype = None

native.bind(_declare)


#: The largest rank (and pending rank) ``psgd_form_m`` takes.
PSGD_MAX_RANK = 8


def psgd_form_m(e: torch.Tensor, g: torch.Tensor, p_prev: Optional[torch.Tensor],
                qt_prev: Optional[torch.Tensor], qt: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """PowerSGD's round 0 into a second buffer: ``out = (g + e) - P' Q'^T`` with the
    bits of ``lowrank.py``'s pointwise formula, written with streaming stores,
    and ``P = out Q`` returned (rows, rank) from the same sweep (``powersgd.c``
    says why). All contiguous float32 (rows, cols) / (rows, r') / (r', cols) /
    (rank, cols) on the CPU, ranks at most ``PSGD_MAX_RANK``."""
    lib = _load()
    rows, cols = out.shape
    rank = int(qt.shape[0])
    prev = 0 if p_prev is None else int(p_prev.shape[1])
    p = torch.empty(rows, rank, dtype=torch.float32)
    ep, gp, qtp, op, pp = e.data_ptr(), g.data_ptr(), qt.data_ptr(), out.data_ptr(), p.data_ptr()
    ppp = p_prev.data_ptr() if prev else None
    qpp = qt_prev.data_ptr() if prev else None
    _map(lambda r0, r1, last: lib.hp_psgd_form_m(ep, gp, ppp, qpp, prev, qtp, rank, op, pp,
                                                  cols, r0, r1), _rows(rows, cols))
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
