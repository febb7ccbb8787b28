"""PowerSGD's native kernels (``psgd_native``) against the torch kernels and CompLL's
matrix operators.

The contract (``powersgd/powersgd.c``): M is the bits of ``_fused_lowrank``'s pointwise
formula ``g + (e - P' Q'^T)``, in place or into a second buffer alike; every
product and Gram-Schmidt sums in the lane order, the bits of
``compll.matrices``' reference definitions, whatever the buffers' alignment
and the number of threads. ``_fused_lowrank`` takes them for float32 on the
CPU and keeps the torch kernels for everything else.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hipress_like.compressors._build import native as _native
from hipress_like.compressors.compll import matrices
from hipress_like.compressors.powersgd import lowrank as _fused_lowrank
from hipress_like.compressors.powersgd import native as psgd_native

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cuda_emulation  # noqa: E402

pytestmark = pytest.mark.skipif(not _native.available(),
                                reason="no working C compiler: the torch kernels are used")

# (rows, cols, rank, pending rank): rows of every alignment, ranks up to the limit
CASES = [(1, 1, 1, 0), (37, 53, 1, 0), (64, 2560, 1, 1), (33, 101, 4, 4), (5, 7, 8, 3),
         (16, 16, 2, 2), (9, 8 * 64 + 3, 8, 8)]


def _inputs(rows, cols, rank, prev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    e, g = torch.randn(rows, cols, generator=gen), torch.randn(rows, cols, generator=gen)
    pp = torch.randn(rows, prev, generator=gen) if prev else None
    qp = torch.randn(prev, cols, generator=gen) if prev else None
    return e, g, pp, qp, torch.randn(rank, cols, generator=gen)


@pytest.mark.parametrize("rows,cols,rank,prev", CASES)
def test_m_is_the_pointwise_formula_and_in_place_equals_a_second_buffer(rows, cols, rank, prev):
    e, g, pp, qp, qt = _inputs(rows, cols, rank, prev)
    want = g + (e - _fused_lowrank._outer_sum(pp, qp, prev)) if prev else g + e
    e0 = e.clone()
    out = torch.empty_like(e)
    p = psgd_native.psgd_form_m(e, g, pp, qp, qt, out)
    assert torch.equal(out, want) and torch.equal(e, e0)  # e is left as it was
    inplace = e.clone()
    p2 = psgd_native.psgd_form_m(inplace, g, pp, qp, qt, inplace)
    assert torch.equal(inplace, out) and torch.equal(p2, p)
    assert p.shape == (rows, rank)
    assert torch.equal(p, matrices.matmul(want, qt.t()))  # the lane order
    assert torch.equal(psgd_native.psgd_mq(want, qt), p)


@pytest.mark.parametrize("offset", range(8))
def test_p_does_not_depend_on_the_buffers_alignment(offset):
    """The AVX sweep starts where ``out`` is 32-byte aligned; the lanes it seeds and
    continues keep the lane order whatever the head's length."""
    rows, cols = 7, 8 * 9 + 5
    e, g, pp, qp, qt = _inputs(rows, cols, 3, 2, seed=11)
    out = torch.empty(rows * cols + 8)[offset:offset + rows * cols].view(rows, cols)
    p = psgd_native.psgd_form_m(e, g, pp, qp, qt, out)
    assert torch.equal(p, matrices.matmul(out, qt.t()))


@pytest.mark.parametrize("rows,cols,rank", [(1, 1, 1), (9, 5, 2), (37, 1030, 4), (700, 3, 8),
                                            (8, 513, 1)])
def test_mtp_and_orthogonalize_are_the_lane_order(rows, cols, rank, monkeypatch):
    gen = torch.Generator().manual_seed(rows + cols)
    m, p = torch.randn(rows, cols, generator=gen), torch.randn(rows, rank, generator=gen)
    q = psgd_native.psgd_mtp(m, p)
    assert torch.equal(q, matrices.matmul(m.t(), p))
    monkeypatch.setattr(_native, "PARALLEL_NUMEL", 16)  # column blocks on several threads
    assert torch.equal(psgd_native.psgd_mtp(m, p), q)
    a = torch.randn(rows, rank, generator=gen)
    assert torch.equal(psgd_native.psgd_orthogonalize(a.clone()), matrices.orthogonalize(a))
    a[:, 0] = 0  # a zero column stays zero
    assert torch.equal(psgd_native.psgd_orthogonalize(a.clone()), matrices.orthogonalize(a))


