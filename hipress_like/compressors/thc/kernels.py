"""THC's kernels: the randomized Hadamard transform and the quantize/merge/decode loops.

``thc.py`` holds the compressor (rounds, payloads, checks); this module the
arithmetic it runs, kept apart so each file holds one concept.

Transform (THC Sec. 5.1): ``H D x_j`` per block of B = 2^12 elements and the
tail's binary expansion, D a Rademacher diagonal from a seed shared by all
ranks. On the CPU for float32, ``_c.thc_rht``/``thc_fwht`` run each
block's signs and twelve butterfly stages in the L1 cache (about 0.6x a
memory copy here); elsewhere (CUDA, other dtypes, no C compiler)
``_fwht_rows`` runs H_B as batched GEMMs with the factor H_16 (Sylvester),
or radix-2 butterflies below torch's grain size. The forward floats then
differ from C's in the last bit where additions come in another order, which
moves no index beyond a rounding boundary and does not matter across ranks:
each rank quantizes its own gradient, and the decode's inverse runs on exact
integers, identical on every path.

Kernels (``_build.fused.Kernel``: pure torch, compiled by inductor for large
tensors) use no lookups, since gathers do not vectorise there: the table
enters as hinges. phi(a) = a / w_0 + sum_q c_q max(a - T_q, 0) maps T_j to j
and is linear in between, so SQ onto the table is TernGrad's floor(phi) +
[u < phi - floor(phi)], with a hinge where the table's step w_q changes
(four for T_{4,30,1/32}); and T(z) = s z + sum_i (w_{i-1} - s) [z >= i] in
integers, s the commonest step (four terms for T_{4,30,1/32}), computed on
all lanes of a word at once where no lane can overflow (SWAR).
"""
from __future__ import annotations

import functools
import math
from typing import Any, List, Sequence, Tuple

import torch

from .._build import native as _native
from .._build.fused import Kernel, compute_dtype
from ..ops import _as_i32, _fmix32_i32, _uniform_from_counter, mix_seed
from . import native as _c

__all__ = ["BLOCK", "BLOCK_LOG2", "forward_rht", "inverse_rht", "randomized_hadamard"]

BLOCK_LOG2 = 12
BLOCK = 1 << BLOCK_LOG2
_SMALL = 1 << 15  # torch's grain size: smaller ops run on one thread


# -- the randomized Hadamard transform (Sec. 5.1) --------------------------------------

