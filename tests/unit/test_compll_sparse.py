"""CompLL's sparsification operators and the DGC / GradDrop programs (issue 45, second half).

``sparse/dgc.compll`` and ``sparse/graddrop.compll`` must give the hand-written
``dgc`` / ``graddrop`` payloads and states byte for byte with the same seed
(both are deterministic given it), through the generated C and the
interpreter, and either side must decode the other's payloads. The
operators (filter, topk, threshold, gather, scatter, fma) are checked against
their definitions in ``compll/arrays.py``.
"""
import pytest
import torch

import hipress_like as hp
from hipress_like.compressors import compll
from hipress_like.compressors.compll import CompllError, load, program_path
from hipress_like.compressors.compll.arrays import fma
from hipress_like.compressors.compll.render_c import render_c

SPARSE = {
    "dgc": [{}, {"ratio": 0.01, "warmup_steps": 3},
            {"ratio": 0.05, "momentum": 0.5, "sample_ratio": 0.1}],
    "graddrop": [{}, {"ratio": 0.001}, {"ratio": 0.05, "max_ratio": 0.06,
                                        "sample_ratio": 0.01}],
}
STATE = {"dgc": ("u", "v"), "graddrop": ("residual",)}
SIZES = [1, 7, 1000, 5003, 300001]


def _dsl(name, interp=False):
    key = f"{name}_dsl_sp{'_i' if interp else ''}"
    cls = compll.register_dsl(program_path(name), name=key, replace=True)
    if interp:
        cls.native = False  # the reference interpreter
    return key, cls


@pytest.mark.parametrize("interp", [False, True], ids=["c", "interp"])
@pytest.mark.parametrize("name", sorted(SPARSE))
def test_payloads_and_states_match_hand_written(name, interp):
    key, cls = _dsl(name, interp)
    gen = torch.Generator().manual_seed(11)
    for params in SPARSE[name]:
        h, d = hp.compressors.get(name, **params), hp.compressors.get(key, **params)
        if not interp:
            assert d._native() is not None
        for n in SIZES if not interp else SIZES[:-1]:
            g0 = torch.zeros(n)
            for seed in (0, 9):
                sh, sd = h.init(g0, seed=seed), d.init(g0, seed=seed)
                for step in range(4):
                    g = torch.randn(n, generator=gen) * (1 + step)
                    ph, sh = h.encode(g, sh)
                    pd, sd = d.encode(g, sd)
                    assert torch.equal(ph, pd), (name, params, n, seed, step)
                    for k in STATE[name]:
                        assert torch.equal(sh[k], sd[k]), (name, k, n, step)
                    assert sh["step"] == sd["step"] and sh["seed"] == sd["seed"]
                    assert torch.equal(h.decode(pd), d.decode(ph))
                    assert torch.equal(d.decode(pd), h.decode(ph))


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_capabilities_sizes_and_shapes(name):
    key, _ = _dsl(name)
    d, h = hp.compressors.get(key), hp.compressors.get(name)
    assert d.capabilities.category == "sparsification"
    assert not d.capabilities.fixed_size and d.capabilities.stateful
    assert d.algo_id == h.algo_id
    g = torch.randn(3, 50, 7)
    p, st = d.encode(g, d.init(g, seed=2))
    assert p.numel() <= d.payload_nbytes(g.numel(), g.dim())
    assert d.decode(p).shape == g.shape and st[STATE[name][0]].shape == g.shape
    with pytest.raises(ValueError, match="state"):
        d.encode(g, d.init(torch.zeros(5)))


@pytest.mark.parametrize("interp", [False, True], ids=["c", "interp"])
def test_nonfinite_gradient_raises_and_leaves_the_state(interp):
    key, _ = _dsl("dgc", interp)
    d = hp.compressors.get(key, ratio=0.1)
    g = torch.randn(100)
    st = d.init(g)
    _, st = d.encode(g, st)
    before = {k: st[k].clone() for k in ("u", "v")}
    bad = g.clone()
    bad[17] = float("nan")
    with pytest.raises(ValueError, match="NaN|Inf|finite"):
        d.encode(bad, st)
    for k in ("u", "v"):
        assert torch.equal(st[k], before[k])


@pytest.mark.parametrize("interp", [False, True], ids=["c", "interp"])
def test_corrupt_sparse_payloads_are_payload_errors(interp):
    key, _ = _dsl("graddrop", interp)
    d = hp.compressors.get(key, ratio=0.1)
    g = torch.randn(200, generator=torch.Generator().manual_seed(1))
    p, _ = d.encode(g, d.init(g))
    start = hp.compressors.header_nbytes(1, 16)
    idx = p[start:start + 8].view(torch.int32)
    swapped = p.clone()
    swapped[start:start + 8] = torch.stack([idx[1], idx[0]]).view(torch.uint8)
    out_of_range = p.clone()
    out_of_range[start:start + 4] = torch.tensor([5000], dtype=torch.int32).view(torch.uint8)
    short = p[:-4].clone()
    for bad in (swapped, out_of_range):
        with pytest.raises(hp.compressors.PayloadError):
            d.decode(bad)
    with pytest.raises(hp.compressors.PayloadError):
        d.decode(short)


