"""Tests of the quantizers onebit (Seide et al. 2014), TBQ (Strom 2015) and TernGrad
(HiPress Fig. 5): reference values, unbiasedness, reproducibility, and the fused
(torch.compile) kernels against their eager twins, byte for byte."""
import logging

import pytest
import torch

import hipress_like.compressors as C
from hipress_like.compressors import ops
from hipress_like.compressors._build import fused as _fused
from hipress_like.compressors._build import native as _native
from hipress_like.compressors.onebit import fused as onebit_fused
from hipress_like.compressors.quantizers import fused as quantizers_fused


def _grad(n, seed=0, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _round_trip(c, g, seed=0):
    payload, state = c.encode(g, c.init(g, seed=seed))
    return payload, c.decode(payload), state


# -- onebit ------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 8, 1001])
def test_onebit_reconstructs_with_the_means_of_both_signs(n):
    g = _grad(n, seed=n)
    _, out, _ = _round_trip(C.get("onebit"), g)
    g64 = g.double()
    pos = g64[g64 >= 0].mean() if bool((g64 >= 0).any()) else torch.tensor(0.0)
    neg = g64[g64 < 0].mean() if bool((g64 < 0).any()) else torch.tensor(0.0)
    ref = torch.where(g64 >= 0, pos, neg)
    # fixed-point sums: error <= 2**-20 of max|g| (documented in onebit/fused.onebit_encode)
    assert torch.allclose(out.double(), ref, atol=2**-19 * float(g.abs().max()), rtol=1e-6)


def test_onebit_exact_example_and_degenerate_inputs():
    c = C.get("onebit")
    assert _round_trip(c, torch.tensor([0.5, -1.0, 1.5, -3.0]))[1].tolist() == [1, -2, 1, -2]
    assert _round_trip(c, torch.zeros(9))[1].tolist() == [0.0] * 9
    assert _round_trip(c, torch.full((5,), -2.0))[1].tolist() == [-2.0] * 5


def test_onebit_keeps_signs_and_is_pure():
    c = C.get("onebit")
    g = _grad(1001, seed=3)
    state = c.init(g)
    payload, new_state = c.encode(g, state)
    assert new_state == state  # no hidden error feedback: the engine wraps it
    out = c.decode(payload)
    assert torch.equal(out >= 0, g >= 0)
    assert not c.capabilities.unbiased and c.capabilities.category == "quantization"
    assert c.compression_ratio(1 << 20) < 1 / 31


# -- TBQ ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 5, 1001])
def test_tbq_sends_plus_minus_tau_above_the_threshold(n):
    tau = 0.7
    g = _grad(n, seed=n)
    _, out, _ = _round_trip(C.get("tbq", threshold=tau), g)
    ref = torch.where(g > tau, tau, torch.where(g < -tau, -tau, 0.0))
    assert torch.equal(out, ref)


def test_tbq_decodes_with_the_threshold_of_the_payload():
    g = torch.tensor([0.3, -0.3, 0.01])
    payload, _ = C.get("tbq", threshold=0.2).encode(g, {})
    assert C.get("tbq").decode(payload).tolist() == pytest.approx([0.2, -0.2, 0.0])


def test_tbq_default_and_params():
    c = C.get("tbq")
    assert c.params() == {"threshold": 0.01}
    assert c.payload_nbytes(1000) == 16 + 8 + 8 + 250
    assert "threshold=0.01" in repr(c)


# -- TernGrad ----------------------------------------------------------------

@pytest.mark.parametrize("bitwidth", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 1001])
def test_terngrad_stays_on_the_levels_between_min_and_max(bitwidth, n):
    g = _grad(n, seed=n + bitwidth)
    _, out, _ = _round_trip(C.get("terngrad", bitwidth=bitwidth), g)
    lo, hi = float(g.min()), float(g.max())
    gap = (hi - lo) / (2**bitwidth - 1) if hi > lo else 1.0
    k = (out.double() - lo) / gap
    assert torch.allclose(k, k.round(), atol=1e-3)  # on a level
    assert float(k.min()) >= -1e-3 and float(k.max()) <= 2**bitwidth - 1 + 1e-3
    assert float((out - g).abs().max()) <= gap * (1 + 1e-5)  # a neighbouring level


