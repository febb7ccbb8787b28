"""PowerSGD as a CompLL round program (powersgd/powersgd.compll; issue 45, the sixth program).

The program's matrix operators have one fixed summation order, the lane order
(compll/matrices.py), so the generated C and the interpreter agree bit for bit; the
hand-written PowerSGD's float32 CPU kernels (powersgd/powersgd.c) sum in the same
order and keep the error feedback rounded as the program does, so payloads, decodes
and states agree with it byte for byte, on the fused (unpadded) path and the padded
one. Ranks always agree bit for bit with each other.
"""
import pickle
import sys
from pathlib import Path

import pytest
import torch

import hipress_like as hp
from hipress_like.compressors import compll
from hipress_like.compressors.compll import CompllError, load, matrices, program_path
from hipress_like.compressors.payload import unpack_payload
from hipress_like.compressors.rounds import MultiRoundCompressor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cuda_emulation  # noqa: E402

SHAPES = [(1,), (2,), (37,), (1000,), (16, 24), (4, 3, 5, 2), (200, 64), (7, 1)]
RANKS = (1, 2, 4, 8)
# for the payloads of another implementation (the hand-written on torch's BLAS kernels)
TOL = 1e-4


def _dsl(interp=False):
    key = "powersgd_dsl_test" + ("_i" if interp else "")
    cls = compll.register_dsl(program_path("powersgd"), name=key, replace=True)
    if interp:
        cls.native = False  # force the reference interpreter
    return key


def _steps(c, grads, steps, shape, shared_seed=7):
    """Run ``steps`` steps of the two rounds on len(grads) ranks, the engine's role by hand:
    per step (round-0 payloads, round-1 payloads, decoded averages, states)."""
    n = len(grads)
    states = [c.init(torch.zeros(shape), world_size=n, shared_seed=shared_seed)
              for _ in range(n)]
    out = []
    for s in range(steps):
        g = [grads[i][s] for i in range(n)]
        p0 = []
        for i in range(n):
            p, states[i] = c.encode_round(0, g[i], states[i], None)
            p0.append(p)
        a0 = c.merge(p0)
        p1 = []
        for i in range(n):
            p, states[i] = c.encode_round(1, g[i], states[i], a0)
            p1.append(p)
        a1 = c.merge(p1)
        res = []
        for i in range(n):
            r, states[i] = c.decode_rounds(g[i], states[i], a1, average=True)
            res.append(r)
        # the hand-written rounds reuse the error buffer in place next step: copy it now
        out.append((p0, p1, res, [{"error": _error(c, st), "q": st["q"].clone(),
                                   "step": st["step"]} for st in states]))
    return out


def _error(c, st):
    """The error feedback memory (the hand-written state keeps it factored)."""
    return c.error(st) if hasattr(c, "error") else st["error"].clone()


def _grads(shape, ranks=3, steps=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=gen) for _ in range(steps)] for _ in range(ranks)]


def _body(p):
    return unpack_payload(p, 30).body.view(torch.float32)


def _rel(a, b):
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_generated_c_and_interpreter_agree_bit_for_bit(shape):
    key, ikey = _dsl(), _dsl(interp=True)
    assert hp.compressors.get(key)._native() is not None
    assert hp.compressors.get(ikey)._native() is None
    for rank in RANKS:
        grads = _grads(shape, steps=3)
        a = _steps(hp.compressors.get(key, rank=rank), grads, 3, shape)
        b = _steps(hp.compressors.get(ikey, rank=rank), grads, 3, shape)
        for (p0a, p1a, ra, sa), (p0b, p1b, rb, sb) in zip(a, b):
            for x, y in zip(p0a + p1a + ra, p0b + p1b + rb):
                assert torch.equal(x, y), (shape, rank)
            for x, y in zip(sa, sb):
                for k in ("error", "q"):
                    assert torch.equal(x[k], y[k]), (shape, rank, k)


