"""PowerSGD with its error memory in bfloat16 (``PowerSGD(error_dtype="bfloat16")``).

What it must keep (``powersgd/powersgd.c``, ``powersgd.py``'s module docstring):
M is stored as torch's CPU conversion rounds float32 to bfloat16 (nearest, ties to
even, NaN to 0xFFFF), by the C kernels and the torch path alike; P, Q and the error all take
the stored values, in the lane order; the default (float32) path keeps its
bits and its repr; the option is validated; and error feedback still carries
what the low rank leaves out, to within the rounding it adds.
"""
from __future__ import annotations

import pytest
import torch

from hipress_like.compressors import get
from hipress_like.compressors._build import native as _native
from hipress_like.compressors.compll import matrices
from hipress_like.compressors.params import ParamError, ParamTypeError
from hipress_like.compressors.powersgd import ErrorMemoryRangeError, PowerSGD
from hipress_like.compressors.powersgd import lowrank as _lowrank
from hipress_like.compressors.powersgd import native as psgd_native

native_only = pytest.mark.skipif(not _native.available(),
                                 reason="no working C compiler: the torch kernels are used")

# (rows, cols, rank, pending rank): rows of every alignment, ranks up to the limit
CASES = [(1, 1, 1, 0), (37, 53, 1, 0), (64, 2560, 1, 1), (33, 101, 4, 4), (5, 7, 8, 3),
         (9, 8 * 64 + 3, 2, 2)]


