"""Natural compression C_nat (Horvath et al., "Natural Compression for Distributed
Deep Learning", MSML 2022 / arXiv:1905.10988; sections and the table are cited by
their names in the paper's summary). Its dithering relatives are in
``dithering.py``, which shares this module's bit-plane helpers.

Idea: C_nat rounds every entry t to one of the two powers of two around it,
at random and without bias, so only its sign and exponent travel: 9 bits
instead of 32 (the paper's table of relative iteration complexity: 9d bits,
(9/8)^theta iterations). It costs almost nothing in convergence, since
C_nat is in B(1/8): E[C_nat(x)] = x and E||C_nat(x)||^2 <= (9/8)||x||^2
(the paper's "unbiased bounded-second moment compression operator" with
omega = 1/8). It is also cheap to compute: the nearest powers of two of an
IEEE float are its exponent field, and the rounding probability is its
mantissa.

Payload (after the common header; the sign plane uses onebit's planar
layout, ``_build/fused.py`` rule 1: byte j holds elements j, m + j, ..., 7m + j,
m = n // 8, and the last n - 8m elements sit in byte m, unused bits 0):
extra = base (int64); body = sign plane (ceil(n/8) bytes, bit 1 for a set
sign bit) + one code byte per element.

C_nat, exactly (t a float32, computed on its bits; float16 and bfloat16
are widened to float32 first, which is exact):

1. e = exponent field, f = mantissa field; a subnormal is normalised
   (e <= 0 is then its exponent, f its fraction), so subnormals round
   between powers of two exactly as normal numbers do.
2. up iff u < f / 2^23, u = ``ops.uniform``'s number i of the stream keyed by
   (state["seed"], state["step"]) as TernGrad keys it (computed as
   (h >> 9) < f on the hash h, exact); the output exponent is
   E = min(e + up, cap). This is the paper's C_nat: sign(t) 2^a with
   probability (2^(a+1) - |t|) / 2^a, else sign(t) 2^(a+1). (The poster's
   formula prints the first probability as (2^a - |t|) / 2^a, a typo: it
   would be negative.)
3. base = the largest E of the tensor's nonzero entries (0 if none); the code
   is base - E in [0, 254], 255 is zero. Any tensor whose nonzero entries lie
   within a factor 2^254 of each other (base - 254 <= every e) is therefore
   encoded exactly by C_nat, subnormals included.

Edge cases, deliberately:

* zero (either sign) encodes as code 255 and decodes to a zero of its sign;
  a tensor of zeros has base 0.
* entries below the code range (e < lo = base - 254; only possible when a
  tensor spans more than 2^254, e.g. subnormals next to values above 2^104)
  become 2^lo with probability |t| / 2^lo, else zero: unbiased up to the
  2^-32 resolution of the comparison (h < floor(M 2^(9-d)), M = 2^23 + f,
  d = lo - e), a bias below 2^(lo-32), i.e. below 2^-285 of the largest
  entry. The 9/8 bound does not hold for those entries.
* overflow: an entry whose round-up would leave the dtype's range
  (|t| >= 2^127 for float32/bfloat16, >= 2^15 for float16, 2^1023 for
  float64) saturates at the largest power of two, cap: E[C(t)] = 2^cap < t
  there (biased), never Inf.
* NaN/Inf: the encode sweep notices them and raises the standard
  ``check_gradient`` error (``nonfinite="always"``), as TernGrad does.
* float64: the same rules on its 11/52-bit fields by the torch path, with a
  63-bit uniform (two hash streams) so the rounding stays exact (below the
  code range: to 2^-63); the code range is 254 below base as for float32.

The float32 CPU path is C (``natural.c``, bound in ``native.py``: one sweep writes each exponent and
finds base, a byte sweep turns exponents into codes; same bytes as the torch
path here, which serves other devices and ``HIPRESS_NO_NATIVE=1``).
Every encode advances ``state["step"]``.
"""
from __future__ import annotations

import struct
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from .._build import fused as _fused
from .._build import native as _native
from ..base import (
    Capabilities,
    Compressor,
    PayloadError,
    PayloadPool,
    State,
    check_gradient,
    header_nbytes,
    workspace,
)
from ..kernels import FusedDecode
from ..ops import _as_i32, _fmix32_i32, mix_seed, packed_nbytes
from ..quantizers.terngrad import step_seed
from ..registry import register
from . import native as _c

__all__ = ["Natural"]

