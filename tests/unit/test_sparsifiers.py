"""Sparsifiers: topk, randomk, dgc, graddrop (hipress_like/compressors/{sparse,dgc,graddrop}.py)."""
from __future__ import annotations

import math
import struct
from unittest import mock

import pytest
import torch

from hipress_like.compressors import PayloadError, get, header_nbytes
from hipress_like.compressors._build import native
from hipress_like.compressors.base import NonFiniteError, assume_finite
from hipress_like.compressors.sparse import accumulators
from hipress_like.compressors.sparse.dgc import DGC
from hipress_like.compressors.sparse.graddrop import GradDrop
from hipress_like.compressors.sparse.topk import RandomK, TopK, num_selected, sparse_payload_nbytes

CASES = [
    ("topk", {"ratio": 0.05}),
    ("randomk", {"ratio": 0.05}),
    ("randomk", {"ratio": 0.05, "unbiased": False}),
    ("dgc", {"ratio": 0.05, "warmup_steps": 2}),
    ("graddrop", {"ratio": 0.05}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items())}" for n, p in CASES]


def _hdr(ndim: int) -> int:
    return header_nbytes(ndim, 16)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (1000,), (20, 30), (2, 3, 4, 5)])
def test_round_trip_keeps_shape_and_dtype(name, params, dtype, shape):
    c = get(name, **params)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    st = c.init(g, seed=7)
    for _ in range(3):
        payload, st = c.encode(g, st)
        assert payload.dtype == torch.uint8 and payload.dim() == 1
        out = c.decode(payload)
        assert out.shape == g.shape and out.dtype == g.dtype


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
@pytest.mark.parametrize("shape", [(1000,), (40, 25), (3, 7, 11)])
def test_payload_size_matches_declared(name, params, shape):
    c = get(name, **params)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    n, ndim = g.numel(), g.dim()
    declared = c.payload_nbytes(n, ndim)
    st = c.init(g, seed=3)
    for _ in range(5):
        payload, st = c.encode(g, st)
        if c.capabilities.fixed_size:
            k = num_selected(params["ratio"], n)
            assert payload.numel() == declared == _hdr(ndim) + _pad8(4 * k) + 4 * k
        else:
            assert payload.numel() <= declared


def test_sparse_payload_formula_int64_indices():
    # past 2**31 entries the indices widen to int64
    n = 2**31 + 10
    assert sparse_payload_nbytes(3, n, 1) == _hdr(1) + _pad8(8 * 3) + 3 * 4
    assert sparse_payload_nbytes(3, 1000, 1) == _hdr(1) + _pad8(4 * 3) + 3 * 4


