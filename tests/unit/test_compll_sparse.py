"""CompLL's sparsification operators and the DGC / GradDrop programs (issue 45, second half).

``sparse/dgc.compll`` and ``sparse/graddrop.compll`` must give the hand-written
``dgc`` / ``graddrop`` payloads and states byte for byte with the same seed
(both are deterministic given it), through the generated C and the
interpreter, and either side must decode the other's payloads. The
operators (filter, topk, threshold, gather, scatter, fma) are checked against
their definitions in ``compll/arrays.py``.
"""
import shutil
import subprocess

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
@pytest.mark.parametrize("ratio", [0.0, 1.5, -0.1])
def test_threshold_ratio_outside_its_range_is_an_error(interp, ratio):
    key, _ = _dsl("graddrop", interp)
    d = hp.compressors.get(key, ratio=ratio)
    g = torch.randn(3000)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        d.encode(g, d.init(g))


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


_EMU_SHIM = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <barrier>
#include <thread>
#include <vector>
struct cl_dim_ { unsigned int x; };
static thread_local cl_dim_ threadIdx;
static cl_dim_ blockIdx, gridDim, blockDim;
static std::barrier<>* cl_bar_;
static unsigned int cl_ballot_[1024];
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define CL_INLINE static inline
static inline void __syncthreads() { cl_bar_->arrive_and_wait(); }
static inline unsigned int __ballot_sync(unsigned int, int pred) {
    cl_ballot_[threadIdx.x] = pred != 0;
    __syncthreads();
    unsigned int w = threadIdx.x & ~31u, r = 0;
    for (unsigned int l = 0; l < 32 && w + l < blockDim.x; ++l) r |= cl_ballot_[w + l] << l;
    __syncthreads();
    return r;
}
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
CL_INLINE uint32_t cl_fmix32(uint32_t h) {
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16; return h;
}
CL_INLINE void cl_memcpy(void* d, const void* s, int k) { memcpy(d, s, k); }
template <class F, class... A> static void cl_launch(F f, unsigned int grid, unsigned int block,
                                                     A... a) {
    gridDim.x = grid; blockDim.x = block;
    for (unsigned int b = 0; b < grid; ++b) {
        blockIdx.x = b;
        std::barrier<> bar(block);
        cl_bar_ = &bar;
        std::vector<std::thread> ts;
        for (unsigned int t = 0; t < block; ++t)
            ts.emplace_back([=] { threadIdx.x = t; f(a...); });
        for (auto& t : ts) t.join();
    }
}
"""


class _EmulatedSeqCuda:
    """The state-array programs' CUDA kernels compiled for the CPU, each GPU thread a CPU
    thread (``__syncthreads`` a barrier, ``__ballot_sync`` through shared flags, atomics
    real), launched in schedule order with 2 blocks of 256 threads (the grid-stride loops
    and the chunked compaction then cover several chunks per block): no GPU needed."""

    def __init__(self, checked, tmp_path):
        import ctypes

        from hipress_like.compressors.compll.prelude import CUDA_PRELUDE
        from hipress_like.compressors.compll.render_cuda import render_cuda
        r = render_cuda(checked)
        enc_args = "c, g, n, params, st, seed, raw_seed, step, scratch"
        dec_args = "c, extra, extra_len, body, body_len, out, n, params, scratch"

        def driver(which, sig, args):
            calls = [f"    cl_launch({k.split(':')[0]}, {1 if k.endswith(':1') else 2}, "
                     f"{32 if k.endswith(':1') else 256}, {args});" for k in r[which]]
            return f'extern "C" void emu_{which}({sig}) {{\n' + "\n".join(calls) + "\n}\n"
        src = r["source"].replace(CUDA_PRELUDE, _EMU_SHIM)
        src += driver("encode", "ctx_t* c, const float* g, long long n, const double* params, "
                      "float** st, unsigned int seed, unsigned int raw_seed, long long step, "
                      "uint8_t* scratch", enc_args)
        src += driver("decode", "ctx_t* c, const uint8_t* extra, long long extra_len, const "
                      "uint8_t* body, long long body_len, float* out, long long n, const "
                      "double* params, uint8_t* scratch", dec_args)
        src += ('extern "C" void emu_result(ctx_t* c, uint8_t* extra, long long* lens) {\n'
                "    memcpy(extra, c->extra_out, sizeof c->extra_out);\n"
                "    memcpy(lens, c->out_len, sizeof c->out_len);\n}\n")
        (tmp_path / "emu.cpp").write_text(src)
        so = tmp_path / "emu.so"
        p = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                            "-ffp-contract=off", "-o", str(so), str(tmp_path / "emu.cpp")],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
        self.lib = ctypes.CDLL(str(so))
        self.r, self.c = r, checked
        self.ctx = ctypes.create_string_buffer(1 << 16)

    def _params(self, params):
        import ctypes
        vals = [float(params[pn]) for pn, _, _, _ in self.c.params] or [0.0]
        return (ctypes.c_double * len(vals))(*vals)

    def encode(self, g, state, params, raw_seed, step):
        """Returns (extra bytes, body arrays as uint8 tensors); ``state`` updated in place."""
        import ctypes
        n = g.numel()
        scratch = torch.zeros(self.r["scratch_regions"] * (n + 1) * 8, dtype=torch.uint8)
        names = [k for k, t in self.c.globals.items() if t.array]
        sp = (ctypes.c_void_p * len(names))(*[state[k].data_ptr() for k in names])
        self.lib.emu_encode(self.ctx, ctypes.c_void_p(g.data_ptr()), ctypes.c_longlong(n),
                            self._params(params), sp, ctypes.c_uint(0),
                            ctypes.c_uint(raw_seed & 0xFFFFFFFF), ctypes.c_longlong(step),
                            ctypes.c_void_p(scratch.data_ptr()))
        assert self.error() == 0, self.error()
        extra = ctypes.create_string_buffer(64)
        lens = (ctypes.c_longlong * 8)()
        self.lib.emu_result(self.ctx, extra, lens)
        arrays = []
        for j, name in enumerate(["idx", "vals"]):
            off = self.r["encode_regions"][name] * (n + 1) * 8
            arrays.append(scratch[off:off + lens[j]].clone())
        return extra.raw, arrays

    def decode(self, extra, body, out, params):
        import ctypes
        n = out.numel()
        scratch = torch.zeros(self.r["scratch_regions"] * (n + 1) * 8, dtype=torch.uint8)
        self.lib.emu_decode(self.ctx, ctypes.c_void_p(extra.data_ptr()),
                            ctypes.c_longlong(extra.numel()), ctypes.c_void_p(body.data_ptr()),
                            ctypes.c_longlong(body.numel()), ctypes.c_void_p(out.data_ptr()),
                            ctypes.c_longlong(n), self._params(params),
                            ctypes.c_void_p(scratch.data_ptr()))

    def error(self):
        return int.from_bytes(self.ctx.raw[:4], "little", signed=True)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to emulate the CUDA "
                    "kernels on the CPU")
@pytest.mark.parametrize("name", sorted(SPARSE))
def test_generated_cuda_emulated_on_cpu_matches_hand_written(name, tmp_path):
    """DGC and GradDrop's CUDA kernels (stream compaction, radix selections, state maps),
    run by ``_EmulatedSeqCuda`` (no GPU here), give the hand-written payload bytes and
    states, and decode the hand-written payloads alike."""
    from hipress_like.compressors.compll.arrays import assemble_body
    key, cls = _dsl(name)
    emu = _EmulatedSeqCuda(cls.checked, tmp_path)
    params = SPARSE[name][2]  # 40000 elements: the threshold samples, fewer than k pass
    h, d = hp.compressors.get(name, **params), hp.compressors.get(key, **params)
    gen = torch.Generator().manual_seed(5)
    for n in (1, 7, 1000, 40000):
        g0 = torch.zeros(n)
        sh, se = h.init(g0, seed=123457), d.init(g0, seed=123457)
        for step in range(2):
            g = torch.randn(n, generator=gen)
            ph, sh = h.encode(g, sh)
            extra, arrays = emu.encode(g, {k: se[k].view(-1) for k in STATE[name]},
                                       d.params(), 123457, step)
            hn = hp.compressors.header_nbytes(1, 16)
            assert bytes(ph[hn - 16:hn].tolist()) == extra[:16], (name, n, step)
            assert torch.equal(ph[hn:], assemble_body(arrays)), (name, n, step)
            for k in STATE[name]:
                assert torch.equal(sh[k], se[k]), (name, k, n, step)
            out = torch.empty(n)
            emu.decode(ph[hn - 16:hn].clone(), ph[hn:].clone(), out, d.params())
            assert emu.error() == 0
            assert torch.equal(out, h.decode(ph)), (name, n, step)
