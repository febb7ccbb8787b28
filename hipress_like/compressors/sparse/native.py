"""The sparsifiers' native CPU loops: top-k's threshold filter (``topk.c``), the
accumulating sparsifiers' one-pass step (``accumulate.c``: DGC, GradDrop, AR-Topk's
round 0) and the Bloom-filter index codec's build, universe query and conflict-set
policy (``bloom.c``).

Idea: top-k's prefilter (``ops.topk_abs``) is a compare per element whose ~1%
survivors are kept: torch writes two bool tensors, ORs them and scans the
result with ``nonzero``; one pass that skips the blocks of 64 with no
survivor is several times faster, and it tells NaN/Inf on the way. DGC's and
GradDrop's steps read the gradient and their accumulators several times in
torch (the accumulations, the NaN/Inf scan, the filter); ``accumulate_select``
does all of it in one pass, into the same state buffers or a second set. The
Bloom loops hash every position of the universe. All are written once in C
(built by ``_build/native.py``) and called here; the torch paths give the same
results (``tests/unit/test_ops.py``, ``tests/unit/test_sparsifiers.py``,
``tests/unit/test_bloom.py``).
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, List, Optional, Tuple

import torch

from .._build import native
from .._build.native import load as _load
from .._build.native import parallel as _map
from .._build.native import ranges as _ranges

__all__ = ["abs_at_least_indices", "bloom_build", "bloom_conflict_blocks", "bloom_query",
           "accumulate_select"]

_P, _I64, _I32, _U32, _F32 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32,
                              ctypes.c_float)


def _declare(lib: ctypes.CDLL) -> None:
    lib.hp_abs_at_least.argtypes = [_P, _I64, _I64, _F32, _P, _I64, _P]
    lib.hp_abs_at_least.restype = _I64
    lib.hp_acc_select.argtypes = [_P, _P, _P, _F32, _P, _P, _I64, _I64, _F32, _P, _I64, _P]
    lib.hp_acc_select.restype = _I64
    lib.hp_bloom_query.argtypes = [_P, _I64, _P, _P, _I32, _I32, _U32, _U32, _I64, _I64, _I64,
                                   _P, _I64]
    lib.hp_bloom_query.restype = _I64
    lib.hp_bloom_conflict_blocks.argtypes = [_P, _P, _P, _P, _I64, _I64, _I32, _U32, _U32, _U32,
                                             _P, _P, _I32]
    lib.hp_bloom_conflict_blocks.restype = _I32
    lib.hp_bloom_build.argtypes = [_P, _I64, _I32, _P, _P, _I32, _U32, _U32, _P]
    lib.hp_bloom_build.restype = None

native.bind(_declare)


def abs_at_least_indices(x: torch.Tensor, t: float,
                         cap: int) -> Tuple[torch.Tensor, int, bool]:
    """Sorted int64 positions of flat float32 ``x`` where ``|x| >= t`` (NaN never).

    One pass instead of ``ops.abs_at_least`` and ``torch.nonzero`` (two bool
    tensors and a scan); split over threads by element ranges for a large ``x``.

    Returns:
        (at most ``cap`` positions, how many there are in all, which may
        exceed ``cap``: call again with that count; whether ``x`` holds NaN or
        Inf, found in the same pass).
    """
    lib, xp = _load(), x.data_ptr()
    return _positions_by_range(x.numel(), 16, cap, lambda i0, i1, out, nonfinite: (
        lib.hp_abs_at_least(xp, i0, i1, t, out, cap, nonfinite)))


def accumulate_select(g: torch.Tensor, u: Optional[torch.Tensor], v: torch.Tensor, m: float,
                      uo: Optional[torch.Tensor], vo: torch.Tensor, t: float,
                      cap: int) -> Tuple[torch.Tensor, int, bool]:
    """An accumulating sparsifier's step in one pass over flat float32 tensors
    (``accumulate.c``): with a velocity ``u`` (DGC) ``uo = fma(m, u, g)``
    (``torch.add(g, u, alpha=m)``'s bits) and ``vo = v + uo``; without (``u`` and
    ``uo`` None: GradDrop) ``vo = v + g``. ``uo`` may be ``u`` and ``vo`` may be
    ``v`` (in place).

    Returns:
        (sorted positions where ``|vo| >= t``, at most ``cap`` of them; how many
        there are, which may exceed ``cap``: then filter ``vo`` again with
        ``abs_at_least_indices``; whether ``g`` holds NaN or Inf).
    """
    lib = _load()
    up, uop = (None, None) if u is None else (u.data_ptr(), uo.data_ptr())
    gp, vp, vop = g.data_ptr(), v.data_ptr(), vo.data_ptr()
    return _positions_by_range(g.numel(), 64, cap, lambda i0, i1, out, nonfinite: (
        lib.hp_acc_select(gp, up, vp, m, uop, vop, i0, i1, t, out, cap, nonfinite)))


def _positions_by_range(n: int, block: int, cap: int,
                        call: Callable[[int, int, int, Any], int]
                        ) -> Tuple[torch.Tensor, int, bool]:
    """Run a filtering loop ``call(i0, i1, out, nonfinite) -> count`` over ranges of
    whole ``block``s of ``n`` elements, one per thread, each into its own buffer
    of ``cap`` positions and its own NaN/Inf flag; returns (the positions in
    order, or none when more than ``cap`` passed; how many passed; whether any
    range saw NaN/Inf)."""
    ranges = [(j0 * block, min(n, j1 * block)) for j0, j1 in _ranges(-(-n // block), n)]
    bufs = [torch.empty(max(1, cap), dtype=torch.int64) for _ in ranges]
    bad = (ctypes.c_int32 * len(ranges))()
    slot = {r: i for i, r in enumerate(ranges)}

    def run(i0: int, i1: int, last: bool) -> int:
        i = slot[(i0, i1)]
        return int(call(i0, i1, bufs[i].data_ptr(), ctypes.byref(bad, 4 * i)))

    found = _map(run, ranges)
    total = sum(found)
    idx = (bufs[0][:0] if total > cap
           else torch.cat([b[:c] for b, c in zip(bufs, found)]))
    return idx, total, any(bad)


def _block_ranges(weights: torch.Tensor, n: int) -> List[Tuple[int, int]]:
    """Block ranges [b0, b1), one per thread for a large universe, of similar weight."""
    nb = weights.numel()
    threads = torch.get_num_threads() if n >= native.PARALLEL_NUMEL else 1
    threads = max(1, min(threads, nb))
    if threads == 1:
        return [(0, nb)]
    cum = torch.cumsum(weights.to(torch.float64), 0)
    total = float(cum[-1]) if nb else 0.0
    cuts = [0] + [int(torch.searchsorted(cum, total * t / threads)) + 1
                  for t in range(1, threads)] + [nb]
    cuts = sorted(set(min(max(c, 0), nb) for c in cuts))
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a] or [(0, nb)]


def bloom_build(x: torch.Tensor, log2u: int, mb: torch.Tensor, off: torch.Tensor, nbytes: int,
                nh: int, s1: int, s2: int) -> torch.Tensor:
    """The ``nbytes`` filter bytes of int64 ``x`` (``bloom.build_filter``'s bits)."""
    lib = _load()
    x, mb, off = x.contiguous(), mb.contiguous(), off.contiguous()
    filt = torch.zeros(nbytes, dtype=torch.uint8)
    lib.hp_bloom_build(x.data_ptr(), x.numel(), log2u, mb.data_ptr(), off.data_ptr(), nh,
                       s1 & 0xFFFFFFFF, s2 & 0xFFFFFFFF, filt.data_ptr())
    return filt


def bloom_query(filt: torch.Tensor, log2u: int, mb: torch.Tensor, off: torch.Tensor, nh: int,
                s1: int, s2: int, n: int, cap: int) -> Tuple[torch.Tensor, int]:
    """Positives of blocked Bloom filters over the universe [0, n) (``bloom.query``).

    Args:
        filt: the filters' bytes (uint8, contiguous, CPU); ``log2u``, ``mb``
            (bits per block), ``off`` (byte offset per block) their layout.
        nh, s1, s2: probes and hash seeds.
        n: the universe size (below 2**32).
        cap: at most this many positives are returned.

    Returns:
        (sorted int64 positives, at most ``cap`` of them; how many there are
        in all, which may exceed ``cap``).
    """
    lib = _load()
    mb, off, filt = mb.contiguous(), off.contiguous(), filt.contiguous()
    ranges = _block_ranges((mb > 0).to(torch.int64), n)
    bufs = {r: torch.empty(max(1, cap), dtype=torch.int64) for r in ranges}
    fp, mp, op = filt.data_ptr(), mb.data_ptr(), off.data_ptr()
    found = _map(lambda b0, b1, last: int(lib.hp_bloom_query(
        fp, filt.numel(), mp, op, log2u, nh, s1 & 0xFFFFFFFF, s2 & 0xFFFFFFFF, n, b0, b1,
        bufs[(b0, b1)].data_ptr(), cap)), ranges)
    kept = [bufs[r][: min(c, cap)] for r, c in zip(ranges, found)]
    return torch.cat(kept)[:cap], sum(found)


def bloom_conflict_blocks(cand: torch.Tensor, cstart: torch.Tensor, mb: torch.Tensor,
                          rb: torch.Tensor, sel: torch.Tensor, nh: int, s1: int, s2: int,
                          kseed: int, rounds: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """bloom.py's "conflict" rounds in every block (``bloom._conflict``, the same selection).

    Args:
        cand: sorted int64 positives; cstart: (B + 1) offsets of each block's
            candidates; mb, rb: bits and positions per block.
        sel: bool preselection (not modified).
        nh, s1, s2: probes and seeds; kseed: the keys' seed; rounds: the cap;
        n: the universe size (threads are used for a large one).

    Returns:
        (the bool selection after the rounds, the int64 keys ``hash32(cand, kseed)``).

    Raises:
        MemoryError: the workspaces could not be allocated.
    """
    lib = _load()
    cand, cstart = cand.contiguous(), cstart.contiguous()
    mb, rb = mb.contiguous(), rb.contiguous()
    flags = sel.to(torch.uint8).contiguous()
    key = torch.empty(cand.numel(), dtype=torch.int64)
    ptrs = (cand.data_ptr(), cstart.data_ptr(), mb.data_ptr(), rb.data_ptr())
    ranges = _block_ranges(cstart[1:] - cstart[:-1], n)
    done = _map(lambda b0, b1, last: int(lib.hp_bloom_conflict_blocks(
        *ptrs, b0, b1, nh, s1 & 0xFFFFFFFF, s2 & 0xFFFFFFFF, kseed & 0xFFFFFFFF,
        key.data_ptr(), flags.data_ptr(), rounds)), ranges)
    if min(done) < 0:
        raise MemoryError(f"bloom conflict policy: no memory for {cand.numel()} candidates")
    return flags.to(torch.bool), key
