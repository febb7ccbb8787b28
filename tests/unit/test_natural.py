"""Natural compression C_nat, natural dithering D_nat^{p,s} and standard dithering
D_sta^{p,s} (Horvath et al., "Natural Compression for Distributed Deep Learning").

Statistical checks use two-sided Bernstein intervals built from the variances the
operators are known to have (each entry rounds between two adjacent levels l < l',
variance (t - l)(l' - t)), each holding with probability >= 1 - DELTA, so a failure
is a bug, not bad luck. Then the edge cases natural.py's module docstring promises
(powers of two, zeros, subnormals, entries below the code range, overflow, NaN/Inf,
half types, float64), payload sizes, determinism, parameter and payload
validation, and round trips through the registry, the fused kernels and error
feedback. The C path against the torch path is in test_native.py.
"""
import math

import pytest
import torch

import hipress_like.compressors as C
from hipress_like.compressors import PayloadError, pack_payload, unpack_payload
from hipress_like.compressors.params import ParamError, ParamTypeError

DELTA = 1e-6  # failure probability allowed to each statistical assertion
F32_EPS = 2.0 ** -23


def _bernstein(var, spread, draws, count=1):
    """Half-width of a two-sided Bernstein interval for the mean of ``draws`` i.i.d.
    values with variance ``var`` lying within ``spread`` of each other, holding for
    ``count`` such means at once with probability >= 1 - DELTA (union bound)."""
    log = math.log(2 * count / DELTA)
    return (2 * var * log / draws) ** 0.5 + 2 * spread * log / (3 * draws)


def _draws(c, g, count, step=0):
    """decode(encode(g)) for seeds 0 .. count-1, one float64 row each."""
    rows = []
    for seed in range(count):
        st = c.init(g, seed=seed)
        st["step"] = step
        rows.append(c.decode(c.encode(g, st)[0]).double().reshape(-1))
    return torch.stack(rows)


def _cnat_levels(g):
    """(l, p): C_nat rounds |t| between l = 2^floor(log2 |t|) and 2l, up with p."""
    t = g.double().abs().reshape(-1)
    m, _ = torch.frexp(t)
    low = torch.where(t > 0, t / (2 * m), 0.0)  # exact: a power of two
    p = torch.where(t > 0, (t - low) / torch.where(t > 0, low, 1.0), 0.0)
    return low, p


def _powers(lo, hi, dtype):
    a = torch.tensor([2.0 ** k for k in range(lo, hi + 1)], dtype=torch.float64)
    return torch.cat([a, -a]).to(dtype)


# -- C_nat: unbiased, second moment (9/8) ------------------------------------------

def _natural_inputs():
    gen = torch.Generator().manual_seed(0)
    sub = torch.tensor([k * 2.0 ** -149 for k in (1, 3, 5, 7, 100, 1000, 2 ** 20 + 3)])
    return {
        "gaussian": torch.randn(128, generator=gen),
        "tiny_and_huge": torch.cat([torch.randn(32, generator=gen) * 1e-30,
                                    torch.randn(32, generator=gen) * 1e30]),
        # 4/3 * 2^a: where C_nat's variance is largest, exactly 1/8 of t^2
        "worst_case": torch.tensor([(-1) ** a * (4 / 3) * 2.0 ** a for a in range(-40, 40)]),
        "just_above_powers": torch.nextafter(_powers(-30, 30, torch.float32),
                                             torch.tensor(float("inf"))),
        "subnormals": torch.cat([sub, -sub]),
        "float16": torch.randn(128, generator=gen).half(),
        "bfloat16": (torch.randn(128, generator=gen) * 1e20).bfloat16(),
        "float64": torch.randn(64, generator=gen, dtype=torch.float64),
    }


@pytest.mark.parametrize("kind", list(_natural_inputs()))
def test_natural_is_unbiased_within_its_variance(kind):
    g = _natural_inputs()[kind]
    draws = 300 if g.dtype == torch.float64 else 1500  # float64 takes the torch path
    mean = _draws(C.get("natural"), g, draws).mean(0)
    low, p = _cnat_levels(g)
    tol = _bernstein(low ** 2 * p * (1 - p), low, draws, g.numel())
    t = g.double().reshape(-1)
    assert bool(((mean - t).abs() <= tol + 1e-12 * t.abs()).all()), kind


