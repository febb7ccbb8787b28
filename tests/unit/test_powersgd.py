"""PowerSGD (hipress_like/compressors/powersgd.py): two-round protocol, accuracy, payloads."""
from __future__ import annotations

import logging
import struct

import pytest
import torch

from hipress_like.compressors import PayloadError, get, header_nbytes
from hipress_like.compressors.ops import orthogonalize_, uniform
from hipress_like.compressors.powersgd.powersgd import (
    ROUND_LOCAL,
    ROUND_P,
    ROUND_Q,
    PowerSGD,
    matrix_shape,
    power_iteration,
)


def _run_step(c, grads, states, average=False):
    """Play the engine: round 0, merge, round 1, merge, decode (rank order)."""
    p0 = []
    for i, g in enumerate(grads):
        p, states[i] = c.encode_round(0, g, states[i], None)
        p0.append(p)
    agg0 = c.merge(p0)
    p1 = []
    for i, g in enumerate(grads):
        p, states[i] = c.encode_round(1, g, states[i], agg0)
        p1.append(p)
    agg1 = c.merge(p1)
    outs = []
    for i, g in enumerate(grads):
        o, states[i] = c.decode_rounds(g, states[i], agg1, average=average)
        outs.append(o)
    return outs, p0, p1


def _low_rank_ish(n, m, seed, decay=0.6, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=dtype))
    v, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=dtype))
    k = min(n, m)
    s = decay ** torch.arange(k, dtype=dtype)
    return u[:, :k] @ torch.diag(s) @ v[:, :k].t()


def test_matrix_shape_rule():
    assert matrix_shape((10,)) == (4, 3)  # ceil(sqrt(10)) = 4, ceil(10 / 4) = 3
    assert matrix_shape((16,)) == (4, 4)
    assert matrix_shape((17,)) == (5, 4)
    assert matrix_shape((1,)) == (1, 1)
    assert matrix_shape(()) == (1, 1)
    assert matrix_shape((7, 3, 2)) == (7, 6)
    assert matrix_shape((5, 1)) == (5, 1)


@pytest.mark.parametrize("rank", [0, -1, 1.5, True, "2"])
def test_invalid_rank_raises(rank):
    with pytest.raises(ValueError):
        get("powersgd", rank=rank)


def test_capabilities():
    c = PowerSGD()
    caps = c.capabilities
    assert (caps.category, caps.aggregatable, caps.rounds, caps.stateful) == (
        "lowrank", True, 2, True)
    assert c.algo_id == 30 and c.rank == 4 and c.warm_start


def test_two_round_protocol_matches_hand_computation():
    n_ranks, rank, shared = 3, 2, 1234
    c = PowerSGD(rank=rank)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(12, 5, generator=gen, dtype=torch.float64) for _ in range(n_ranks)]
    # per-rank seeds differ; the shared seed is the same everywhere
    states = [c.init(g, seed=100 + i, world_size=n_ranks, shared_seed=shared)
              for i, g in enumerate(grads)]
    outs, p0, p1 = _run_step(c, grads, states)

    q0 = (uniform(5 * rank, shared, 0) - 0.5).to(torch.float64).reshape(5, rank)
    q0 = orthogonalize_(q0)
    ps = [g @ q0 for g in grads]
    p_hat = orthogonalize_(sum(ps[1:], ps[0].clone()))
    qs = [g.t() @ p_hat for g in grads]
    q_sum = sum(qs[1:], qs[0].clone())
    want = p_hat @ q_sum.t()
    for i in range(n_ranks):
        assert torch.allclose(outs[i], want, atol=1e-12)
        assert torch.equal(outs[i], outs[0])  # bitwise identical on every rank
        assert torch.allclose(c.error(states[i]), grads[i] - want / n_ranks, atol=1e-12)
        assert torch.allclose(states[i]["q"], q_sum / n_ranks, atol=1e-12)
        assert states[i]["step"] == 1 and "p" not in states[i]
    # payload sizes are the declared per-round formula
    assert all(p.numel() == c.round_nbytes((12, 5), ROUND_P, 8) for p in p0)
    assert all(p.numel() == c.round_nbytes((12, 5), ROUND_Q, 8) for p in p1)
    assert p0[0].numel() == header_nbytes(2, 32) + 12 * rank * 8


