"""DecodeMemo: a hit only on an equal input, bounded memory, least recently used out."""
from __future__ import annotations

import doctest

import torch

from hipress_like.compressors import memo
from hipress_like.compressors.memo import DecodeMemo


def test_doctests():
    assert doctest.testmod(memo).failed == 0


def test_a_hit_needs_the_same_key_and_equal_bytes():
    m = DecodeMemo()
    sec, val = torch.arange(100, dtype=torch.uint8), torch.arange(7)
    m.put("k", sec, val)
    sec[0] = 99  # the memo holds its own copy
    assert m.get("k", torch.arange(100, dtype=torch.uint8)).tolist() == list(range(7))
    assert m.get("other", torch.arange(100, dtype=torch.uint8)) is None
    assert m.get("k", torch.arange(99, dtype=torch.uint8)) is None          # shorter
    assert m.get("k", torch.arange(100, dtype=torch.int8)) is None          # dtype
    flipped = torch.arange(100, dtype=torch.uint8)
    flipped[50] ^= 1
    assert m.get("k", flipped) is None
    assert (m.hits, m.misses) == (1, 4)


def test_a_returned_value_is_a_copy():
    m = DecodeMemo()
    sec = torch.zeros(8, dtype=torch.uint8)
    m.put("k", sec, torch.tensor([1, 2]))
    m.get("k", sec).zero_()
    assert m.get("k", sec).tolist() == [1, 2]


def test_memory_is_bounded_least_recently_used_first():
    m = DecodeMemo(max_bytes=3 * 1100, max_entries=10)
    secs = {k: torch.full((1000,), k, dtype=torch.uint8) for k in range(4)}
    for k in range(3):
        m.put(k, secs[k], torch.zeros(10, dtype=torch.int64))  # 1080 bytes each
    assert m.get(0, secs[0]) is not None      # 0 is now the most recently used
    m.put(3, secs[3], torch.zeros(10, dtype=torch.int64))
    assert m.get(1, secs[1]) is None and m.get(0, secs[0]) is not None
    m.put("big", torch.zeros(10_000, dtype=torch.uint8), torch.zeros(1))  # above the bound
    assert m.get("big", torch.zeros(10_000, dtype=torch.uint8)) is None
    few = DecodeMemo(max_entries=2)
    for k in range(3):
        few.put(k, secs[k], torch.zeros(1))
    assert few.get(0, secs[0]) is None and few.get(2, secs[2]) is not None
    few.clear()
    assert few.get(2, secs[2]) is None
