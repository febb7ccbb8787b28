"""Bloom-filter index codec: the sparse positions as Bloom filters (thesis Sec. 3).

The thesis ("Sparse communication for deep learning", Sec. 2.3.2 and 3)
sends the set ``S`` of the ``r`` positions a sparsifier kept as a Bloom
filter of ``m`` bits built with ``k`` hash functions, instead of ``r``
int32 positions. For a false-positive rate ``eps`` chosen by the user
(Sec. 2.3.2.1 and 3.2, after Broder & Mitzenmacher):

    m = -r ln(eps) / (ln 2)**2  bits       (~9.59 bits per position at eps = 0.01)
    k = -ln(eps) / ln 2         hashes     (rounded to the nearest integer, >= 1)

Blocks. The universe ``[0, d)`` is cut into blocks of ``2**18`` positions
and block ``b`` gets its own filter, sized by the same formula for its own
count ``r_b`` (``m_b = ceil(r_b * -ln(eps) / (ln 2)**2)``), with the counts
sent as 32-bit words. A tensor of at most ``2**18`` elements is one block:
the thesis' filter. For larger ones the bits per position are the thesis'
plus 40 per block (the count, and a byte of slack reserved so the size
depends on ``d`` and ``r`` only: 0.015 bits per position at top-k 1%); in exchange
every step of the decoder (and of a false-positive-aware encoder) works on
one block's few kilobytes, in cache and in parallel, and a policy draws
exactly ``r_b`` positions in each block, which lowers its error rate.

Hashing (``bloom_filter.py``). Position ``x`` (below 2**32) of block ``b``
probes bits ``((h1 + i h2) mod 2**32) * m_b >> 32`` of the block's filter
for ``i < k``, ``h1 = fmix32(x ^ s1)``, ``h2 = fmix32(x ^ s2) | 1``, seeds
from the payload's seed; bit ``p`` is bit ``p % 8`` of byte ``p // 8``.

Decoding (Sec. 3.1, Alg. 3) queries every position of the universe,
vectorised, never a Python loop per element (a C loop in ``bloom.c``
when a compiler is available, which stops probing an element at its first
miss; else torch, chunk by chunk, probing only the elements that hit so
far). The positives ``P`` hold ``S`` and about ``eps (d - r)`` false
positives; a *policy* draws ``r_b`` of them in each block (Sec. 3.4), and
the values, sent sorted by position, are placed on the drawn positions in
order (Sec. 3.3, Alg. 4):

- ``leftmost``: the smallest positives (Sec. 3.4.1);
- ``random``: positives drawn by hash keys from the payload's seed
  (Sec. 3.4.2);
- ``conflict`` (Sec. 3.4.3): a bit's *conflict set* is the positives
  probing it; each set bit was set by a true position, so a set with a
  single candidate left is a true position for sure. In rounds, over the
  bits no selected position probes ("certain" sets, which still hold a
  true position): select every candidate alone in such a set; when there
  is none, select candidates by priority, at most one per certain set in a
  round (a candidate is taken when it comes first in each of its certain
  sets). When no certain set is left, the rest is drawn by key. The thesis
  draws one at a time from the smallest certain set; here the priority is
  the number of certain sets a candidate is in (more first), then their
  total size (smaller first), then the key. The count matters most: a
  false positive's bits were set by true positions, mostly selected
  already, so few of its sets stay certain, while a true position not yet
  selected keeps its own bits uncovered. ``bench/sparse_codecs.py`` prints
  the rates (the thesis reports 18.7% at top-k 1%, eps 0.01).

A second filter (Sec. 3.6), with its own rate ``second_eps``, holds the
false positives ``P - S`` (blocked the same way); a positive it rejects is
certainly true and is selected before the policy draws the rest.

False-positive-aware compression (Sec. 3.7, ``fpaware=True``, the
default): the policy is deterministic given the payload, so the encoder
runs the decoder on its own filters and sends the values of the positions
the decoder will draw. No value lands on a position it was not taken from:
a false positive carries the true gradient value at that position, and
the true positions not drawn are not sent (error feedback keeps them).
Without it, values are sent for ``S`` and shift when a false positive is
drawn (the reconstruction errors of Sec. 3.3). The encoder leaves the
decoder's result in ``DECODED`` (``memo.py``), so this process's own
decodes of the payload (error feedback's residual, a PS server's
aggregate) do not run the decoder a second time.

The *policy error rate* (Sec. 3.5, 6.2) is the share of drawn positions
that are false positives: ``policy_error_rate(selected, true)``.

Fields (header extra, ``BloomIndex.fields``): eps, second_eps, the filter
bytes, the second filter's bytes, the number of positives ``|P|`` (when
the encoder counted them: decoders check it, so a corrupted filter is an
error, not garbage), seed, k, k2, policy, flags (1 fpaware, 2 second
filter, 4 positives counted), log2 of the block size. Section: the block
counts (uint32 each, padded to 8), the filters (each block's
``ceil(m_b / 8)`` bytes), then, padded to 8, the second filters.
"""
from __future__ import annotations