_NAT_EXTRA = struct.Struct("<q")  # base exponent
_ZERO = 255  # C_nat's code for zero
_SPAN = 254  # codes 0..254 are base - E


class _Fmt(NamedTuple):
    """An IEEE binary format as C_nat's torch path needs it."""

    mant: int  # mantissa bits
    bias_sub: int  # (float)f's exponent field minus this is a subnormal f's exponent
    e_min: int  # exponent of the smallest subnormal, normalised
    rand_shift: int  # uniform bits minus mantissa bits
    itype: torch.dtype
    ftype: torch.dtype


_F32 = _Fmt(23, 149, -22, 9, torch.int32, torch.float32)
_F64 = _Fmt(52, 1074, -51, 11, torch.int64, torch.float64)
# the largest power of two of each dtype, as a biased exponent of its computing format
_CAP = {torch.float32: 254, torch.bfloat16: 254, torch.float16: 127 + 15, torch.float64: 2046}
_F64_STREAM = 0x2545F491  # keys float64's second hash stream


def _check_state(name: str, state: Any) -> None:
    if not isinstance(state, dict) or "seed" not in state or "step" not in state:
        raise ValueError(f"{name} needs the state from init(grad, seed) with 'seed' and "
                         f"'step', found {state!r}")


def _advance(state: State) -> State:
    new = dict(state)
    new["step"] = int(state["step"]) + 1
    return new


# ------------------------------------------------------------------ bit planes

# Elements per step of the torch paths: their temporaries stay a few MB, which the
# allocator recycles (a fresh gradient-sized temporary per op costs more in page
# faults than the op itself; see ``base.decode_output``).
_CHUNK = 1 << 20


def _chunks(n: int, step: int = _CHUNK):
    return ((i, min(n, i + step)) for i in range(0, n, step))


