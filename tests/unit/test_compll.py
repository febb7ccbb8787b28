"""CompLL's DSL (issue 45): grammar, located errors, interpreter, generated C, registration.

The shipped programs must give the hand-written compressors' payload bytes
(same seed) through both the generated C and the reference interpreter, and
either side must decode the other's payloads. Bad programs must fail with a
located CompllError; random token soup and mutations of the shipped programs
must never crash the compiler any other way, and C generated from a program
the checker accepts must compile.
"""
import pickle
import random
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

import hipress_like as hp
from hipress_like.compressors import compll
from hipress_like.compressors.compll import CompllError, load, parse, program_path
from hipress_like.compressors.compll import compressor as cm
from hipress_like.compressors.compll.render_c import render_c

SHIPPED = {"onebit": [{}], "tbq": [{"threshold": 0.5}, {"threshold": 0.01}],
           "terngrad": [{"bitwidth": b} for b in (1, 2, 4, 8)]}
SIZES = [1, 7, 8, 13, 64, 1001, 40003]


def _dsl(name, interp=False):
    key = f"{name}_dsl_test{'_i' if interp else ''}"
    cls = compll.register_dsl(program_path(name), name=key, replace=True)
    if interp:
        cls.native = False  # force the reference interpreter
    return key, cls


@pytest.mark.parametrize("interp", [False, True], ids=["c", "interp"])
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_payloads_match_hand_written(name, interp):
    key, cls = _dsl(name, interp)
    if not interp:
        assert hp.compressors.get(key, **SHIPPED[name][0])._native() is not None
    gen = torch.Generator().manual_seed(7)
    for params in SHIPPED[name]:
        for n in SIZES if not interp else SIZES[:-1]:
            g = torch.randn(n, generator=gen) * 0.3
            h, d = hp.compressors.get(name, **params), hp.compressors.get(key, **params)
            for seed in (0, 5):
                ph, sh = h.encode(g, h.init(g, seed=seed))
                pd, sd = d.encode(g, d.init(g, seed=seed))
                assert torch.equal(ph, pd), (name, params, n, seed)
                assert torch.equal(h.decode(pd), d.decode(ph))
                assert torch.equal(d.decode(pd), h.decode(ph))
                assert sh == sd


def test_half_precision_uses_the_interpreter_with_the_same_bytes():
    key, _ = _dsl("terngrad")
    g = torch.randn(3, 37).half()
    h, d = hp.compressors.get("terngrad"), hp.compressors.get(key)
    ph, _ = h.encode(g, h.init(g, seed=2))
    pd, _ = d.encode(g, d.init(g, seed=2))
    assert torch.equal(ph, pd)
    out = d.decode(pd)
    assert out.dtype == torch.float16 and out.shape == (3, 37)
    assert torch.equal(out, h.decode(ph))


def test_registered_compressor_is_a_normal_one():
    key, cls = _dsl("terngrad")
    c = hp.compressors.get(key, bitwidth=4)
    assert c.params() == {"bitwidth": 4}
    assert c.capabilities.category == "quantization" and c.capabilities.unbiased
    assert c.capabilities.stateful  # it draws random numbers: seed and step state
    g = torch.randn(100)
    p, st = c.encode(g, c.init(g, seed=1))
    assert st["step"] == 1 and p.numel() == c.payload_nbytes(100)
    c2 = pickle.loads(pickle.dumps(c))
    assert torch.equal(c2.encode(g, c2.init(g, seed=1))[0], p)
    with pytest.raises(ValueError, match="one of"):
        hp.compressors.get(key, bitwidth=3)
    with pytest.raises(ValueError, match="unknown parameter"):
        hp.compressors.get(key, bits=2)
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.encode(torch.tensor([1.0, float("nan")]), c.init(g))
    bad = p.clone()
    bad[-1] ^= 0  # untouched: decodes
    c.decode(bad)
    with pytest.raises(hp.compressors.PayloadError):
        c.decode(p[:-1])
    ef = hp.compressors.with_error_feedback(hp.compressors.get(_dsl("onebit")[0]))
    s = ef.init(g)
    p1, s = ef.encode(g, s)
    assert torch.equal(ef.decode(p1), hp.compressors.get("onebit").decode(p1))