def test_error_feedback_conserves_the_sum():
    # sum_i e_i(new) + approx_sum == sum_i (g_i + e_i(old))  (Vogels Alg. 2)
    n_ranks = 4
    c = PowerSGD(rank=1)
    gen = torch.Generator().manual_seed(1)
    shape = (9, 2, 4)
    states = [c.init(torch.zeros(shape, dtype=torch.float64), world_size=n_ranks)
              for _ in range(n_ranks)]
    for _ in range(3):
        grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(n_ranks)]
        before = sum(g + c.error(st) for g, st in zip(grads, states))
        outs, _, _ = _run_step(c, grads, states)
        after = outs[0] + sum(c.error(st) for st in states)
        assert torch.allclose(after, before, atol=1e-10)


def test_single_rank_running_sum_converges_to_gradient():
    # with one rank, sum of outputs over T steps + final error == T * g exactly
    c = PowerSGD(rank=1)
    g = torch.randn(20, 30, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    states = [c.init(g, world_size=1)]
    total = torch.zeros_like(g)
    steps = 100
    for _ in range(steps):
        outs, _, _ = _run_step(c, [g], states)
        total += outs[0]
    assert torch.allclose(total + c.error(states[0]), steps * g, atol=1e-8)
    # the error stays bounded (~12 |g| here for rank 1), so the mean output -> g as 1/T
    assert float(c.error(states[0]).norm()) < 20 * float(g.norm())
    assert float((total / steps - g).norm()) < 0.2 * float(g.norm())


def test_warm_start_approaches_svd_optimum_and_error_shrinks_with_rank():
    m = _low_rank_ish(48, 40, seed=3)
    svals = torch.linalg.svdvals(m)
    errs = []
    for rank in (1, 2, 4, 8):
        c = PowerSGD(rank=rank)
        st = [c.init(m, world_size=1)]
        for _ in range(30):
            # isolate the warm-started power iteration
            st[0].update(error=torch.zeros_like(m), error_p=None)
            outs, _, _ = _run_step(c, [m], st)
        err = float((m - outs[0]).norm())
        best = float(svals[rank:].square().sum().sqrt())  # Eckart-Young
        assert best <= err * (1 + 1e-9)
        assert err <= 1.05 * best, (rank, err, best)
        errs.append(err)
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.1 * errs[0]


def test_power_iteration_helper():
    m = _low_rank_ish(30, 20, seed=4)
    q = torch.randn(20, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for _ in range(40):
        p, q = power_iteration(m, q)
    assert torch.allclose(p.t() @ p, torch.eye(3, dtype=torch.float64), atol=1e-10)
    best = float(torch.linalg.svdvals(m)[3:].square().sum().sqrt())
    assert float((m - p @ q.t()).norm()) <= 1.01 * best


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(10,), (1,), (6, 4), (3, 4, 5), (7, 1)])
def test_round_trip_shapes_and_dtypes(dtype, shape):
    c = PowerSGD(rank=2)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    outs, _, _ = _run_step(c, [g, g], [c.init(g, world_size=2), c.init(g, world_size=2)])
    assert outs[0].shape == g.shape and outs[0].dtype == g.dtype
    st = c.init(g)
    payload, st = c.encode(g, st)
    out = c.decode(payload)
    assert out.shape == g.shape and out.dtype == g.dtype
    assert payload.numel() == c.round_nbytes(shape, ROUND_LOCAL, 8 if dtype == torch.float64
                                             else 4)


def test_payload_nbytes_one_dimensional_is_both_rounds():
    c = PowerSGD(rank=4)
    g = torch.randn(1000)
    st = [c.init(g, world_size=1)]
    _, p0, p1 = _run_step(c, [g], st)
    assert c.payload_nbytes(1000) == p0[0].numel() + p1[0].numel()
    rows, cols = matrix_shape((1000,))
    assert c.payload_nbytes(1000) == 2 * header_nbytes(1, 32) + 4 * 4 * (rows + cols)


def test_local_single_round_is_one_power_step_with_error_feedback():
    c = PowerSGD(rank=3)
    g = _low_rank_ish(16, 12, seed=7)
    st = c.init(g)
    payload, st2 = c.encode(g, st)
    out = c.decode(payload)
    assert torch.allclose(out + st2["error"], g, atol=1e-12)
    assert torch.count_nonzero(st["error"]) == 0  # input state untouched
    with pytest.raises(PayloadError, match="merge"):
        c.merge([payload, payload])