@pytest.mark.parametrize("shape", SHAPES + [(9, 8 * 40 + 3), (1030, 1031)], ids=str)
def test_payloads_decodes_and_states_equal_the_hand_written_byte_for_byte(shape):
    key = _dsl()
    for rank in RANKS if len(shape) < 2 or shape[0] < 1000 else (1, 4):
        grads = _grads(shape, ranks=3 if shape[0] < 1000 else 2)
        hand = _steps(hp.compressors.get("powersgd", rank=rank), grads, 4, shape)
        dsl = _steps(hp.compressors.get(key, rank=rank), grads, 4, shape)
        for step, ((p0h, p1h, rh, sh), (p0d, p1d, rd, sd)) in enumerate(zip(hand, dsl)):
            for x, y in zip(p0h + p1h + rh, p0d + p1d + rd):
                assert torch.equal(x, y), (shape, rank, step)
            for x, y in zip(sh, sd):
                assert torch.equal(x["q"], y["q"]) and torch.equal(x["error"], y["error"])
                assert y["step"] == x["step"] == step + 1
            for r in rd[1:]:  # every rank decodes the same sums to the same bits
                assert torch.equal(r, rd[0])


def test_hand_written_off_the_native_kernels_agrees_within_tolerance(monkeypatch):
    """Without the C kernels (HIPRESS_NO_NATIVE) the hand-written takes torch's BLAS:
    the same values to rounding, not the lane order's bits."""
    key, shape = _dsl(), (33, 70)
    grads = _grads(shape)
    dsl = _steps(hp.compressors.get(key, rank=2), grads, 3, shape)
    monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")
    hand = _steps(hp.compressors.get("powersgd", rank=2), grads, 3, shape)
    for (p0h, p1h, rh, _), (p0d, p1d, rd, _) in zip(hand, dsl):
        for x, y in zip(p0h + p1h, p0d + p1d):
            assert _rel(_body(x), _body(y)) < TOL
        for x, y in zip(rh, rd):
            assert _rel(x, y) < TOL


def test_each_round_reads_the_hand_written_merged_payload():
    """Same wire format (@wire(30)): the program's round 1 and decode take the merged
    payloads of the hand-written rounds, and give what they give on their own ones."""
    key = _dsl()
    g = torch.randn(24, 20)
    h, d = hp.compressors.get("powersgd", rank=2), hp.compressors.get(key, rank=2)
    sh, sd = h.init(g, world_size=1), d.init(g, world_size=1)
    p0h, sh = h.encode_round(0, g, sh, None)
    p0d, sd = d.encode_round(0, g, sd, None)
    q_own, _ = d.encode_round(1, g, sd, d.merge([p0d]))
    q_hand, sd = d.encode_round(1, g, sd, h.merge([p0h]))
    assert torch.equal(q_own, q_hand)
    p1h, sh = h.encode_round(1, g, sh, h.merge([p0h]))
    assert torch.equal(p1h, q_own)
    xd, _ = d.decode_rounds(g, sd, h.merge([p1h]), average=True)
    xh, _ = h.decode_rounds(g, sh, h.merge([p1h]), average=True)
    assert torch.equal(xh, xd)


def test_sum_and_average_and_out():
    key = _dsl()
    c = hp.compressors.get(key, rank=2)
    g = torch.randn(10, 12)
    st = c.init(g, world_size=2)
    p0, st = c.encode_round(0, g, st, None)
    p1, st = c.encode_round(1, g, st, c.merge([p0, p0]))
    avg, _ = c.decode_rounds(g, st, c.merge([p1, p1]), average=True)
    tot, _ = c.decode_rounds(g, st, c.merge([p1, p1]))
    assert torch.equal(tot, avg * 2)
    out = torch.empty(10, 12)
    r, st2 = c.decode_rounds(g, st, c.merge([p1, p1]), out=out, average=True)
    assert r.data_ptr() == out.data_ptr() and torch.equal(out, avg) and st2["step"] == 1