def test_register_dsl_from_the_package_and_source_text():
    src = program_path("tbq").read_text().replace("@wire(11);", "")
    cls = hp.compressors.register_dsl(src, name="tbq_dsl_fresh_id", replace=True)
    assert cls.algo_id >= 200  # no @wire: a free id, so it cannot decode tbq's payloads
    c = hp.compressors.get("tbq_dsl_fresh_id", threshold=0.5)
    g = torch.tensor([0.7, -0.2, -0.9, 0.5])
    p, _ = c.encode(g, c.init(g))
    assert c.decode(p).tolist() == [0.5, 0.0, -0.5, 0.0]
    with pytest.raises(hp.compressors.PayloadError):
        hp.compressors.get("tbq").decode(p)


FIG5 = r"""
param EncodeParams{
     uint8 bitwidth; // assume bitwidth = 2 for clarity
}
float min, max, gap;
uint2 floatToUint(float elem) {
     float r = (elem - min) / gap;
    return floor(r + random<float>(0, 1));
}
void encode(float* gradient, uint8* compressed, \
        EncodeParams params) {
    min = reduce(gradient, smaller);
    max = reduce(gradient, greater);
    gap = (max - min) / ((1 << params.bitwidth) - 1)
    uint8 tail = gradient.size % (1 << params.
         bitwidth);
    uint2* Q = map(gradient, floatToUint);
    compressed = concat(params.bitwidth, tail, \
         min, max, Q);
}
"""

FIG5_DECODE = r"""
float uintToFloat(uint2 q) { return min + q * gap; }
void decode(uint8* compressed, float* gradient, EncodeParams params) {
    uint8 bitwidth, tail;
    uint2* Q;
    extract(compressed, bitwidth, tail, min, max, Q);
    gap = (max - min) / ((1 << bitwidth) - 1);
    gradient = map(Q, uintToFloat);
}
"""


def test_fig5_compiles_as_printed():
    """HiPress Fig. 5 as printed (line 13 has no semicolon), its closing braces restored."""
    c = load(FIG5)
    assert c.params[0][0] == "bitwidth" and set(c.globals) == {"min", "max", "gap"}
    assert "cl_encode" in render_c(c)


def test_fig5_terngrad_is_unbiased_like_the_hand_written_one():
    """Fig. 5's floor(r + u) differs from the shipped floor(r) + (u < frac) bit for bit
    but not in law: both decode to g on average (TernGrad is unbiased)."""
    src = FIG5.replace("uint8 bitwidth;", "uint8 bitwidth = 2;") + FIG5_DECODE
    assert "- 1)\n    uint8 tail" in src
    cls = hp.compressors.register_dsl(src, name="terngrad_fig5", replace=True)
    c, h = hp.compressors.get("terngrad_fig5"), hp.compressors.get("terngrad")
    g = torch.linspace(-1, 1, 257)
    for comp in (c, h):
        acc = torch.zeros(257, dtype=torch.float64)
        trials = 400
        st = comp.init(g, seed=11)
        for _ in range(trials):
            p, st = comp.encode(g, st)
            acc += comp.decode(p).double()
        mean = acc / trials
        gap = 2.0 / 3.0
        # each element's decode is a two-point law with variance <= gap^2 / 4
        tol = 5 * (gap / 2) / trials ** 0.5
        assert (mean - g.double()).abs().max() < tol, comp
    assert cls.capabilities.stateful


def test_open_source_form_parses_with_lambdas_and_range():
    src = r"""
    @wire(11);
    param EncodeParams { double threshold = 0.5; }
    float tau;
    lambda_func code = [&](float elem) -> uint2 {
        if (elem > tau) { return 1; } else if (elem < -tau) { return 2; }
        return 0;
    };
    lambda_func value = [&](uint2 c) -> T { return c == 1 ? tau : (c == 2 ? -tau : 0.0); };
    lambda_func ramp = [&](int index) -> float { return index; };
    void encode(float* gradient, uint8* compressed, EncodeParams params) {
        tau = params.threshold;
        int64 n = reduce(map(range(gradient.size), ramp), 0, add);
        uint2* Q = map(gradient, code);
        compressed = concat(params.threshold, Q);
    }
    void decode(uint8* compressed, float* gradient, EncodeParams params) {
        double threshold; uint2* Q;
        extract(compressed, threshold, Q);
        tau = threshold;
        gradient = map(Q, value);
    }
    """
    cls = hp.compressors.register_dsl(src, name="tbq_oss_form", replace=True)
    g = torch.randn(1001)
    for native in (None, False):
        cls.native = native
        c, h = hp.compressors.get("tbq_oss_form", threshold=0.5), hp.compressors.get(
            "tbq", threshold=0.5)
        p, _ = c.encode(g, c.init(g))
        assert torch.equal(p, h.encode(g, h.init(g))[0])
        assert torch.equal(c.decode(p), h.decode(p))