def test_shared_seed_not_rank_seed_decides_initial_q():
    c = PowerSGD(rank=2)
    g = torch.randn(8, 6, generator=torch.Generator().manual_seed(8))
    a, _ = c.encode_round(0, g, c.init(g, seed=1, world_size=2), None)
    b, _ = c.encode_round(0, g, c.init(g, seed=2, world_size=2), None)
    d, _ = c.encode_round(0, g, c.init(g, seed=1, world_size=2, shared_seed=9), None)
    assert torch.equal(a, b)
    assert not torch.equal(a, d)
    st = c.init(g, world_size=2)
    st["shared_seed"] = 9  # the engine may set it after init: Q is drawn lazily
    assert torch.equal(c.encode_round(0, g, st, None)[0], d)


def test_same_seed_same_bytes_over_steps():
    c = PowerSGD(rank=2)
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(10, 7, generator=gen) for _ in range(2)]
    s1 = [c.init(g, world_size=2) for g in grads]
    s2 = [c.init(g, world_size=2) for g in grads]
    for _ in range(3):
        o1, a1, b1 = _run_step(c, grads, s1)
        o2, a2, b2 = _run_step(c, grads, s2)
        assert all(torch.equal(x, y) for x, y in zip(a1 + b1, a2 + b2))


def test_warm_start_off_draws_a_fresh_q_each_step():
    c = PowerSGD(rank=1, warm_start=False)
    g = torch.randn(10, 8, generator=torch.Generator().manual_seed(10))
    st = [c.init(g, world_size=1)]
    _, p_first, _ = _run_step(c, [g], st)
    st[0].update(error=torch.zeros_like(g), error_p=None)
    _, p_second, _ = _run_step(c, [g], st)
    assert not torch.equal(p_first[0], p_second[0])


def test_protocol_misuse_raises_clearly(caplog):
    c = PowerSGD(rank=2)
    g = torch.randn(6, 5)
    st = c.init(g)  # no world_size
    with pytest.raises(ValueError, match="world_size"):
        c.encode_round(0, g, st, None)
    st = c.init(g, world_size=1)
    p0, st = c.encode_round(0, g, st, None)
    with pytest.raises(ValueError, match="encode_round\\(1\\)"):
        c.decode_rounds(g, st, p0)
    with pytest.raises(ValueError, match="round 1 needs"):
        c.encode_round(1, g, st, None)
    with pytest.raises(ValueError, match="rounds 0 and 1"):
        c.encode_round(2, g, st, p0)
    p1, st1 = c.encode_round(1, g, st, c.merge([p0]))
    with pytest.raises(PayloadError, match="round"):
        c.encode_round(1, g, st, p1)  # a round-1 payload where a round-0 sum belongs
    with pytest.raises(PayloadError, match="round"):
        c.merge([p0, p1])
    with pytest.raises(PayloadError, match="expected 255"):
        c.decode(p0)
    with pytest.raises(PayloadError, match="shape"):
        c.encode_round(1, torch.randn(5, 6), c.init(torch.randn(5, 6), world_size=1), p0)
    with pytest.raises(ValueError, match="init"):
        c.encode_round(0, torch.randn(3, 3), c.init(g, world_size=1), None)
    with pytest.raises(ValueError, match="interrupted step"):
        c.encode_round(0, g, st, None)  # round 0 again before decode_rounds of this step
    # PowerSGD has its own error feedback: wrapping it adds a second memory, with a warning
    with caplog.at_level(logging.WARNING):
        get("ef", inner="powersgd")
    assert "keeps its own residual" in caplog.text


def test_corrupted_payloads_raise_payload_error():
    c = PowerSGD(rank=2)
    g = torch.randn(6, 5)
    p0, _ = c.encode_round(0, g, c.init(g, world_size=1), None)
    fields = header_nbytes(2, 32) - 32
    with pytest.raises(PayloadError):
        c.merge([p0[:-4]])
    bad = p0.clone()
    bad[fields: fields + 8] = torch.frombuffer(bytearray(struct.pack("<Q", 7)), dtype=torch.uint8)
    with pytest.raises(PayloadError, match="unknown round"):
        c.merge([bad])
    bad = p0.clone()
    bad[fields + 24: fields + 32] = torch.frombuffer(bytearray(struct.pack("<Q", 3)),
                                                     dtype=torch.uint8)
    with pytest.raises(PayloadError, match="rank"):
        c.merge([bad])
    with pytest.raises(PayloadError, match="rank"):
        PowerSGD(rank=3).merge([p0])  # ranks configured with different ranks
    with pytest.raises(PayloadError, match="algorithm id"):
        get("topk").decode(p0)