@pytest.mark.parametrize("kind", list(_natural_inputs()))
def test_natural_second_moment_is_at_most_nine_eighths(kind):
    """C_nat is in B(1/8): E||C_nat(x)||^2 <= (9/8) ||x||^2. Checked on the exact
    expectation, and the empirical mean against it (and against 9/8) within a
    Bernstein interval of ||C_nat(x)||^2, whose per-entry terms are l^2 or 4 l^2."""
    g = _natural_inputs()[kind]
    draws = 300 if g.dtype == torch.float64 else 1500
    t2 = float((g.double() ** 2).sum())
    low, p = _cnat_levels(g)
    expected = float((low ** 2 * (1 + 3 * p)).sum())
    assert expected <= 9 / 8 * t2 * (1 + 1e-12)
    z = (_draws(C.get("natural"), g, draws) ** 2).sum(1)
    tol = _bernstein(float((p * (1 - p) * (3 * low ** 2) ** 2).sum()),
                     float((3 * low ** 2).sum()), draws, 2)
    assert abs(float(z.mean()) - expected) <= tol
    assert float(z.mean()) <= 9 / 8 * t2 + tol


def test_the_worst_case_input_reaches_nine_eighths():
    """The bound is tight at t = (4/3) 2^a, so the check above is not loose."""
    low, p = _cnat_levels(torch.tensor([4 / 3], dtype=torch.float64))
    assert float(low[0] ** 2 * (1 + 3 * p[0])) == pytest.approx(9 / 8 * (4 / 3) ** 2)


# -- C_nat edge cases ---------------------------------------------------------------

@pytest.mark.parametrize("dtype, lo, hi", [
    (torch.float32, -126, 127),   # every normal power: a range of 2^253
    (torch.float32, -149, 100),   # subnormal powers too (the largest sets the base)
    (torch.float16, -24, 15),
    (torch.bfloat16, -133, 120),
    (torch.float64, -1074, -821),
    (torch.float64, -100, 150),
])
def test_powers_of_two_and_zeros_are_exact(dtype, lo, hi):
    g = torch.cat([_powers(lo, hi, dtype), torch.tensor([0.0, -0.0], dtype=dtype)])
    c = C.get("natural")
    for seed in range(3):
        out = c.decode(c.encode(g, c.init(g, seed=seed))[0])
        assert torch.equal(out, g)
        assert torch.equal(torch.signbit(out), torch.signbit(g))  # -0.0 stays -0.0


def test_each_entry_rounds_to_one_of_its_two_powers():
    g = torch.cat([_natural_inputs()["subnormals"], _natural_inputs()["just_above_powers"],
                   torch.tensor([3.0, -5.0, 0.1])])
    low, _ = _cnat_levels(g)
    sign = torch.where(g < 0, -1.0, 1.0).double()
    out = _draws(C.get("natural"), g, 50)
    assert bool(((out == sign * low) | (out == 2 * sign * low)).all())


def test_entries_below_the_code_range_round_between_zero_and_its_smallest_power():
    """With 2^127 in the tensor the codes reach down to 2^(127-254) = 2^-127; smaller
    entries become 0 or 2^-127, with probability |t| / 2^-127 (unbiased)."""
    small = torch.tensor([0.75 * 2.0 ** -127, -0.25 * 2.0 ** -127, 2.0 ** -149, 3e-40])
    g = torch.cat([torch.tensor([2.0 ** 127]), small])
    draws = 2000
    out = _draws(C.get("natural"), g, draws)
    assert bool((out[:, 0] == 2.0 ** 127).all())
    unit = 2.0 ** -127
    assert bool(((out[:, 1:].abs() == 0) | (out[:, 1:].abs() == unit)).all())
    p = small.double().abs() / unit
    tol = _bernstein(unit ** 2 * p * (1 - p), unit, draws, small.numel())
    assert bool(((out[:, 1:].mean(0) - small.double()).abs() <= tol).all())


@pytest.mark.parametrize("dtype, top", [(torch.float32, 127), (torch.bfloat16, 127),
                                        (torch.float16, 15), (torch.float64, 1023)])
