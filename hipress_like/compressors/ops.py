"""CompLL's common operator library (HiPress Sec. 4.2, Table 4).

Algorithms are written with these operators instead of ad-hoc tensor code,
so a faster operator speeds every algorithm that uses it:

| operator | here                     | used by                      |
|----------|--------------------------|------------------------------|
| sort     | ``topk_abs``             | top-k, DGC, GradDrop         |
| filter   | ``filter_mask``          | threshold sparsifiers, TBQ   |
| map      | ``map_``                 | quantizers                   |
| reduce   | ``reduce``               | norms, maxima, means         |
| random   | ``uniform``              | TernGrad, random-k, sampling |
| concat   | ``concat``               | payload assembly             |
| extract  | ``extract``              | sparse gather                |
| decomp   | ``orthogonalize_``       | PowerSGD                     |
| matmul   | ``matmul``               | PowerSGD                     |
| pack     | ``pack_bits``/``unpack_bits`` | 1/2/4/8-bit codes       |

All are device-agnostic torch. ``uniform`` is a counter-based hash RNG in
integer ops (no ``torch.rand``): the same (seed, counter) always gives the
same numbers on every device and thread count, and it fuses under
``torch.compile`` (ENVIRONMENT.md: ``torch.rand`` does not).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

import torch

from ._build import native as _native

__all__ = [
    "topk_abs",
    "topk_abs_finite",
    "filter_mask",
    "map_",
    "reduce",
    "uniform",
    "hash32",
    "mix_seed",
    "concat",
    "extract",
    "orthogonalize_",
    "abs_at_least",
    "abs_at_least_indices",
    "topk_among",
    "sample_positions",
    "matmul",
    "pack_bits",
    "unpack_bits",
    "packed_nbytes",
    "VALID_BITS",
]

VALID_BITS = (1, 2, 4, 8)
_M32 = 0xFFFFFFFF


#: ``topk_abs`` prefilters tensors at least this large (smaller: plain torch.topk).
PREFILTER_MIN_NUMEL = 1 << 17
_PREFILTER_SAMPLES = 1 << 16
_PREFILTER_SEED = 0x70C4


def abs_at_least(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The mask ``|x| >= t`` without materialising ``|x|`` (filter operator).

    ``(x >= t) | (x <= -t)`` writes two bool tensors (a quarter of ``x``'s
    bytes each) instead of a float copy of ``|x|`` (a quarter of the
    traffic). NaN entries are never selected.
    """
    return (x >= t) | (x <= -t)