def test_state_contract():
    key = _dsl()
    c = hp.compressors.get(key, rank=2)
    g = torch.randn(6, 5)
    st = c.init(g, seed=3, shared_seed=9)
    assert set(st) >= {"error", "q", "step", "seed", "shared_seed", "world_size"}
    assert st["error"].shape == g.shape and not st["error"].any() and st["q"].numel() == 0
    with pytest.raises(ValueError, match="world_size"):
        c.encode_round(0, g, st, None)
    st["world_size"] = 1
    bad = g.clone()
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError):
        c.encode_round(0, bad, st, None)
    p0, st1 = c.encode_round(0, g, st, None)
    assert st["q"].numel() == 0 and not st["error"].any(), "round 0 wrote into its input state"
    # the first Q is the hand-written one's: the counter stream keyed by shared_seed
    q0 = (hp.compressors.ops.uniform(5 * 2, 9) - 0.5).reshape(5, 2)
    assert torch.equal(st1["q"], matrices.orthogonalize(q0))
    with pytest.raises(ValueError, match="merged payload"):
        c.encode_round(1, g, st1, None)
    with pytest.raises(hp.compressors.PayloadError):
        other = torch.randn(5, 6)
        po, _ = c.encode_round(0, other, c.init(other, world_size=1), None)
        c.encode_round(1, g, st1, po)
    with pytest.raises(ValueError, match="rounds 0..1"):
        c.encode_round(2, g, st1, p0)
    with pytest.raises(ValueError, match="shape"):
        c.encode_round(0, torch.randn(3, 3), st, None)


def test_registered_by_name_and_path():
    c = hp.compressors.get("powersgd.compll", rank=4)
    assert isinstance(c, MultiRoundCompressor)
    cap = c.capabilities
    assert cap.rounds == 2 and cap.summable == (True, True) and cap.aggregatable
    assert cap.shared_randomness and cap.keeps_memory and c.algo_id == 30
    with pytest.raises(hp.compressors.ParamError):
        hp.compressors.get("powersgd.compll", rank=3)
    g = torch.randn(64, 32)
    h = hp.compressors.get("powersgd", rank=4)
    assert c.round_nbytes(g.shape, 0) == h.round_nbytes(g.shape, 0)
    assert c.round_nbytes(g.shape, 1) == h.round_nbytes(g.shape, 1)
    assert c.payload_nbytes(1000) == h.payload_nbytes(1000)
    with pytest.raises(TypeError, match="encode_round"):
        c.encode(g, c.init(g))
    c2 = pickle.loads(pickle.dumps(c))  # re-registers its program where it lands
    assert isinstance(c2, MultiRoundCompressor) and c2.params() == {"rank": 4}


def test_summable_view_is_the_body():
    c = hp.compressors.get(_dsl(), rank=1)
    g = torch.randn(9, 4)
    p, _ = c.encode_round(0, g, c.init(g, world_size=1), None)
    v = c.kernels.summable_view(p)
    assert v is not None and torch.equal(v, _body(p))


def test_operators_follow_their_definitions():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(9, 5, generator=gen), torch.randn(5, 4, generator=gen)
    assert torch.allclose(matrices.matmul(a, b), a @ b, rtol=1e-5, atol=1e-6)
    acc = a[:, 0:1] * b[0:1, :]
    for i in range(1, 5):
        acc = acc + a[:, i:i + 1] * b[i:i + 1, :]
    assert torch.equal(matrices.matmul(a, b), acc)
    q = matrices.orthogonalize(a)
    assert torch.allclose(q.t() @ q, torch.eye(5), atol=1e-5)
    assert torch.allclose(q, hp.compressors.ops.orthogonalize_(a.clone()), atol=1e-5)
    z = matrices.orthogonalize(torch.zeros(4, 2))
    assert torch.equal(z, torch.zeros(4, 2)), "a zero column stays zero"
    for shape, want in [((10,), (4, 3)), ((1,), (1, 1)), ((4, 3, 2), (4, 6)), ((16,), (4, 4))]:
        assert matrices.matrix_shape(shape) == want == \
            hp.compressors.powersgd.matrix_shape(shape)


ROUND_HEAD = "@rounds(2);\nparam P { int32 rank = 1; }\nfloat** q;\n"
ROUND_OK = ("void encode_round0(float* g, uint8* c, P p) { q = matrix(g); c = concat(q); }\n"
            "void encode_round1(uint8* a, float* g, uint8* c, P p) { c = concat(q); }\n"
            "void decode(uint8* c, float* g, P p) { g = q; }\n")
