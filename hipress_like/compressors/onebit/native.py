"""onebit's native CPU loops (``onebit.c``), the compressor on the PS fast path
(HiPress Sec. 6.2).

Idea: on this project's reference host (AVX2, one core per two ranks)
inductor's code for onebit's decode ran several times slower than the same
loop written in C, and its fused ``mem += grad; pack`` too: those loops mix
a byte stream with eight float planes, which inductor does not vectorise
well. They are written once in C (``onebit.c``), built by ``_build/native.py``
and called here; ``onebit/fused.py`` picks them for contiguous float32 CPU
tensors. Same bytes and floats as the torch kernels (``tests/unit/test_native.py``).
"""
from __future__ import annotations

import ctypes
import struct
from typing import Optional, Sequence, Tuple

import torch

from .._build import native
from .._build.native import load as _load
from .._build.native import parallel as _map
from .._build.native import ranges as _ranges

__all__ = ["onebit_pack", "onebit_sums", "onebit_unpack", "onebit_unpack_add_many", "sums_scale_ok"]

_P, _I64, _I32, _U32, _F32 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32,
                              ctypes.c_float)


def _declare(lib: ctypes.CDLL) -> None:
    lib.hp_onebit_pack.argtypes = [_P, _P, _P, _I64, _I64, _I64, _I32, _P]
    lib.hp_onebit_pack.restype = ctypes.c_uint32
    lib.hp_onebit_sums.argtypes = [_P, _I64, _I64, _F32, _P]
    lib.hp_onebit_sums.restype = None
    lib.hp_onebit_unpack.argtypes = [_P, _P, _I64, _I64, _I64, _I32, _F32, _F32, _I32]
    lib.hp_onebit_unpack.restype = None
    lib.hp_onebit_unpack_add_many.argtypes = [_P, _P, _I32, _P, _I64, _I64, _I64, _I32]
    lib.hp_onebit_unpack_add_many.restype = None

native.bind(_declare)


def _bits_to_float(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


def onebit_pack(x: torch.Tensor, body: torch.Tensor, grad: Optional[torch.Tensor] = None,
                residual: Optional[Tuple[float, float]] = None) -> torch.Tensor:
    """Pack the sign bits of flat float32 ``x`` into ``body``; return max|x| as a
    float32 0-d tensor (NaN/Inf propagate).

    With ``grad``, ``x += grad`` first (stored back); with ``residual`` =
    (a, b) as well, ``x -= (a if x >= 0 else b)`` before that (float32 values).
    """
    if residual is not None and grad is None:
        raise ValueError("onebit_pack: a residual is only taken out together with grad")
    lib = _load()
    n = x.numel()
    xp, bp = x.data_ptr(), body.data_ptr()
    gp = grad.data_ptr() if grad is not None else None
    res = (ctypes.c_float * 2)(*residual) if residual is not None else None
    parts = _map(lambda j0, j1, last: lib.hp_onebit_pack(xp, gp, bp, n, j0, j1, int(last), res),
                 _ranges(n // 8, n))
    return torch.tensor(_bits_to_float(max(parts)), dtype=torch.float32)


def sums_scale_ok(scale: float) -> bool:
    """True when onebit's fixed-point ``scale`` is a float32 normal number, which
    ``onebit_sums`` needs (it is, unless max|x| is below ~1e-32)."""
    return 2.0 ** -126 <= scale <= 2.0 ** 127


def onebit_sums(x: torch.Tensor, scale: float) -> Tuple[int, int, int]:
    """onebit's exact fixed-point sums of flat float32 ``x`` (``fused._onebit_sums_fn``):
    (sum of rint(x*scale) over x >= 0, over all, count of x >= 0), as integers.

    ``x`` must be finite, ``scale`` a power of two passing ``sums_scale_ok``
    with max|x| * scale <= 2**20 (how ``fused._onebit_values`` picks it).
    """
    lib = _load()
    n = x.numel()
    xp = x.data_ptr()

    def part(j0, j1, last):
        res = (ctypes.c_int64 * 3)()
        lib.hp_onebit_sums(xp, j0 * 8, n if last else j1 * 8, scale, res)
        return res[0], res[1], res[2]

    parts = _map(part, _ranges(n // 8, n))
    return tuple(sum(p[i] for p in parts) for i in range(3))


def onebit_unpack(body: torch.Tensor, out: torch.Tensor, a: float, b: float,
                  add: bool) -> None:
    """``out = a where the bit is 1 else b`` (or ``out +=`` that, when ``add``), flat float32."""
    lib = _load()
    n = out.numel()
    bp, op = body.data_ptr(), out.data_ptr()
    _map(lambda j0, j1, last: lib.hp_onebit_unpack(bp, op, n, j0, j1, int(add), a, b, int(last)),
         _ranges(n // 8, n))


def onebit_unpack_add_many(bodies: Sequence[torch.Tensor], out: torch.Tensor,
                           values: Sequence[Tuple[float, float]]) -> None:
    """``out += decode(body_i)`` for each i in order (``values[i]`` = (a_i, b_i)), flat float32."""
    lib = _load()
    n = out.numel()
    count = len(bodies)
    ptrs = (ctypes.c_void_p * count)(*[bd.data_ptr() for bd in bodies])
    vals = (ctypes.c_float * (2 * count))(*[v for ab in values for v in ab])
    op = out.data_ptr()
    _map(lambda j0, j1, last: lib.hp_onebit_unpack_add_many(ptrs, vals, count, op, n, j0, j1,
                                                            int(last)),
         _ranges(n // 8, n))