BAD = [
    ("void encode(float* g, uint8* c) { float x = 1 }", 1, "unexpected '}'; expected"),
    ("void encode(float* g, uint8* c) {\n  y = 2;\n}", 2, "unknown name 'y'"),
    ("float f(float a) { return a; }\nvoid encode(float* g, uint8* c) { float x = f(1, 2); }",
     2, "takes 1 argument"),
    ("void encode(float* g, uint8* c) { float x = g; }", 1, "type mismatch"),
    ("void encode(float* g, uint8* c) { float x = sort(g); }", 1, "not available"),
    ("void encode(float* g, uint8* c) { float x = frobnicate(g); }", 1,
     "unknown function or operator 'frobnicate'"),
    ("void encode(float* g, uint8* c) {\n uint2 x = 7;\n}", 2, "does not fit in uint<2>"),
    ("uint<3> f(float e) { return 1; }\nvoid encode(float* g, uint8* c) { }", 1, "uint<3>"),
    ("param P { uint8 bits = 2 in {2, 300}; }\nvoid encode(float* g, uint8* c, P p) { }", 1,
     "values must be integers in [0, 255]"),
    ("param P { uint4 bits = 2 in {2, 16}; }\nuint<bits> f(float e) { return 1; }\n"
     "void encode(float* g, uint8* c, P p) { }", 1, "values must be integers in [0, 15]"),
    ("param P { uint8 bits = 16; }\nuint<bits> f(float e) { return 1; }\n"
     "void encode(float* g, uint8* c, P p) { }", 2, "wider than a byte"),
    ("void encode(float* g, uint8* c) { float x = 1.5 << 2; }", 1, "needs integers"),
    ("float f(float a) { if (a > 0) return 1; }\nvoid encode(float* g, uint8* c) { }", 1,
     "may end without a return"),
    ("void encode(float* g, uint8* c) { $ }", 1, "unexpected character"),
    ("void decode(uint8* c, float* g) { }", 0, "needs an encode function"),
]


@pytest.mark.parametrize("src,line,msg", BAD)
def test_bad_programs_give_located_errors(src, line, msg):
    with pytest.raises(CompllError) as ei:
        load(src)
    e = ei.value
    assert msg in str(e)
    assert e.line == line
    if line:
        assert "^" in str(e) and f":{line}:" in str(e)


def _gcc():
    return shutil.which("gcc") or shutil.which("cc")


def _compiles(src, tmp_path):
    f = tmp_path / "x.c"
    f.write_text(src)
    r = subprocess.run([_gcc(), "-fsyntax-only", "-Werror=implicit-function-declaration",
                        "-std=gnu99", str(f)], capture_output=True, text=True)
    return r.returncode == 0, r.stderr


_TOKENS = ["float", "uint2", "uint<bits>", "int32", "double", "void", "encode", "decode", "(",
           ")", "{", "}", ";", ",", "=", "+", "-", "*", "/", "<<", "?", ":", "map", "reduce",
           "concat", "extract", "gradient", "compressed", "x", "1", "2.5", "random<float>",
           "if", "else", "return", "param", "P", "@wire", "lambda_func", "[&]", "->", "<", ">",
           "float*", "uint8*", "smaller", "greater", "add", "abs", "floor", ".size", "\n",
           "filter", "topk", "threshold", "gather", "scatter", "int32*", "idx", "[k]", "fma",
           "float**", "matmul", "orthogonalize", "matrix", ".T", ".rows", "@rounds", "q",
           "encode_round0"]


def _check_never_crashes(src, tmp_path, stats):
    try:
        c = load(src)
    except CompllError as e:
        assert e.line >= 0 and str(e)
        stats["located"] += 1
        return
    try:
        text = render_c(c)
    except CompllError:
        stats["located"] += 1
        return
    ok, err = _compiles(text, tmp_path)
    assert ok, f"accepted program produced C that does not compile:\n{src}\n{err}"
    stats["compiled"] += 1