def test_topk_selects_the_largest_magnitudes_exactly():
    g = torch.randn(5000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    c = TopK(ratio=0.01)
    out = c.decode(c.encode(g, c.init(g))[0])
    want = torch.topk(g.abs(), 50).indices
    got = torch.nonzero(out).reshape(-1)
    assert set(got.tolist()) == set(want.tolist())
    assert torch.equal(out[got], g[got])


def test_randomk_picks_k_distinct_indices_reproducibly():
    c = RandomK(ratio=0.1, unbiased=False)
    n = 1000
    a = c.indices(n, seed=5, step=0)
    assert a.numel() == 100 and torch.unique(a).numel() == 100
    assert int(a.min()) >= 0 and int(a.max()) < n
    assert torch.equal(a, c.indices(n, seed=5, step=0))
    assert not torch.equal(a, c.indices(n, seed=5, step=1))
    assert not torch.equal(a, c.indices(n, seed=6, step=0))
    g = torch.randn(n)
    st = c.init(g, seed=5)
    p, st2 = c.encode(g, st)
    out = c.decode(p)
    assert st2["step"] == 1 and st["step"] == 0
    assert torch.equal(torch.nonzero(out).reshape(-1), a)
    assert torch.equal(out[a], g[a])  # unbiased=False sends values as they are


def test_randomk_with_a_seed_draws_alike_whatever_the_states_seed():
    # BytePS's random-k: every worker and the server seeded alike keep the same
    # entries at a step, whatever seed the engine gave each state (rank, site)
    c = RandomK(ratio=0.1, unbiased=False, seed=2020)
    assert c.params()["seed"] == 2020 and "seed" not in RandomK(ratio=0.1).params()
    g, h = torch.randn(1000), torch.randn(1000)
    a, b = c.init(g, seed=1), c.init(h, seed=99)
    for _ in range(3):  # step by step, both states advance alike
        pa, a = c.encode(g, a)
        pb, b = c.encode(h, b)
        kept = torch.nonzero(c.decode(pa)).reshape(-1)
        assert torch.equal(kept, torch.nonzero(c.decode(pb)).reshape(-1))
        assert kept.numel() == 100
    for bad in (-1, 1.5, "3", True):
        with pytest.raises((TypeError, ValueError), match="seed"):
            RandomK(ratio=0.1, seed=bad)


def test_randomk_is_unbiased_over_seeds():
    # Each entry is kept w.p. k/n and scaled by n/k, so the estimator has
    # variance g_i^2 (n/k - 1). Over T seeds the mean's std is
    # |g_i| sqrt((n/k - 1) / T); we allow 5 of those per entry (and the max
    # over 64 entries of a 5-sigma event is still rare: p < 1e-4).
    n, ratio, trials = 64, 0.25, 4000
    g = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    c = RandomK(ratio=ratio, unbiased=True)
    assert c.capabilities.unbiased
    acc = torch.zeros(n, dtype=torch.float64)
    for seed in range(trials):
        acc += c.decode(c.encode(g, c.init(g, seed=seed))[0])
    mean = acc / trials
    k = num_selected(ratio, n)
    tol = 5 * g.abs() * math.sqrt((n / k - 1) / trials)
    assert bool(((mean - g).abs() <= tol).all()), (mean - g).abs().max()


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_same_seed_same_bytes(name, params):
    g = torch.randn(30_000, generator=torch.Generator().manual_seed(4))
    c1, c2 = get(name, **params), get(name, **params)
    s1, s2 = c1.init(g, seed=11), c2.init(g, seed=11)
    for _ in range(4):
        p1, s1 = c1.encode(g, s1)
        p2, s2 = c2.encode(g, s2)
        assert torch.equal(p1, p2)


def test_dgc_warmup_schedule_matches_paper():
    c = DGC(ratio=0.001, warmup_steps=5)
    sparsity = [1 - c.density(t) for t in range(7)]
    paper = [0.75, 0.9375, 0.984375, 0.996, 0.999, 0.999, 0.999]
    assert sparsity == pytest.approx(paper, abs=2e-3)
    assert all(a < b for a, b in zip(sparsity[:5], sparsity[1:5]))
    assert DGC(ratio=0.01).density(0) == 0.01  # no warm-up by default


def test_dgc_keeps_declared_fraction_after_warmup():
    n, ratio = 200_000, 0.001
    k = num_selected(ratio, n)
    c = DGC(ratio=ratio, warmup_steps=3, momentum=0.9)
    gen = torch.Generator().manual_seed(5)
    st = c.init(torch.zeros(n), seed=1)
    counts = []
    for t in range(10):
        g = torch.randn(n, generator=gen)
        p, st = c.encode(g, st)
        nnz = int((c.decode(p) != 0).sum())
        assert nnz <= num_selected(c.density(t), n)  # never more than the step's k
        if t >= 3:
            counts.append(nnz)
    # sampled threshold: never above k (exact top-k fallback), rarely far below
    assert all(0.5 * k <= x <= k for x in counts), counts
    assert sum(counts) / len(counts) >= 0.8 * k


def test_dgc_momentum_correction_and_masking_by_hand():
    n, m = 2000, 0.9
    c = DGC(ratio=0.01, momentum=m, sample_ratio=1.0)  # sample everything: exact top-k
    gen = torch.Generator().manual_seed(6)
    g1, g2 = torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(
        n, generator=gen, dtype=torch.float64)
    st0 = c.init(g1)
    p1, st1 = c.encode(g1, st0)
    p2, st2 = c.encode(g2, st1)
    # the accumulators are updated in place (no per-step allocation); the dicts are new
    assert st2["u"].data_ptr() == st0["u"].data_ptr() and st0["step"] == 0
    k = num_selected(0.01, n)
    u = g1.clone()
    v = g1.clone()
    sel = torch.topk(v.abs(), k).indices
    want1 = torch.zeros(n, dtype=torch.float64)
    want1[sel] = v[sel]
    u[sel] = 0
    v[sel] = 0
    u = m * u + g2
    v = v + u
    sel = torch.topk(v.abs(), k).indices
    want2 = torch.zeros(n, dtype=torch.float64)
    want2[sel] = v[sel]
    u[sel] = 0
    v[sel] = 0
    assert torch.equal(c.decode(p1), want1)
    assert torch.allclose(c.decode(p2), want2, atol=1e-12)
    assert torch.allclose(st2["u"], u, atol=1e-12) and torch.allclose(st2["v"], v, atol=1e-12)
    assert st2["step"] == 2


def test_dgc_local_gradient_clipping():
    g = torch.full((5000,), 3.0, dtype=torch.float64)
    c = DGC(ratio=0.01, momentum=0.0, clip_norm=1.0, sample_ratio=1.0)
    p, st = c.encode(g, c.init(g))
    total = c.decode(p) + st["v"]  # everything accumulated this step
    assert float(torch.linalg.vector_norm(total)) == pytest.approx(1.0, rel=1e-9)


def _torch_path(c, g, st):
    """``c.encode`` on its torch path (the accumulations, ``_select``) only."""
    with mock.patch.object(accumulators, "one_pass_usable", lambda *a: False):
        return c.encode(g, st)


ACCUMULATING = [(DGC, {}, ("u", "v")), (DGC, {"ratio": 0.01, "warmup_steps": 3}, ("u", "v")),
                (DGC, {"clip_norm": 20.0}, ("u", "v")), (DGC, {"ratio": 0.2}, ("u", "v")),
                (GradDrop, {}, ("residual",)), (GradDrop, {"ratio": 0.2}, ("residual",))]


@pytest.mark.skipif(not native.available(), reason="no C compiler for the native loops")
@pytest.mark.parametrize("cls,params,keys", ACCUMULATING)
@pytest.mark.parametrize("detached", [False, True])
def test_one_pass_step_gives_the_torch_paths_bits(cls, params, keys, detached):
    """DGC's and GradDrop's one pass (sparse/accumulate.c: accumulate, select, check),
    in place or into second buffers (detach_state), gives the torch path's payloads
    and states bitwise, step after step: the first step's all-zero accumulator
    (selected by != 0), a step where every entry ties (more pass than the kernel's
    buffer holds: a second filter, then the exact top-k), then random ones."""
    c, n = cls(**params), native.PARALLEL_NUMEL + 4099  # split over threads, a tail
    gen = torch.Generator().manual_seed(5)
    st = c.init(torch.zeros(n), seed=3)
    ref = c.init(torch.zeros(n), seed=3)
    _, st = c.encode(torch.zeros(n), st)
    _, ref = _torch_path(c, torch.zeros(n), ref)
    spare = None
    for step in range(5):
        g = torch.ones(n) if step == 0 else torch.randn(n, generator=gen) * (step + 1)
        density = c.density(st["step"]) if cls is DGC else c.ratio
        assert accumulators.one_pass_usable(g, st, keys, density, c.sample_ratio)
        use = c.detach_state(st, spare) if detached else st
        kept = {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
        p, new = c.encode(g, use)
        want, ref = _torch_path(c, g, ref)
        assert torch.equal(p, want), step
        assert new.keys() == ref.keys()  # the buffers' keys are consumed
        assert all(torch.equal(new[k], ref[k]) for k in keys)
        if detached:  # the given state stays valid; the next step reuses its arrays
            assert all(torch.equal(st[k], v) for k, v in kept.items())
            assert new[keys[0]].data_ptr() != st[keys[0]].data_ptr()
            if spare is not None:
                assert new[keys[-1]].data_ptr() == spare[keys[-1]].data_ptr()
            spare = st
        st = new


@pytest.mark.skipif(not native.available(), reason="no C compiler for the native loops")
@pytest.mark.parametrize("cls", [DGC, GradDrop])
def test_one_pass_step_refuses_nan_inside_assume_finite_and_keeps_the_state(cls):
    """The engine leaves DGC and GradDrop the NaN/Inf check (checks_finite): the
    one-pass kernel reports it; the state the engine keeps (detached) is untouched."""
    c, n = cls(), 200_000
    g = torch.randn(n)
    _, st = c.encode(g, c.init(g))
    before = {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
    g[n - 1] = float("nan")
    with assume_finite(), pytest.raises(NonFiniteError):
        c.encode(g, c.detach_state(st, None))
    assert all(torch.equal(st[k], v) for k, v in before.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("where", [0, 77_777, 199_999])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_topk_tells_nan_and_inf_inside_assume_finite(where, bad, dtype):
    """TopK declares checks_finite: its prefiltered selection (200 K entries: the
    sample, then the native filter for float32, torch's for float64, which then
    scans) refuses NaN/Inf where the engine vouched and scanned nothing; a finite
    gradient encodes as before."""
    c = TopK(ratio=0.01)
    assert c.capabilities.checks_finite
    g = torch.randn(200_000, generator=torch.Generator().manual_seed(where), dtype=dtype)
    with assume_finite():
        want, _ = c.encode(g, c.init(g))
    assert torch.equal(want, c.encode(g, c.init(g))[0])
    g[where] = bad
    with assume_finite(), pytest.raises(NonFiniteError):
        c.encode(g, c.init(g))


def test_graddrop_conserves_mass_and_keeps_fraction():
    n, ratio = 100_000, 0.01
    c = GradDrop(ratio=ratio)
    gen = torch.Generator().manual_seed(7)
    st = c.init(torch.zeros(n, dtype=torch.float64), seed=2)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    k = num_selected(ratio, n)
    for _ in range(8):
        g = torch.randn(n, generator=gen, dtype=torch.float64)
        p, st = c.encode(g, st)
        out = c.decode(p)
        nnz = int((out != 0).sum())
        assert 0.5 * k <= nnz <= num_selected(c.max_ratio, n), nnz
        assert p.numel() <= c.payload_nbytes(n)
        sent += out
        total += g
    # Aji & Heafield Alg. 1: what is not sent stays in the residual
    assert torch.allclose(sent + st["residual"], total, atol=1e-10)


def test_graddrop_half_precision_keeps_rounding_in_residual():
    g = torch.randn(4000, generator=torch.Generator().manual_seed(8)).to(torch.float16)
    c = GradDrop(ratio=0.05)
    p, st = c.encode(g, c.init(g))
    assert st["residual"].dtype == torch.float32
    assert torch.allclose(c.decode(p).float() + st["residual"], g.float(), atol=1e-6)


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_reselect_gives_exact_topk_of_merged_tensor(name, params):
    c = get(name, **params)
    merged = torch.randn(3000, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out = c.decode(c.reselect(merged, k=30))
    want = torch.topk(merged.abs(), 30).indices
    assert set(torch.nonzero(out).reshape(-1).tolist()) == set(want.tolist())


def _topk_payload(n=100, k=5):
    g = torch.arange(1, n + 1, dtype=torch.float32)
    return TopK(ratio=k / n).encode(g, {})[0]


def test_decode_accepts_unaligned_payload():
    p = _topk_payload()
    buf = torch.zeros(p.numel() + 3, dtype=torch.uint8)
    buf[3:] = p
    assert torch.equal(TopK(ratio=0.05).decode(buf[3:]), TopK(ratio=0.05).decode(p))


def test_corrupted_payloads_raise_payload_error():
    c = TopK(ratio=0.05)
    p = _topk_payload()
    body = _hdr(1)  # indices start right after the header (1-D, 16 bytes of fields)
    bad = p.clone()
    bad[body: body + 4] = torch.frombuffer(bytearray(struct.pack("<i", 1000)), dtype=torch.uint8)
    with pytest.raises(PayloadError, match="out of range"):
        c.decode(bad)
    bad = p.clone()
    bad[body: body + 4] = torch.frombuffer(bytearray(struct.pack("<i", -1)), dtype=torch.uint8)
    with pytest.raises(PayloadError, match="out of range"):
        c.decode(bad)
    bad = p.clone()  # duplicate: second index := first index
    bad[body + 4: body + 8] = bad[body: body + 4]
    with pytest.raises(PayloadError, match="increasing"):
        c.decode(bad)
    k_at = _hdr(1) - 16  # the k field
    bad = p.clone()
    bad[k_at: k_at + 8] = torch.frombuffer(bytearray(struct.pack("<Q", 6)), dtype=torch.uint8)
    with pytest.raises(PayloadError, match="body"):
        c.decode(bad)
    bad = p.clone()
    bad[k_at: k_at + 8] = torch.frombuffer(bytearray(struct.pack("<Q", 10**6)),
                                           dtype=torch.uint8)
    with pytest.raises(PayloadError, match="k="):
        c.decode(bad)
    bad = p.clone()
    bad[k_at + 8: k_at + 16] = torch.frombuffer(bytearray(struct.pack("<Q", 8)),
                                                dtype=torch.uint8)
    with pytest.raises(PayloadError, match="index size"):
        c.decode(bad)
    with pytest.raises(PayloadError):
        c.decode(p[:-3])
    with pytest.raises(PayloadError, match="algorithm id"):
        RandomK(ratio=0.05).decode(p)
    with pytest.raises(PayloadError):
        c.decode(p.to(torch.int32))


@pytest.mark.parametrize("name,params", [
    ("topk", {"ratio": 0}), ("topk", {"ratio": 1.5}), ("topk", {"ratio": -0.1}),
    ("topk", {"ratio": "x"}), ("randomk", {"ratio": 0.0}), ("dgc", {"ratio": 2}),
    ("dgc", {"momentum": 1.0}), ("dgc", {"warmup_steps": -1}), ("dgc", {"clip_norm": 0}),
    ("dgc", {"sample_ratio": 0}), ("graddrop", {"ratio": 0}),
    ("graddrop", {"ratio": 0.1, "max_ratio": 0.05}), ("topk", {"bogus": 1}),
])
def test_invalid_params_raise(name, params):
    with pytest.raises(ValueError):
        get(name, **params)


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_bad_gradients_raise(name, params):
    c = get(name, **params)
    g = torch.ones(100)
    st = c.init(g)
    with pytest.raises(TypeError):
        c.encode(torch.ones(100, dtype=torch.int32), st)
    with pytest.raises(ValueError):
        c.encode(torch.tensor([1.0, float("nan")] * 50), st)


def test_stateful_state_of_wrong_shape_raises():
    for c in (DGC(), GradDrop()):
        st = c.init(torch.zeros(10))
        with pytest.raises(ValueError, match="init"):
            c.encode(torch.ones(20), st)


def test_capabilities_declared():
    assert TopK().capabilities.fixed_size and not TopK().capabilities.stateful
    assert RandomK().capabilities.unbiased and not RandomK(unbiased=False).capabilities.unbiased
    for c in (DGC(), GradDrop()):
        assert c.capabilities.category == "sparsification"
        assert not c.capabilities.fixed_size and c.capabilities.stateful
        assert not c.capabilities.aggregatable
    assert {TopK.algo_id, RandomK.algo_id, DGC.algo_id, GradDrop.algo_id} == {20, 21, 22, 23}