def test_rounds_reuse_the_error_buffer_and_decode_into_out():
    """M is formed in the error buffer and stays the (factored) error; no per-step allocation."""
    c = PowerSGD(rank=2)
    g = torch.randn(32, 24, generator=torch.Generator().manual_seed(3))
    st = c.init(g, world_size=1)
    buf = st["error"]
    for _ in range(3):
        before = c.error(st)
        p0, st = c.encode_round(0, g, st, None)
        p1, st = c.encode_round(1, g, st, c.merge([p0]))
        out = torch.empty_like(g)
        res, st = c.decode_rounds(g, st, c.merge([p1]), out=out)
        assert res.data_ptr() == out.data_ptr()
        assert st["error"].data_ptr() == buf.data_ptr()
        assert st["error_p"] is not None  # e = M - P^ q^T, kept factored
        # e_new = (g + e_old) - approx, checked in float64
        torch.testing.assert_close(c.error(st).double() + out.double(),
                                   g.double() + before.double(), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="elements"):
        p0, st = c.encode_round(0, g, st, None)
        p1, st = c.encode_round(1, g, st, c.merge([p0]))
        c.decode_rounds(g, st, c.merge([p1]), out=torch.empty(5))


def test_padded_matrix_keeps_the_error_explicit():
    """A 1-D gradient whose matrix view needs padding takes the fresh-M path (no factors)."""
    c = PowerSGD(rank=2)
    g = torch.randn(10, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    st = [c.init(g, world_size=1)]
    for _ in range(3):
        before = c.error(st[0])
        outs, _, _ = _run_step(c, [g], st)
        assert st[0]["error_p"] is None
        assert torch.allclose(outs[0] + st[0]["error"], g + before, atol=1e-12)


def test_nan_gradient_leaves_the_state_untouched():
    """The NaN check runs before round 0 forms M in the error buffer."""
    c = PowerSGD(rank=2)
    g = torch.randn(16, 12, generator=torch.Generator().manual_seed(6))
    st = [c.init(g, world_size=1)]
    _run_step(c, [g], st)
    err, err_p, q = st[0]["error"].clone(), st[0]["error_p"].clone(), st[0]["q"].clone()
    bad = g.clone()
    bad[3, 4] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        c.encode_round(0, bad, st[0], None)
    assert torch.equal(st[0]["error"], err) and torch.equal(st[0]["error_p"], err_p)
    assert torch.equal(st[0]["q"], q)
    _run_step(c, [g], st)  # and training goes on


def test_bad_error_factors_raise_clearly():
    c = PowerSGD(rank=2)
    g = torch.randn(16, 12)
    st = [c.init(g, world_size=1)]
    _run_step(c, [g], st)
    st[0]["error_p"] = torch.zeros(5, 2)
    with pytest.raises(ValueError, match="error_p"):
        c.encode_round(0, g, st[0], None)


def test_fused_kernels_compiled_and_eager(monkeypatch):
    """The decompression gives the same bits compiled and eager (ranks that decode the
    same sums agree even if one fell back to eager); round 0's fused M and P = M Q agree
    to rounding (their sums run in another order)."""
    from hipress_like.compressors._build import fused as _fused
    from hipress_like.compressors.powersgd import lowrank as _fused_lowrank

    if not _fused.compile_enabled():
        pytest.skip("torch.compile is disabled (HIPRESS_NO_COMPILE=1 or it failed earlier)")
    monkeypatch.setattr(_fused, "MIN_COMPILE_NUMEL", 64)
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(48, 40, generator=gen)
    e0 = torch.randn(48, 40, generator=gen)
    p_prev, qt_prev = torch.randn(48, 3, generator=gen), torch.randn(3, 40, generator=gen)
    qt = torch.randn(3, 40, generator=gen)

    def run():
        out = torch.empty_like(g)
        _fused_lowrank.powersgd_lowrank(p_prev, qt, out)
        e = e0.clone()
        p = _fused_lowrank.powersgd_form_m(e, g, p_prev, qt_prev, qt)
        e_first = e0.clone()
        p_first = _fused_lowrank.powersgd_form_m(e_first, g, None, None, qt)
        return out, e, p, e_first, p_first

    compiled = run()
    monkeypatch.setenv("HIPRESS_NO_COMPILE", "1")
    eager = run()
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[0], p_prev @ qt)
    m = g + e0 - p_prev @ qt_prev
    for got in (compiled, eager):
        torch.testing.assert_close(got[1], m)
        torch.testing.assert_close(got[2], m @ qt.t())
        torch.testing.assert_close(got[3], g + e0)
        torch.testing.assert_close(got[4], (g + e0) @ qt.t())


