"""onebit's fused kernels: 1-bit SGD's encode, decode and residual as torch.compile
kernels (``_build/fused.py`` has the machinery and the rules that make the
compiled and the eager version give the same bits), with the C loops of
``onebit.c`` (``native.py``) taking contiguous float32 CPU tensors.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from .._build import native as _native
from .._build.fused import (
    Kernel,
    _divisor,
    _emit,
    _max2,
    _run_pack,
    _run_unpack,
    _run_unpack_tail,
    _split,
)
from ..ops import _pack_planes, _plane_codes
from . import native as _c

__all__ = ["onebit_decode", "onebit_decode_add_many", "onebit_encode",
           "onebit_encode_accumulated", "onebit_residual"]


def _onebit_pack_fn() -> Callable:
    def onebit_pack(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Sign bits of x (1 for x >= 0: 1-bit SGD's threshold 0, Seide et al. 2014,
        Sec. 2) into ``out``; returns max|x| (NaN/Inf propagate)."""
        out.copy_(_pack_planes(torch.where(x.view(8, -1) >= 0, 1.0, 0.0), 1))
        return x.abs().amax()
    return onebit_pack


def _onebit_pack_acc_fn() -> Callable:
    def onebit_pack_acc(mem: torch.Tensor, grad: torch.Tensor, out: torch.Tensor
                        ) -> torch.Tensor:
        """``mem += grad`` (error feedback's compensation), then ``onebit_pack`` of the
        sum, in one sweep: the sum is stored and packed without reading it back."""
        x = mem + grad
        mem.copy_(x)
        out.copy_(_pack_planes(torch.where(x.view(8, -1) >= 0, 1.0, 0.0), 1))
        return x.abs().amax()
    return onebit_pack_acc