BAD = [
    ("void encode(float* g, uint8* c) { float** m = matmul(g, g); }", 1,
     "matrix operator of round programs"),
    ("float** q;\nvoid encode(float* g, uint8* c) { }", 1, "state of round programs"),
    ("@rounds(2);\nvoid encode_round0(float* g, uint8* c) { }\nvoid decode(uint8* c, "
     "float* g) { }", 1, "needs void encode_round1"),
    ("@rounds(1);\nvoid encode(float* g, uint8* c) { }", 1, "@rounds takes the number"),
    (ROUND_HEAD + ROUND_OK.replace("matrix(g)", "matmul(g, q)"), 4, "matmul multiplies"),
    (ROUND_HEAD + ROUND_OK.replace("matrix(g)", "orthogonalize(g)"), 4,
     "orthogonalize works on a matrix"),
    (ROUND_HEAD + ROUND_OK.replace("concat(q); }\nvoid decode", "concat(g.T); }\nvoid decode"),
     5, ".T transposes a matrix"),
    (ROUND_HEAD + ROUND_OK.replace("q = matrix(g);", "int64 k = p.rank.rows;"), 4,
     "rows and cols belong to matrices"),
    (ROUND_HEAD + ROUND_OK.replace("q = matrix(g);", "float* x = q;"), 4, "type mismatch"),
    (ROUND_HEAD + ROUND_OK.replace("void encode_round0(float* g", "void encode_round0(int32* g"),
     4, "encode_round0 must be declared"),
    ("void encode_round0(float* g, uint8* c) { }\nvoid encode(float* g, uint8* c) { }", 1,
     "declare the rounds with @rounds"),
]


@pytest.mark.parametrize("src,line,msg", BAD)
def test_bad_round_programs_give_located_errors(src, line, msg):
    with pytest.raises(CompllError) as ei:
        load(src)
    assert msg in str(ei.value)
    assert ei.value.line == line and "^" in str(ei.value)


def test_a_minimal_round_program_runs():
    key = "round_min_test"
    compll.register_dsl(ROUND_HEAD + ROUND_OK, name=key, replace=True)
    c = hp.compressors.get(key)
    g = torch.randn(3, 4)
    st = c.init(g, world_size=1)
    p0, st = c.encode_round(0, g, st, None)
    p1, st = c.encode_round(1, g, st, c.merge([p0]))
    x, st = c.decode_rounds(g, st, c.merge([p1]), average=True)
    assert torch.equal(x, g) and torch.equal(_body_any(p0), g.reshape(-1))


def _body_any(p):
    return hp.compressors.unpack_payload(p).body.view(torch.float32)


def test_cli_check_show_build(capsys):
    from hipress_like.tuning.cli import main
    path = str(program_path("powersgd"))
    assert main(["compll", "check", path]) == 0
    out = capsys.readouterr().out
    assert "wire id 30" in out and "rounds 2" in out
    assert main(["compll", "show", path]) == 0
    assert "cl_encode_round1" in capsys.readouterr().out
    assert main(["compll", "show", path, "--target", "cuda"]) == 0
    assert "__global__ void cl_decode" in capsys.readouterr().out
    assert main(["compll", "build", path, "--mb", "0.25", "--repeats", "1"]) == 0
    assert "x copy" in capsys.readouterr().out


@pytest.mark.parametrize("strategy", ["ps", "ring"])
def test_engine_runs_the_program_on_every_rank_alike(strategy):
    """Under the engine (4 ranks as threads) the program leaves every rank bitwise
    identical, and equal to the hand-written PowerSGD byte for byte."""
    from hipress_like.casync.engine import Engine, EngineConfig
    from hipress_like.casync.transport.inproc import run_threads
    from hipress_like.cost_model.plan import Plan, SizeRule
    key = _dsl()

    def run(comp):
        plan = Plan(compressor=comp, params={"rank": 2}, rule=SizeRule(
            min_compress_bytes=0, bytes_per_partition=1 << 30, max_partitions=1), gradients={})

        def body(tr):
            eng = Engine(tr, EngineConfig(compressor=None, plan=plan, strategy=strategy,
                                          threads=True, timeout=60))
            try:
                gen = torch.Generator().manual_seed(100 + tr.rank)
                gs = {f"g{i}": torch.randn(s, generator=gen)
                      for i, s in enumerate(((37,), (16, 12)))}
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
        return run_threads(body, 4, timeout=180)

    dsl, hand = run(key), run("powersgd")
    for r in range(4):
        for step in range(3):
            for k in dsl[0][step]:
                assert torch.equal(dsl[r][step][k], dsl[0][step][k])
                assert torch.equal(hand[r][step][k], dsl[r][step][k])