_OPS = """
param P { double density = 0.5; double sr = 0.5; int32 k = 3; }
float* s;
float t;
float keepnew(float a, float b) { return b; }
bool big(float x) { return abs(x) >= t; }
void encode(float* gradient, uint8* compressed, P params) {
    s = map(s, gradient, keepnew);
    t = threshold(s, params.density, params.sr);
    int32* idx = topk(s, filter(s, big), params.k);
    float* vals = gather(s, idx);
    scatter(s, idx, 0.0);
    compressed = concat(t, idx.size, idx, vals);
}
void decode(uint8* compressed, float* gradient, P params) {
    float t0;
    int64 k;
    int32* idx;
    float* vals;
    extract(compressed, t0, k, idx[k], vals[k]);
    gradient = scatter(idx, vals);
}
"""


@pytest.mark.parametrize("interp", [False, True], ids=["c", "interp"])
def test_operators_follow_their_definitions(interp):
    """threshold is the exact ceil(density n)-th largest |x| when the sample would cover
    x; topk keeps the k largest |x| among filter's survivors, the lower index on ties,
    ascending; scatter zeroes the sent state entries; decode scatters into zeros."""
    cls = compll.register_dsl(_OPS, name="ops_sp_test" + ("_i" if interp else ""),
                              replace=True)
    if interp:
        cls.native = False
    c = cls()
    x = torch.tensor([0.5, -3.0, 2.0, 2.0, -0.1, 7.0, -2.0, 0.0])
    p, st = c.encode(x, c.init(x))
    import struct
    t, k = struct.unpack_from("<f4xq", bytes(p[hp.compressors.header_nbytes(1, 0):].tolist()))
    assert t == 2.0 and k == 3  # 4th largest of 8 magnitudes; 5 pass |x| >= 2
    out = c.decode(p)
    # survivors 1, 2, 3, 5, 6 (|x| 3, 2, 2, 7, 2): top 3 = 5, 1 and 2 (tie 2: lowest index)
    assert torch.equal(out, torch.tensor([0, -3.0, 2.0, 0, 0, 7.0, 0, 0]))
    assert torch.equal(st["s"], torch.tensor([0.5, 0, 0, 2.0, -0.1, 0, -2.0, 0.0]))


def test_sampled_threshold_follows_the_sample_statistically():
    """With a sample (s < n) the threshold keeps about density * n entries: over 20
    steps the mean kept fraction is within 15% of the density."""
    cls = compll.register_dsl(_OPS.replace("int32 k = 3", "int32 k = 100000"),
                              name="ops_sp_stat", replace=True)
    c = cls(density=0.01, sr=0.01)
    n = 200_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    st = c.init(x, seed=3)
    fracs = []
    for _ in range(20):
        st["s"].zero_()
        p, st = c.encode(x, st)
        fracs.append((c.decode(p) != 0).sum().item() / n)
    mean = sum(fracs) / len(fracs)
    assert abs(mean - 0.01) < 0.0015, mean
    assert len(set(fracs)) > 1  # each step samples afresh


def test_fma_rounds_once_like_torch_add_alpha():
    gen = torch.Generator().manual_seed(0)
    u, g = torch.randn(100_003, generator=gen), torch.randn(100_003, generator=gen)
    m = torch.tensor(0.9, dtype=torch.float32)
    ref = torch.add(g, u, alpha=0.9)
    assert torch.equal(fma(m, u, g), ref)
    assert not torch.equal(m * u + g, ref)  # the unfused form differs somewhere


@pytest.mark.parametrize("src,msg", [
    ("float* s;\nfloat f(float a) { return threshold(s, 0.1, 0.1); }\n"
     "void encode(float* g, uint8* c) { c = concat(g); }", "threshold cannot be used"),
    ("float f(float a, float b) { return a; }\n"
     "void encode(float* g, uint8* c) { float* y = map(g, g, f); c = concat(y); }",
     "updates a state array"),
    ("int32* s;\nvoid encode(float* g, uint8* c) { c = concat(g); }", "per-gradient state"),
    ("float* s;\nbool p(float x) { return x > 0; }\n"
     "void encode(float* g, uint8* c) { int32* i = filter(g, p); c = concat(i); }\n"
     "void decode(uint8* c, float* g) { int32* i; g = scatter(i, filter(g, p)); }",
     "filter cannot be used in decode"),
    ("void encode(float* g, uint8* c) { int32* i = sort(g); c = concat(i); }",
     "topk(x, candidates, k)"),
])
def test_sparse_misuse_gives_located_errors(src, msg):
    with pytest.raises(CompllError) as ei:
        load(src)
    assert msg in str(ei.value) and ei.value.line >= 1


def test_undefined_array_in_generated_c_is_a_located_error():
    src = program_path("graddrop").read_text().replace(
        "extract(compressed, k, isz, idx[k], vals[k]);", "")
    with pytest.raises(CompllError, match="has no value here"):
        render_c(load(src))