def _onebit_sums_fn() -> Callable:
    def onebit_sums(x: torch.Tensor, scale: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Exact, order-independent sums for 1-bit SGD's two reconstruction values.

        Each value becomes a fixed-point integer ``rint(x * scale)`` in float64
        (|.| <= 2**20), so the sums are exact for up to 2**33 elements whatever
        the reduction order. Returns (sum over x >= 0, sum over all, #(x >= 0)).
        """
        q = torch.round(x.to(torch.float64) * scale)
        pos = x >= 0
        return torch.where(pos, q, 0.0).sum(), q.sum(), pos.sum()
    return onebit_sums


def _onebit_unpack_fn(mode: str, out_dtype: torch.dtype) -> Callable:
    def onebit_unpack(packed: torch.Tensor, out: torch.Tensor, pos: torch.Tensor,
                      neg: torch.Tensor, d: torch.Tensor, shift: torch.Tensor) -> None:
        """One plane: ``pos`` where the bit at ``shift`` of the byte is 1, ``neg`` where it is 0."""
        _emit(out, torch.where(_plane_codes(packed, 1, shift) != 0, pos, neg), mode, d)
    return onebit_unpack


def _onebit_unpack_add_many_fn(count: int) -> Callable:
    def onebit_unpack_add_many(out: torch.Tensor, shift: torch.Tensor, *planes: torch.Tensor
                               ) -> None:
        """One plane of ``count`` payloads added into float32 ``out`` in order:
        ``planes`` is (packed, pos, neg) per payload. The float32 sums round
        as the same additions one payload at a time would."""
        acc = out
        for i in range(count):
            packed, pos, neg = planes[3 * i: 3 * i + 3]
            acc = acc + torch.where(_plane_codes(packed, 1, shift) != 0, pos, neg)
        out.copy_(acc)
    return onebit_unpack_add_many


def _onebit_residual_fn(dtype: torch.dtype) -> Callable:
    def onebit_residual(x: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> None:
        """``x -= (pos if x >= 0 else neg)``: x minus its 1-bit reconstruction."""
        x.copy_(x - torch.where(x >= 0, pos, neg))
    return onebit_residual


_K_ONEBIT_PACK = Kernel(_onebit_pack_fn, "onebit encode")
_K_ONEBIT_PACK_ACC = Kernel(_onebit_pack_acc_fn, "onebit accumulate+encode")
_K_ONEBIT_SUMS = Kernel(_onebit_sums_fn, "onebit sums")
_K_ONEBIT_UNPACK = Kernel(_onebit_unpack_fn, "onebit decode")
_K_ONEBIT_RESIDUAL = Kernel(_onebit_residual_fn, "onebit residual")
_K_ONEBIT_UNPACK_ADD_MANY = Kernel(_onebit_unpack_add_many_fn, "onebit decode-add (many)")


def _native_f32(*tensors: torch.Tensor) -> bool:
    """True when onebit may run ``onebit.c``'s loops on these tensors: float32
    values (uint8 bodies) on the CPU, contiguous, and the library built."""
    return (any(t.dtype == torch.float32 for t in tensors) and _native.usable(*tensors))


def onebit_encode(x: torch.Tensor, body: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    """Pack sign bits of flat ``x`` into ``body``; return (value for 1, value for 0, max|x|).

    The values are 1-bit SGD's reconstruction (Seide et al. 2014, Sec. 2):
    the means of the x >= 0 and the x < 0 parts, as float64 0-d tensors (0
    for an empty part), from exact fixed-point sums.
    """
    if _native_f32(x, body):
        return _onebit_values(x, _c.onebit_pack(x, body))
    amax = _max2(*_run_pack(_K_ONEBIT_PACK, x, body, 8, (), ()))
    return _onebit_values(x, amax)


def onebit_encode_accumulated(mem: torch.Tensor, grad: torch.Tensor, body: torch.Tensor,
                              residual: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mem += grad``, then ``onebit_encode(mem, body)``, with the addition fused into
    the packing sweep (flat contiguous tensors of one dtype; same bits as the two
    steps: the float sum rounds the same in the kernel as in ``add_``).

    ``residual`` = (value for 1, value for 0), 0-d tensors of ``mem``'s dtype:
    first ``onebit_residual(mem, *residual)`` (the last step's residual, deferred
    by error feedback); the native loop does it in the same sweep, same bits.
    """
    if _native_f32(mem, grad, body):
        res = None if residual is None else (float(residual[0]), float(residual[1]))
        return _onebit_values(mem, _c.onebit_pack(mem, body, grad, res))
    if residual is not None:
        onebit_residual(mem, *residual)
    n = mem.numel()
    full = n - n % 8
    r_main = r_tail = None
    if full:
        r_main = _K_ONEBIT_PACK_ACC(mem[:full], grad[:full], body[: full // 8])
    if full < n:
        mem[full:].add_(grad[full:])
        _, tail = _split(mem, 8)
        r_tail = _K_ONEBIT_PACK.eager(())(tail, body[full // 8:])
    return _onebit_values(mem, _max2(r_main, r_tail))


def _onebit_values(x: torch.Tensor, amax: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-bit SGD's two reconstruction values of flat ``x`` (packed already), and max|x|."""
    # Fixed-point unit: the power of two with max|x| * scale in [2**19, 2**20], so the
    # sums of rint(x * scale) are exact up to 2**33 elements (float64 has 53 bits) and
    # dividing by scale is exact. (0 -> 2**20; tiny inputs are capped at 2**1000.)
    exp = torch.frexp(amax.to(torch.float64)).exponent
    scale = torch.ldexp(torch.ones((), dtype=torch.float64, device=x.device),
                        (20 - exp).clamp(max=1000))
    if (_native_f32(x) and bool(torch.isfinite(amax))
            and _c.sums_scale_ok(float(scale))):  # else the error path or ~1e-32 values
        ps_, ts_, cnt_ = _c.onebit_sums(x, float(scale))
        ps = torch.tensor(float(ps_), dtype=torch.float64, device=x.device)
        ts = torch.tensor(float(ts_), dtype=torch.float64, device=x.device)
        cnt = torch.tensor(cnt_, dtype=torch.int64, device=x.device)
    else:
        ps, ts, cnt = _K_ONEBIT_SUMS(x, scale)
    n = x.numel()
    cnt_f = cnt.to(torch.float64)
    zero = torch.zeros_like(ps)
    pos = torch.where(cnt > 0, ps / cnt_f.clamp(min=1) / scale, zero)
    neg = torch.where(cnt < n, (ts - ps) / (n - cnt_f).clamp(min=1) / scale, zero)
    return pos, neg, amax


def onebit_decode(body: torch.Tensor, out: torch.Tensor, pos: torch.Tensor,
                  neg: torch.Tensor, mode: str = "set", d: float = 1.0) -> None:
    """``pos`` where the bit is 1 and ``neg`` where it is 0, stored into flat ``out``
    as ``mode`` says (``_emit``: set, add, or divide by ``d``)."""
    if _native_f32(out, body, pos, neg):
        v = torch.stack([pos, neg]).to(out.dtype)  # rounds as _emit does
        a, b = (v / _divisor(out, d) if mode == "div" else v).tolist()
        _c.onebit_unpack(body, out, a, b, add=mode == "add")
        return
    _run_unpack(_K_ONEBIT_UNPACK, body, out, 8, (pos, neg, _divisor(out, d)), spec=(mode,))


def onebit_decode_add_many(bodies: Sequence[torch.Tensor], out: torch.Tensor,
                           values: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``out += decode(body_i)`` for each payload in order, one pass over float32 ``out``.

    ``values[i]`` is payload i's (value for 1, value for 0) as 0-d float32
    tensors. Planes go through one kernel for all payloads; the elements of the
    last partial byte are added payload by payload (same order, same bits).
    """
    if _native_f32(out, *bodies, *(v for pn in values for v in pn)):
        _c.onebit_unpack_add_many(bodies, out, [(float(p), float(q)) for p, q in values])
        return
    n = out.numel()
    m = n // 8
    count = len(bodies)
    if m:
        args = [t for body, (pos, neg) in zip(bodies, values) for t in (body[:m], pos, neg)]
        for k in range(8):
            kt = torch.tensor(k, dtype=torch.int32, device=out.device)
            _K_ONEBIT_UNPACK_ADD_MANY(out[k * m: (k + 1) * m], kt, *args, spec=(count,),
                                      numel=n)
    if n - m * 8:
        one = torch.ones((), dtype=out.dtype, device=out.device)
        for body, (pos, neg) in zip(bodies, values):
            _run_unpack_tail(_K_ONEBIT_UNPACK, body, out, 8, (pos, neg, one), ("add",))


def onebit_residual(x: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> None:
    """``x -= pos where x >= 0 else neg``, in place, one pass (flat contiguous ``x``)."""
    _K_ONEBIT_RESIDUAL(x, pos, neg, spec=(x.dtype,))
