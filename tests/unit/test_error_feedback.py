"""Error feedback wrapper (hipress_like/compressors/error_feedback.py)."""
from __future__ import annotations

import logging

import pytest
import torch

from hipress_like.compressors import ErrorFeedback, available, get
from hipress_like.compressors.sparse.topk import TopK

# Inner compressors built here (plus others' quantizers when registered).
INNERS = [
    ("identity", {}),
    ("fp16", {}),
    ("topk", {"ratio": 0.05}),
    ("randomk", {"ratio": 0.1}),
    ("randomk", {"ratio": 0.1, "unbiased": False}),
]
for _name in ("onebit", "terngrad", "tbq", "natural"):
    if _name in available():
        INNERS.append((_name, {}))
IDS = [f"{n}{'-' + '-'.join(f'{k}={v}' for k, v in p.items()) if p else ''}" for n, p in INNERS]


def _grads(shape, steps, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(steps)]


@pytest.mark.parametrize("name,params", INNERS, ids=IDS)
def test_identity_g_plus_e_equals_decode_plus_new_e(name, params):
    c = get("ef", inner=name, **params)
    grads = _grads((30, 40), 5, seed=1)
    st = c.init(grads[0], seed=3)
    for g in grads:
        e_old = c.error(st).clone()
        payload, st = c.encode(g, st)
        assert torch.allclose(g + e_old, c.decode(payload) + c.error(st), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,params", INNERS, ids=IDS)
def test_decayed_memory_identity(name, params):
    beta, gamma = 0.5, 2.0
    c = ErrorFeedback(name, beta=beta, gamma=gamma, **params)
    grads = _grads((500,), 4, seed=2)
    st = c.init(grads[0])
    for g in grads:
        e_old = c.error(st).clone()
        payload, st = c.encode(g, st)
        # thesis Sec. 2.2.2: p = beta m + gamma g; m' = p - decode(C(p))
        assert torch.allclose(beta * e_old + gamma * g, c.decode(payload) + c.error(st),
                              rtol=0, atol=1e-12)


def test_nothing_is_lost_over_steps():
    c = get("ef", inner="topk", ratio=0.01)
    grads = _grads((2000,), 20, seed=3)
    st = c.init(grads[0])
    sent = torch.zeros(2000, dtype=torch.float64)
    for g in grads:
        p, st = c.encode(g, st)
        sent += c.decode(p)
    assert torch.allclose(sent + c.error(st), sum(grads), atol=1e-10)


def test_payload_is_the_inner_payload_of_the_compensated_gradient():
    inner = TopK(ratio=0.1)
    c = ErrorFeedback(inner)
    grads = _grads((300,), 3, seed=4)
    st = c.init(grads[0])
    for g in grads:
        want, _ = inner.encode(g + st["error"], {})
        buf = st["error"].data_ptr()
        payload, st2 = c.encode(g, st)
        assert torch.equal(payload, want)
        assert st2["error"].data_ptr() == buf  # the memory is updated in place
        st = st2
    assert c.algo_id == inner.algo_id
    assert c.capabilities == type(inner.capabilities)(
        **{**inner.capabilities.__dict__, "stateful": True, "keeps_memory": True})
    assert c.payload_nbytes(300) == inner.payload_nbytes(300)


def test_inner_state_is_threaded_through():
    c = get("ef", inner="randomk", ratio=0.1)
    g = torch.randn(100)
    st = c.init(g, seed=9)
    assert st["inner"] == {"seed": 9, "step": 0}
    _, st = c.encode(g, st)
    _, st = c.encode(g, st)
    assert st["inner"]["step"] == 2


def test_same_seed_same_bytes():
    grads = _grads((1000,), 3, seed=5, dtype=torch.float32)
    c1, c2 = get("ef", inner="randomk", ratio=0.05), get("ef", inner="randomk", ratio=0.05)
    s1, s2 = c1.init(grads[0], seed=1), c2.init(grads[0], seed=1)
    for g in grads:
        p1, s1 = c1.encode(g, s1)
        p2, s2 = c2.encode(g, s2)
        assert torch.equal(p1, p2)


def test_registry_and_constructor():
    c = get("ef", inner="topk", ratio=0.2)
    assert isinstance(c, ErrorFeedback) and isinstance(c.inner, TopK) and c.inner.ratio == 0.2
    assert isinstance(get("error_feedback", inner="fp16"), ErrorFeedback)
    assert get("ef").inner.name == "identity"
    assert ErrorFeedback(TopK(0.3)).inner.ratio == 0.3
    assert "topk" in repr(c) or "TopK" in repr(c)


@pytest.mark.parametrize("kwargs", [
    {"inner": "topk", "beta": 0}, {"inner": "topk", "gamma": -1.0},
    {"inner": "topk", "beta": float("nan")}, {"inner": "tpok"},
    {"inner": "topk", "ratio": 3.0}, {"inner": "topk", "nonsense": 1},
    {"inner": TopK(), "ratio": 0.1},
    {"inner": ErrorFeedback("topk")},
])
def test_invalid_construction_raises(kwargs):
    with pytest.raises(ValueError):
        get("ef", **kwargs)


def test_unknown_inner_lists_available():
    with pytest.raises(ValueError, match="available: .*topk"):
        get("ef", inner="tpok")


def test_wrapping_own_memory_compressor_warns(caplog):
    ef_logger = "hipress_like.compressors.wrappers.error_feedback"
    with caplog.at_level(logging.WARNING, logger=ef_logger):
        get("ef", inner="graddrop")
    assert "own residual" in caplog.text


def test_bad_inputs_raise():
    c = get("ef", inner="topk")
    st = c.init(torch.zeros(10))
    with pytest.raises(ValueError, match="init"):
        c.encode(torch.ones(20), st)
    with pytest.raises(TypeError):
        c.encode(torch.ones(10, dtype=torch.int64), st)
    with pytest.raises(ValueError):
        c.encode(torch.full((10,), float("inf")), st)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_dtypes(dtype):
    c = get("ef", inner="topk", ratio=0.1)
    g = torch.randn(7, 9).to(dtype)
    st = c.init(g)
    p, st = c.encode(g, st)
    out = c.decode(p)
    assert out.shape == g.shape and out.dtype == dtype
    assert st["error"].dtype == torch.float32  # half-precision memory would lose residuals
    # the cast to the wire dtype is compensated too
    assert torch.allclose(g.float(), out.float() + st["error"], atol=1e-6)


@pytest.mark.parametrize("n", [1000, 1 << 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_onebit_residual_equals_decode_and_subtract(n, dtype):
    """onebit's one-pass residual (x - (v1 if x >= 0 else v0)) gives the same bits as
    the generic decode-into-a-buffer-then-subtract, compiled (large) and eager (small)."""
    from hipress_like.compressors.kernels import Kernels

    c = get("onebit")
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[::7] = 0.0  # the threshold itself: x >= 0 takes v1
    payload, _ = c.encode(x, {})
    fused = c.kernels.subtract_decoded_(x.clone(), payload)
    generic = Kernels(c).subtract_decoded_(x.clone(), payload)
    assert torch.equal(fused, generic)
    assert torch.equal(fused, x - c.decode(payload))


@pytest.mark.parametrize("n", [1001, 8 * 1021 + 5, 1 << 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("kernels", ["eager", "compiled", "native"])
def test_onebit_fused_compensation_matches_the_two_steps(n, dtype, kernels, monkeypatch):
    """EF(onebit) adds the gradient into its memory inside onebit's packing sweep
    (``encode_accumulated_``); payloads and memories must be those of adding
    first and encoding after, step after step (half memories are float32 and
    take the two steps)."""
    from test_quantizers import use_kernels  # tests/unit is on sys.path (rootdir import)

    use_kernels(kernels, monkeypatch)
    ef = get("ef", inner="onebit")
    inner = get("onebit")
    gen = torch.Generator().manual_seed(5)
    g0 = torch.randn(n, generator=gen).to(dtype)
    st = ef.init(g0)
    mem = st["error"].clone()
    for step in range(3):
        g = torch.randn(n, generator=gen).to(dtype)
        payload, st = ef.encode(g, st)
        p = mem + g.to(mem.dtype)  # the reference: compensate, encode, memorise
        ref, _ = inner.encode(p.to(dtype), {})
        mem = p - inner.decode(ref).to(mem.dtype)
        assert torch.equal(payload, ref), step
        assert torch.equal(ef.error(st), mem), step
        # float32/64 defer the residual to the next encode's sweep; half types
        # (float32 memory, half payload) subtract it at once
        assert ("pending" in st) == (dtype != torch.float16), step
    ef.settle_(st)
    assert "pending" not in st and torch.equal(st["error"], mem)


def test_deferred_residual_is_applied_when_the_next_encode_cannot_fuse():
    """A state whose residual is still pending gives the same payload and memory on
    the unfused path (decay factors) as the settled state does."""
    fused = get("ef", inner="onebit")
    decayed = ErrorFeedback("onebit", beta=0.5, gamma=2.0)
    gen = torch.Generator().manual_seed(9)
    g0, g1 = (torch.randn(1003, generator=gen) for _ in range(2))
    _, st = fused.encode(g0, fused.init(g0))
    assert "pending" in st
    settled = fused.settle_({"error": st["error"].clone(), "pending": st["pending"],
                             "inner": {}})
    assert "pending" not in settled and torch.equal(settled["error"], fused.error(st))
    p_a, st_a = decayed.encode(g1, st)
    p_b, st_b = decayed.encode(g1, settled)
    assert torch.equal(p_a, p_b) and "pending" not in st_a
    assert torch.equal(st_a["error"], st_b["error"])


# -- multi-round inner compressors ---------------------------------------------------
def _ef_rounds_step(c, grads, states, average=False):
    """Play the engine for a multi-round compressor (rank order), as in test_powersgd."""
    from test_powersgd import _run_step

    return _run_step(c, grads, states, average=average)[0]


@pytest.mark.parametrize("average", [False, True])
def test_error_feedback_wraps_multi_round_and_keeps_the_global_error(average):
    """sum_i m_i(new) + N * average == sum_i (g_i + m_i(old)): what the average missed
    stays in the memories (the PowerSGD wrapper's own error is inside the inner state)."""
    n = 3
    c = ErrorFeedback(get("powersgd", rank=1))
    assert c.capabilities.rounds == 2 and c.capabilities.summable == (True, True)
    shape = (8, 5)
    states = [c.init(torch.zeros(shape, dtype=torch.float64), seed=i, world_size=n,
                     shared_seed=4) for i in range(n)]
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(n)]
        before = sum(g + c.error(st) for g, st in zip(grads, states))
        outs = _ef_rounds_step(c, grads, states, average=average)
        avg = outs[0] if average else outs[0] / n
        after = n * avg + sum(c.error(st) for st in states)
        assert torch.allclose(after, before, atol=1e-10)
        assert all(torch.equal(o, outs[0]) for o in outs)  # every rank decodes the same


def test_error_feedback_over_multi_round_sends_the_compensated_gradient():
    inner, c = get("powersgd", rank=2), ErrorFeedback(get("powersgd", rank=2))
    g = torch.randn(6, 4, dtype=torch.float64)
    st_i = inner.init(g, world_size=1, shared_seed=3)
    st_c = c.init(g, world_size=1, shared_seed=3)
    st_c["error"].fill_(0.5)
    p_i, _ = inner.encode_round(0, g + 0.5, st_i, None)
    p_c, _ = c.encode_round(0, g, st_c, None)
    assert torch.equal(p_i, p_c)  # round 0 of p = m + g


def test_error_feedback_round_order_is_checked():
    c = ErrorFeedback(get("powersgd"))
    g = torch.randn(4, 4)
    st = c.init(g, world_size=1)
    with pytest.raises(ValueError, match="before round 0"):
        c.encode_round(1, g, st, None)
    with pytest.raises(ValueError, match="one round, asked for round 1"):
        ErrorFeedback(get("topk")).encode_round(1, g, ErrorFeedback(get("topk")).init(g), None)


def test_error_feedback_forwards_the_summable_view():
    c, inner = ErrorFeedback(get("powersgd")), get("powersgd")
    g = torch.randn(6, 4)
    p, _ = c.encode_round(0, g, c.init(g, world_size=1), None)
    assert torch.equal(c.kernels.summable_view(p), inner.kernels.summable_view(p))
