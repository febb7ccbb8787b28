"""THC (hipress_like/compressors/thc.py): exact homomorphic sums, unbiasedness, NMSE
against TernGrad / onebit+EF / top-k, overflow and input checks, the lookup-table
solver and files, and the engine running both rounds on PS and Ring.

The sums are checked against a reference written here from the module docstring's
layouts (not from the kernels): unpack every rank's indices, look them up in the
table, add as integers. Run with -s to see the NMSE figures.
"""
import itertools
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hipress_like.compressors as C
from hipress_like.compressors.base import STEP_SEED
from hipress_like.compressors.params import ParamError, ParamTypeError
from hipress_like.compressors.payload import PayloadError, pack_payload, unpack_payload
from hipress_like.compressors.thc import cli_tables as thc_tables_cli
from hipress_like.compressors.thc import tables as thc_tables
from hipress_like.compressors.thc.thc import BLOCK, THC, randomized_hadamard, sum_width
from hipress_like.compressors.wrappers.error_feedback import ErrorFeedback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rounds_compressors as rc  # noqa: E402

_EXTRA = struct.Struct("<BBBBBBxxIII")  # kind bits flags log2B cap width | g count crc
D = 2 * BLOCK + 777  # two full transform blocks and a tail of 512 + 256 + 8 + 1


def _grads(n, d=D, seed=0, scale=None):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=g) * (1.0 if scale is None else scale[r])
            for r in range(n)]


def _run(c, grads, shared_seed=11, seeds=None):
    """The engine's sequence by hand: (states after round 1, index payloads, round-0 merge)."""
    n = len(grads)
    sts = [c.init(g, seed=(r if seeds is None else seeds[r]), world_size=n,
                  shared_seed=shared_seed) for r, g in enumerate(grads)]
    rng = c.merge_round(0, [c.encode_round(0, g, s, None)[0] for g, s in zip(grads, sts)])
    enc = [c.encode_round(1, g, s, rng) for g, s in zip(grads, sts)]
    return [s for _, s in enc], [p for p, _ in enc], rng


def _fields(payload):
    h = unpack_payload(payload)
    return h, _EXTRA.unpack_from(h.extra)