@functools.lru_cache(maxsize=None)
def _hadamard(f: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < f:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


def _fwht_rows(src: torch.Tensor, size: int, bufs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Unnormalised H_size of every row of ``src.view(-1, size)``: O(size log size).

    H_size = H_16 (x) H_16 (x) ... (Sylvester), so each factor is one batched
    GEMM along one axis of the row seen as a 16 x 16 x ... tensor (BLAS runs
    a 16-wide GEMM faster than torch runs four radix-2 butterfly passes).
    Results ping-pong between the two ``bufs`` (never ``src``); returns the last.
    Below ``_SMALL`` elements (where torch runs ops on one thread) the radix-2
    butterflies run instead, into new tensors: a BLAS call there costs more in
    thread start-up than the arithmetic. Integer inputs below 2^24 (float32)
    give the same exact result either way.
    """
    n = src.numel()
    if n < _SMALL:
        y, h = src, 1
        while h < size:
            v = y.view(-1, 2, h)
            y = torch.stack((v[:, 0] + v[:, 1], v[:, 0] - v[:, 1]), 1)
            h *= 2
        return y.reshape(-1)
    cur, c = src, 1
    while c < size:
        f = min(16, size // c)
        dst = bufs[0][:n] if cur.data_ptr() != bufs[0].data_ptr() else bufs[1][:n]
        h = _hadamard(f, src.dtype, str(src.device))
        if c == 1:
            torch.mm(cur.view(-1, f), h, out=dst.view(-1, f))
        else:
            torch.matmul(h, cur.view(-1, f, c), out=dst.view(-1, f, c))
        cur, c = dst, c * f
    return cur


def _native_ok(*ts: torch.Tensor) -> bool:
    """float32 CPU tensors the C loops take (``thc.c``: the transform in L1 blocks)."""
    return _native.usable(*ts, dtypes=(torch.float32,))


def _tail_blocks(tail: int) -> List[int]:
    """The transform's blocks after the full ones: the tail's binary expansion."""
    return [1 << j for j in reversed(range(tail.bit_length())) if tail >> j & 1]


def _rademacher(i: torch.Tensor, key: Any) -> torch.Tensor:
    """True where D_ii = -1: the top bit of murmur3's fmix32 of counter ``i`` ^ ``key``
    (int32 ops, no table: it fuses into the kernels that apply D)."""
    return _fmix32_i32(i ^ key) < 0


def _sign_key(seed: int) -> int:
    return _as_i32(mix_seed(seed ^ 0x5448_4344))  # a stream apart from the SQ dither


def _flip(v: torch.Tensor, key: Any, first: Any) -> torch.Tensor:
    """``D v`` for the elements ``first, first + 1, ...`` of the gradient."""
    i = torch.arange(v.numel(), dtype=torch.int32, device=v.device) + first
    return torch.where(_rademacher(i, key).view(v.shape), -v, v)


def randomized_hadamard(x: torch.Tensor, seed: int, inverse: bool = False) -> torch.Tensor:
    """THC's orthonormal transform of a flat tensor, blockwise (see the module docstring).

    Forward: ``H D x_j / sqrt(B)`` per block; inverse: ``D H y_j / sqrt(B)``.
    ``seed`` keys the Rademacher diagonal D. Returns a new float tensor.
    """
    x = x.reshape(-1).to(compute_dtype(x.dtype))
    n, key = x.numel(), _sign_key(seed)
    nfull = n // BLOCK * BLOCK
    out = torch.empty_like(x)
    start = 0
    for size in ([BLOCK] if nfull else []) + _tail_blocks(n - nfull):
        stop = nfull if size == BLOCK else start + size
        seg = x[start:stop]
        if not inverse:
            seg = _flip(seg, key, start)
        y = _fwht_rows(seg.contiguous(), size, (torch.empty_like(seg), torch.empty_like(seg)))
        y = y / math.sqrt(size)
        out[start:stop] = _flip(y, key, start) if inverse else y
        start = stop
    return out


# -- kernels (``_build.fused.Kernel``: one pure function, compiled for large tensors) --------
#
# The table enters as hinges, not lookups (gathers do not vectorise in inductor's CPU
# code): see the module docstring.

def _hinges(values: Sequence[int]) -> Tuple[Tuple[Any, ...], Tuple[Any, ...]]:
    """phi's (slope, hinges) and T's (slope, steps, lane widths that fit SWAR) of a table."""
    w = [b - a for a, b in zip(values[:-1], values[1:])]
    changes = [q for q in range(1, len(w)) if w[q] != w[q - 1]]
    phi = (1.0 / w[0], tuple((float(values[q]), 1.0 / w[q] - 1.0 / w[q - 1]) for q in changes))
    # T(z) = s z + sum_i c_i [z >= i] with s the commonest step: c_i = w_{i-1} - s
    s = max(sorted(set(w)), key=w.count)
    steps = tuple((i, w[i - 1] - s) for i in range(1, len(values)) if w[i - 1] != s)
    # SWAR on lanes of ``lane`` bits needs z < 2^(lane-1) and s z + (positive steps) below
    # 2^lane for every z: then no lane carries or borrows into the next
    top = max(s * z + sum(c for i, c in steps if c > 0 and z >= i) for z in range(len(values)))
    swar = tuple(lane for lane in (8, 16) if len(values) <= 1 << (lane - 1) and top < 1 << lane)
    return phi, (s, steps, swar)


def _quant_fn(bits: int, g: int, phi: Tuple[Any, ...], dtype: torch.dtype):
    planes, top = 32 // bits, float((1 << bits) - 1)
    slope, hinges = phi

    def thc_quant(y, out, scale, offset, seed, first) -> None:
        """Round 1's steps 3-4 into int32 words (word j, field k: element j + k m):
        a = clamp(y * scale + offset, 0, g), z = SQ of phi(a) with u from the counter."""
        yv = y.view(planes, -1)
        m = yv.shape[1]
        ramp = torch.arange(m, dtype=torch.int32, device=y.device) + first
        packed = None
        for k in range(planes):  # one expression per plane, fused into the packing
            a = (yv[k].to(scale.dtype) * scale + offset).clamp(0.0, float(g))
            p = a * slope
            for t, c in hinges:
                p = p + (a - t).clamp(min=0.0) * c
            p = p.clamp(0.0, top)
            f = torch.floor(p)
            u = _uniform_from_counter(ramp + k * m, seed)
            z = (f + torch.where(u < p - f, 1.0, 0.0)).clamp(max=top).to(torch.int32)
            if k == planes - 1 and bits > 1:  # the top field signed: no int32 overflow
                z = z - (z >> (bits - 1)) * (1 << bits)
            z = z * _as_i32(1 << (k * bits))
            packed = z if packed is None else packed + z
        out.copy_(packed)
    return thc_quant


def _lanes(width: int, value: int) -> int:
    """``value`` in every lane of ``width`` bits of an int32 word, as an int32."""
    return _as_i32(sum(value << (lane * width) for lane in range(32 // width)))


def _spread_steps(bits: int, width: int) -> List[Tuple[int, int]]:
    """(shift, mask) steps moving 32/width contiguous ``bits``-bit fields to one lane of
    ``width`` bits each (field l: from bit l*bits to l*width), largest move first."""
    lanes = 32 // width
    steps, pos = [], [lane * bits for lane in range(lanes)]
    group = lanes // 2
    while group:
        sh = group * (width - bits)
        pos = [p + sh if lane & group else p for lane, p in enumerate(pos)]
        steps.append((sh, _as_i32(sum(((1 << bits) - 1) << p for p in pos))))
        group //= 2
    return steps


def _merge_fn(kinds: Tuple[int, ...], bits: int, width: int, tz: Tuple[Any, ...]):
    lanes, (slope, steps, swar) = 32 // width, tz
    swar = width in swar and lanes > 1
    hb, ones = _lanes(width, 1 << (width - 1)), _lanes(width, 1)
    spread = _spread_steps(bits, width) if swar else []

    def times(v, c):
        return v * c if c > 1 else v

    def thc_merge(out, *inputs) -> None:
        """One sum array: lane l of word j = the sum, over the inputs, of element field
        (base + l) of their word j: T(z) for index words (kind 0), the value for sum
        words (kind = their width). ``inputs`` holds (words, base bit offset) per
        input. Lanes are packed with wrapping int32 arithmetic; no lane overflows, so
        adding packed words adds every lane (SWAR)."""
        total = None
        for i, kind in enumerate(kinds):
            word, base = inputs[2 * i], inputs[2 * i + 1]
            if kind == width:  # a partial sum of this width: add the packed lanes
                v = word
            elif kind or not swar:  # narrower sums, or T lane by lane
                v = None
                for lane in range(lanes):
                    f = kind or bits
                    z = (word >> (base + lane * f)) & ((1 << f) - 1) if f < 32 else word
                    if not kind:
                        t = times(z, slope)
                        for q, c in steps:
                            t = t + (z >= q).to(torch.int32) * c
                        z = t
                    z = z * (1 << (lane * width)) if lane else z
                    v = z if v is None else v + z
            else:  # T on all lanes at once: s z + sum c_i [z >= i], the negative c apart
                z = (word >> base) & ((1 << (lanes * bits)) - 1)
                for sh, mask in spread:
                    z = (z | (z << sh)) & mask
                pos, neg = times(z, slope), None
                for q, c in steps:  # lane: 2^(w-1) + z - q never borrows; its top bit is z >= q
                    ge = times(((z + _as_i32(hb - q * ones)) >> (width - 1)) & ones, abs(c))
                    if c > 0:
                        pos = pos + ge
                    else:
                        neg = ge if neg is None else neg + ge
                v = pos if neg is None else pos - neg
            total = v if total is None else total + v
        out.copy_(total)
    return thc_merge


def _center_fn(width: int, dtype: torch.dtype):
    def thc_center(sums, out, shift, cg) -> None:
        """W = 2Y - c g for one field of sum words (exact integers in float ``out``)."""
        v = sums if width == 32 else (sums >> shift) & ((1 << width) - 1)
        out.copy_(v.to(out.dtype) * 2.0 - cg)
    return thc_center


def _affine_fn(width: int, dtype: torch.dtype):
    def thc_affine(sums, out, shift, mul, add) -> None:
        """out = Y * mul + add for one field of sum words (the decode without the transform)."""
        v = sums if width == 32 else (sums >> shift) & ((1 << width) - 1)
        out.copy_((v.to(mul.dtype) * mul + add).to(out.dtype))
    return thc_affine


def _scale_flip_fn(size: int, dtype: torch.dtype):
    def thc_scale_flip(x, out, scale, key, first) -> None:
        """out = D (x * scale of its row of ``size``): the transform's first step (with
        the block's range scale folded in) and the inverse's last one."""
        v = x.view(-1, size).to(scale.dtype) * scale.view(-1, 1)
        out.view(-1, size).copy_(_flip(v, key, first).to(out.dtype))
    return thc_scale_flip


_K_QUANT = Kernel(_quant_fn, "thc quantize")
_K_MERGE = Kernel(_merge_fn, "thc merge")
_K_CENTER = Kernel(_center_fn, "thc center")
_K_SCALE_FLIP = Kernel(_scale_flip_fn, "thc scale and sign flip")
_K_AFFINE = Kernel(_affine_fn, "thc affine decode")


# -- the transform over a gradient's blocks ---------------------------------------------

def forward_rht(x: torch.Tensor, scale: torch.Tensor, ikey: int, bufs: Sequence[torch.Tensor],
                full: int, tails: Sequence[int]) -> torch.Tensor:
    """``H D (x_j * scale_j)`` for every block j (``full`` elements in blocks of ``BLOCK``,
    then the ``tails``), unnormalised; returns a view of one of ``bufs``. float32 on the
    CPU: ``_c.thc_rht``, each block in the L1 cache."""
    rows, n = full // BLOCK, full + sum(tails)
    y = bufs[0]
    if _native_ok(x, y, scale):
        if full:
            _c.thc_rht(x[:full], y[:full], BLOCK, scale[:rows], ikey, 0)
        start = full
        for j, size in enumerate(tails):  # a tail block: one row of its own size
            _c.thc_rht(x[start: start + size], y[start: start + size], size,
                            scale[rows + j: rows + j + 1], ikey, start)
            start += size
        return y[:n]
    zero = torch.zeros((), dtype=torch.int32, device=x.device)
    key = torch.tensor(ikey, dtype=torch.int32, device=x.device)
    if full:
        _K_SCALE_FLIP(x[:full], bufs[0][:full], scale[:rows], key, zero,
                      spec=(BLOCK, bufs[0].dtype), numel=full)
        hw = _fwht_rows(bufs[0][:full], BLOCK, bufs)
        y = bufs[0] if hw.data_ptr() == bufs[0].data_ptr() else bufs[1]
        if hw.data_ptr() != y.data_ptr():  # the butterflies' own tensor
            y[:full] = hw
    start = full
    for j, size in enumerate(tails):  # small blocks: eagerly
        seg = torch.empty(size, dtype=y.dtype, device=x.device)
        _K_SCALE_FLIP.eager((size, y.dtype))(x[start: start + size], seg,
                                             scale[rows + j: rows + j + 1], key, zero + start)
        y[start: start + size] = _fwht_rows(seg, size, (torch.empty_like(seg),
                                                        torch.empty_like(seg)))
        start += size
    return y[:n]


def inverse_rht(bufs: Sequence[torch.Tensor], out: torch.Tensor, dscale: torch.Tensor,
                ikey: int, full: int, tails: Sequence[int]) -> None:
    """``out_j = D H w_j * dscale_j / size_j`` for every block j of ``w = bufs[0]`` (exact
    integers in float, so every path gives the same floats); ``bufs[1]`` is scratch."""
    rows, dev, ddt = full // BLOCK, out.device, bufs[0].dtype
    key = torch.tensor(ikey, dtype=torch.int32, device=dev)
    zero = torch.zeros((), dtype=torch.int32, device=dev)
    native = _native_ok(bufs[0])
    if full:
        if native:
            _c.thc_fwht(bufs[0][:full], BLOCK)
            hw = bufs[0][:full]
        else:
            hw = _fwht_rows(bufs[0][:full], BLOCK, bufs)
        _K_SCALE_FLIP(hw, out[:full], dscale[:rows] / BLOCK, key, zero, spec=(BLOCK, ddt),
                      numel=full)
    start = full
    for j, size in enumerate(tails):
        seg = bufs[0][start: start + size].clone()
        if native:
            _c.thc_fwht(seg, size)
            hw = seg
        else:
            hw = _fwht_rows(seg, size, (torch.empty_like(seg), torch.empty_like(seg)))
        _K_SCALE_FLIP.eager((size, ddt))(hw, out[start: start + size],
                                         dscale[rows + j: rows + j + 1] / size, key,
                                         zero + start)
        start += size