import struct
from typing import Any, Dict, Optional, Tuple

import torch

from ..base import mix_seed, view_as_dtype
from ..memo import DecodeMemo
from ..params import ParamError, check_bool, check_real
from ..payload import PayloadError, pad8
from . import native as _c
from .bloom_filter import (  # noqa: F401  (re-exported: the codec's primitives)
    BLOCK_LOG2,
    Layout,
    _nblocks,
    _policy_key,
    _seeds,
    _use_native,
    block_starts,
    bloom_bits,
    bloom_hashes,
    build_filter,
    contains,
    layout,
    probe_positions,
    query,
)
from .codecs import IndexCode, IndexCodec, register_index_codec

__all__ = [
    "POLICIES",
    "BloomIndex",
    "Layout",
    "bloom_bits",
    "bloom_hashes",
    "layout",
    "block_starts",
    "probe_positions",
    "build_filter",
    "contains",
    "query",
    "select",
    "policy_errors",
    "policy_error_rate",
]

POLICIES = ("leftmost", "random", "conflict")
_FPAWARE, _SECOND, _COUNTED = 1, 2, 4
#: The decodes this process's encoders already ran (memo.py says why).
DECODED = DecodeMemo()
_MAX_ROUNDS = 64          # conflict policy: rounds before the rest is drawn by key
_MAX_HASHES = 255         # a byte in the fields
_TOTAL_CAP = (1 << 20) - 1  # conflict policy: sizes summed per candidate, capped (20 bits)


# -- policies (Sec. 3.4) ------------------------------------------------------------------

def _first_by(order: torch.Tensor, mask: torch.Tensor, group: torch.Tensor,
              need: torch.Tensor) -> torch.Tensor:
    """A mask of, in each group ``g``, the ``need[g]`` elements of ``mask`` with the
    smallest ``order`` (distinct within a group, below 2**33)."""
    out = torch.zeros_like(mask)
    if not bool((need > 0).any()):
        return out
    idx = torch.nonzero(mask & (need > 0)[group]).reshape(-1)
    if not idx.numel():
        return out
    g = group[idx]
    perm = torch.argsort((g << 33) | order[idx])
    gs = g[perm]
    rank = torch.arange(gs.numel(), device=gs.device) - torch.searchsorted(gs, gs)
    out[idx[perm[rank < need[gs]]]] = True
    return out