def test_summable_view_is_the_merged_part_of_the_payload():
    c = PowerSGD(rank=2)
    g1, g2 = torch.randn(12, 10), torch.randn(12, 10)
    a, _ = c.encode_round(0, g1, c.init(g1, world_size=2), None)
    b, _ = c.encode_round(0, g2, c.init(g2, world_size=2), None)
    want = c.merge([a, b])
    va = c.kernels.summable_view(a)
    assert va.data_ptr() >= a.data_ptr() and va.numel() == 12 * 2
    va.add_(c.kernels.summable_view(b))  # what an allreduce does in place
    assert torch.equal(a, want)
    local, _ = c.encode(g1, c.init(g1))
    with pytest.raises(PayloadError, match="not summable"):
        c.kernels.summable_view(local)


@pytest.mark.parametrize("kernels", ["eager", "compiled", "native"])
def test_double_buffered_steps_give_the_in_place_bits_and_leave_the_old_state(
        kernels, monkeypatch):
    """``detach_state``: round 0 forms M in a second buffer. The outputs and the
    states are bit for bit those of the in-place steps, with each kind of
    kernel; the state a step started from keeps its tensors (so the engine
    can keep it to undo the step); two buffers alternate, no allocation per
    step."""
    from hipress_like.compressors._build import fused as _fused
    from hipress_like.compressors._build import native as _native

    if kernels == "native":
        if not _native.available():
            pytest.skip("no working C compiler: the torch kernels are used")
    else:
        monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")
    if kernels == "compiled":
        if not _fused.compile_enabled():
            pytest.skip("torch.compile is disabled (HIPRESS_NO_COMPILE=1 or it failed earlier)")
        monkeypatch.setattr(_fused, "MIN_COMPILE_NUMEL", 64)
    elif kernels == "eager":
        monkeypatch.setenv("HIPRESS_NO_COMPILE", "1")
    c = PowerSGD(rank=2)
    gen = torch.Generator().manual_seed(11)
    grads = [[torch.randn(48, 40, generator=gen) for _ in range(2)] for _ in range(5)]

    def run(double):
        states = [c.init(grads[0][i], world_size=2, shared_seed=7) for i in range(2)]
        spares, outs, ptrs = [None, None], [], set()
        for step in grads:
            kept = states
            if double:
                states = [c.detach_state(st, sp) for st, sp in zip(states, spares)]
            before = [{k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
                      for st in kept]
            outs.append(_run_step(c, step, states, average=True))
            if double:
                for st, old in zip(kept, before):
                    for k, v in old.items():
                        assert torch.equal(st[k], v), k  # the kept state is untouched
                spares = kept
                ptrs.add(states[0]["error"].data_ptr())
        return outs, states, ptrs

    want, want_states, _ = run(False)
    got, got_states, ptrs = run(True)
    for a, b in zip(want, got):  # per step: outputs, P payloads, Q payloads
        for xs, ys in zip(a, b):
            assert all(torch.equal(x, y) for x, y in zip(xs, ys))
    for a, b in zip(want_states, got_states):
        assert torch.equal(c.error(a), c.error(b)) and torch.equal(a["q"], b["q"])
        assert "m_buffer" not in b
    assert len(ptrs) == 2


def test_detach_state_never_hands_out_a_buffer_the_state_uses():
    c = PowerSGD(rank=1)
    g = torch.randn(6, 5)
    st = c.init(g, world_size=1)
    # a spare that is the live error (a state the step only read) is not reused
    use = c.detach_state(st, {"error": st["error"]})
    assert use["m_buffer"].data_ptr() != st["error"].data_ptr()
    # a spare of another shape or dtype is not either; a fitting free one is
    assert c.detach_state(st, {"error": torch.zeros(5, 6)})["m_buffer"].shape == (6, 5)
    free = torch.zeros(6, 5)
    assert c.detach_state(st, {"error": free})["m_buffer"] is free
    assert c.detach_state(st, {"error": free.double()})["m_buffer"].dtype == torch.float32
    # mid-step (M in flight, no error buffer) it declines: the caller copies
    _, mid = c.encode_round(0, g, st, None)
    assert c.detach_state(mid, None) is None