def _inputs(rows, cols, rank, prev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    g = torch.randn(rows, cols, generator=gen)
    pp = torch.randn(rows, prev, generator=gen) if prev else None
    qp = torch.randn(prev, cols, generator=gen) if prev else None
    return e, g, pp, qp, torch.randn(rank, cols, generator=gen)


def _want(e, g, pp, qp, prev):
    wide = e.float()
    m = g + (wide - _lowrank._outer_sum(pp, qp, prev)) if prev else g + wide
    return m.to(torch.bfloat16)  # torch's rounding: nearest, ties to even


@native_only
@pytest.mark.parametrize("rows,cols,rank,prev", CASES)
def test_native_m_rounds_as_torch_and_p_sums_the_stored_values(rows, cols, rank, prev):
    e, g, pp, qp, qt = _inputs(rows, cols, rank, prev)
    e0, out = e.clone(), torch.empty_like(e)
    p = psgd_native.psgd_form_m(e, g, pp, qp, qt, out)
    want = _want(e, g, pp, qp, prev)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(e, e0)  # double buffering: the previous M stays
    assert torch.equal(p, matrices.matmul(want.float(), qt.t()))  # the lane order
    inplace = e.clone()
    assert torch.equal(psgd_native.psgd_form_m(inplace, g, pp, qp, qt, inplace), p)
    assert torch.equal(inplace.view(torch.int16), out.view(torch.int16))


@native_only
@pytest.mark.parametrize("offset", range(8))
def test_bf16_p_does_not_depend_on_the_buffers_alignment(offset):
    """The sweep streams 16-byte stores from where ``out`` is aligned; the head's
    length changes nothing."""
    rows, cols = 7, 8 * 9 + 5
    e, g, pp, qp, qt = _inputs(rows, cols, 3, 2, seed=11)
    out = torch.empty(rows * cols + 8, dtype=torch.bfloat16)[offset:offset + rows * cols]
    out = out.view(rows, cols)
    p = psgd_native.psgd_form_m(e, g, pp, qp, qt, out)
    assert torch.equal(out.view(torch.int16), _want(e, g, pp, qp, 2).view(torch.int16))
    assert torch.equal(p, matrices.matmul(out.float(), qt.t()))


@native_only
@pytest.mark.parametrize("rows,cols,rank", [(1, 1, 1), (9, 5, 2), (70, 1030, 4), (8, 513, 1)])
def test_bf16_mtp_is_the_float_mtp_of_the_widened_matrix(rows, cols, rank, monkeypatch):
    gen = torch.Generator().manual_seed(rows + cols)
    m = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    p = torch.randn(rows, rank, generator=gen)
    q = psgd_native.psgd_mtp(m, p)
    assert torch.equal(q, psgd_native.psgd_mtp(m.float(), p))  # widening is exact
    assert torch.equal(q, matrices.matmul(m.float().t(), p))
    monkeypatch.setattr(_native, "PARALLEL_NUMEL", 16)  # column blocks on several threads
    assert torch.equal(psgd_native.psgd_mtp(m, p), q)


@native_only
def test_nonfinite_values_round_as_torch():
    e, g, pp, qp, qt = _inputs(3, 40, 1, 0, seed=2)
    g[0, 5], g[1, 17], g[2, 33] = float("nan"), float("inf"), -float("inf")
    g[1, 0] = 3.4e38  # past bfloat16's largest finite value (3.39e38): +inf, as torch
    out = torch.empty_like(e)
    p = psgd_native.psgd_form_m(e, g, None, None, qt, out)
    assert torch.equal(out.view(torch.int16), _want(e, g, None, None, 0).view(torch.int16))
    assert not torch.isfinite(p).any()  # every row met a non-finite value


def test_torch_path_stores_the_native_bits(monkeypatch):
    """Without the C kernels (another device, or none built) M is stored with the
    same bits; P is the same sum up to its summation order."""
    e, g, pp, qp, qt = _inputs(24, 40, 2, 2, seed=5)
    monkeypatch.setattr(_lowrank, "_native_form_m", lambda *a: False)
    out = torch.empty_like(e)
    p = _lowrank.powersgd_form_m(e, g, pp, qp, qt, out=out)
    want = _want(e, g, pp, qp, 2)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    torch.testing.assert_close(p, want.float() @ qt.t(), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(_native, "usable", lambda *a, **k: False)
    torch.testing.assert_close(_lowrank.powersgd_mtp(out, p), out.float().t() @ p)


def test_error_dtype_is_validated_and_the_default_repr_is_unchanged():
    assert repr(PowerSGD(rank=2)) == "PowerSGD(rank=2, warm_start=True)"
    c = get("powersgd", rank=2, error_dtype="bfloat16")
    assert c.params() == {"rank": 2, "warm_start": True, "error_dtype": "bfloat16"}
    assert repr(get("powersgd", **c.params())) == repr(c)
    with pytest.raises(ParamError, match="error_dtype must be one of"):
        PowerSGD(error_dtype="float16")
    with pytest.raises(ParamTypeError, match="must be a string"):
        PowerSGD(error_dtype=torch.bfloat16)


def _run(c, grads_per_step, ranks):
    """The two-round protocol by hand over ``ranks`` simulated ranks; the averages."""
    states = [c.init(grads_per_step[0][r], world_size=ranks) for r in range(ranks)]
    outs = []
    for grads in grads_per_step:
        agg = None
        for rnd in (0, 1):  # each round's payloads, summed, feed the next
            sent = [c.encode_round(rnd, grads[r], states[r], agg) for r in range(ranks)]
            states = [st for _, st in sent]
            agg = c.merge([pl for pl, _ in sent])
        done = [c.decode_rounds(grads[r], states[r], agg, average=True) for r in range(ranks)]
        states = [st for _, st in done]
        outs.append(done[0][0])
    return outs, states


@pytest.mark.parametrize("shape", [(48, 40), (300,)])  # a matrix, and a padded vector
def test_bf16_error_feedback_carries_what_the_low_rank_leaves(shape):
    """Error feedback's invariant, sum of applied updates = sum of gradients minus
    the mean error left, holds to bfloat16's rounding of M, and the bfloat16 run
    tracks the float32 one."""
    ranks, steps = 2, 12
    gen = torch.Generator().manual_seed(7)
    grads = [[torch.randn(shape, generator=gen) for _ in range(ranks)] for _ in range(steps)]
    c16, c32 = PowerSGD(rank=2, error_dtype="bfloat16"), PowerSGD(rank=2)
    outs16, st16 = _run(c16, grads, ranks)
    outs32, _ = _run(c32, grads, ranks)
    assert all(st["error"].dtype == torch.bfloat16 for st in st16)
    applied = torch.stack(outs16).sum(0)
    total = sum(sum(g) for g in grads) / ranks
    left = sum(c16.error(st).float() for st in st16) / ranks
    # each step rounds M once (relative 2^-9); the drift stays a small part of the total
    drift = (applied + left - total).norm() / total.norm()
    assert drift < 0.02, drift
    rel = (torch.stack(outs16) - torch.stack(outs32)).norm() / torch.stack(outs32).norm()
    assert rel < 0.05, rel


def test_a_float32_error_from_a_checkpoint_is_taken_and_stored_in_bfloat16():
    c = PowerSGD(rank=1, error_dtype="bfloat16")
    g = torch.randn(16, 12)
    st = PowerSGD(rank=1).init(g, world_size=1)  # a state saved without the option
    p0, st = c.encode_round(0, g, st, None)
    p1, st = c.encode_round(1, g, st, c.merge([p0]))
    _, st = c.decode_rounds(g, st, c.merge([p1]))
    assert st["error"].dtype == torch.bfloat16
    p0, st = c.encode_round(0, g, c.detach_state(st, None), None)  # the fused path now
    assert st["m"].dtype == torch.bfloat16


def test_a_finite_gradient_past_bfloat16s_range_is_named_not_carried():
    """A finite M that rounds to Inf would stay Inf in the error memory for good."""
    c = PowerSGD(rank=1, error_dtype="bfloat16")
    g = torch.randn(8, 16)
    g[3, 4] = 3.4e38
    st = c.init(g, world_size=1)
    with pytest.raises(ErrorMemoryRangeError, match="bfloat16's range"):
        c.encode_round(0, g, st, None)
    g[3, 4] = float("nan")  # a non-finite gradient keeps the standard error
    with pytest.raises(ValueError, match="NaN|Inf|non-finite"):
        c.encode_round(0, g, c.init(g, world_size=1), None)