@pytest.mark.skipif(_gcc() is None, reason="no C compiler to compile the accepted programs")
def test_fuzz_tokens_and_mutations_never_crash(tmp_path):
    rng = random.Random(45)
    stats = {"located": 0, "compiled": 0}
    for _ in range(150):
        src = " ".join(rng.choice(_TOKENS) for _ in range(rng.randint(1, 40)))
        _check_never_crashes(src, tmp_path, stats)
    programs = [program_path(n).read_text() for n in list(SHIPPED) + ["dgc", "graddrop",
                                                                     "powersgd"]]
    for _ in range(450):
        src = rng.choice(programs)
        toks = re.findall(r"\w+|[^\w\s]|\s+", src)
        for _m in range(rng.randint(1, 3)):
            i = rng.randrange(len(toks))
            op = rng.random()
            if op < 0.4:
                del toks[i]
            elif op < 0.7:
                toks.insert(i, rng.choice(_TOKENS))
            else:
                toks[i] = rng.choice(_TOKENS)
        _check_never_crashes("".join(toks), tmp_path, stats)
    assert stats["located"] > 100 and stats["compiled"] > 5, stats


def test_parse_keeps_positions():
    p = parse("float a;\nvoid encode(float* g, uint8* c) {\n  a = 1;\n}\n")
    st = p.functions["encode"].args[3].args[0][0]
    assert (st.line, st.col) == (3, 3)


def test_c_backend_reports_compile_time_and_cache(monkeypatch):
    key, cls = _dsl("tbq")
    c = hp.compressors.get(key)
    nat = c._native()
    assert nat.cache_hit or nat.compile_s > 0
    again = cm.compile_program(cls.checked)
    assert again.cache_hit and again.compile_s == 0.0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: the "
                    "generated CUDA cannot be compile-checked on this machine")