def test_overflow_saturates_at_the_largest_power(dtype, top):
    """An entry whose round-up would leave the dtype saturates at 2^top (biased
    there, documented) instead of becoming Inf."""
    big = torch.finfo(dtype).max
    g = torch.tensor([big, -big, 1.5 * 2.0 ** top, 1.0], dtype=dtype)
    out = _draws(C.get("natural"), g, 20)
    want = torch.tensor([2.0 ** top, -(2.0 ** top), 2.0 ** top], dtype=torch.float64)
    assert bool((out[:, :3] == want).all()) and bool(torch.isfinite(out).all())


def test_a_tensor_of_zeros_has_base_zero_and_decodes_to_zeros():
    g = torch.tensor([0.0, -0.0] * 9)
    c = C.get("natural")
    p = c.encode(g, c.init(g))[0]
    assert int.from_bytes(unpack_payload(p).extra[:8], "little", signed=True) == 0
    assert torch.equal(torch.signbit(c.decode(p)), torch.signbit(g))


@pytest.mark.parametrize("name", ["natural", "natural_dithering", "dithering"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("native", [True, False])
def test_nan_and_inf_raise_the_standard_error(name, bad, native, monkeypatch):
    if not native:
        monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")
    g = torch.randn(1001, generator=torch.Generator().manual_seed(1))
    g[500] = bad
    c = C.get(name)
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.encode(g, c.init(g))


# -- dithering: unbiased, natural below standard ------------------------------------

def _dither_levels(name, s, p, g):
    """(l, l', ||g||_p) per entry: the levels around |g_i| / ||g||_p."""
    norm = float(torch.linalg.vector_norm(g.double(), ord=p))
    y = g.double().abs() / norm
    if name == "dithering":
        low = torch.floor(y * s) / s
        return low, torch.clamp(low + 1.0 / s, max=1.0), norm
    m, _ = torch.frexp(y)
    low = torch.where(y >= 2.0 ** (1 - s), y / (2 * m), 0.0)
    return low, torch.where(low > 0, 2 * low, 2.0 ** (1 - s)), norm


@pytest.mark.parametrize("name, s, p", [
    ("natural_dithering", 3, math.inf), ("natural_dithering", 7, 2.0),
    ("natural_dithering", 2, 1.0), ("dithering", 3, math.inf), ("dithering", 7, 2.0),
    ("dithering", 2, 1.0),
])
def test_dithering_is_unbiased_within_its_variance(name, s, p):
    g = torch.randn(64, generator=torch.Generator().manual_seed(3))
    draws = 1000
    mean = _draws(C.get(name, s=s, p=p), g, draws).mean(0)
    low, high, norm = _dither_levels(name, s, p, g)
    y = g.double().abs() / norm
    tol = _bernstein(norm ** 2 * (y - low) * (high - y), norm * (high - low), draws, g.numel())
    # float32 rounding of |x| / ||x|| and of the decoded levels, and the uniforms'
    # 2^-24 resolution: a few float32 ulps of the norm
    assert bool(((mean - g.double()).abs() <= tol + 4 * F32_EPS * norm).all())


def test_natural_dithering_has_lower_variance_than_standard_at_equal_s():
    """The paper: at a fixed number of levels s, D_nat^{p,s} has O(2^(s-1)/s) times
    smaller variance than D_sta^{p,s}. That is the worst-case regime, where the
    normalised entries |x_i| / ||x||_p mostly fall below the first standard level
    1/s: here p = 2, s = 8 and d = 4096 gaussian entries (|x_i| / ||x||_2 ~ 1/64).
    Both expected variances are computed exactly from the levels and the empirical
    ones checked against them (Bernstein, per-entry squared errors as the draws)."""
    s, p, d, draws = 8, 2.0, 4096, 150
    g = torch.randn(d, generator=torch.Generator().manual_seed(4))
    variance = {}
    for name in ("natural_dithering", "dithering"):
        low, high, norm = _dither_levels(name, s, p, g)
        y = g.double().abs() / norm
        up = (y - low) / (high - low)
        expected = float((norm ** 2 * (y - low) * (high - y)).sum())
        err = ((_draws(C.get(name, s=s, p=p), g, draws) - g.double()) ** 2).sum(1)
        lo_sq, hi_sq = (norm * (y - low)) ** 2, (norm * (high - y)) ** 2
        var_z = float((up * (1 - up) * (hi_sq - lo_sq) ** 2).sum())
        tol = _bernstein(var_z, float((hi_sq - lo_sq).abs().sum()), draws, 2)
        assert abs(float(err.mean()) - expected) <= tol + 1e-9 * expected, name
        variance[name] = (expected, float(err.mean()))
    nat, sta = variance["natural_dithering"], variance["dithering"]
    factor = 2 ** (s - 1) / s  # the paper's order of the gain (16 here; ~57 measured)
    assert nat[0] * factor < sta[0] and nat[1] * factor < sta[1], variance


def test_dithering_entries_on_a_level_are_exact():
    g = torch.tensor([1.0, -0.5, 0.25, 0.0, -0.125])
    c = C.get("natural_dithering", s=4, p=math.inf)
    assert torch.equal(c.decode(c.encode(g, c.init(g))[0]), g)
    g = torch.tensor([1.0, -0.75, 0.25, 0.0, 0.5])
    c = C.get("dithering", s=4, p=math.inf)
    assert torch.equal(c.decode(c.encode(g, c.init(g))[0]), g)


# -- bits and sizes ----------------------------------------------------------------

@pytest.mark.parametrize("n", [8, 64, 1000, 1001])
def test_natural_sends_nine_bits_a_value(n):
    """The paper's table: C_nat needs 9d bits (a sign and an 8-bit exponent)."""
    c = C.get("natural")
    g = torch.randn(n)
    p = c.encode(g, c.init(g))[0]
    body = unpack_payload(p).body.numel()
    assert body == -(-n // 8) + n and p.numel() == c.payload_nbytes(n)
    if n % 8 == 0:
        assert 8 * body == 9 * n


@pytest.mark.parametrize("name, s", [("natural_dithering", s) for s in (1, 2, 3, 7, 8, 127)]
                         + [("dithering", s) for s in (1, 3, 4, 15, 16, 255)])
@pytest.mark.parametrize("n", [8, 1001])
def test_dithering_sends_a_sign_and_ceil_log2_s_plus_1_bits_a_value(name, s, n):
    """d (1 + ceil(log2(s + 1))) bits, each plane padded to whole bytes, plus the
    float64 norm in the header (the paper counts ~ d (2 + log2 s) for D_nat)."""
    c = C.get(name, s=s)
    g = torch.randn(n)
    p = c.encode(g, c.init(g))[0]
    bits = math.ceil(math.log2(s + 1))
    assert unpack_payload(p).body.numel() == (1 + bits) * -(-n // 8)
    assert p.numel() == c.payload_nbytes(n)


# -- determinism --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["natural", "natural_dithering", "dithering"])
def test_same_seed_and_step_give_the_same_bytes_and_steps_differ(name):
    c = C.get(name)
    g = torch.randn(4097, generator=torch.Generator().manual_seed(5))
    st = c.init(g, seed=11)
    p0, st1 = c.encode(g, st)
    assert st1["step"] == st["step"] + 1 and st["step"] == 0  # input state untouched
    assert torch.equal(p0, c.encode(g, c.init(g, seed=11))[0])
    p1, _ = c.encode(g, st1)
    assert not torch.equal(p0, p1)
    assert not torch.equal(p0, c.encode(g, c.init(g, seed=12))[0])


# -- parameters ---------------------------------------------------------------------

BAD_PARAMS = [
    ("natural_dithering", {"s": 0}, ParamError, "s must be an integer >= 1"),
    ("natural_dithering", {"s": 128}, ParamError, r"s must be an integer in \[1, 127\]"),
    ("dithering", {"s": 256}, ParamError, r"s must be an integer in \[1, 255\]"),
    ("dithering", {"s": "4"}, ParamTypeError, "s must be an integer, found str '4'"),
    ("dithering", {"s": 2.5}, ParamTypeError, "s must be an integer, found float"),
    ("dithering", {"k": True}, ParamTypeError, "k must be an integer, found bool"),
    ("dithering", {"s": 4, "k": 4}, ParamError, "given twice"),
    ("natural_dithering", {"p": 3}, ParamError, "p must be 1, 2 or inf"),
    ("natural_dithering", {"p": 0.5}, ParamError, "p must be 1, 2 or inf"),
    ("dithering", {"p": "inf"}, ParamTypeError, "p must be a number, found str"),
    ("dithering", {"p": True}, ParamTypeError, "p must be a number, found bool"),
    ("dithering", {"normalize": "l1"}, ParamError, "normalize must be 'max' or 'l2'"),
    ("dithering", {"normalize": 1}, ParamTypeError, "normalize must be a string"),
    ("dithering", {"p": 2, "normalize": "l2"}, ParamError, "norm was given twice"),
    ("dithering", {"partition": "natural"}, ParamError, "'natural_dithering' compressor"),
    ("natural_dithering", {"partition": "linear"}, ParamError, "'dithering' compressor"),
    ("dithering", {"partition": 0}, ParamTypeError, "partition must be a string"),
]


@pytest.mark.parametrize("name, params, error, message", BAD_PARAMS,
                         ids=[f"{n}-{sorted(p.items())}" for n, p, _, _ in BAD_PARAMS])
def test_bad_parameters_raise_naming_the_parameter(name, params, error, message):
    with pytest.raises(error, match=message) as e:
        C.get(name, **params)
    assert str(e.value).startswith(f"{name}: ")
    assert isinstance(e.value, TypeError) == (error is ParamTypeError)


def test_natural_takes_no_parameters():
    with pytest.raises(ValueError, match="invalid parameters for compressor 'natural'"):
        C.get("natural", s=4)


def test_byteps_names_map_to_s_and_p():
    assert C.get("dithering", k=4, normalize="max", partition="linear").params() == {
        "s": 4, "p": math.inf}
    assert C.get("natural_dithering", k=3, normalize="L2", partition="natural").params() == {
        "s": 3, "p": 2.0}
    assert C.get("natural_dithering").params() == {"s": 7, "p": math.inf}
    assert C.get("dithering", s=5, p=1).params() == {"s": 5, "p": 1.0}


def test_declared_capabilities():
    for name in ("natural", "natural_dithering", "dithering"):
        caps = C.get(name).capabilities
        assert caps.category == "quantization" and caps.unbiased and caps.stateful
        assert caps.fixed_size and not caps.aggregatable and caps.rounds == 1
    assert [C.get(n).algo_id for n in ("natural", "natural_dithering", "dithering")] == [
        40, 41, 42]


# -- malformed payloads -------------------------------------------------------------

def _with_extra(payload, extra):
    h = unpack_payload(payload)
    bad, body = pack_payload(h.algo_id, h.dtype, h.shape, extra, h.body.numel())
    body.copy_(h.body)
    return bad


@pytest.mark.parametrize("dtype, base", [(torch.float32, 255), (torch.float32, -23),
                                         (torch.float16, 143), (torch.float64, 2047)])
def test_natural_rejects_a_base_outside_the_dtype(dtype, base):
    c = C.get("natural")
    g = torch.randn(33).to(dtype)
    bad = _with_extra(c.encode(g, c.init(g))[0], base.to_bytes(8, "little", signed=True))
    with pytest.raises(PayloadError, match="base exponent"):
        c.decode(bad)


@pytest.mark.parametrize("field, value, message", [
    ("s", 0, "declares s=0"), ("s", 200, "declares s=200"), ("p", 7, "p code 7"),
    ("norm", float("nan"), "declares norm nan"), ("norm", -1.0, "declares norm -1.0"),
])
def test_dithering_rejects_bad_header_fields(field, value, message):
    import struct
    c = C.get("natural_dithering")
    g = torch.randn(33)
    p = c.encode(g, c.init(g))[0]
    norm, s, pcode = struct.unpack_from("<dHB", unpack_payload(p).extra)
    fields = {"norm": norm, "s": s, "p": pcode, field: value}
    bad = _with_extra(p, struct.pack("<dHB5x", fields["norm"], fields["s"], fields["p"]))
    with pytest.raises(PayloadError, match=message):
        c.decode(bad)


def test_dithering_rejects_a_level_code_above_s():
    c = C.get("dithering", s=4)  # 3 code bits: codes 5..7 are not levels
    g = torch.randn(33)
    p = c.encode(g, c.init(g))[0].clone()
    unpack_payload(p).body[5:].fill_(0xFF)
    with pytest.raises(PayloadError, match="above s=4"):
        c.decode(p)


@pytest.mark.parametrize("name, other", [("natural", "natural_dithering"),
                                         ("natural_dithering", "dithering"),
                                         ("dithering", "natural")])
def test_foreign_and_truncated_payloads_are_rejected(name, other):
    g = torch.randn(33)
    c, o = C.get(name), C.get(other)
    with pytest.raises(PayloadError, match="algorithm id"):
        c.decode(o.encode(g, o.init(g))[0])
    p = c.encode(g, c.init(g))[0]
    with pytest.raises(PayloadError, match="truncated|size mismatch"):
        c.decode(p[:-1].clone())


# -- round trips --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["natural", "natural_dithering", "dithering"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_round_trip_through_the_registry_and_the_fused_kernels(name, dtype):
    c = C.get(name)
    g = torch.randn(7, 13, generator=torch.Generator().manual_seed(6)).to(dtype)
    p = c.encode(g, c.init(g, seed=2))[0]
    out = c.decode(p)
    assert out.shape == g.shape and out.dtype == g.dtype
    assert torch.equal(c.decode(p, out=torch.empty(91, dtype=dtype)), out)
    acc = torch.randn(7, 13).to(dtype)
    assert torch.equal(c.kernels.decode_add_(p, acc.clone()), acc + out)
    assert torch.equal(c.kernels.decode_div_(p, torch.empty_like(g), 3), out / 3)


def test_error_feedback_wraps_natural():
    """``ef`` around C_nat keeps m_{t+1} = (m_t + g) - decode(payload); since a C_nat
    output lies within a factor 2 of its input, the subtraction is exact, so
    m_{t+1} + decode == m_t + g bit for bit."""
    ef = C.get("ef", inner="natural")
    assert ef.inner.name == "natural" and ef.algo_id == 40
    g = torch.randn(1001, generator=torch.Generator().manual_seed(7))
    st = ef.init(g, seed=3)
    for _ in range(3):
        before = ef.error(st).clone()
        p, st = ef.encode(g, st)
        dec = ef.decode(p)
        assert torch.equal(ef.error(st) + dec, before + g)
    assert st["inner"]["step"] == 3
    assert torch.equal(dec, C.get("natural").decode(p))


def test_docstring_examples_run_as_written():
    import doctest

    from hipress_like.compressors.natural import natural
    result = doctest.testmod(natural, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("name", ["natural_dithering", "dithering"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dithering_saturates_values_beyond_the_dtype(name, dtype):
    """||x||_1 of entries near the dtype's maximum exceeds the dtype; a level times it
    saturates at the largest finite value instead of becoming Inf."""
    big = torch.finfo(dtype).max
    g = torch.tensor([0.9 * big, -0.6 * big, 0.0], dtype=dtype)  # ||g||_1 = 1.5 max
    c = C.get(name, s=1, p=1)  # levels 0 and 1: each entry decodes to 0 or +-||g||_1
    out = _draws(c, g, 30)
    assert bool(torch.isfinite(out).all())
    assert set(out.abs().unique().tolist()) == {0.0, big}


def test_payload_pool_never_hands_out_bytes_still_referenced():
    """Natural reuses idle payload buffers (PayloadPool): a payload the caller
    still holds, or any view of it, keeps its bytes; a dropped one is reused."""
    import copy
    import pickle

    from hipress_like.compressors.payload import PayloadPool, _use_count

    c = C.get("natural")
    g = torch.randn(4096)
    st = c.init(g, seed=3)
    p1, st = c.encode(g, st)
    keep = p1.clone()
    p2, st = c.encode(g, st)
    assert p2.data_ptr() != p1.data_ptr() and torch.equal(p1, keep)
    body = p1[40:]  # a view alone keeps the buffer busy
    del p1
    p3, st = c.encode(g, st)
    assert p3.data_ptr() not in (body.data_ptr() - 40, p2.data_ptr())
    if _use_count(p2) is not None:  # this torch tells: idle buffers are reused
        ptr = p2.data_ptr()
        del p2
        p4, st = c.encode(g, st)
        assert p4.data_ptr() == ptr
    # copies of a compressor get their own, empty pool
    for other in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
        assert other._pool is not c._pool and not other._pool._bufs
    pool = PayloadPool(keep=1)
    a, b = pool.empty(64), pool.empty(64)
    assert a.data_ptr() != b.data_ptr()
