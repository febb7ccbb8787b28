"""A memo of an expensive, deterministic decode, keyed by its whole input.

Some index codecs decode slowly: a Bloom filter's decoder queries every
position of the gradient and runs its draw policy (``bloom.py``). A
false-positive-aware encoder runs that decoder already, to learn which
positions the receivers will draw. The same rank then decodes its own
payload again, sometimes twice: error feedback subtracts the decoded payload
from its memory, and a CaSync-PS server decodes the aggregate it just
encoded.

``DecodeMemo`` lets the encoder leave its result for those decodes. An
entry is found only when the decoder's whole input is equal: the key, then
the section's bytes compared in full. The decode is a pure function of that
input, so a hit returns exactly what decoding would. Payloads received from
peers are never entered; they miss and are decoded as usual. Memory is
bounded: the least recently used entries go first, past ``max_bytes``.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable, Optional

import torch

__all__ = ["DecodeMemo"]


class DecodeMemo:
    """Least-recently-used map ``(key, section bytes) -> decoded tensor``, thread-safe.

    Args:
        max_bytes: bound on the sections and results held (default 64 MB).
        max_entries: bound on their number (default 256).

    Example:
        >>> memo = DecodeMemo()
        >>> sec = torch.arange(4, dtype=torch.uint8)
        >>> memo.put(("f", 4), sec, torch.tensor([1, 3]))
        >>> memo.get(("f", 4), sec.clone())
        tensor([1, 3])
        >>> memo.get(("f", 4), torch.zeros(4, dtype=torch.uint8)) is None
        True
    """

    def __init__(self, max_bytes: int = 64 << 20, max_entries: int = 256) -> None:
        self.max_bytes, self.max_entries = int(max_bytes), int(max_entries)
        self._lock = threading.Lock()
        self._entries: "OrderedDict[Hashable, tuple]" = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    @staticmethod
    def _size(section: torch.Tensor, value: torch.Tensor) -> int:
        return section.numel() * section.element_size() + value.numel() * value.element_size()

    def put(self, key: Hashable, section: torch.Tensor, value: torch.Tensor) -> None:
        """Remember that decoding ``section`` under ``key`` gives ``value`` (both copied)."""
        size = self._size(section, value)
        if size > self.max_bytes or section.device.type != "cpu":
            return
        entry = (section.detach().clone(), value.detach().clone())
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= self._size(*old)
            self._entries[key] = entry
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= self._size(*dropped)

    def get(self, key: Hashable, section: torch.Tensor) -> Optional[torch.Tensor]:
        """The remembered decode of ``section`` under ``key`` (a copy), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        hit = entry is not None and entry[0].shape == section.shape and \
            entry[0].dtype == section.dtype and torch.equal(entry[0], section)
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1
        return entry[1].clone() if hit else None

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