def _emulated_cuda_runner(checked, tmp_path, threads):
    """The round program's CUDA kernels compiled for the CPU (each GPU thread a CPU thread,
    ``__syncthreads`` a barrier, device malloc the host's), behind the C runner's calls."""
    import ctypes
    import subprocess

    from hipress_like.compressors.compll.prelude import _HASH, _MATH, CUDA_PRELUDE
    from hipress_like.compressors.compll.render_cuda import render_cuda
    from hipress_like.compressors.compll.render_rounds import RoundsNativeProgram
    r = render_cuda(checked)
    assert CUDA_PRELUDE in r["source"]
    src = r["source"].replace(CUDA_PRELUDE, cuda_emulation.SHIM + _HASH + _MATH)
    args = ("g, n, grows, gcols, params, seed, step, world_size, extra_in, extra_len, "
            "body_in, body_len, state, extra, outs, arena, n_arena")
    sig = ("const float* g, int64_t n, int64_t grows, int64_t gcols, const double* params, "
           "uint32_t seed, int64_t step, int64_t world_size, const uint8_t* extra_in, "
           "int64_t extra_len, const uint8_t* body_in, int64_t body_len, cl_mat* state, "
           "uint8_t* extra, cl_mat* outs, void** arena, int64_t* n_arena")
    for k in r["encode"] + r["decode"]:
        name = k.split(":")[0]
        src += (f'extern "C" int emu_{name}({sig}) {{\n    int err = 0;\n'
                f"    cl_launch({name}, {threads}, {args}, &err);\n    return err;\n}}\n")
    src += ('extern "C" void cl_free_arena(void** arena, int64_t n) {\n'
            "    for (int64_t i = 0; i < n; ++i) free(arena[i]);\n}\n")
    (tmp_path / "emu.cpp").write_text(src)
    so = tmp_path / "emu.so"
    p = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                        "-ffp-contract=off", "-o", str(so), str(tmp_path / "emu.cpp")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    lib = ctypes.CDLL(str(so))

    class _Lib:  # the C runner calls cl_<entry>: hand it the emulated kernels
        cl_free_arena = lib.cl_free_arena

    pp, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
    for f in checked.rounds + [checked.decode]:
        fn = getattr(lib, f"emu_cl_{f.name}")
        fn.argtypes = [pp, i64, i64, i64, pp, u32, i64, i64, pp, i64, pp, i64, pp, pp, pp, pp,
                       pp]
        fn.restype = ctypes.c_int
        setattr(_Lib, f"cl_{f.name}", fn)
    lib.cl_free_arena.argtypes = [pp, i64]
    runner = RoundsNativeProgram.__new__(RoundsNativeProgram)
    runner.c, runner.lib = checked, _Lib
    runner.names = [n for n, t in checked.globals.items() if t.array]
    return runner


@pytest.mark.skipif(__import__("shutil").which("g++") is None,
                    reason="no C++ compiler to emulate the CUDA kernels on the CPU")
@pytest.mark.parametrize("threads", [1, 7, 64])
def test_generated_cuda_emulated_on_cpu_equals_the_c(threads, tmp_path):
    """The CUDA of the round program (bench/gpu_check.py runs it on a GPU) gives the C's
    bits when its kernels run on the CPU, each block thread a CPU thread: the block-cooperative
    operators keep every element's order of operations."""
    key = _dsl()
    ekey = "powersgd_dsl_test_emu"
    ecls = compll.register_dsl(program_path("powersgd"), name=ekey, replace=True)
    ecls.native = _emulated_cuda_runner(ecls.checked, tmp_path, threads)
    for shape in [(37,), (16, 24), (4, 3, 5, 2)]:
        for rank in (1, 4):
            grads = _grads(shape, ranks=2, steps=2)
            a = _steps(hp.compressors.get(key, rank=rank), grads, 2, shape)
            b = _steps(hp.compressors.get(ekey, rank=rank), grads, 2, shape)
            for (p0a, p1a, ra, _), (p0b, p1b, rb, _) in zip(a, b):
                for x, y in zip(p0a + p1a + ra, p0b + p1b + rb):
                    assert torch.equal(x, y), (shape, rank, threads)