def _pack_planes(vals: torch.Tensor, nplanes: int, out: torch.Tensor) -> None:
    """Bit k of n uint8 ``vals`` into plane k of ``out`` (``nplanes`` planes of
    ceil(n/8) bytes each, the planar layout of the module docstring)."""
    n = vals.numel()
    m, q = n // 8, packed_nbytes(n, 1)
    dev = vals.device
    sh = torch.arange(8, dtype=torch.uint8, device=dev).view(8, 1)
    rows = vals[: 8 * m].view(8, m)
    for j0, j1 in _chunks(m, _CHUNK // 8):
        blk = rows[:, j0:j1]
        for k in range(nplanes):
            out[k * q + j0: k * q + j1] = (((blk >> k) & 1) << sh).sum(0, dtype=torch.uint8)
    if n > 8 * m:
        tail = vals[8 * m:]
        sh_t = sh[: n - 8 * m, 0]
        for k in range(nplanes):
            out[k * q + m] = (((tail >> k) & 1) << sh_t).sum(dtype=torch.uint8)


def _unpack_planes(packed: torch.Tensor, n: int, nplanes: int) -> torch.Tensor:
    """Inverse of ``_pack_planes``: n uint8 values whose bit k is plane k's."""
    m, q = n // 8, packed_nbytes(n, 1)
    dev = packed.device
    sh = torch.arange(8, dtype=torch.uint8, device=dev).view(8, 1)
    vals = torch.zeros(n, dtype=torch.uint8, device=dev)
    rows = vals[: 8 * m].view(8, m)
    for j0, j1 in _chunks(m, _CHUNK // 8):
        for k in range(nplanes):
            plane = packed[k * q + j0: k * q + j1].unsqueeze(0)
            rows[:, j0:j1] |= ((plane >> sh) & 1) << k
    if n > 8 * m:
        sh_t = sh[: n - 8 * m, 0]
        for k in range(nplanes):
            vals[8 * m:] |= ((packed[k * q + m] >> sh_t) & 1) << k
    return vals


def _emit(out: torch.Tensor, v: torch.Tensor, mode: str, d: float) -> None:
    _fused._emit(out, v, mode, torch.tensor(d, dtype=out.dtype, device=out.device))


# ------------------------------------------------------------------ C_nat, torch path

def _hash(i0: int, i1: int, key: int, device: Any) -> torch.Tensor:
    """fmix32(i ^ key) for i in [i0, i1) as int64 in [0, 2^32): ``ops.hash32``'s stream
    (counters taken modulo 2^32, as ``ops.uniform``)."""
    c = torch.arange(i1 - i0, dtype=torch.int32, device=device) + _as_i32(i0)
    return _fmix32_i32(c ^ _as_i32(key)).to(torch.int64) & 0xFFFFFFFF


def _nat_round(x: torch.Tensor, i0: int, key: int, cap: int):
    """Steps 1-2 of C_nat on the chunk ``x`` (elements i0...): (|t| bits, e, f, h, E)."""
    fmt = _F64 if x.dtype == torch.float64 else _F32
    mmask = (1 << fmt.mant) - 1
    if fmt is _F64:
        a = x.view(torch.int64) & 0x7FFF_FFFF_FFFF_FFFF
    else:
        a = x.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    e, f = a >> fmt.mant, a & mmask
    fb = f.to(fmt.ftype).view(fmt.itype).to(torch.int64)  # exact: f < 2^mant
    sub = e == 0
    e = torch.where(sub, (fb >> fmt.mant) - fmt.bias_sub, e)
    f = torch.where(sub, fb & mmask, f)
    h = _hash(i0, i0 + x.numel(), key, x.device)
    if fmt is _F64:  # 63 uniform bits, so the probability f / 2^52 is exact
        h2 = _hash(i0, i0 + x.numel(), mix_seed(key ^ _F64_STREAM), x.device)
        h = (h << 31) | (h2 & 0x7FFFFFFF)
    E = (e + (h < (f << fmt.rand_shift)).to(torch.int64)).clamp(max=cap)
    return a, e, f, h, E


def _nat_encode_torch(x: torch.Tensor, signs: torch.Tensor, codes: torch.Tensor, key: int,
                      cap: int) -> int:
    """C_nat of flat float32/float64 ``x`` by the module docstring's steps 1-3 into
    ``signs``/``codes``; returns base, or None when ``x`` holds NaN/Inf (found in
    pass 1, as the native sweep does: |x|'s bits reach the all-ones exponent)."""
    fmt = _F64 if x.dtype == torch.float64 else _F32
    low = torch.iinfo(torch.int64).min
    inf_bits = int(torch.tensor(float("inf"), dtype=fmt.ftype).view(fmt.itype))
    base = low
    for i0, i1 in _chunks(x.numel()):  # pass 1: base = max E of the nonzero entries
        a, _, _, _, E = _nat_round(x[i0:i1], i0, key, cap)
        if int(a.max()) >= inf_bits:
            return None
        base = max(base, int(torch.where(a != 0, E, low).max()))
    base = base if base > low else 0
    r = fmt.rand_shift
    for i0, i1 in _chunks(x.numel()):  # pass 2: codes
        a, e, f, h, E = _nat_round(x[i0:i1], i0, key, cap)
        d = (base - _SPAN) - e  # >= 1: below the code range
        T = ((f | (1 << fmt.mant)) << (r - d).clamp(0, r - 1)) >> (d - r).clamp(0, 62)
        code = torch.where(d >= 1, _ZERO - (h < T).to(torch.int64), base - E)
        codes[i0:i1] = torch.where(a != 0, code, _ZERO).to(torch.uint8)
    _pack_planes(torch.signbit(x).view(torch.uint8), 1, signs)
    return base


def _nat_values(signs: torch.Tensor, codes: torch.Tensor, base: int,
                dtype: torch.dtype) -> torch.Tensor:
    """+-2^(base - c) of codes c (uint8) with sign bits ``signs`` (uint8 0/1), in the
    computing format of ``dtype`` (float32, or float64)."""
    fmt = _F64 if dtype == torch.float64 else _F32
    c = codes.to(torch.int64)
    E = base - c
    sub = torch.ones_like(E) << (E - fmt.e_min).clamp(0, fmt.mant - 1)
    mag = torch.where(E >= 1, E << fmt.mant, torch.where(E >= fmt.e_min, sub, 0))
    v = torch.where(c == _ZERO, 0, mag).to(fmt.itype).view(fmt.ftype)
    return torch.where(signs != 0, -v, v)


@register("natural")
class Natural(FusedDecode, Compressor):
    """Natural compression C_nat (Horvath et al.): each entry to a neighbouring power
    of two, unbiased, 9 bits per entry; the module docstring gives the rules.

    Algorithm (the paper's C_nat definition, on IEEE fields):
        1. e, f = exponent and mantissa fields of t (subnormals normalised)
        2. up = [u < f / 2^23], u ~ U[0, 1) from the (seed, step) stream
        3. E = min(e + up, cap); base = max E; code = base - E (255: zero)
        4. send (base, sign plane, codes); decode sign(t) 2^(base - code).

    E[C_nat(t)] = t and E[C_nat(t)^2] <= (9/8) t^2 (C_nat in B(1/8)), except
    where the module docstring says otherwise (saturation, entries 2^254
    below the largest).

    Example:
        >>> import hipress_like as hp
        >>> c = hp.compressors.get("natural")
        >>> g = torch.tensor([0.25, -2.0, 0.0, 1024.0])
        >>> p, s = c.encode(g, c.init(g, seed=1))
        >>> c.decode(p).tolist()      # powers of two are kept exactly
        [0.25, -2.0, 0.0, 1024.0]
    """

    name = "natural"
    algo_id = 40
    capabilities = Capabilities("quantization", aggregatable=False, fixed_size=True,
                                unbiased=True, stateful=True,
                                checks_finite=True)  # the encode sweep

    def __init__(self) -> None:
        # 9/32 of the input per payload: reusing idle ones saves their page faults
        self._pool = PayloadPool()

    def params(self) -> Dict[str, Any]:
        """Constructor parameters (none)."""
        return {}

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Round ``grad`` to powers of two; the new state has ``step`` + 1.

        Raises:
            TypeError: non-tensor or non-float input.
            ValueError: empty input, NaN/Inf in it, or a state without
                ``seed``/``step`` (create it with ``init``).
        """
        check_gradient(grad, nonfinite="ignore")  # NaN/Inf: caught by the encode sweep
        _check_state(self.name, state)
        g = grad.detach().contiguous().reshape(-1)
        n = g.numel()
        x = g if g.dtype in (torch.float32, torch.float64) else g.float()
        cap = _CAP[g.dtype]
        key = mix_seed(step_seed(int(state["seed"]), int(state["step"])))
        q = packed_nbytes(n, 1)
        payload, body = self.frame_payload(grad, bytes(_NAT_EXTRA.size), q + n, self._pool)
        if x.dtype == torch.float32 and _native.usable(x):
            base = _c.natural_encode(x, body[:q], body[q:], key, cap)
        else:
            base = _nat_encode_torch(x, body[:q], body[q:], key, cap)
        if base is None:
            check_gradient(grad, nonfinite="always")  # raises the standard NaN/Inf error
        off = header_nbytes(grad.dim(), 0)
        payload[off: off + 8].view(torch.int64).fill_(int(base))
        return payload, _advance(state)

    def _decode(self, payload: torch.Tensor, out: Optional[torch.Tensor], mode: str,
                d: float) -> torch.Tensor:
        """``sign * 2^(base - code)`` in the original shape and dtype, by ``mode``
        (``FusedDecode``)."""
        h, (base,), body, out = self.unframe_payload(payload, _NAT_EXTRA, self._body_nbytes, out,
                                                     " (a sign plane and a byte each)")
        n = h.numel
        q = packed_nbytes(n, 1)
        dev = payload.device
        flat = out.view(-1)
        signs, codes = body[:q], body[q:]
        if h.dtype == torch.float32 and _native.usable(flat, body):
            _c.natural_decode(signs, codes, flat, base, mode, d)
        elif h.dtype != torch.float64 and _native.usable(body):
            v = workspace(n, torch.float32, dev, "natural")  # half types: through float32
            _c.natural_decode(signs, codes, v, base, "set")
            _emit(flat, v, mode, d)
        else:
            sg = _unpack_planes(signs, n, 1)
            for i0, i1 in _chunks(n):
                _emit(flat[i0:i1], _nat_values(sg[i0:i1], codes[i0:i1], base, h.dtype), mode, d)
        return out

    def _body_nbytes(self, h: Any, base: int) -> int:
        """A payload's body size, a sign plane and a byte per element, once its base
        exponent is checked to lie in the dtype's range."""
        fmt = _F64 if h.dtype == torch.float64 else _F32
        if not fmt.e_min <= base <= _CAP[h.dtype]:
            raise PayloadError(f"{self.name} payload declares base exponent {base}, expected "
                               f"one in [{fmt.e_min}, {_CAP[h.dtype]}] for {h.dtype}")
        return packed_nbytes(h.numel, 1) + h.numel

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Header (8 bytes of base) plus ceil(numel / 8) + numel bytes: 9 bits a value."""
        return header_nbytes(ndim, _NAT_EXTRA.size) + packed_nbytes(numel, 1) + numel
