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

from typing import Callable, Sequence, Tuple

import torch

__all__ = [
    "topk_abs",
    "filter_mask",
    "map_",
    "reduce",
    "uniform",
    "hash32",
    "concat",
    "extract",
    "orthogonalize_",
    "matmul",
    "pack_bits",
    "unpack_bits",
    "packed_nbytes",
    "VALID_BITS",
]

VALID_BITS = (1, 2, 4, 8)
_M32 = 0xFFFFFFFF


def topk_abs(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Indices (int64) and values of the ``k`` largest-magnitude entries of 1-D ``x``."""
    k = max(1, min(int(k), x.numel()))
    _, idx = torch.topk(x.abs(), k, sorted=False)
    return idx, x[idx]


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


def hash32(counter: torch.Tensor, seed: int) -> torch.Tensor:
    """A 32-bit integer hash of ``counter`` (int64 tensor) keyed by ``seed``.

    The murmur3 finaliser (Appleby, MurmurHash3 ``fmix32``) applied to
    ``counter ^ seed``, computed in int64 and masked to 32 bits so it runs
    identically on every backend without unsigned types.
    """
    h = (counter ^ (seed & _M32)) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    h = h ^ (h >> 16)
    return h


def uniform(n: int, seed: int, offset: int = 0, device="cpu") -> torch.Tensor:
    """``n`` float32 numbers uniform in [0, 1) from a counter-based hash RNG.

    Element i is ``hash32(offset + i, seed) / 2**32``, so any slice of the
    stream can be regenerated from (seed, offset) alone.
    """
    c = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    seed_mixed = int(hash32(torch.tensor([seed & _M32]), 0x9E3779B9).item())
    # top 24 bits -> exactly representable float32 in [0, 1)
    return (hash32(c, seed_mixed) >> 8).to(torch.float32) * (1.0 / (1 << 24))


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


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Matrix product (kept as an operator so DSL code can name it)."""
    return a @ b


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes needed to store ``n`` codes of ``bits`` bits each."""
    if bits not in VALID_BITS:
        raise ValueError(f"bits must be one of {VALID_BITS}, found {bits!r}")
    per = 8 // bits
    return (n + per - 1) // per


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) into bytes, little-endian within a byte.

    Code i sits in byte i // (8/bits), at bit offset (i % (8/bits)) * bits.
    """
    if bits not in VALID_BITS:
        raise ValueError(f"bits must be one of {VALID_BITS}, found {bits!r}")
    c = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return c.clone()
    per = 8 // bits
    n = c.numel()
    pad = (-n) % per
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    c = c.view(-1, per).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=c.device)
    return (c << shifts).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first ``n`` codes as uint8."""
    if bits not in VALID_BITS:
        raise ValueError(f"bits must be one of {VALID_BITS}, found {bits!r}")
    if packed.numel() < packed_nbytes(n, bits):
        raise ValueError(f"packed data has {packed.numel()} bytes, {n} codes of {bits} bits "
                         f"need {packed_nbytes(n, bits)}")
    if bits == 8:
        return packed[:n].clone()
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.view(-1, 1) >> shifts) & mask).reshape(-1)[:n]
