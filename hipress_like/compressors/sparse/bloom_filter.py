"""Blocked Bloom filters for the sparse index codec (``bloom.py``; thesis Sec. 2.3.2, 3.1-3.2).

The filter primitives of ``bloom.py`` (which explains the design): the sizes
of the thesis (Sec. 2.3.2.1, 3.2, after Broder & Mitzenmacher),

    m = -r ln(eps) / (ln 2)**2  bits       (~9.59 bits per position at eps = 0.01)
    k = -ln(eps) / ln 2         hashes     (rounded to the nearest integer, >= 1)

applied per block of ``2**18`` positions to the block's own count
(``Layout``); the probes of a position (double hashing, Kirsch &
Mitzenmacher 2006, over the murmur3 finaliser of ``ops.hash32``, reduced
by Lemire's multiply-shift); building a filter (thesis Alg. 1), membership
(Alg. 2) and the query of the whole universe (Alg. 3, lines 2-5),
vectorised: a C loop in ``bloom.c`` when it is built (it stops probing
an element at its first miss), else torch, chunk by chunk, probing only
the elements that hit so far. Both give the same bits and positives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from .._build import native as _native
from ..base import mix_seed
from ..ops import hash32
from . import native as _c

__all__ = ["BLOCK_LOG2", "Layout", "bloom_bits", "bloom_hashes", "layout", "block_starts",
           "probe_positions", "build_filter", "contains", "query"]

BLOCK_LOG2 = 18           # 2**18 positions per block: a block's filter fits the L1 cache
_M32 = 0xFFFFFFFF
_CHUNK = 1 << 20          # torch query: universe positions per chunk (bounds temporaries)


def _bits_per_element(eps: float) -> float:
    return -math.log(eps) / (math.log(2) ** 2)


def bloom_bits(r: int, eps: float) -> int:
    """Filter size ``m = ceil(r * -ln(eps) / (ln 2)**2)`` bits (thesis Sec. 2.3.2.1, 3.2)."""
    return math.ceil(r * _bits_per_element(eps))


def bloom_hashes(eps: float) -> int:
    """Hash count ``k = -ln(eps) / ln 2`` rounded, at least 1 (thesis Sec. 2.3.2.1, 3.2)."""
    return max(1, round(-math.log(eps) / math.log(2)))


@dataclass(frozen=True)
class Layout:
    """Where each block's filter lies: block ``b`` covers ``[b * 2**log2u, ...)``.

    Attributes:
        log2u: log2 of the block size.
        counts: int64 elements of the set per block (``r_b``).
        bits: int64 filter bits per block (``m_b = bloom_bits(r_b, eps)``).
        offsets: int64 byte offset of each block's filter, and the total at the end.
    """

    log2u: int
    counts: torch.Tensor
    bits: torch.Tensor
    offsets: torch.Tensor

    @property
    def nbytes(self) -> int:
        """All filters' bytes."""
        return int(self.offsets[-1])