def _ref_codes(payload, bits):
    """Every element's b-bit index, from the docstring's layout (word j, field k:
    element j + k m; the last word: element m * planes + f in field f)."""
    h, _ = _fields(payload)
    n, planes = h.shape[0], 32 // bits
    words = np.frombuffer(h.body.numpy().tobytes(), dtype="<u4").astype(np.int64)
    m = n // planes
    e = np.arange(n)
    word = np.where(e < m * planes, e % max(m, 1), m)
    field = np.where(e < m * planes, e // max(m, 1), e - m * planes)
    return (words[word] >> (field * bits)) & ((1 << bits) - 1)


def _ref_sums(payload, bits):
    """Every element's sum Y from a sum payload (planes/lanes arrays of words)."""
    h, (_, _, _, _, _, width, _, _, _) = _fields(payload)
    n, planes, lanes = h.shape[0], 32 // bits, 32 // width
    words = np.frombuffer(h.body.numpy().tobytes(), dtype="<u4").astype(np.int64)
    m, arrays = n // planes, planes // lanes
    e = np.arange(n)
    k = np.where(e < m * planes, e // max(m, 1), e - m * planes)
    j = np.where(e < m * planes, e % max(m, 1), 0)
    idx = np.where(e < m * planes, (k // lanes) * m + j, arrays * m + k // lanes)
    return (words[idx] >> ((k % lanes) * width)) & ((1 << width) - 1)


def _nmse(est, true):
    return float(((est - true) ** 2).sum() / (true ** 2).sum())


# -- homomorphism ---------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"transform": False}, {"table": "uniform", "bits": 2}])
def test_the_sum_of_table_values_is_exact_and_decodes_to_the_mean(kw):
    c, n = THC(**kw), 4
    grads = _grads(n)
    sts, idx, _ = _run(c, grads)
    total = c.merge_round(1, idx)
    table = np.array(c.values)
    want = sum(table[_ref_codes(p, c.bits)] for p in idx)
    assert np.array_equal(_ref_sums(total, c.bits), want)  # the integers, exactly
    avg, _ = c.decode_rounds(grads[0], sts[0], total, average=True)
    singles = [c.decode_rounds(g, s, c.merge_round(1, [p]))[0]
               for g, s, p in zip(grads, sts, idx)]
    mean_of_decodes = torch.stack([s.double() for s in singles]).mean(0)
    # D(sum T[Z_i]) / n and mean_i D(T[Z_i]) are the same real number; the float
    # results differ only by the roundings of the n separate decodes
    torch.testing.assert_close(avg.double(), mean_of_decodes, rtol=0, atol=1e-6)
    assert _nmse(avg, sum(grads) / n) < (0.1 if c.bits == 4 else 0.5)


def test_every_grouping_gives_the_same_bytes_and_widens_as_needed():
    """PS (all at once), Ring hops [partial sum, own indices] in two directions, and
    pairwise trees; 9 ranks of g=30 outgrow 8-bit sums (9 * 30 > 255) midway."""
    c, n = THC(), 9
    grads = _grads(n, d=BLOCK + 100)
    sts, idx, _ = _run(c, grads)
    ps = c.merge_round(1, idx)
    ring_fwd, ring_back = idx[0], idx[-1]
    for p in idx[1:]:
        ring_fwd = c.merge_round(1, [ring_fwd, p])
    for p in reversed(idx[:-1]):
        ring_back = c.merge_round(1, [ring_back, p])
    pairs = [c.merge_round(1, idx[i:i + 2]) for i in range(0, 8, 2)] + [idx[8]]
    tree = c.merge_round(1, [c.merge_round(1, pairs[:2]), c.merge_round(1, pairs[2:])])
    assert _fields(pairs[0])[1][5] == 8 and _fields(ps)[1][5] == 16  # widened
    for other in (ring_fwd, ring_back, tree, c.merge([idx[3], c.merge(idx[:3] + idx[4:])])):
        assert torch.equal(other, ps)
    one, _ = c.decode_rounds(grads[1], sts[1], ps, average=True)
    two, _ = c.decode_rounds(grads[1], sts[1], tree, average=True)
    assert torch.equal(one, two)
    assert c.kernels.merged_nbytes(idx[0].numel(), n) == ps.numel()


def test_sums_widen_to_32_bits_exactly():
    """258 payloads of b=8, g=255 need 32-bit sums (258 * 255 > 65535); partial sums of
    16 bits merge into them too."""
    c = THC(bits=8, table="uniform")
    x = torch.randn(45)
    st = c.init(x)
    p1, _ = c.encode_round(1, x, st, c.merge_round(0, [c.encode_round(0, x, st, None)[0]]))
    want = 258 * np.array(c.values)[_ref_codes(p1, 8)]
    wide = c.merge_round(1, [p1] * 258)
    halves = c.merge_round(1, [c.merge_round(1, [p1] * 200), c.merge_round(1, [p1] * 58)])
    assert _fields(wide)[1][5] == 32 and torch.equal(wide, halves)
    assert np.array_equal(_ref_sums(wide, 8), want)


def test_same_seeds_same_bytes_and_ranks_decode_the_same():
    c = THC()
    a = _run(c, _grads(3))
    b = _run(c, _grads(3))
    for pa, pb in zip(a[1] + [a[2]], b[1] + [b[2]]):
        assert torch.equal(pa, pb)
    total = c.merge_round(1, a[1])
    outs = [c.decode_rounds(g, s, total, average=True)[0] for g, s in zip(_grads(3), a[0])]
    assert all(torch.equal(o, outs[0]) for o in outs)
    # a new step draws a new diagonal and new dither
    st = dict(a[0][0], step=1)
    assert not torch.equal(c.encode_round(1, _grads(3)[0], st, a[2])[0], a[1][0])


def test_payload_sizes_are_exact():
    c = THC()
    for d in (1, 7, 8, 33, BLOCK, D):
        g = torch.randn(d)
        st = c.init(g)
        p0, st = c.encode_round(0, g, st, None)
        p1, st = c.encode_round(1, g, st, c.merge_round(0, [p0]))
        assert (p0.numel(), p1.numel()) == (c.round_nbytes(d, 0), c.round_nbytes(d, 1))
        assert c.payload_nbytes(d) == p0.numel() + p1.numel()
        assert c.kernels.merged_nbytes(p1.numel(), 1) == c.merge_round(1, [p1]).numel()


def test_the_transform_is_orthonormal_and_inverted():
    x = torch.randn(D, dtype=torch.float64)
    y = randomized_hadamard(x, 5)
    torch.testing.assert_close(y.norm(), x.norm())
    torch.testing.assert_close(randomized_hadamard(y, 5, inverse=True), x)
    assert not torch.allclose(randomized_hadamard(x, 6), y)


# -- unbiasedness ---------------------------------------------------------------------

def _sq_variance(a, values):
    """Var of SQ of ``a`` (in grid units, [0, g]) onto the table: (hi - lo)^2 p (1 - p)."""
    t = torch.tensor(values, dtype=torch.float64)
    j = (torch.searchsorted(t, a, right=True) - 1).clamp(0, len(values) - 2)
    lo, hi = t[j], t[j + 1]
    q = (a - lo) / (hi - lo)
    return (hi - lo) ** 2 * q * (1 - q)


def _blocks(d):
    """The transform's blocks (module docstring): full ones, then the tail's binary expansion."""
    full = [BLOCK] * (d // BLOCK)
    tail = d % BLOCK
    return full + [1 << j for j in reversed(range(tail.bit_length())) if tail >> j & 1]


def _decodes(c, x, trials, step_seed=None):
    """``trials`` single-rank decodes of x, each with a fresh per-rank seed (the dither)."""
    outs = []
    for t in range(trials):
        st = c.init(x, seed=1000 + t, world_size=1, shared_seed=3)
        if step_seed is not None:
            st[STEP_SEED] = step_seed  # D fixed, the SQ dither varies
        p0, st = c.encode_round(0, x, st, None)
        p1, st = c.encode_round(1, x, st, c.merge_round(0, [p0]))
        outs.append(c.decode_rounds(x, st, c.merge_round(1, [p1]), average=True)[0].double())
    return torch.stack(outs)


def test_unbiased_without_the_transform_within_five_standard_errors():
    """Mean of T decodes vs x, each coordinate within 5 standard errors of SQ's own
    variance on the grid of Alg. 1's [min, max] (plus float rounding)."""
    c, trials = THC(transform=False), 300  # the optimal non-uniform table, true [min, max]
    assert c.capabilities.unbiased
    x = torch.randn(600, generator=torch.Generator().manual_seed(1)).double() ** 3
    lo, hi = float(x.min()), float(x.max())
    step = (hi - lo) / c.granularity
    var = _sq_variance((x - lo) / step, c.values) * step ** 2
    mean = _decodes(c, x.float(), trials).mean(0)
    tol = 5 * (var / trials).sqrt() + 1e-5 * float(x.abs().max())
    assert bool(((mean - x).abs() <= tol).all())
    assert abs(float((mean - x).sum())) <= 5 * float(var.sum() / trials) ** 0.5 + 1e-3


def test_unbiased_with_the_transform_when_nothing_is_clamped():
    """x = RHT^-1(R) with |R| below the range (t_p ||R_j|| / sqrt(B) > max |R|), so the
    clamping never acts: THC is then unbiased, within 5 standard errors of SQ's
    variance carried through the orthonormal inverse (the block mean of R's)."""
    c, trials, seed = THC(), 150, 1234
    assert not c.capabilities.unbiased  # clamping biases in general (Sec. 5.1)
    r = (torch.rand(BLOCK + 300, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64) * 2 - 1)
    x = randomized_hadamard(r, seed, inverse=True).float()
    var, start = torch.empty_like(r), 0
    for size in _blocks(r.numel()):
        rb = r[start: start + size]
        unit = 2 * c.t_p * float(rb.norm()) / (c.granularity * size ** 0.5)  # R per grid unit
        assert float(rb.abs().max()) < unit * c.granularity / 2  # nothing clamped
        var[start: start + size] = (_sq_variance(rb / unit + c.granularity / 2, c.values)
                                    * unit ** 2).mean()
        start += size
    mean = _decodes(c, x, trials, step_seed=seed).mean(0)
    tol = 5 * (var / trials).sqrt() + 1e-5
    assert bool(((mean - x.double()).abs() <= tol).all())


# -- accuracy: NMSE against the baselines --------------------------------------

def _baseline_nmse(name, grads, steps_grads=None):
    c = name if isinstance(name, C.Compressor) else C.get(name)
    mean = sum(grads) / len(grads)
    outs = []
    for r, g in enumerate(grads):
        p, _ = c.encode(g, c.init(g, seed=r))
        outs.append(c.decode(p))
    return _nmse(sum(outs) / len(outs), mean)


def _thc_nmse(grads, **kw):
    c = THC(**kw)
    sts, idx, _ = _run(c, grads)
    avg, _ = c.decode_rounds(grads[0], sts[0], c.merge_round(1, idx), average=True)
    return _nmse(avg, sum(grads) / len(grads))


def _digits_gradients(n):
    """The first layer's weight gradient of a small MLP on sklearn's digits, after a
    few SGD steps, one per rank (each rank its own batch)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(20):
        b = slice(64 * step, 64 * step + 64)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[b]), y[b]).backward()
        opt.step()
    out = []
    for r in range(n):
        b = slice(1280 + 64 * r, 1344 + 64 * r)
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(x[b]), y[b]).backward()
        out.append(net[0].weight.grad.detach().clone().reshape(-1))
    return out


@pytest.mark.parametrize("source", ["gaussian", "digits-mlp"])
def test_nmse_of_4_bit_thc_is_a_tenth_of_terngrads_or_less(source):
    n = 4
    grads = _grads(n, d=1 << 15, seed=5) if source == "gaussian" else _digits_gradients(n)
    fig = {
        "thc b=4 (RHT, T_4,30,1/32)": _thc_nmse(grads),
        "thc b=4 uniform (Alg. 1, RHT)": _thc_nmse(grads, table="uniform"),
        "thc b=4 no transform": _thc_nmse(grads, transform=False),
        "thc b=2 (T_2,36,1/32)": _thc_nmse(grads, bits=2),
        "terngrad (2 bits)": _baseline_nmse("terngrad", grads),
        "onebit + EF (first step)": _baseline_nmse(ErrorFeedback("onebit"), grads),
        "topk 10%": _baseline_nmse(C.get("topk", ratio=0.1), grads),
    }
    print(f"\nNMSE of the average of {n} ranks, {source} ({grads[0].numel()} elements):")
    for k, v in fig.items():
        print(f"  {k:32} {v:.5f}")
    assert fig["thc b=4 (RHT, T_4,30,1/32)"] <= 0.1 * fig["terngrad (2 bits)"]


# -- error feedback --------------------------------------------------------------------

def test_error_feedback_keeps_each_ranks_own_quantization_error():
    """THC Alg. 3 l. 22: e_i = x_i - RHT^-1(X_i), the rank's own compressed gradient
    (its payload decoded alone with the step's range), not the average: the memory
    holds compression error only, never a rank's deviation from the mean."""
    ef, n = ErrorFeedback(THC()), 2
    grads = _grads(n, d=BLOCK + 50, seed=3)
    sts = [ef.init(g, seed=r, world_size=n, shared_seed=4) for r, g in enumerate(grads)]
    for _ in range(3):
        mem = [ef.error(s).clone() for s in sts]
        p0 = [ef.encode_round(0, g, s, None) for g, s in zip(grads, sts)]
        rng = ef.merge_round(0, [p for p, _ in p0])
        p1 = [ef.encode_round(1, g, s, rng) for g, (_, s) in zip(grads, p0)]
        own = [ef.inner.decode_rounds(g, s["inner"], ef.merge_round(1, [p]))[0]
               for g, (p, s) in zip(grads, p1)]
        total = ef.merge_round(1, [p for p, _ in p1])
        dec = [ef.decode_rounds(g, s, total, average=True) for g, (_, s) in zip(grads, p1)]
        sts = [s for _, s in dec]
        avg = dec[0][0]
        assert torch.equal(avg, dec[1][0])
        torch.testing.assert_close(avg, (own[0] + own[1]) / 2, rtol=0, atol=1e-6)
        for g, m_old, s, mine in zip(grads, mem, sts, own):  # m' = (g + m) - C(g + m)
            torch.testing.assert_close(ef.error(s), g + m_old - mine)
            assert "own" not in s
        # each rank's error is a quantization error, far below its distance to the mean
        dev = (grads[0] - grads[1]).norm() / 2
        assert all(float(ef.error(s).norm()) < 0.5 * float(dev) for s in sts)


def test_thc_with_the_transform_gets_error_feedback_by_default():
    from hipress_like.compressors.wrappers.error_feedback import needs_error_feedback

    assert needs_error_feedback(THC())  # biased by the clamp; Alg. 3 adds EF
    assert not needs_error_feedback(THC(transform=False))  # unbiased SQ


# -- overflow and bad input -------------------------------------------------------------

def test_a_world_too_large_for_the_sum_width_is_refused_at_init():
    g = torch.zeros(10)
    THC(sum_bits=8).init(g, world_size=8)  # 8 * 30 = 240 <= 255
    with pytest.raises(ValueError, match=r"9 \* granularity 30 = 270.*sum_bits=8"):
        THC(sum_bits=8).init(g, world_size=9)
    with pytest.raises(ValueError, match="sum_bits=16"):
        THC(sum_bits=16).init(g, world_size=65535 // 30 + 1)
    assert sum_width(8, 30) == 8 and sum_width(9, 30) == 16 and sum_width(9, 30, 8) == 0


def test_a_merge_that_would_overflow_raises():
    c = THC(sum_bits=8)
    _, idx, _ = _run(c, _grads(8, d=64))
    with pytest.raises(PayloadError, match="sum_bits=8"):
        c.merge_round(1, idx + idx[:1])


@pytest.mark.parametrize("kw, err, match", [
    ({"bits": 3}, ParamError, "bits must be one of"),
    ({"bits": "4"}, ParamTypeError, "bits must be an integer"),
    ({"granularity": 14}, ParamError, "granularity must be an integer >= 15"),
    ({"granularity": 2000}, ParamError, "granularity must be <= 1023"),
    ({"granularity": 30.0}, ParamTypeError, "granularity must be an integer"),
    ({"p": 0}, ParamError, "p must be a finite number"),
    ({"p": 1.0}, ParamError, "p must be a finite number"),
    ({"p": "1/32"}, ParamTypeError, "p must be a number"),
    ({"transform": 1}, ParamTypeError, "transform must be True or False"),
    ({"sum_bits": 12}, ParamError, "sum_bits must be one of"),
    ({"table": 3}, ParamError, "table must be None, 'uniform'"),
    ({"table": "uniform", "granularity": 30}, ParamError, "needs granularity = 2\\^bits - 1"),
    ({"granularity": 31}, thc_tables.TableError, "no shipped THC table.*solve one"),
    ({"bits": 8}, ParamError, "no default granularity"),
])
def test_bad_parameters_raise_clear_errors(kw, err, match):
    with pytest.raises(err, match=match):
        THC(**kw)
    with pytest.raises(ValueError):  # the registry's contract
        C.get("thc", **kw) if "thc" in C.available() else THC(**kw)


def test_malformed_truncated_and_foreign_payloads_raise():
    c = THC()
    grads = _grads(2, d=300)
    sts, idx, rng = _run(c, grads)
    total = c.merge_round(1, idx)
    bad = [idx[0][: idx[0].numel() - 1].clone(), idx[0][:10].clone()]
    v = idx[0].clone()
    v[2] += 1  # header version
    bad.append(v)
    h = unpack_payload(idx[0])
    longer, body = pack_payload(h.algo_id, h.dtype, h.shape, h.extra, h.body.numel() + 4)
    body.zero_()
    bad.append(longer)
    extra = bytearray(h.extra)
    extra[5] = 16  # an index payload claiming a sum width
    bad.append(pack_payload(h.algo_id, h.dtype, h.shape, bytes(extra), h.body.numel())[0])
    tg = C.get("terngrad")
    bad.append(tg.encode(grads[0], tg.init(grads[0]))[0])  # another algorithm's
    bad.append(_run(THC(bits=2), grads)[1][0])  # another THC configuration's
    bad.append(_run(c, _grads(2, d=301))[1][0])  # another size
    for p in bad:
        with pytest.raises(PayloadError):
            c.merge_round(1, [idx[1], p])
    with pytest.raises(PayloadError, match="expected range"):
        c.merge_round(0, idx)  # indices where ranges belong
    with pytest.raises(PayloadError, match="holds range"):
        c.decode_rounds(grads[0], sts[0], rng)
    with pytest.raises(PayloadError, match="merges 1 ranks' ranges, expected world_size=2"):
        st = c.init(grads[0], world_size=2)
        c.encode_round(1, grads[0], st, c.encode_round(0, grads[0], st, None)[0])
    with pytest.raises(ValueError, match="run the rounds in order"):
        c.decode_rounds(grads[0], c.init(grads[0], world_size=2), total)
    with pytest.raises(ValueError, match="needs the merged round-0 payload"):
        c.encode_round(1, grads[0], sts[0], None)
    with pytest.raises(ValueError, match="sums 1 payloads; averaging over world_size=2"):
        c.decode_rounds(grads[0], sts[0], c.merge_round(1, idx[:1]), average=True)
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.encode_round(0, torch.tensor([1.0, float("nan")]), c.init(grads[0]), None)
    with pytest.raises(TypeError, match="two rounds"):
        c.encode(grads[0], sts[0])


# -- tables ----------------------------------------------------------------------------

def test_the_solver_is_exact_and_reproduces_the_shipped_tables():
    for b, g in ((2, 8), (2, 13), (1, 5)):  # brute force over every increasing table
        best = min(thc_tables.objective((0, *mid, g), g, 1 / 32)
                   for mid in itertools.combinations(range(1, g), (1 << b) - 2))
        assert thc_tables.solve(b, g, 1 / 32).objective == pytest.approx(best, rel=1e-12)
    shipped = thc_tables.shipped_tables()
    assert {(4, 30, 1 / 32), (2, 36, 1 / 32)} <= set(shipped)
    for (b, g, p), t in shipped.items():
        assert t.source and thc_tables.solve(b, g, p).objective == pytest.approx(t.objective)
    assert thc_tables.solve(4, 30, 1 / 32).values == shipped[(4, 30, 1 / 32)].values


def test_table_files_are_validated(tmp_path):
    good = thc_tables.shipped(4, 30, 1 / 32).to_json()
    f = tmp_path / "t.json"
    thc_tables.dump(thc_tables.solve(4, 16, 1 / 64), f)
    assert thc_tables_cli.main(["check", str(f)]) == 0
    assert THC(granularity=16, p=1 / 64, table=str(f)).values == thc_tables.load(f).values
    with pytest.raises(thc_tables.TableError, match="expected bits=4, granularity=30"):
        THC(table=str(f))  # a table for other parameters
    cases = [("{not json", "cannot read"),
             (dict(good, format="other"), "format tag"),
             (dict(good, version=2), "version 2 is not supported"),
             (dict(good, extra=1), "unknown fields"),
             ({k: v for k, v in good.items() if k != "values"}, "missing fields"),
             (dict(good, values=good["values"][:-1]), "list of 16 integers"),
             (dict(good, values=[0] + good["values"][2:] + [30]), "increase strictly"),
             (dict(good, t_p=2.0), "does not match Phi"),
             (dict(good, objective=0.5), "objective")]
    for obj, match in cases:
        f.write_text(obj if isinstance(obj, str) else json.dumps(obj))
        with pytest.raises(thc_tables.TableError, match=match):
            thc_tables.load(f)
    f.write_text(json.dumps(dict(good, values=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                14, 30],
                                 objective=thc_tables.objective(
                                     [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 30],
                                     30, 1 / 32))))
    assert thc_tables_cli.main(["check", str(f)]) == 1  # valid but not optimal


# -- the engine runs both rounds ----------------------------------------------------------

@pytest.mark.parametrize("n, strategy, k", [(2, "ps", 1), (3, "ps", 2), (3, "ring", 1),
                                            (2, "ring", 2)])
def test_engine_runs_thc_on_ps_and_ring(n, strategy, k):
    from hipress_like.casync.transport.inproc import run_threads

    res = run_threads(lambda tr: rc.run_rounds(tr, THC(), strategy, k, 2), n, timeout=120)
    wf = "rounds-ring" if strategy == "ring" else "rounds"
    assert {v["workflow"] for v in res[0][1].values()} == {wf}
    all_g = [rc.grads_of(r) for r in range(n)]
    for name in all_g[0]:
        mean = sum(g[name] for g in all_g) / n
        for step in range(2):
            got = res[0][0][step][name]
            for r in range(1, n):  # every rank holds the same bits
                assert torch.equal(res[r][0][step][name], got), (name, step, r)
            assert _nmse(got, mean) < 0.15, (name, step, _nmse(got, mean))
    # the engine wraps THC (biased by the clamp) in error feedback (Alg. 3 l. 22)
    assert all("error" in st for st in res[0][2].values())
    steps = {st["inner"]["step"] for st in res[0][2].values()}
    assert steps == {2}


def test_engine_runs_thc_inside_error_feedback():
    from hipress_like.casync.transport.inproc import run_threads

    res = run_threads(lambda tr: rc.run_rounds(tr, ErrorFeedback(THC()), "ring", 1, 3), 2,
                      timeout=120)
    for name in res[0][0][0]:
        for step in range(3):
            assert torch.equal(res[0][0][step][name], res[1][0][step][name])
    for key, st in res[0][2].items():
        assert st["inner"]["step"] == 3 and float(st["error"].abs().max()) > 0, key