def _smallest(order: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """A mask of the ``count`` elements of ``mask`` with the smallest (distinct) ``order``."""
    out = torch.zeros_like(mask)
    idx = torch.nonzero(mask).reshape(-1)
    if idx.numel() > count:
        idx = idx[torch.argsort(order[idx])[:count]]
    out[idx] = True
    return out


def _conflict(pos: torch.Tensor, key: torch.Tensor, sel: torch.Tensor, r: int,
              m: int) -> torch.Tensor:
    """One block's conflict-set rounds (module docstring); returns ``sel`` updated.

    ``_c.bloom_conflict_blocks`` runs the same rounds on the same
    integers (sorted by bit, updated incrementally), so the selection does
    not depend on which one ran.
    """
    p, nh = pos.shape
    sel = sel.clone()
    pos = torch.sort(pos, 1).values
    if nh > 1:  # an element probing one bit twice belongs to its set once
        dup = torch.zeros_like(pos, dtype=torch.bool)
        dup[:, 1:] = pos[:, 1:] == pos[:, :-1]
        pos = pos.masked_fill(dup, m)  # bit m: a sentinel, always covered
    bits = pos.reshape(-1)
    owner = torch.arange(p, device=pos.device).repeat_interleave(nh)
    big = torch.iinfo(torch.int64).max
    for _ in range(_MAX_ROUNDS):
        need = r - int(sel.sum())
        if need <= 0:
            break
        covered = torch.zeros(m + 1, dtype=torch.bool, device=pos.device)
        covered[bits[sel[owner]]] = True
        covered[m] = True
        live = ~(sel[owner] | covered[bits])
        if not bool(live.any()):
            break
        lb, lo = bits[live], owner[live]
        size = torch.bincount(lb, minlength=m + 1)[lb]
        forced = torch.zeros(p, dtype=torch.bool, device=pos.device)
        forced[lo[size == 1]] = True
        if bool(forced.any()):
            acc, order = forced, key
        else:
            nlive = torch.bincount(lo, minlength=p)
            total = torch.zeros(p, dtype=torch.int64, device=pos.device)
            total.scatter_add_(0, lo, size)
            score = ((nh - nlive) << 20) | total.clamp(max=_TOTAL_CAP)
            order = torch.where(nlive > 0, (score << 32) | key, big)
            best = torch.full((m + 1,), big, dtype=torch.int64, device=pos.device)
            best.scatter_reduce_(0, lb, order[lo], "amin")
            beaten = torch.zeros(p, dtype=torch.bool, device=pos.device)
            beaten[lo[order[lo] != best[lb]]] = True
            acc = (nlive > 0) & ~beaten
        sel |= _smallest(order, acc, need)
    return sel


def select(policy: str, cand: torch.Tensor, lay: Layout, pre: Optional[torch.Tensor],
           seed: int, nh: int = 1, s1: int = 0, s2: int = 0,
           native: Optional[bool] = None) -> torch.Tensor:
    """Draw ``lay.counts[b]`` of the sorted positives ``cand`` in each block (Sec. 3.4).

    Deterministic given its arguments (the decoder and a false-positive-aware
    encoder call it with the same ones).

    Args:
        policy: one of ``POLICIES``.
        cand: sorted int64 positives, at least ``lay.counts[b]`` in block ``b``.
        lay: the filters' layout; ``nh``, ``s1``, ``s2`` their hashes (``conflict``).
        pre: bool mask of ``cand`` known to be true (second filter), or None.
        seed: the payload seed (random keys).
        native: force or forbid the C loop of ``conflict`` (None: when built).

    Returns:
        The drawn positions, sorted.
    """
    nb = lay.counts.numel()
    sel = torch.zeros(cand.numel(), dtype=torch.bool, device=cand.device) if pre is None \
        else pre.clone()
    if policy == "leftmost":
        key = torch.arange(cand.numel(), device=cand.device)
    elif policy == "conflict":
        cstart = block_starts(cand, lay.log2u, nb)
        if _use_native(native, cand):  # the C rounds also draw the rest by key
            sel, key = _c.bloom_conflict_blocks(
                cand, cstart, lay.bits, lay.counts, sel, nh, s1, s2, mix_seed(seed, 7),
                _MAX_ROUNDS, int(cand[-1]) + 1 if cand.numel() else 0)
            return cand[sel]
        else:
            key = _policy_key(cand, seed)
            for b in torch.nonzero(cstart[1:] > cstart[:-1]).reshape(-1).tolist():
                c0, c1, m = int(cstart[b]), int(cstart[b + 1]), int(lay.bits[b])
                sel[c0:c1] = _conflict(probe_positions(cand[c0:c1], m, nh, s1, s2),
                                       key[c0:c1], sel[c0:c1], int(lay.counts[b]), m)
    else:
        key = _policy_key(cand, seed)
    blk = cand >> lay.log2u
    have = torch.diff(block_starts(cand[sel], lay.log2u, nb))
    sel |= _first_by(key, ~sel, blk, lay.counts - have)
    return cand[sel]


def policy_errors(selected: torch.Tensor, true: torch.Tensor) -> Tuple[int, int]:
    """(false positives drawn, positions drawn): the counts of the policy error rate."""
    if not selected.numel():
        return 0, 0
    wrong = int((~torch.isin(selected, true)).sum())
    return wrong, int(selected.numel())


def policy_error_rate(selected: torch.Tensor, true: torch.Tensor) -> float:
    """Share of drawn positions that are false positives (thesis Sec. 3.5, 6.2 "PER").

    Args:
        selected: the positions a decoder drew (``BloomIndex.decode``).
        true: the positions the sparsifier chose.

    Returns:
        ``|selected - true| / |selected|`` (0 for an empty draw).

    Example:
        >>> policy_error_rate(torch.tensor([0, 3, 6, 9]), torch.tensor([0, 3, 4, 8]))
        0.5
    """
    wrong, total = policy_errors(selected, true)
    return wrong / total if total else 0.0


# -- the codec ------------------------------------------------------------------------------

def _resolve(filt: torch.Tensor, lay: Layout, nh: int, seed: int, policy: str,
             cand: torch.Tensor, second: Optional[Tuple[torch.Tensor, Layout, int]]
             ) -> torch.Tensor:
    """The positions a decoder draws from positives ``cand`` (shared by both ends)."""
    pre = None
    if second is not None:
        filt2, lay2, nh2 = second
        pre = ~contains(filt2, lay2, nh2, *_seeds(seed, 1), cand)
    return select(policy, cand, lay, pre, seed, nh, *_seeds(seed, 0))


def _region(n: int, k: int, eps: float, log2u: int) -> int:
    """Bytes reserved for the first filters: their most for ``k`` positions, so the
    payload size depends on ``n`` and ``k`` only (``sum ceil(m_b / 8)`` is at most
    ``ceil(m / 8)`` plus one byte per block)."""
    return (bloom_bits(k, eps) + 7) // 8 + _nblocks(n, log2u)


def _counts_bytes(counts: torch.Tensor) -> torch.Tensor:
    raw = counts.to(torch.int32).view(torch.uint8)
    return torch.cat([raw, raw.new_zeros(pad8(raw.numel()) - raw.numel())])


@register_index_codec
class BloomIndex(IndexCodec):
    """The positions as blocked Bloom filters (module docstring; thesis Sec. 3).

    Args:
        eps: false-positive rate in (0, 1); sets ``m`` and ``k``. Default 0.01.
        policy: "conflict" (default), "random" or "leftmost"; "fpaware" is
            accepted as "conflict" with ``fpaware=True``.
        fpaware: false-positive-aware compression (Sec. 3.7); default True.
        second_eps: rate of a second filter on the false positives
            (Sec. 3.6), or None (default) for none.

    Raises:
        ParamError: a parameter out of range or an unknown policy.
    """

    name = "bloom"
    codec_id = 2
    # eps, second eps, filter bytes, second filter bytes, positives, seed, k, k2, policy,
    # flags, log2 block size
    fields = struct.Struct("<ddQQQIBBBBB3x")
    param_names = ("eps", "policy", "fpaware", "second_eps")
    lossless = False
    randomised = True

    def __init__(self, owner: str = "sparse", eps: float = 0.01, policy: str = "conflict",
                 fpaware: bool = True, second_eps: Optional[float] = None) -> None:
        self.eps = self._rate(owner, "eps", eps)
        if policy == "fpaware":
            policy, fpaware = "conflict", True
        if policy not in POLICIES:
            raise ParamError(f"{owner}: policy must be one of {POLICIES + ('fpaware',)}, "
                             f"found {policy!r}")
        self.policy = policy
        self.fpaware = check_bool(owner, "fpaware", fpaware)
        self.second_eps = None if second_eps is None else self._rate(owner, "second_eps",
                                                                     second_eps)
        self.fixed_size = second_eps is None  # the second filter's size follows |P - S|

    @staticmethod
    def _rate(owner: str, name: str, eps: Any) -> float:
        v = check_real(owner, name, eps, low=0.0, high=1.0, low_open=True, high_open=True,
                       example=0.01)
        if bloom_hashes(v) > _MAX_HASHES:
            raise ParamError(f"{owner}: {name}={eps!r} needs {bloom_hashes(v)} hashes, at most "
                             f"{_MAX_HASHES} fit the payload; raise it")
        return v

    def params(self) -> Dict[str, Any]:
        """Constructor parameters."""
        return {"eps": self.eps, "policy": self.policy, "fpaware": self.fpaware,
                "second_eps": self.second_eps}

    def encode(self, idx: torch.Tensor, n: int, seed: int) -> IndexCode:
        """Build the filters; with ``fpaware`` or a second filter, run the decoder on them.

        Raises:
            ValueError: ``n >= 2**32`` (the hashes read 32-bit positions).
        """
        if n >= 1 << 32:
            raise ValueError(f"bloom: the index codec handles tensors below 2**32 elements, "
                             f"found {n}; use index_codec='plain' for this one")
        r, nb = idx.numel(), _nblocks(n, BLOCK_LOG2)
        lay = layout(torch.diff(block_starts(idx, BLOCK_LOG2, nb)), self.eps)
        nh = bloom_hashes(self.eps)
        filt = build_filter(idx, lay, nh, *_seeds(seed, 0))
        pol, flags = POLICIES.index(self.policy), _FPAWARE if self.fpaware else 0
        region = _region(n, r, self.eps, BLOCK_LOG2)
        head = [_counts_bytes(lay.counts), filt, filt.new_zeros(region - filt.numel())]
        if r == 0 or not (self.fpaware or self.second_eps is not None):
            fields = self.fields.pack(self.eps, 0.0, lay.nbytes, 0, 0, seed, nh, 0, pol, flags,
                                      BLOCK_LOG2)
            return IndexCode(fields, torch.cat(head), idx)
        cap = r + int(4 * self.eps * (n - r)) + 1024
        cand, total = query(filt, lay, nh, *_seeds(seed, 0), n, cap)
        if total > cap:
            cand, total = query(filt, lay, nh, *_seeds(seed, 0), n, total)
        second, eps2, nbytes2, nh2, tail = None, 0.0, 0, 0, []
        if self.second_eps is not None:
            eps2, nh2 = self.second_eps, bloom_hashes(self.second_eps)
            fp = cand[~torch.isin(cand, idx)]
            lay2 = layout(torch.diff(block_starts(fp, BLOCK_LOG2, nb)), eps2)
            filt2 = build_filter(fp, lay2, nh2, *_seeds(seed, 1))
            second, nbytes2 = (filt2, lay2, nh2), lay2.nbytes
            tail = [filt.new_zeros(pad8(region) - region), filt2]
            flags |= _SECOND
        chosen = _resolve(filt, lay, nh, seed, self.policy, cand, second)
        fields = self.fields.pack(self.eps, eps2, lay.nbytes, nbytes2, total, seed, nh, nh2,
                                  pol, flags | _COUNTED, BLOCK_LOG2)
        section = torch.cat([*head, *tail])
        DECODED.put((self.fields.unpack(fields), n, r), section, chosen)
        return IndexCode(fields, section, chosen if self.fpaware else idx)

    @classmethod
    def section_nbytes(cls, fields: Tuple[Any, ...], n: int, k: int) -> int:
        """Counts, the first filters' region and (padded) second filters."""
        eps, nbytes2, flags, log2u = fields[0], fields[3], fields[9], fields[10]
        if not (0.0 < eps < 1.0 and 8 <= log2u <= 32):
            raise PayloadError(f"bloom payload declares eps={eps!r} (expected in (0, 1)) and "
                               f"blocks of 2**{log2u} (expected 2**8..2**32)")
        region = _region(n, k, eps, log2u)
        return pad8(4 * _nblocks(n, log2u)) + (pad8(region) + nbytes2 if flags & _SECOND
                                                else region)

    @classmethod
    def decode(cls, fields: Tuple[Any, ...], section: torch.Tensor, n: int,
               k: int) -> torch.Tensor:
        """Query the universe, check the counts, draw each block's count by the policy.

        Raises:
            PayloadError: inconsistent fields (``k`` against ``eps``, filter
                bytes against the block counts), an unknown policy, a filter
                whose positives do not match the count the encoder recorded
                or are fewer than a block's values.
        """
        eps, eps2, nbytes, nbytes2, positives, seed, nh, nh2, pol, flags, log2u = fields
        if not (0.0 < eps < 1.0) or nh != bloom_hashes(eps) or not 8 <= log2u <= 32:
            raise PayloadError(f"bloom payload declares {nh} hashes at eps={eps!r} in blocks "
                               f"of 2**{log2u} (expected {_expect(eps)}, blocks 2**8..2**32)")
        if pol >= len(POLICIES) or flags & ~(_FPAWARE | _SECOND | _COUNTED):
            raise PayloadError(f"bloom payload has unknown policy {pol} or flags {flags:#x} "
                               f"(known policies: {', '.join(POLICIES)})")
        has2, counted = bool(flags & _SECOND), bool(flags & _COUNTED)
        if has2 and not (counted and 0.0 < eps2 < 1.0 and nh2 == bloom_hashes(eps2)):
            raise PayloadError(f"bloom payload's second filter is inconsistent: eps2={eps2!r}, "
                               f"{nh2} hashes, flags {flags:#x}")
        if (not has2 and (nbytes2 or nh2)) or (not counted and positives) or positives > n:
            raise PayloadError(f"bloom payload fields are inconsistent: {nbytes2} second "
                               f"filter bytes, {positives} positives of {n}, flags {flags:#x}")
        if n >= 1 << 32:
            raise PayloadError(f"bloom payload for a tensor of {n} >= 2**32 elements")
        known = DECODED.get((tuple(fields), n, k), section) if counted else None
        if known is not None:  # this process encoded it: the decoder ran then
            return known
        nb = _nblocks(n, log2u)
        counts = view_as_dtype(section[: 4 * nb], torch.int32).to(torch.int64)
        sizes = torch.full((nb,), 1 << log2u, dtype=torch.int64)
        if nb:
            sizes[-1] = n - ((nb - 1) << log2u)
        if int(counts.sum()) != k or bool((counts < 0).any()) or bool((counts > sizes).any()):
            raise PayloadError(f"bloom payload's block counts sum to {int(counts.sum())} for "
                               f"{k} values, or exceed a block (corrupted)")
        lay = layout(counts, eps, log2u)
        if lay.nbytes != nbytes:
            raise PayloadError(f"bloom payload has {nbytes} filter bytes, its block counts "
                               f"make {lay.nbytes} at eps={eps!r}")
        off, region = pad8(4 * nb), _region(n, k, eps, log2u)
        filt = section[off: off + nbytes]
        _check_padding(filt, lay)
        if bool(section[off + nbytes: off + region].any()):
            raise PayloadError("bloom payload has bytes set after its filters (corrupted)")
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=section.device)
        s1, s2 = _seeds(seed, 0)
        cap = positives if counted else k + int(4 * eps * (n - k)) + 1024
        cand, total = query(filt, lay, nh, s1, s2, n, cap)
        if counted and total != positives:
            raise PayloadError(f"bloom payload filter gives {total} positives, the encoder "
                               f"recorded {positives} (corrupted filter)")
        if total > cap:
            cand, total = query(filt, lay, nh, s1, s2, n, total)
        found = torch.diff(block_starts(cand, log2u, nb))
        if bool((found < counts).any()):
            raise PayloadError("bloom payload filter gives fewer positives than values in a "
                               "block (corrupted filter)")
        second = None
        if has2:
            lay2 = layout(found - counts, eps2, log2u)
            if lay2.nbytes != nbytes2:
                raise PayloadError(f"bloom payload's second filter has {nbytes2} bytes, "
                                   f"expected {lay2.nbytes} for {total - k} false positives")
            f2 = off + pad8(region)
            second = (section[f2: f2 + nbytes2], lay2, nh2)
        return _resolve(filt, lay, nh, seed, POLICIES[pol], cand, second)

    def max_section_nbytes(self, n: int, k: int) -> int:
        """Exact without a second filter (counts and the filters' region); with one, its
        largest size added."""
        nb = _nblocks(n, BLOCK_LOG2)
        region = _region(n, k, self.eps, BLOCK_LOG2)
        if self.second_eps is None:
            return pad8(4 * nb) + region
        return pad8(4 * nb) + pad8(region) + (bloom_bits(n - k, self.second_eps) + 7) // 8 + nb


def _check_padding(filt: torch.Tensor, lay: Layout) -> None:
    """Raise ``PayloadError`` when a block's last byte has bits set past its ``m_b``."""
    tail = lay.bits % 8
    partial = torch.nonzero(tail).reshape(-1)
    if partial.numel():
        last = filt[lay.offsets[partial + 1] - 1].to(torch.int64)
        if bool(((last >> tail[partial]) != 0).any()):
            raise PayloadError("bloom payload filter has bits set past its m bits (corrupted)")


def _expect(eps: float) -> str:
    try:
        return f"{bloom_hashes(eps)} hashes"
    except (ValueError, OverflowError):
        return "eps in (0, 1)"