def layout(counts: torch.Tensor, eps: float, log2u: int = BLOCK_LOG2) -> Layout:
    """The filters' layout for per-block counts at rate ``eps`` (sizes as ``bloom_bits``)."""
    counts = counts.to(torch.int64)
    bits = torch.ceil(counts.to(torch.float64) * _bits_per_element(eps)).to(torch.int64)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum((bits + 7) // 8, 0)
    return Layout(log2u, counts, bits, offsets)


def _nblocks(n: int, log2u: int) -> int:
    return (n + (1 << log2u) - 1) >> log2u


def _seeds(seed: int, which: int) -> Tuple[int, int]:
    """The hash seeds (s1, s2) of filter ``which`` (0 first, 1 second) for a payload seed."""
    return mix_seed(seed, 2 * which), mix_seed(seed, 2 * which + 1)


def _policy_key(cand: torch.Tensor, seed: int) -> torch.Tensor:
    return hash32(cand, mix_seed(seed, 7))


def probe_positions(x: torch.Tensor, m: Any, nh: int, s1: int, s2: int) -> torch.Tensor:
    """The ``nh`` bits each element of ``x`` probes in its ``m``-bit filter: ``(len(x), nh)``.

    ``m`` is an int or one int64 per element.
    """
    h1 = hash32(x, s1)
    h2 = hash32(x, s2) | 1
    i = torch.arange(nh, dtype=torch.int64, device=x.device)
    h = (h1.unsqueeze(1) + i * h2.unsqueeze(1)) & _M32
    mm = m.unsqueeze(1) if isinstance(m, torch.Tensor) else m
    return (h * mm) >> 32


def _global_bits(x: torch.Tensor, lay: Layout, nh: int, s1: int, s2: int) -> torch.Tensor:
    """Probed bits of ``x`` as indices into all filters' bits (rows of empty blocks: -1)."""
    blk = x >> lay.log2u
    m = lay.bits[blk]
    pos = probe_positions(x, m, nh, s1, s2) + 8 * lay.offsets[blk].unsqueeze(1)
    return pos.masked_fill((m == 0).unsqueeze(1), -1)


def _use_native(native: Optional[bool], t: torch.Tensor) -> bool:
    """Whether to take the C loops (``native`` None: when built, for CPU tensors)."""
    if native is False:
        return False
    ok = t.device.type == "cpu" and _native.available()
    if native and not ok:
        raise RuntimeError("bloom: the native loops are not available (no C compiler, "
                           "HIPRESS_NO_NATIVE=1, or a non-CPU tensor)")
    return ok


def build_filter(x: torch.Tensor, lay: Layout, nh: int, s1: int, s2: int,
                 native: Optional[bool] = None) -> torch.Tensor:
    """The filters of sorted ``x`` (thesis Alg. 1): ``lay.nbytes`` bytes.

    ``native``: force (True) or forbid (False) the C loop; None: use it when built.
    """
    if _use_native(native, x):
        return _c.bloom_build(x, lay.log2u, lay.bits, lay.offsets, lay.nbytes, nh, s1, s2)
    bits = torch.zeros(8 * lay.nbytes, dtype=torch.bool, device=x.device)
    if x.numel():
        bits[_global_bits(x, lay, nh, s1, s2).reshape(-1)] = True
    w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=x.device)
    return (bits.view(-1, 8).to(torch.uint8) * w).sum(1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(filt: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=filt.device)
    return ((filt.unsqueeze(1) >> shifts) & 1).to(torch.bool).reshape(-1)


def contains(filt: torch.Tensor, lay: Layout, nh: int, s1: int, s2: int,
             x: torch.Tensor) -> torch.Tensor:
    """Membership answers for the elements of ``x`` (thesis Alg. 2): a bool mask."""
    if not x.numel() or lay.nbytes == 0:
        return torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
    # index -1 (an empty block's probes) reads the False appended at the end
    bits = torch.cat([_unpack_bits(filt), torch.zeros(1, dtype=torch.bool, device=x.device)])
    return bits[_global_bits(x, lay, nh, s1, s2)].all(1)


def _query_torch(filt: torch.Tensor, lay: Layout, nh: int, s1: int, s2: int,
                 n: int) -> torch.Tensor:
    bits = _unpack_bits(filt)
    out = []
    for c0 in range(0, n, _CHUNK):
        x = torch.arange(c0, min(n, c0 + _CHUNK), dtype=torch.int64, device=filt.device)
        blk = x >> lay.log2u
        m = lay.bits[blk]
        x, m, base = x[m > 0], m[m > 0], 8 * lay.offsets[blk[m > 0]]
        h1 = hash32(x, s1)
        keep = bits[base + ((h1 * m) >> 32)]
        x, h1, m, base = x[keep], h1[keep], m[keep], base[keep]
        h2 = hash32(x, s2) | 1
        for i in range(1, nh):
            keep = bits[base + ((((h1 + i * h2) & _M32) * m) >> 32)]
            x, h1, h2, m, base = x[keep], h1[keep], h2[keep], m[keep], base[keep]
        out.append(x)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)


def query(filt: torch.Tensor, lay: Layout, nh: int, s1: int, s2: int, n: int, cap: int,
          native: Optional[bool] = None) -> Tuple[torch.Tensor, int]:
    """All positives of the universe ``[0, n)`` (thesis Alg. 3, lines 2-5), vectorised.

    Args:
        filt: the filters' bytes, laid out by ``lay``, built with ``nh``, ``s1``, ``s2``.
        n: universe size, below 2**32.
        cap: return at most this many positives.
        native: force (True) or forbid (False) the C loop; None: use it when built.

    Returns:
        (sorted int64 positives, at most ``cap``; their total number).
    """
    if lay.nbytes == 0 or n == 0:
        return torch.empty(0, dtype=torch.int64, device=filt.device), 0
    if _use_native(native, filt):
        return _c.bloom_query(filt, lay.log2u, lay.bits, lay.offsets, nh, s1, s2, n, cap)
    pos = _query_torch(filt, lay, nh, s1, s2, n)
    return pos[:cap], pos.numel()


def block_starts(x: torch.Tensor, log2u: int, nb: int) -> torch.Tensor:
    """Where each of ``nb`` blocks starts in sorted ``x``, and its end: ``nb + 1`` offsets
    (their differences count the elements per block)."""
    edges = torch.arange(nb + 1, dtype=torch.int64, device=x.device) << log2u
    return torch.searchsorted(x, edges)