@pytest.mark.parametrize("name", sorted(SHIPPED) + ["dgc", "graddrop", "powersgd"])
def test_generated_cuda_compiles_with_nvcc(name, tmp_path):
    """What a GPU runs compiles: the fused sweeps' kernels, and for the state-array and
    round programs the source their cupy runners load (their own kernels appended)."""
    from hipress_like.compressors.compll.cuda_runners import runner_source
    from hipress_like.compressors.compll.render_cuda import render_cuda
    c = load(program_path(name))
    r = runner_source(c) if name in ("dgc", "graddrop", "powersgd") else render_cuda(c)
    assert r["encode"] and r["decode"]
    cu = tmp_path / f"{name}.cu"
    cu.write_text(r["source"])
    p = subprocess.run(["nvcc", "-ptx", "-arch=sm_80", "--fmad=false", "-std=c++17", "-o",
                        str(tmp_path / f"{name}.ptx"), str(cu)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ptx = (tmp_path / f"{name}.ptx").read_text()
    for k in r["encode"] + r["decode"] + r.get("helpers", []):
        assert k.split(":")[0] in ptx


_SHIM = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
struct cl_dim_ { unsigned int x; };
static cl_dim_ threadIdx, blockIdx, gridDim, blockDim;
#define __global__
#define CL_INLINE static inline
extern "C" void cl_launch_(unsigned int b, unsigned int g) {
    blockIdx.x = b; gridDim.x = g; blockDim.x = 1; threadIdx.x = 0;
}
CL_INLINE uint32_t cl_fmix32(uint32_t h) {
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16; return h;
}
CL_INLINE float cl_uniform(uint32_t seed, int64_t i) {
    return (float)((cl_fmix32((uint32_t)i ^ seed) >> 8) & 0xFFFFFFu) * (1.0f / 16777216.0f);
}
CL_INLINE int32_t cl_exponent(double x) {
    int e = 0;
    if (x == 0.0) return 0;
    frexp(x, &e);
    return e;
}
CL_INLINE float cl_clamp_float(float x, float lo, float hi) {
    x = x > lo ? x : lo;
    return x < hi ? x : hi;
}
CL_INLINE double cl_clamp_double(double x, double lo, double hi) {
    x = x > lo ? x : lo;
    return x < hi ? x : hi;
}
CL_INLINE int32_t cl_clamp_int32_t(int32_t x, int32_t lo, int32_t hi) {
    x = x > lo ? x : lo;
    return x < hi ? x : hi;
}
CL_INLINE int64_t cl_clamp_int64_t(int64_t x, int64_t lo, int64_t hi) {
    x = x > lo ? x : lo;
    return x < hi ? x : hi;
}
CL_INLINE int64_t cl_packed_nbytes(int64_t n, int bits) { return (n * bits + 7) / 8; }
CL_INLINE int cl_valid_bits(int64_t b) { return b == 1 || b == 2 || b == 4 || b == 8; }
CL_INLINE void cl_memcpy(void* d, const void* s, int k) { memcpy(d, s, k); }
CL_INLINE float cl_warp_min(float v) { return v; }
CL_INLINE float cl_warp_max(float v) { return v; }
CL_INLINE double cl_warp_mind(double v) { return v; }
CL_INLINE double cl_warp_maxd(double v) { return v; }
CL_INLINE long long cl_warp_sumi(long long v) { return v; }
CL_INLINE double cl_warp_sumd(double v) { return v; }
CL_INLINE void cl_atomic_min(float* a, float v) { if (v < *a) *a = v; }
CL_INLINE void cl_atomic_max(float* a, float v) { if (v > *a) *a = v; }
CL_INLINE void cl_atomic_mind(double* a, double v) { if (v < *a) *a = v; }
CL_INLINE void cl_atomic_maxd(double* a, double v) { if (v > *a) *a = v; }
CL_INLINE void atomicAdd(double* a, double v) { *a += v; }
CL_INLINE void atomicAdd(unsigned long long* a, unsigned long long v) { *a += v; }
CL_INLINE void atomicMin(long long* a, long long v) { if (v < *a) *a = v; }
CL_INLINE void atomicMax(long long* a, long long v) { if (v > *a) *a = v; }
"""


class _EmulatedCuda:
    """The generated CUDA kernels compiled for the CPU with a one-thread-per-block shim
    (warp reductions are identities, atomics plain updates) and launched block by block
    in schedule order: the kernels' indexing, planar layout and scalar glue, no GPU."""

    def __init__(self, checked, tmp_path, blocks=7):
        import ctypes

        from hipress_like.compressors.compll.render_cuda import PRELUDE, render_cuda
        r = render_cuda(checked)
        src = r["source"].replace(PRELUDE, _SHIM)
        (tmp_path / "emu.cpp").write_text(src)
        so = tmp_path / "emu.so"
        p = subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-ffp-contract=off", "-o",
                            str(so), str(tmp_path / "emu.cpp")], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
        self.lib = ctypes.CDLL(str(so))
        self.sched, self.blocks, self.c = r, blocks, checked
        self.ctx = ctypes.create_string_buffer(4096)

    def _run(self, which, args):
        for entry in self.sched[which]:
            name, kind = entry.split(":")
            fn = getattr(self.lib, name)
            for b in range(1 if kind == "1" else self.blocks):
                self.lib.cl_launch_(b, 1 if kind == "1" else self.blocks)
                fn(*args)

    def encode(self, g, extra, body, params, seed):
        import ctypes
        pv = (ctypes.c_double * 4)(*[float(params[pn]) for pn, _, _, _ in self.c.params])
        self._run("encode", (self.ctx, ctypes.c_void_p(g.data_ptr()), ctypes.c_longlong(
            g.numel()), pv, ctypes.c_void_p(extra.data_ptr()), ctypes.c_void_p(body.data_ptr()),
            ctypes.c_uint(seed & 0xFFFFFFFF)))

    def decode(self, extra, body, out, params):
        import ctypes
        pv = (ctypes.c_double * 4)(*[float(params[pn]) for pn, _, _, _ in self.c.params])
        self._run("decode", (self.ctx, ctypes.c_void_p(extra.data_ptr()), ctypes.c_longlong(
            extra.numel()), ctypes.c_void_p(body.data_ptr()), ctypes.c_longlong(body.numel()),
            ctypes.c_void_p(out.data_ptr()), ctypes.c_longlong(out.numel()), pv))

    def error(self):
        return int.from_bytes(self.ctx.raw[:4], "little", signed=True)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to emulate the CUDA "
                    "kernels on the CPU")
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_generated_cuda_kernels_emulated_on_cpu_match_hand_written(name, tmp_path):
    """The CUDA path of DslCompressor, with the kernels run by ``_EmulatedCuda`` in place
    of cupy (no GPU here): same payload bytes as the hand-written compressor."""
    key, cls = _dsl(name)
    emu = _EmulatedCuda(cls.checked, tmp_path)
    gen = torch.Generator().manual_seed(3)
    for params in SHIPPED[name]:
        for n in (1, 7, 13, 64, 1001):
            g = torch.randn(n, generator=gen)
            h, d = hp.compressors.get(name, **params), hp.compressors.get(key, **params)
            ph, _ = h.encode(g, h.init(g, seed=4))
            pd = torch.zeros_like(ph)
            hn = hp.compressors.header_nbytes(1, 0)
            d._concat()
            extra_n = cls._layout.extra_nbytes
            pd[:hn] = ph[:hn]  # the header proper: written by pack_payload in DslCompressor
            emu.encode(g, pd[hn:hn + extra_n], pd[hp.compressors.header_nbytes(1, extra_n):],
                       d.params(), d._seed(h.init(g, seed=4)))
            assert emu.error() == 0
            assert torch.equal(ph, pd), (name, params, n)
            out = torch.empty(n)
            emu.decode(ph[hn:hn + extra_n], ph[hp.compressors.header_nbytes(1, extra_n):], out,
                       d.params())
            assert emu.error() == 0
            assert torch.equal(out, h.decode(ph)), (name, params, n)