def topk_abs(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Indices (int64) and values of the ``k`` largest-magnitude entries of 1-D ``x``.

    Exact. For a large ``x`` and a small ``k`` (at most an eighth of ``x``),
    a full ``torch.topk`` over ``|x|`` costs ~80x a memory copy here, so
    the candidates are prefiltered first, the sampled-threshold idea of DGC
    (Lin et al. 2018, Sec. 3) made exact:

    1. draw ``s = 65536`` positions with the counter RNG (fixed seed: the
       result does not depend on it) and take the ``j``-th largest sampled
       magnitude, ``j = h + 5 sqrt(h) + 2`` with ``h = k s / n`` the
       expected number of top-k entries in the sample: a threshold ``t``
       a few standard deviations *below* the k-th largest magnitude;
    2. candidates ``C = {i : |x_i| >= t}`` (one filter pass, ~1.2 k of them);
    3. if ``|C| >= k`` (it holds unless the sample is ~5 sigma off), every
       top-k entry is in ``C`` and the exact top-k of ``C`` is the answer;
       otherwise fall back to ``torch.topk`` over all of ``x``.

    Ties at the k-th magnitude may be broken differently from a full
    ``torch.topk`` (which also leaves them unspecified).
    """
    idx, vals, _ = topk_abs_finite(x, k)
    return idx, vals


def topk_abs_finite(x: torch.Tensor, k: int
                    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[bool]]:
    """``topk_abs``, and whether ``x`` holds no NaN/Inf, as the selection saw it:
    the native filter reports NaN/Inf in its pass (a filter alone never takes
    NaN); ``torch.topk`` over ``|x|`` takes NaN and Inf first, so they are among
    the values it returns. None where neither holds (a prefilter in torch, for
    other dtypes and devices): the caller scans.
    """
    n = x.numel()
    k = max(1, min(int(k), n))
    if n >= PREFILTER_MIN_NUMEL and k * 8 <= n:
        idx, finite = _prefiltered_topk(x, k)
        if idx is not None:
            return idx, x[idx], finite
    _, idx = torch.topk(x.abs(), k, sorted=False)
    vals = x[idx]
    return idx, vals, bool(torch.isfinite(vals).all())


def _prefiltered_topk(x: torch.Tensor, k: int) -> Tuple[Optional[torch.Tensor], Optional[bool]]:
    """Steps 1-3 of ``topk_abs``: the top-k positions or None (fewer candidates
    than k), and whether the filter saw only finite values (None: unknown)."""
    n = x.numel()
    s = _PREFILTER_SAMPLES
    h = k * s / n
    j = min(s, int(math.ceil(h + 5.0 * math.sqrt(h) + 2.0)))
    sample = x.index_select(0, sample_positions(s, n, _PREFILTER_SEED, 0, x.device)).abs_()
    t = torch.topk(sample, j, sorted=False).values.min()
    cand, nonfinite = _filter_indices(x, t, n * j // s)
    finite = None if nonfinite is None else not nonfinite
    if cand.numel() < k:
        return None, finite
    return topk_among(x, cand, k), finite


def abs_at_least_indices(x: torch.Tensor, t: "torch.Tensor | float",
                         expect: int = 0) -> torch.Tensor:
    """Sorted int64 positions of 1-D ``x`` where ``|x| >= t`` (filter operator; NaN never).

    ``torch.nonzero(abs_at_least(x, t))``, in one native pass for float32 CPU
    tensors (``sparse/native.abs_at_least_indices``: ~6x faster for 16 M floats
    here), else by torch. ``expect`` (about how many pass) sizes the native
    buffer; a wrong guess costs a second pass, never a wrong answer.
    """
    return _filter_indices(x, t, expect)[0]


def _filter_indices(x: torch.Tensor, t: "torch.Tensor | float",
                    expect: int) -> Tuple[torch.Tensor, Optional[bool]]:
    """``abs_at_least_indices``, and whether ``x`` holds NaN/Inf (the native pass
    tells; None from torch's)."""
    if x.dtype == torch.float32 and _native.usable(x):
        # the C filter is top-k's (sparse/topk.c); sparse/ imports this module, hence here
        from .sparse import native as _c

        cand, total, nonfinite = _c.abs_at_least_indices(x, float(t), 2 * int(expect) + 1024)
        if total > cand.numel():
            cand, total, nonfinite = _c.abs_at_least_indices(x, float(t), total)
        return cand, nonfinite
    tt = t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=x.dtype, device=x.device)
    return filter_mask(x, abs_at_least(x, tt))[0], None


def topk_among(x: torch.Tensor, idx: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` indices of ``idx`` with the largest ``|x|`` (unsorted; sort operator).

    The exact second stage of every sampled-threshold selection: the
    candidates that passed a threshold are few, so a full ``topk`` over
    them is cheap.
    """
    top = torch.topk(x.index_select(0, idx).abs_(), k, sorted=False).indices
    return idx.index_select(0, top)


def sample_positions(s: int, n: int, seed: int, offset: int, device) -> torch.Tensor:
    """``s`` pseudo-random positions in [0, n) (with replacement) from the counter RNG.

    Position j is ``(hash32(offset + j, seed) * n) >> 32`` (Lemire's
    multiply-shift range reduction, no modulo bias worth the name).
    """
    c = torch.arange(offset, offset + s, dtype=torch.int64, device=device)
    return (hash32(c, seed) * n) >> 32


def filter_mask(x: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Indices (int64) and values of 1-D ``x`` where ``mask`` is true."""
    idx = torch.nonzero(mask, as_tuple=False).reshape(-1)
    return idx, x[idx]


def map_(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Elementwise map (kept as an operator so DSL code can name it)."""
    return fn(x)


def reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce to a scalar tensor: "sum", "max", "min", "absmax", "mean", "norm"."""
    if op == "sum":
        return x.sum()
    if op == "max":
        return x.max()
    if op == "min":
        return x.min()
    if op == "absmax":
        return x.abs().max()
    if op == "mean":
        return x.mean()
    if op == "norm":
        return torch.linalg.vector_norm(x)
    raise ValueError(f"unknown reduce op {op!r}; expected sum, max, min, absmax, mean, norm")


def _fmix32(x: int) -> int:
    """MurmurHash3 ``fmix32`` on a Python int (for mixing scalar seeds on the host)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    x ^= x >> 16
    return x


# fmix32's multipliers as two's-complement int32 (int32 products wrap modulo 2**32).
_C1_I32 = 0x85EBCA6B - (1 << 32)
_C2_I32 = 0xC2B2AE35 - (1 << 32)


def _as_i32(x: int) -> int:
    """The low 32 bits of ``x`` as a two's-complement int32 value."""
    x &= _M32
    return x - (1 << 32) if x >= (1 << 31) else x


def _fmix32_i32(h: torch.Tensor) -> torch.Tensor:
    """``fmix32`` on an int32 tensor, bit for bit equal to the 32-bit definition.

    Works in int32 (half the memory traffic of int64, and it vectorises and
    fuses under ``torch.compile``): products wrap modulo 2**32 and the logical
    right shifts of the reference are arithmetic shifts with the sign bits
    masked off.
    """
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _C1_I32
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _C2_I32
    h = h ^ ((h >> 16) & 0xFFFF)
    return h


def _uniform_from_counter(counter_i32: torch.Tensor, seed_mixed: int) -> torch.Tensor:
    """The ``uniform`` stream at the given int32 counters (low 32 bits of the index).

    ``seed_mixed`` is ``_fmix32(seed ^ 0x9E3779B9)`` as produced by ``uniform``;
    it may be an int or a 0-d int32 tensor (the fused kernels pass a tensor so
    one compiled kernel serves every seed).
    """
    if not isinstance(seed_mixed, torch.Tensor):
        seed_mixed = _as_i32(seed_mixed)
    h = _fmix32_i32(counter_i32 ^ seed_mixed)
    # top 24 bits -> exactly representable float32 in [0, 1)
    return ((h >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


def mix_seed(seed: int) -> int:
    """The per-stream key ``uniform`` derives from ``seed`` (fmix32 of seed ^ golden ratio)."""
    return _fmix32((seed & _M32) ^ 0x9E3779B9)


def hash32(counter: torch.Tensor, seed: int) -> torch.Tensor:
    """A 32-bit integer hash of ``counter`` (int64 tensor) keyed by ``seed``.

    The murmur3 finaliser (Appleby, MurmurHash3 ``fmix32``) applied to
    ``counter ^ seed``. Returns int64 values in [0, 2**32). Computed in int32
    with wrapping products (``_fmix32_i32``), which equals the 32-bit
    definition bit for bit on every backend.
    """
    c = (counter.to(torch.int64) & _M32).to(torch.int32)  # low 32 bits, wrapped into int32
    h = _fmix32_i32(c ^ _as_i32(seed))
    return h.to(torch.int64) & _M32


def uniform(n: int, seed: int, offset: int = 0, device="cpu") -> torch.Tensor:
    """``n`` float32 numbers uniform in [0, 1) from a counter-based hash RNG.

    Element i is ``(hash32(offset + i, mix_seed(seed)) >> 8) / 2**24``, so any
    slice of the stream can be regenerated from (seed, offset) alone. Only the
    low 32 bits of the counter enter the hash, so the stream repeats after
    2**32 elements.
    """
    lo = _as_i32(offset)
    c = torch.arange(n, dtype=torch.int32, device=device)
    if lo:
        c = c + lo  # int32 addition wraps, i.e. counters are taken modulo 2**32
    return _uniform_from_counter(c, mix_seed(seed))


def concat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate 1-D tensors (uint8 payload assembly)."""
    return torch.cat([p.reshape(-1) for p in parts])


def extract(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gather ``x[idx]`` (the inverse of a sparse scatter)."""
    return x.index_select(0, idx)


def orthogonalize_(m: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Orthonormalise the columns of ``m`` in place (Gram-Schmidt, as PowerSGD).

    Vogels et al. 2019, Alg. 1 line "P <- ORTHOGONALIZE(P)". Columns that are
    numerically zero stay zero instead of becoming NaN.
    """
    for i in range(m.shape[1]):
        col = m[:, i]
        if i:
            prev = m[:, :i]
            col -= prev @ (prev.t() @ col)
        norm = torch.linalg.vector_norm(col)
        col /= norm + eps
    return m


#: A right operand with at most this many columns is "thin" (PowerSGD's Q or P).
THIN_COLS = 64


def matmul(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Matrix product ``a @ b`` (kept as an operator so DSL code can name it).

    Thin right operands (``b`` with at most ``THIN_COLS`` columns, PowerSGD's
    ``M Q`` and ``M^T P``) take the layouts BLAS is fast at on CPU:
    ``(P^T @ M)^T`` instead of ``M^T @ P`` on a transposed view, and
    ``M @ (Q^T contiguous)^T`` instead of ``M @ Q`` (docs/design.md,
    "Measurements behind the code"). The result is the same product up to
    float rounding (summation order).

    Args:
        a: (n, k) matrix (may be a transposed view).
        b: (k, m) matrix.
        out: optional (n, m) contiguous tensor to write into (no allocation).

    Returns:
        ``a @ b`` (``out`` when given).
    """
    if a.dim() == 2 and b.dim() == 2 and b.shape[1] <= THIN_COLS and a.shape[0] > THIN_COLS:
        if not a.is_contiguous() and a.t().is_contiguous():
            r = torch.mm(b.t(), a.t()).t()      # (b^T a^T^T)^T, reads a row by row
            if out is None:
                return r.contiguous()
            return out.copy_(r)
        if a.is_contiguous():
            bt = b.t().contiguous().t()
            return torch.mm(a, bt) if out is None else torch.mm(a, bt, out=out)
    return a @ b if out is None else torch.matmul(a, b, out=out)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes needed to store ``n`` codes of ``bits`` bits each."""
    _check_bits(bits)
    per = 8 // bits
    return (n + per - 1) // per


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a ``(m, 8 // bits)`` uint8 code matrix into ``m`` bytes.

    Unrolled shifts and ORs over the columns instead of a reduction: each
    output byte is one fused pointwise expression, which vectorises (eager)
    and fuses into the producer of the codes (``torch.compile``).
    """
    per = 8 // bits
    out = codes[:, 0]
    for j in range(1, per):
        out = out | (codes[:, j] << (j * bits))
    return out


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``_pack_rows``: ``m`` bytes -> ``(m, 8 // bits)`` uint8 codes."""
    per = 8 // bits
    mask = (1 << bits) - 1
    return torch.stack([(packed >> (j * bits)) & mask for j in range(per)], dim=1)


def _pack_planes(codes, bits: int) -> torch.Tensor:
    """Pack ``8 // bits`` planes of m codes (floats in [0, 2**bits)) into ``m`` bytes.

    ``codes`` is a ``(8 // bits, m)`` tensor or a sequence of m-element planes.

    Byte j holds ``codes[k, j]`` at bit offset ``k * bits``: a bit-sliced
    ("planar") layout, so every plane is a contiguous stream and the packing
    vectorises (the row layout of ``pack_bits`` needs strided loads). The
    quantizers' payloads use it; ``pack_bits`` keeps the row layout. The
    fields are combined as ``sum_k code_k * 2**(k * bits)`` in float32 (exact,
    < 256): float lanes vectorise on every CPU, 8-bit shifts do not.
    """
    out = codes[0]
    for k in range(1, 8 // bits):
        out = out + codes[k] * float(1 << (k * bits))
    return out.to(torch.uint8)


def _plane_codes(packed: torch.Tensor, bits: int, shift) -> torch.Tensor:
    """The ``bits``-wide field at bit offset ``shift`` (an int or int32 0-d tensor) of
    every byte of ``packed``, as int32 (plane ``shift // bits`` of ``_pack_planes``)."""
    return (packed.to(torch.int32) >> shift) & ((1 << bits) - 1)


def _check_bits(bits: int) -> None:
    if bits not in VALID_BITS:
        raise ValueError(f"bits must be one of {VALID_BITS}, found {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) into bytes, little-endian within a byte.

    Code i sits in byte i // (8/bits), at bit offset (i % (8/bits)) * bits
    (the compact layout of CompLL, HiPress Sec. 4.3: consecutive bits, zero
    padding only in the last byte).

    Args:
        codes: integer tensor of codes (any shape, read in flat order).
        bits: code width, one of 1, 2, 4, 8.

    Returns:
        1-D uint8 tensor of ``packed_nbytes(codes.numel(), bits)`` bytes.

    Raises:
        ValueError: ``bits`` not in ``VALID_BITS``.
    """
    _check_bits(bits)
    c = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return c.clone()
    per = 8 // bits
    n = c.numel()
    m = n // per
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=c.device)
    if m:
        out[:m] = _pack_rows(c[: m * per].view(m, per), bits)
    if n > m * per:  # zero-pad only the last, partial byte (never copy the whole tensor)
        tail = c.new_zeros(per)
        tail[: n - m * per] = c[m * per:]
        out[m:] = _pack_rows(tail.view(1, per), bits)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first ``n`` codes as a 1-D uint8 tensor.

    Raises:
        ValueError: invalid ``bits``, or fewer bytes than ``n`` codes need.
    """
    _check_bits(bits)
    if packed.numel() < packed_nbytes(n, bits):
        raise ValueError(f"packed data has {packed.numel()} bytes, {n} codes of {bits} bits "
                         f"need {packed_nbytes(n, bits)}")
    if bits == 8:
        return packed[:n].clone()
    nb = packed_nbytes(n, bits)
    return _unpack_rows(packed[:nb], bits).reshape(-1)[:n]
