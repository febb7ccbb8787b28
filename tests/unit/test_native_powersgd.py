"""PowerSGD's native round 0 (``psgd_native.psgd_form_m``) against the torch kernels.

The contract (``powersgd/powersgd.c``): M is the bits of ``_fused_lowrank``'s pointwise
formula ``(g + e) - P' Q'^T``, in place or into a second buffer alike; P is
``M Q`` to rounding, and the same bits in place or not, on one thread or
several. ``_fused_lowrank.powersgd_form_m`` takes it for float32 on the CPU
and keeps the torch kernels for everything else.
"""
from __future__ import annotations

import pytest
import torch

from hipress_like.compressors._build import native as _native
from hipress_like.compressors.powersgd import lowrank as _fused_lowrank
from hipress_like.compressors.powersgd import native as psgd_native

pytestmark = pytest.mark.skipif(not _native.available(),
                                reason="no working C compiler: the torch kernels are used")

# (rows, cols, rank, pending rank): rows of every alignment, ranks up to the limit
CASES = [(1, 1, 1, 0), (37, 53, 1, 0), (64, 2560, 1, 1), (33, 101, 4, 4), (5, 7, 8, 3),
         (16, 16, 2, 2), (9, 8 * 64 + 3, 8, 8)]


def _inputs(rows, cols, rank, prev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    e, g = torch.randn(rows, cols, generator=gen), torch.randn(rows, cols, generator=gen)
    pp = torch.randn(rows, prev, generator=gen) if prev else None
    qp = torch.randn(prev, cols, generator=gen) if prev else None
    return e, g, pp, qp, torch.randn(rank, cols, generator=gen)


@pytest.mark.parametrize("rows,cols,rank,prev", CASES)
def test_m_is_the_pointwise_formula_and_in_place_equals_a_second_buffer(rows, cols, rank, prev):
    e, g, pp, qp, qt = _inputs(rows, cols, rank, prev)
    want = g + e
    if prev:
        want = want - _fused_lowrank._outer_sum(pp, qp, prev)
    e0 = e.clone()
    out = torch.empty_like(e)
    p = psgd_native.psgd_form_m(e, g, pp, qp, qt, out)
    assert torch.equal(out, want) and torch.equal(e, e0)  # e is left as it was
    inplace = e.clone()
    p2 = psgd_native.psgd_form_m(inplace, g, pp, qp, qt, inplace)
    assert torch.equal(inplace, out) and torch.equal(p2, p)
    assert p.shape == (rows, rank)
    torch.testing.assert_close(p, want @ qt.t(), rtol=1e-4, atol=1e-4 * cols ** 0.5)


def test_rows_split_over_threads_give_the_same_bits(monkeypatch):
    monkeypatch.setattr(_native, "PARALLEL_NUMEL", 1024)
    e, g, pp, qp, qt = _inputs(301, 517, 2, 1, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.empty_like(e)
        p1 = psgd_native.psgd_form_m(e, g, pp, qp, qt, one)
        torch.set_num_threads(3)
        assert len(_native.rows(301, 517)) == 3
        many = torch.empty_like(e)
        p3 = psgd_native.psgd_form_m(e, g, pp, qp, qt, many)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many) and torch.equal(p1, p3)


def test_form_m_takes_native_for_float32_and_torch_otherwise(monkeypatch):
    calls = []
    real = psgd_native.psgd_form_m
    monkeypatch.setattr(psgd_native, "psgd_form_m", lambda *a: calls.append(1) or real(*a))
    e, g, pp, qp, qt = _inputs(24, 40, 2, 2, seed=5)
    ref = (g + e) - _fused_lowrank._outer_sum(pp, qp, 2)
    out = torch.empty_like(e)
    p = _fused_lowrank.powersgd_form_m(e, g, pp, qp, qt, out=out)
    assert calls == [1] and torch.equal(out, ref)
    # in place, as round 0 runs without double buffering: the same bits
    e2 = e.clone()
    assert torch.equal(_fused_lowrank.powersgd_form_m(e2, g, pp, qp, qt), p)
    assert torch.equal(e2, ref) and calls == [1, 1]
    # float64, a rank above the limit, or HIPRESS_NO_NATIVE: the torch kernels
    d = e.double().clone()
    _fused_lowrank.powersgd_form_m(d, g.double(), pp.double(), qp.double(), qt.double())
    big = torch.randn(psgd_native.PSGD_MAX_RANK + 1, 40)
    _fused_lowrank.powersgd_form_m(e.clone(), g, pp, qp, big)
    monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")
    e3 = e.clone()
    p3 = _fused_lowrank.powersgd_form_m(e3, g, pp, qp, qt)
    assert calls == [1, 1]
    torch.testing.assert_close(e3, ref)  # the eager kernels' addmm rounds its own way
    torch.testing.assert_close(p3, p, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(d.float(), ref)


@pytest.mark.parametrize("rows,cols,rank,prev", CASES)
def test_lowrank_is_the_outer_product_sum_bit_for_bit(rows, cols, rank, prev):
    """The decode's ``P Q^T`` keeps the torch kernels' bits (ranks that decode
    the same sums agree whichever kernels they run), and so does the dispatch."""
    gen = torch.Generator().manual_seed(rows * cols + rank)
    p, qt = torch.randn(rows, rank, generator=gen), torch.randn(rank, cols, generator=gen)
    want = _fused_lowrank._outer_sum(p, qt, rank)
    out = torch.full((rows, cols), float("nan"))
    psgd_native.psgd_lowrank(p, qt, out)
    assert torch.equal(out, want)
    out2 = torch.empty(rows, cols)
    _fused_lowrank.powersgd_lowrank(p, qt, out2)
    assert torch.equal(out2, want)