def test_terngrad_is_exact_on_levels_and_constants():
    c = C.get("terngrad", bitwidth=2)
    assert _round_trip(c, torch.tensor([0.0, 1.0, 2.0, 3.0]))[1].tolist() == [0, 1, 2, 3]
    assert _round_trip(c, torch.full((11,), 0.25))[1].tolist() == [0.25] * 11


@pytest.mark.parametrize("bitwidth", [1, 2])
def test_terngrad_is_unbiased_over_many_seeds(bitwidth):
    """E[decode(encode(g))] = g (Fig. 5: E[floor(r + u)] = r).

    Over S = 2000 seeds, per element the sample mean must lie within 5
    standard errors (sample std / sqrt(S)) of g, plus a float32 rounding
    slack. Seeds are fixed, so the test is deterministic; with 64 elements
    the chance that a correct implementation fails is below 1e-4.
    """
    c = C.get("terngrad", bitwidth=bitwidth)
    g = _grad(64, seed=11)
    s = 2000
    outs = torch.stack([c.decode(c.encode(g, c.init(g, seed=seed))[0]).double()
                        for seed in range(s)])
    mean, std = outs.mean(0), outs.std(0)
    se = std / s**0.5
    assert bool((std[(g != g.min()) & (g != g.max())] > 0).all())  # really random
    assert bool(((mean - g.double()).abs() <= 5 * se + 1e-6).all())


def test_terngrad_randomness_follows_seed_and_step():
    c = C.get("terngrad", bitwidth=1)
    g = _grad(4096, seed=2)
    st = c.init(g, seed=9)
    p1, st1 = c.encode(g, st)
    p2, st2 = c.encode(g, st1)
    assert (st1["step"], st2["step"]) == (1, 2) and st["step"] == 0
    assert not torch.equal(p1, p2)  # a new step draws new numbers
    assert torch.equal(p1, c.encode(g, c.init(g, seed=9))[0])
    assert not torch.equal(p1, c.encode(g, c.init(g, seed=10))[0])
    with pytest.raises(ValueError, match="init"):
        c.encode(g, {})


def test_terngrad_uses_the_uniform_operator_stream():
    """code = floor(r) + (u_i < frac(r)) with u_i = ops.uniform(n, seed)[i], Fig. 5 line 7."""
    from hipress_like.compressors.quantizers.terngrad import step_seed

    c = C.get("terngrad", bitwidth=8)
    g = _grad(37, seed=4)
    payload, _ = c.encode(g, c.init(g, seed=5))
    lo, hi = g.min(), g.max()
    gap = (hi - lo) / 255.0
    r = ((g - lo) / gap).clamp(0, 255)
    u = ops.uniform(37, step_seed(5, 0))
    codes = torch.floor(r) + (u < r - torch.floor(r)).float()
    assert torch.equal(c.decode(payload), lo + codes * gap)


def test_decode_into_a_preallocated_buffer():
    for name in ("onebit", "tbq", "terngrad"):
        c = C.get(name)
        g = _grad((3, 7), seed=1)
        payload, _ = c.encode(g, c.init(g))
        out = torch.empty(3, 7)
        assert c.decode(payload, out=out) is out
        assert torch.equal(out, c.decode(payload))
        with pytest.raises(ValueError, match="out must be"):
            c.decode(payload, out=torch.empty(20))


# -- fused kernels vs eager --------------------------------------------------

CASES = [("onebit", {}, torch.float32), ("onebit", {}, torch.bfloat16),
         ("tbq", {"threshold": 0.5}, torch.float32),
         ("terngrad", {"bitwidth": 2}, torch.float32),
         ("terngrad", {"bitwidth": 8}, torch.float16)]


@pytest.mark.parametrize("gil_free", [False, True], ids=["wrapper", "cpp_wrapper"])
@pytest.mark.parametrize("name,params,dtype", CASES)
def test_compiled_and_eager_payloads_are_identical(name, params, dtype, gil_free, monkeypatch):
    if not _fused.compile_enabled():
        pytest.skip("torch.compile is disabled (HIPRESS_NO_COMPILE=1 or it failed earlier)")
    monkeypatch.setattr(_fused, "MIN_COMPILE_NUMEL", 64)  # small sizes, compiled path
    monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")  # onebit's C loops: test_native.py
    # the GIL-releasing compilation (inductor cpp_wrapper) must give the same bits too
    monkeypatch.setattr(_fused, "GIL_FREE_NUMEL", 64 if gil_free else 1 << 40)
    c = C.get(name, **params)
    n = 8 * 1021 + 5  # odd: full bytes through the kernel plus a partial last byte
    g = _grad(n, seed=7, dtype=dtype)
    p_fused, out_fused, _ = _round_trip(c, g, seed=3)
    monkeypatch.setenv("HIPRESS_NO_COMPILE", "1")
    assert not _fused.compile_enabled()
    p_eager, out_eager, _ = _round_trip(c, g, seed=3)
    assert torch.equal(p_fused, p_eager)
    assert torch.equal(out_fused, out_eager)