def test_rows_split_over_threads_give_the_same_bits(monkeypatch):
    monkeypatch.setattr(_native, "PARALLEL_NUMEL", 1024)
    e, g, pp, qp, qt = _inputs(301, 517, 2, 1, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.empty_like(e)
        p1 = psgd_native.psgd_form_m(e, g, pp, qp, qt, one)
        torch.set_num_threads(3)
        assert len(_native.rows(301, 517)) == 3
        many = torch.empty_like(e)
        p3 = psgd_native.psgd_form_m(e, g, pp, qp, qt, many)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many) and torch.equal(p1, p3)


def test_form_m_takes_native_for_float32_and_torch_otherwise(monkeypatch):
    calls = []
    real = psgd_native.psgd_form_m
    monkeypatch.setattr(psgd_native, "psgd_form_m", lambda *a: calls.append(1) or real(*a))
    e, g, pp, qp, qt = _inputs(24, 40, 2, 2, seed=5)
    ref = g + (e - _fused_lowrank._outer_sum(pp, qp, 2))
    out = torch.empty_like(e)
    p = _fused_lowrank.powersgd_form_m(e, g, pp, qp, qt, out=out)
    assert calls == [1] and torch.equal(out, ref)
    # in place, as round 0 runs without double buffering: the same bits
    e2 = e.clone()
    assert torch.equal(_fused_lowrank.powersgd_form_m(e2, g, pp, qp, qt), p)
    assert torch.equal(e2, ref) and calls == [1, 1]
    # float64, a rank above the limit, or HIPRESS_NO_NATIVE: the torch kernels
    d = e.double().clone()
    _fused_lowrank.powersgd_form_m(d, g.double(), pp.double(), qp.double(), qt.double())
    big = torch.randn(psgd_native.PSGD_MAX_RANK + 1, 40)
    _fused_lowrank.powersgd_form_m(e.clone(), g, pp, qp, big)
    monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")
    e3 = e.clone()
    p3 = _fused_lowrank.powersgd_form_m(e3, g, pp, qp, qt)
    assert calls == [1, 1]
    torch.testing.assert_close(e3, ref)  # the eager kernels' addmm rounds its own way
    torch.testing.assert_close(p3, p, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(d.float(), ref)


@pytest.mark.parametrize("rows,cols,rank,prev", CASES)
def test_lowrank_is_the_outer_product_sum_bit_for_bit(rows, cols, rank, prev):
    """The decode's ``P Q^T`` keeps the torch kernels' bits (ranks that decode
    the same sums agree whichever kernels they run), and so does the dispatch."""
    gen = torch.Generator().manual_seed(rows * cols + rank)
    p, qt = torch.randn(rows, rank, generator=gen), torch.randn(rank, cols, generator=gen)
    want = _fused_lowrank._outer_sum(p, qt, rank)
    out = torch.full((rows, cols), float("nan"))
    psgd_native.psgd_lowrank(p, qt, out)
    assert torch.equal(out, want)
    out2 = torch.empty(rows, cols)
    _fused_lowrank.powersgd_lowrank(p, qt, out2)
    assert torch.equal(out2, want)


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None,
                    reason="nvcc is not installed: the CUDA source is not compile-checked")
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    """The GPU's lane-order kernels (``powersgd/cuda.py``, run by bench/gpu_check.py on
    a GPU) compile as cupy compiles them (no contraction)."""
    import subprocess

    from hipress_like.compressors.powersgd import cuda as psgd_cuda
    out = tmp_path / "psgd.ptx"
    p = subprocess.run(["nvcc", "-ptx", "-arch=sm_80", "--fmad=false", "-std=c++17", "-o",
                        str(out), str(psgd_cuda.SOURCE)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    ptx = out.read_text()
    for name in ("psgd_form_m", "psgd_mq", "psgd_mtp", "psgd_orthogonalize"):
        assert f".entry {name}(" in ptx
    assert "fma.rn.f32" not in ptx  # every product rounds before its sum
    # CPU tensors never take the GPU kernels
    assert not psgd_cuda.usable(torch.zeros(2, 2))


_EMU = cuda_emulation.SHIM + r"""
#include "SOURCE"
extern "C" void emu(int which, unsigned gx, unsigned bx, unsigned by, float* a0, float* a1,
                    float* a2, float* a3, int r, float* a4, long long rows, long long cols) {
    if (which == 0) cl_launch_grid(psgd_form_m, gx, bx, by, (const float*)a0, (const float*)a1,
                              (const float*)a2, (const float*)a3, r, a4, rows, cols);
    if (which == 1) cl_launch_grid(psgd_mq, gx, bx, by, (const float*)a0, (const float*)a1, r, a4,
                              rows, cols);
    if (which == 2) cl_launch_grid(psgd_mtp, gx, bx, by, (const float*)a0, (const float*)a1, r, a4,
                              rows, cols);
    if (which == 3) cl_launch_grid(psgd_orthogonalize, gx, bx, by, a4, rows, cols, a0);
}
"""


@pytest.mark.skipif(__import__("shutil").which("g++") is None,
                    reason="no C++ compiler to emulate the CUDA kernels on the CPU")
@pytest.mark.parametrize("rows,cols,rank,prev", [(37, 53, 1, 1), (9, 8 * 5 + 3, 4, 2),
                                                 (70, 33, 8, 8), (3, 2, 2, 0)])
def test_cuda_kernels_emulated_on_cpu_give_the_c_bits(rows, cols, rank, prev, tmp_path):
    """The GPU's kernels (``powersgd.cu``) run on the CPU, each GPU thread a CPU thread
    with the launch shapes ``cuda.py`` uses: the CPU kernels' bits (the lane order)."""
    import ctypes
    import subprocess

    from hipress_like.compressors.powersgd import cuda as psgd_cuda
    src = tmp_path / "emu.cpp"
    src.write_text(_EMU.replace("SOURCE", str(psgd_cuda.SOURCE)))
    lib_path = tmp_path / "emu.so"
    p = subprocess.run(["g++", "-O1", "-std=c++20", "-ffp-contract=off", "-shared", "-fPIC",
                        "-pthread", "-o", str(lib_path), str(src)], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    lib = ctypes.CDLL(str(lib_path))
    ptr = ctypes.c_void_p

    def run(which, name, r, *ts, rws=rows, cls=cols):
        (gx,), block = psgd_cuda.launch_shape(name, rws, cls, r)
        by = block[1] if len(block) > 1 else 1
        args = [ptr(t.data_ptr()) if t is not None else ptr(0) for t in ts]
        lib.emu(which, gx, block[0], by, *args[:4], ctypes.c_int(r), args[4],
                ctypes.c_longlong(rws), ctypes.c_longlong(cls))

    e, g, pp, qp, qt = _inputs(rows, cols, rank, prev, seed=rows)
    want = torch.empty_like(e)
    p_want = psgd_native.psgd_form_m(e, g, pp, qp, qt, want)
    out = torch.full_like(e, float("nan"))
    run(0, "psgd_form_m", prev, e, g, pp if prev else e, qp if prev else e, out)
    assert torch.equal(out, want)
    p = torch.full((rows, rank), float("nan"))
    run(1, "psgd_mq", rank, out, qt, None, None, p)
    assert torch.equal(p, p_want)
    q = torch.full((cols, rank), float("nan"))
    run(2, "psgd_mtp", rank, out, p, None, None, q)
    assert torch.equal(q, psgd_native.psgd_mtp(out, p))
    a = p.clone()
    run(3, "psgd_orthogonalize", rank, torch.empty(rank), None, None, None, a, cls=rank)
    assert torch.equal(a, psgd_native.psgd_orthogonalize(p.clone()))