def test_cli_check_show_build(capsys, tmp_path):
    from hipress_like.tuning.cli import main
    path = str(program_path("tbq"))
    assert main(["compll", "check", path]) == 0
    assert "wire id 11" in capsys.readouterr().out
    assert main(["compll", "show", path]) == 0
    assert "cl_encode" in capsys.readouterr().out
    assert main(["compll", "show", path, "--target", "cuda"]) == 0
    assert "__global__" in capsys.readouterr().out
    assert main(["compll", "build", path, "--mb", "0.25", "--repeats", "1"]) == 0
    assert "x copy" in capsys.readouterr().out
    bad = tmp_path / "bad.compll"
    bad.write_text("void encode(float* g, uint8* c) {\n  x = 1;\n}\n")
    assert main(["compll", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert ":2:3: unknown name 'x'" in err and "^" in err


@pytest.mark.parametrize("strategy", ["ps", "ring"])
@pytest.mark.parametrize("name", sorted(SHIPPED) + ["dgc", "graddrop"])
def test_engine_runs_dsl_like_the_hand_written_one(name, strategy):
    """Under the engine (4 ranks as threads, error feedback for the biased ones) a DSL
    compressor leaves every rank bitwise identical and equal to the hand-written
    compressor's result: its payloads are the same bytes."""
    from hipress_like.casync.engine import Engine, EngineConfig
    from hipress_like.casync.transport.inproc import run_threads
    from hipress_like.cost_model.plan import Plan, SizeRule
    key, _ = _dsl(name)

    def run(comp):
        plan = Plan(compressor=comp, params={}, rule=SizeRule(
            min_compress_bytes=0, bytes_per_partition=1, max_partitions=2), gradients={})

        def body(tr):
            eng = Engine(tr, EngineConfig(compressor=None, plan=plan, strategy=strategy,
                                          threads=True, timeout=30))
            try:
                gen = torch.Generator().manual_seed(100 + tr.rank)
                gs = {f"g{i}": torch.randn(s, generator=gen) for i, s in enumerate((7, 1001))}
                eng.register([(k, tuple(v.shape), v.dtype) for k, v in gs.items()])
                outs = []
                for _ in range(3):
                    work = {k: v.clone() for k, v in gs.items()}
                    for k, v in work.items():
                        eng.submit(k, v)
                    eng.synchronize()
                    outs.append(work)
                return outs
            finally:
                eng.close()
        return run_threads(body, 4, timeout=120)

    dsl, hand = run(key), run(name)
    for r in range(4):
        for step in range(3):
            for k in dsl[0][step]:
                assert torch.equal(dsl[r][step][k], dsl[0][step][k])
                assert torch.equal(dsl[r][step][k], hand[r][step][k])


def test_docstring_examples_run():
    import doctest

    from hipress_like.compressors.compll import compressor as mod
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("interp", [False, True], ids=["c", "interp"])
def test_corrupt_width_in_payload_is_a_payload_error(interp):
    key, _ = _dsl("terngrad", interp)
    c = hp.compressors.get(key)
    g = torch.randn(50)
    p, _ = c.encode(g, c.init(g))
    bad = p.clone()
    bad[hp.compressors.header_nbytes(1, 0)] = 3  # the bitwidth field: not 1, 2, 4, 8
    with pytest.raises(hp.compressors.PayloadError):
        c.decode(bad)
    with pytest.raises(hp.compressors.PayloadError):
        hp.compressors.get("terngrad").decode(bad)


def test_a_program_path_is_a_compressor_name_for_every_front_end():
    """registry.get (and so plans, the engine and the cost model's profiler) takes a
    .compll path; the profiler measures it like a built-in."""
    from hipress_like.tuning.profiler import profile_compressor
    path = str(program_path("tbq"))
    c = hp.compressors.get(path, threshold=0.5)
    assert c.name == "tbq.compll" and c.algo_id == 11 and c.params() == {"threshold": 0.5}
    assert hp.compressors.get(path).__class__ is type(c)  # registered once
    prof = profile_compressor(path, {"threshold": 0.5}, sizes=[4096, 65536], repeats=1,
                              min_time=0.0)
    assert 0.05 < prof.ratio < 0.1  # 2 bits of 32


@pytest.mark.parametrize("name", ["onebit", "terngrad"])
def test_threaded_sweeps_give_the_same_bytes(name):
    """Above 2**20 elements the generated C splits its sweeps across threads; the bytes
    must not change (exact reductions only) and still match the hand-written ones."""
    key, _ = _dsl(name)
    n = (1 << 20) + 13
    g = torch.randn(n, generator=torch.Generator().manual_seed(9))
    h, d = hp.compressors.get(name), hp.compressors.get(key)
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(d.encode(g, d.init(g, seed=1))[0])
        ref = h.encode(g, h.init(g, seed=1))[0]
        dec = [d.decode(outs[0]) for t in (1, 2)]
    finally:
        torch.set_num_threads(old)
    for p in outs:
        assert torch.equal(p, ref)
    assert torch.equal(dec[0], dec[1]) and torch.equal(dec[0], h.decode(ref))


def test_sqrt_in_the_interpreter_is_the_c_sqrtf():
    """torch.sqrt of float32 is not always correctly rounded; the interpreter's sqrt is
    (through float64), so it gives the generated C's sqrtf bits."""
    src = ("float root(float x) { return sqrt(abs(x)); }\n"
           "void encode(float* gradient, uint8* compressed) {\n"
           "    float* r = map(gradient, root);\n    compressed = concat(r);\n}\n")
    c_key = "sqrt_test_c"
    compll.register_dsl(src, name=c_key, replace=True)
    i_cls = compll.register_dsl(src, name="sqrt_test_i", replace=True)
    i_cls.native = False
    g = torch.rand(20000, generator=torch.Generator().manual_seed(1)) * 100
    a, b = hp.compressors.get(c_key), hp.compressors.get("sqrt_test_i")
    assert a._native() is not None
    pa, pb = a.encode(g, a.init(g))[0], b.encode(g, b.init(g))[0]  # (free wire ids differ)
    va, vb = (hp.compressors.unpack_payload(p).body.view(torch.float32) for p in (pa, pb))
    assert torch.equal(va, vb)
    assert torch.equal(va, torch.from_numpy(np.sqrt(g.numpy())))  # correctly rounded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the generated "
                    "CUDA runs where one exists (bench/gpu_check.py, the results page)")
def test_gpu_check_runs_the_six_programs_on_a_gpu(tmp_path):
    """On a GPU: the six programs' generated CUDA against the hand-written compressors
    (equal bytes; PowerSGD's C bits), small sizes, by the bench script itself."""
    import json
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, os.path.join(root, "bench", "gpu_check.py"),
                        "--sizes", "1", "--repeats", "1"], capture_output=True, text=True,
                       timeout=900, cwd=root, env=dict(os.environ, OUT=str(tmp_path),
                                                       PYTHONPATH=root))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not res["failures"]
    assert {r["algorithm"].split()[0] for r in res["rows"]} == {
        "onebit", "tbq", "terngrad", "dgc", "graddrop", "powersgd"}
