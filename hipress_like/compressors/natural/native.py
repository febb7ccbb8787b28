"""Natural compression's native CPU loops (``natural.c``): C_nat's encode and decode.

Idea: C_nat's loops are of the kind inductor does badly (a hash and a few
integer operations per element into a byte stream and a bit plane; its
eager torch path is ~100x slower), so they are written once in C
(``natural.c``, built by ``_build/native.py``) and called here for contiguous
float32 CPU tensors. Same bytes as the torch path (``tests/unit/test_native.py``).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .._build import native
from .._build.native import load as _load
from .._build.native import parallel as _map
from .._build.native import ranges as _ranges

__all__ = ["natural_decode", "natural_encode"]

_P, _I64, _I32, _U32, _F32 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32,
                              ctypes.c_float)


def _declare(lib: ctypes.CDLL) -> None:
    lib.hp_natural_encode_fast.argtypes = [_P, _P, _P, _I64, _I64, _I64, _U32, _I32, _I32, _P]
    lib.hp_natural_encode_fast.restype = None
    lib.hp_natural_rebase.argtypes = [_P, _I64, _I64, _I32]
    lib.hp_natural_rebase.restype = None
    lib.hp_natural_emax.argtypes = [_P, _I64, _I64, _I64, _U32, _I32, _I32]
    lib.hp_natural_emax.restype = ctypes.c_int32
    lib.hp_natural_encode.argtypes = [_P, _P, _P, _I64, _I64, _I64, _U32, _I32, _I32, _I32]
    lib.hp_natural_encode.restype = None
    lib.hp_natural_decode.argtypes = [_P, _P, _P, _I64, _I64, _I64, _I32, _I32, _F32, _I32]
    lib.hp_natural_decode.restype = None

native.bind(_declare)


def natural_encode(x: torch.Tensor, signs: torch.Tensor, codes: torch.Tensor, key: int,
                   cap: int) -> Optional[int]:
    """C_nat of flat float32 ``x`` (natural.py defines the rules): the sign plane into
    ``signs`` (ceil(n/8) bytes) and one exponent code per element into ``codes``
    (n bytes), from the hash stream keyed by ``key``, output exponents capped at
    ``cap``. Returns the base exponent, or None when ``x`` holds a NaN or an Inf
    (the bytes are then garbage).

    One sweep over ``x`` writes each element's output exponent and finds their
    maximum (the base), a byte-wide sweep turns exponents into codes. An input
    with a subnormal number takes two general sweeps instead (max, then codes).
    """
    lib = _load()
    n = x.numel()
    xp, sp, cp = x.data_ptr(), signs.data_ptr(), codes.data_ptr()
    key &= 0xFFFFFFFF
    ranges = _ranges(n // 8, n)

    def fast(j0, j1, last):
        st = (ctypes.c_uint32 * 3)()
        lib.hp_natural_encode_fast(xp, sp, cp, n, j0, j1, key, cap, int(last), st)
        return st[0], st[1], st[2]

    parts = _map(fast, ranges)
    if max(p[0] for p in parts) >= 0x7F800000:
        return None
    if min(p[1] for p in parts) >= 0x7FFFFF:  # no subnormal: exponents are exact
        base = max(p[2] for p in parts)
        _map(lambda j0, j1, last: lib.hp_natural_rebase(cp, j0 * 8, n if last else j1 * 8,
                                                        base), ranges)
        return base
    emax = max(_map(lambda j0, j1, last: lib.hp_natural_emax(xp, n, j0, j1, key, cap,
                                                             int(last)), ranges))
    base = emax if emax > -(1 << 31) else 0
    _map(lambda j0, j1, last: lib.hp_natural_encode(xp, sp, cp, n, j0, j1, key, base, cap,
                                                    int(last)), ranges)
    return base


def natural_decode(signs: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, base: int,
                   mode: str, d: float = 1.0) -> None:
    """``out = v``, ``out += v`` or ``out = v / d`` (``mode`` "set", "add", "div") for
    the C_nat values v of a payload, flat float32 ``out``."""
    lib = _load()
    n = out.numel()
    sp, cp, op = signs.data_ptr(), codes.data_ptr(), out.data_ptr()
    mcode = {"set": 0, "add": 1, "div": 2}[mode]
    _map(lambda j0, j1, last: lib.hp_natural_decode(sp, cp, op, n, j0, j1, base, mcode, d,
                                                    int(last)),
         _ranges(n // 8, n))
