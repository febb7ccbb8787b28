"""THC's payloads: kinds, header fields and body sizes (the layouts ``thc``'s docstring draws).

Kept apart from the compressor so that ``thc`` holds the algorithm: what a
payload of each kind (range, indices, sums) contains and how large its
body is for an n-element gradient, and the widths sums are widened to.
"""
from __future__ import annotations

import struct

from .kernels import BLOCK, _tail_blocks

__all__ = ["sum_width"]

_RANGE, _INDEX, _SUM = 0, 1, 2
_EXTRA = struct.Struct("<BBBBBBxxIII")  # kind bits flags log2B cap width | g count crc
_WIDTHS = ((8, 255), (16, 65535), (32, 2**31 - 1))  # sum width, largest sum it holds


def sum_width(count: int, granularity: int, cap: int = 32) -> int:
    """Bits per summed value for ``count`` payloads: the narrowest of 8, 16, 32 (at most
    ``cap``) holding ``count * granularity``; 0 when none does (an overflow)."""
    for w, top in _WIDTHS:
        if w <= cap and count * granularity <= top:
            return w
    return 0


class _Layout:
    """Sizes of an n-element gradient's blocks and payload bodies (``thc``'s docstring)."""

    def __init__(self, n: int, bits: int, transform: bool) -> None:
        self.n, self.planes = n, 32 // bits
        self.m = n // self.planes  # main words; the last n - m * planes elements: one more
        self.rest = n - self.m * self.planes
        self.words = self.m + (1 if self.rest else 0)
        self.index_nbytes = 4 * self.words
        self.full = n // BLOCK * BLOCK if transform else 0
        self.rows = self.full // BLOCK
        self.tails = _tail_blocks(n - self.full) if transform else []
        self.k = 1 if transform else 2
        self.nstat = self.rows + len(self.tails) if transform else 1

    def sum_nbytes(self, width: int) -> int:
        """Bytes of a sum body: ``planes / lanes`` arrays of ``words`` int32 words."""
        return 4 * self.words * (self.planes * width // 32)


class _Parsed:
    """A parsed payload: the header's fields by name, the element count, the body."""

    __slots__ = ("h", "kind", "bits", "flags", "log2b", "cap", "width", "g", "count", "crc",
                 "n", "body")

    def __init__(self, h, fields) -> None:
        self.h = h
        (self.kind, self.bits, self.flags, self.log2b, self.cap, self.width, self.g,
         self.count, self.crc) = fields
        self.n, self.body = (h.shape[0] if len(h.shape) == 1 else -1), h.body