def test_large_compiled_calls_release_the_gil():
    """A long compiled kernel must not stop the process's other Python threads (the
    engine's planner and round executor): large calls use the compilation that
    releases the GIL."""
    if not _fused.compile_enabled():
        pytest.skip("torch.compile is disabled (HIPRESS_NO_COMPILE=1 or it failed earlier)")
    kernel = _fused.Kernel(onebit_fused._onebit_residual_fn, "onebit residual (test)")
    x = _grad(1 << 25, seed=2)  # 128 MB: one call takes milliseconds
    one, two = torch.tensor(1.0), torch.tensor(-1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # leave the ticker a core (the machine may have two)
    try:
        kernel(x, one, two, spec=(x.dtype,))  # compile outside the observed call
        assert ((x.dtype,), x.dtype, True) in kernel._compiled
        _assert_releases_gil(lambda: kernel(x, one, two, spec=(x.dtype,)), "large kernel")
    finally:
        torch.set_num_threads(threads)


def _assert_releases_gil(call, what):
    """Fail unless a second Python thread keeps running during ``call``.

    Holding the GIL, a call lets the ticker in at most around its Python
    prologue (measured: 0-1 tick), however idle the machine. Released, the
    ticker runs all through the loop (~50 ticks) when it gets the other
    core; on a busy shared machine it may not, so a few observations are
    taken and the best counts. Retrying cannot make a GIL-holding call pass.
    """
    seen = []
    for _ in range(4):
        inside, ms = _ticks_during(call)
        seen.append(f"{inside} ticks in {ms:.1f} ms")
        if inside >= 5:
            return
    raise AssertionError(f"another thread barely ran during {what} calls: {seen}")


def _ticks_during(call):
    """Run ``call`` while a second thread ticks every 0.2 ms; return (ticks inside
    the call, the call's duration in ms)."""
    import threading
    import time

    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0002)

    t = threading.Thread(target=tick)
    t.start()
    try:
        time.sleep(0.01)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
    finally:
        stop.set()
        t.join()
    return sum(1 for v in ticks if t0 < v < t1), 1e3 * (t1 - t0)


def use_kernels(kernels, monkeypatch):
    """Route onebit's kernels through one path: "eager" torch, "compiled" (inductor,
    even for small tensors) or "native" (the C loops); skip when it is unavailable."""
    compiled = kernels == "compiled"
    if compiled and not _fused.compile_enabled():
        pytest.skip("torch.compile is disabled (HIPRESS_NO_COMPILE=1 or it failed earlier)")
    if kernels == "native" and not _native.available():
        pytest.skip("no C compiler: onebit's native loops are not built")
    monkeypatch.setattr(_fused, "MIN_COMPILE_NUMEL", 64 if compiled else 1 << 40)
    if kernels != "native":
        monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")


@pytest.mark.parametrize("n", [1001, 8 * 1021 + 5, 1 << 17])
@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kernels", ["eager", "compiled", "native"])
def test_decode_add_many_matches_a_loop_of_decode_add(n, count, dtype, kernels, monkeypatch):
    """A PS aggregator's merge: onebit adds all payloads in one pass over the
    accumulator, with the bits of adding them one by one (full bytes in the
    kernel, the last partial byte eagerly; half accumulators take the loop)."""
    use_kernels(kernels, monkeypatch)
    c = C.get("onebit")
    payloads = [c.encode(_grad(n, seed=10 + i, dtype=dtype), {})[0] for i in range(count)]
    acc0 = _grad(n, seed=99, dtype=dtype)
    fused = c.kernels.decode_add_many_(payloads, acc0.clone())
    loop = acc0.clone()
    for p in payloads:
        c.kernels.decode_add_(p, loop)
    assert torch.equal(fused, loop)
    # the engine's error-feedback wrapper passes it through
    ef = C.get("ef", inner="onebit")
    assert torch.equal(ef.kernels.decode_add_many_(payloads, acc0.clone()), loop)


