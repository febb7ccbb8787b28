"""THC's native CPU loops (``thc.c``): the randomized Hadamard transform and the
round-1 merge of 4-bit indices.

Idea: per block of 4096 floats, a hash per element (the signs D) and twelve
butterfly stages, all in the L1 cache, where torch makes a pass over memory
per factor; the merge is a 16-entry table lookup per 4-bit field, one
``vpshufb`` with AVX2. Both are written once in C (``thc.c``, built by
``_build/native.py``) and called here for float32 CPU tensors. Same floats as
``thc/kernels.py``'s torch path (``tests/unit/test_thc_native.py``).
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from .._build import native
from .._build.native import load as _load
from .._build.native import parallel as _map
from .._build.native import rows as _rows

__all__ = ["thc_fwht", "thc_merge_b4w8", "thc_rht"]

_P, _I64, _I32, _U32, _F32 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32,
                              ctypes.c_float)


def _declare(lib: ctypes.CDLL) -> None:
    lib.hp_thc_rht.argtypes = [_P, _P, _I64, _P, _U32, _I64, _I64, _I64]
    lib.hp_thc_rht.restype = None
    lib.hp_thc_fwht.argtypes = [_P, _I64, _I64, _I64]
    lib.hp_thc_fwht.restype = None
    lib.hp_thc_merge_b4w8.argtypes = [_P, _I32, _P, _I32, _P, _P, _I64, _I64, _I64]
    lib.hp_thc_merge_b4w8.restype = _I32

native.bind(_declare)


def thc_rht(x: torch.Tensor, y: torch.Tensor, size: int, scale: torch.Tensor, key: int,
            first: int) -> None:
    """``y = H D (x * scale[row])`` per row of ``size`` floats (THC Sec. 5.1), unnormalised:
    flat float32 ``x`` and ``y`` of rows * size elements, float32 ``scale`` per row, D's
    signs from ``key`` with elements numbered from ``first`` (``kernels._rademacher``). The
    floats equal ``kernels._fwht_rows``' butterfly path."""
    lib = _load()
    rows = x.numel() // size
    xp, yp, sp = x.data_ptr(), y.data_ptr(), scale.data_ptr()
    key &= 0xFFFFFFFF
    _map(lambda r0, r1, last: lib.hp_thc_rht(xp, yp, size, sp, key, first, r0, r1),
         _rows(rows, size))


def thc_fwht(y: torch.Tensor, size: int) -> None:
    """``y = H y`` in place per row of ``size`` floats (flat float32), unnormalised."""
    lib = _load()
    yp = y.data_ptr()
    _map(lambda r0, r1, last: lib.hp_thc_fwht(yp, size, r0, r1), _rows(y.numel() // size, size))


def thc_merge_b4w8(indices: Sequence[torch.Tensor], sums: Sequence[torch.Tensor],
                   table: torch.Tensor, out: torch.Tensor, m: int) -> None:
    """THC's round-1 merge for 4-bit indices into 8-bit sums (thc.py ``merge_round``):
    ``out`` (two arrays of ``m`` int32 words) = sum over ``indices`` (m words each) of
    ``table[z]`` per field, plus ``sums`` (two arrays of m words each, width 8). Every
    sum must fit 8 bits (the caller checked N g <= 255); ``table`` is 16 uint8 values."""
    lib = _load()
    ip = (ctypes.c_void_p * max(1, len(indices)))(*[t.data_ptr() for t in indices])
    sp = (ctypes.c_void_p * max(1, len(sums)))(*[t.data_ptr() for t in sums])
    tp, op = table.data_ptr(), out.data_ptr()
    ni, ns = len(indices), len(sums)
    threads = torch.get_num_threads() if m * 8 >= native.PARALLEL_NUMEL else 1
    step = -(-m // max(1, threads))
    step += -step % 8  # whole vectors of words per thread
    ranges = [(j, min(m, j + step)) for j in range(0, m, step)] or [(0, 0)]
    _map(lambda j0, j1, last: lib.hp_thc_merge_b4w8(ip, ni, sp, ns, tp, op, m, j0, j1), ranges)