def test_decode_add_many_rejects_a_foreign_payload():
    c = C.get("onebit")
    good = c.encode(_grad(100, seed=1), {})[0]
    bad = C.get("tbq").encode(_grad(100, seed=1), {})[0]
    with pytest.raises(C.PayloadError):
        c.kernels.decode_add_many_([good, bad], torch.zeros(100))


def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    def broken_compile(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_fused, "MIN_COMPILE_NUMEL", 16)
    monkeypatch.setattr(_fused, "_broken", False)
    monkeypatch.setattr(_fused, "_warned", False)
    monkeypatch.delenv("HIPRESS_NO_COMPILE", raising=False)
    # fresh kernels, so the cached compiled functions are not used
    monkeypatch.setattr(quantizers_fused, "_K_TBQ_PACK",
                        _fused.Kernel(quantizers_fused._tbq_pack_fn, "tbq encode"))
    monkeypatch.setattr(quantizers_fused, "_K_TBQ_UNPACK",
                        _fused.Kernel(quantizers_fused._tbq_unpack_fn, "tbq decode"))
    monkeypatch.setattr(torch, "compile", broken_compile)
    c = C.get("tbq", threshold=0.5)
    g = _grad(1001, seed=1)
    with caplog.at_level(logging.WARNING, logger=_fused.__name__):
        out1 = c.decode(c.encode(g, {})[0])
        out2 = c.decode(c.encode(g, {})[0])
    warnings = [r for r in caplog.records if r.name == _fused.__name__]
    assert len(warnings) == 1 and "eager" in warnings[0].getMessage()
    ref = torch.where(g > 0.5, 0.5, torch.where(g < -0.5, -0.5, 0.0))
    assert torch.equal(out1, ref) and torch.equal(out2, ref)


@pytest.mark.parametrize("name,params", [("onebit", {}), ("tbq", {}), ("terngrad", {}),
                                         ("terngrad", {"bitwidth": 4}), ("ef", {})])
@pytest.mark.parametrize("n", [1001, 1 << 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_decode_add_and_div_match_decode_then_op(name, params, n, dtype):
    """decode_add_ / decode_div_ (one fused pass; compiled for large n, eager for small,
    with a partial last byte at n = 1001) give the bits of decode, then add_ / div_."""
    from hipress_like.compressors.kernels import Kernels

    c = C.get(name, **params)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen).to(dtype)
    payload, _ = c.encode(x, c.init(x))
    acc = torch.randn(n, generator=gen).to(dtype)
    want_add = acc.clone().add_(c.decode(payload))
    assert torch.equal(c.kernels.decode_add_(payload, acc.clone()), want_add)
    assert torch.equal(Kernels(c).decode_add_(payload, acc.clone()), want_add)
    out = torch.empty(n, dtype=dtype)
    want_div = c.decode(payload).div_(4)
    assert torch.equal(c.kernels.decode_div_(payload, out, 4), want_div)
    assert torch.equal(Kernels(c).decode_div_(payload, torch.empty(n, dtype=dtype), 4),
                       want_div)
    with pytest.raises(ValueError, match="elements"):
        c.kernels.decode_add_(payload, torch.zeros(n + 1, dtype=dtype))


def test_assume_finite_skips_the_scan_but_kernels_still_catch_nan():
    """Inside assume_finite (the engine scanned the gradient already) error feedback's
    own scan is skipped; a NaN that reaches onebit's kernel still raises."""
    from hipress_like.compressors.base import assume_finite, check_gradient

    bad = torch.ones(64)
    bad[5] = float("nan")
    with assume_finite():
        check_gradient(bad)  # vouched for: no scan
        with pytest.raises(ValueError, match="NaN"):
            check_gradient(bad, nonfinite="always")
        c = C.get("ef", inner="onebit")
        with pytest.raises(ValueError, match="NaN"):
            c.encode(bad, c.init(bad))
    with assume_finite(False):
        with pytest.raises(ValueError, match="NaN"):
            check_gradient(bad)
    with pytest.raises(ValueError, match="NaN"):
        check_gradient(bad)
