"""CUDA for CompLL round programs (``@rounds(k)``, ``matrices.py``): PowerSGD on a GPU.

The statements are ``render_rounds``' text; what differs is the operator
library under them and the entry points' shape. Each entry point is one
kernel run by one block (``name:block``): scalar statements run in every
thread alike (each holds the same values), and each matrix operator is
block-cooperative, a ``__syncthreads`` on either side:

- ``cl_matmul``: a thread per output element (grid-stride over the block),
  each summing over the inner index in the lane order (``cl_lane_dot``: 8
  register lanes, ``__fmul_rn`` and ``__fadd_rn``, no contraction), the C's
  and the interpreter's order;
- ``cl_orthogonalize``: per column, a thread per earlier column for the
  projections ``d``, a thread per row for ``col -= prev d``, thread 0 for
  the norm's sum, each in the lane order; the same operations as the C;
- ``map``, ``matrix(x)``'s zero-padded copy, contiguous copies: a thread per
  element;
- allocation: thread 0 takes the block's memory with device ``malloc``
  (recorded in the caller's arena, freed by the caller after copying out)
  and shares the pointer through shared memory.

One block bounds the speed (PowerSGD's products are thin: r <= 8 columns,
but the sums over the long dimension are 8 lanes per element, as their
definition requires). The source is compile-checked by ``nvcc -ptx`` in the
tests and run there by a CPU emulation of the kernels (each block thread a
CPU thread), which must give the C's bits; on a GPU
``cuda_runners.RoundsCudaProgram`` runs it (``bench/gpu_check.py`` checks
it gives the C's bits there).
"""
from __future__ import annotations

from typing import Any, Dict

from .checker import Checked
from .prelude import CUDA_PRELUDE, ctx_struct
from .render_rounds import _ENTRY_ARGS, _Rounds, entry_symbol

__all__ = ["render_cuda_rounds", "CUDA_MATRIX_OPS"]

CUDA_MATRIX_OPS = r"""
struct cl_mat { float* d; int64_t r, c, rs, cs; };
#define CL_AT(m, i, j) ((m).d[(i) * (m).rs + (j) * (m).cs])
#define CL_EL(m, i) (((m).cs == 1 && (m).rs == (m).c) ? (m).d[i] : \
                     CL_AT(m, (i) / (m).c, (i) % (m).c))
#define CL_FOR(i, n) for (int64_t i = threadIdx.x; i < (n); i += blockDim.x)
__device__ cl_mat cl_empty() { cl_mat m = {0, 0, 0, 0, 1}; return m; }
/* a new r x c matrix for the block (thread 0 allocates; the caller frees the arena) */
__device__ cl_mat cl_alloc(void** arena, int64_t* n_arena, int64_t r, int64_t c) {
    __shared__ float* p_;
    __syncthreads();
    if (threadIdx.x == 0) {
        p_ = (float*)malloc((size_t)(r * c > 0 ? r * c : 1) * sizeof(float));
        if (p_) arena[(*n_arena)++] = p_;
    }
    __syncthreads();
    cl_mat m = {p_, r, c, c, 1};
    return m;
}
__device__ cl_mat cl_transpose(cl_mat m) { cl_mat t = {m.d, m.c, m.r, m.cs, m.rs}; return t; }
__device__ int cl_contiguous(cl_mat m) { return m.cs == 1 && m.rs == m.c; }
__device__ cl_mat cl_contig(void** A, int64_t* nA, cl_mat m) {
    if (cl_contiguous(m) || m.r * m.c == 0) return m;
    cl_mat o = cl_alloc(A, nA, m.r, m.c);
    if (!o.d) return o;
    CL_FOR(e, m.r * m.c) o.d[e] = CL_AT(m, e / m.c, e % m.c);
    __syncthreads();
    return o;
}
/* The lane order (matrices.py): ((L0 + L1) ...) + L7, Lc = ((-0 + x_c) + x_{c+8}) ... */
__device__ float cl_lane_dot(const float* x, int64_t sx, const float* y, int64_t sy,
                             int64_t n) {
    float L[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) L[l] = -0.0f;
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
#pragma unroll
        for (int l = 0; l < 8; ++l)   /* l constant after unrolling: L stays in registers */
            if (t0 + l < n) L[l] = __fadd_rn(L[l], __fmul_rn(x[(t0 + l) * sx], y[(t0 + l) * sy]));
    }
    float s = L[0];
#pragma unroll
    for (int l = 1; l < 8; ++l) s = __fadd_rn(s, L[l]);
    return s;
}
__device__ cl_mat cl_matmul(void** A, int64_t* nA, cl_mat a, cl_mat b, int* err) {
    if (a.c != b.r) { *err = 7; return cl_empty(); }
    cl_mat o = cl_alloc(A, nA, a.r, b.c);
    if (!o.d) { *err = 5; return o; }
    int64_t k = a.c, C = b.c;
    CL_FOR(e, a.r * C) {
        int64_t i = e / C, j = e % C;
        o.d[e] = k ? cl_lane_dot(a.d + i * a.rs, a.cs, b.d + j * b.cs, b.rs, k) : 0.0f;
    }
    __syncthreads();
    return o;
}
__device__ cl_mat cl_orthogonalize(void** A, int64_t* nA, cl_mat a, int* err) {
    __shared__ float den_;
    cl_mat m = cl_alloc(A, nA, a.r, a.c);
    if (!m.d) { *err = 5; return m; }
    int64_t R = a.r, C = a.c;
    cl_mat dm = cl_alloc(A, nA, C > 0 ? C : 1, 1);
    if (!dm.d) { *err = 5; return m; }
    float* d = dm.d;
    CL_FOR(e, R * C) m.d[e] = CL_AT(a, e / C, e % C);
    __syncthreads();
    for (int64_t i = 0; i < C && R > 0; ++i) {
        if (i) {
            CL_FOR(l, i) d[l] = cl_lane_dot(m.d + l, C, m.d + i, C, R);  /* d = prev^T col */
            __syncthreads();
            CL_FOR(j, R)                                                 /* col -= prev d */
                m.d[j * C + i] = __fsub_rn(m.d[j * C + i], cl_lane_dot(m.d + j * C, 1, d, 1, i));
            __syncthreads();
        }
        if (threadIdx.x == 0)                         /* the norm, in the lane order */
            den_ = __fadd_rn(__fsqrt_rn(cl_lane_dot(m.d + i, C, m.d + i, C, R)), 1e-8f);
        __syncthreads();
        CL_FOR(j, R) m.d[j * C + i] = __fdiv_rn(m.d[j * C + i], den_);
        __syncthreads();
    }
    return m;
}
__device__ cl_mat cl_first_n(void** A, int64_t* nA, cl_mat m, int64_t n, int* err) {
    if (m.r * m.c < n) { *err = 7; return cl_empty(); }
    cl_mat o = cl_alloc(A, nA, n, 1);
    if (!o.d) { *err = 5; return o; }
    CL_FOR(i, n) o.d[i] = CL_EL(m, i);
    __syncthreads();
    return o;
}
__device__ cl_mat cl_view(void** A, int64_t* nA, const float* x, int64_t n, int64_t r,
                          int64_t c, int* err) {
    cl_mat m = {(float*)x, r, c, c, 1};
    if (r * c == n) return m;
    if (r * c < n) { *err = 7; return cl_empty(); }
    m = cl_alloc(A, nA, r, c);
    if (!m.d) { *err = 5; return m; }
    CL_FOR(e, r * c) m.d[e] = e < n ? x[e] : 0.0f;
    __syncthreads();
    return m;
}
"""


class _CudaRounds(_Rounds):
    """``_Rounds`` with the device's byte copy, its map loops and kernel entry points."""

    memcpy = "cl_memcpy"

    def emit(self, line: str, ind: str) -> None:
        # the statements' loops over elements become block-strided (a thread per element)
        line = line.replace("for (int64_t i_ = 0; i_ <", "for (int64_t i_ = threadIdx.x; i_ <")
        line = line.replace("; ++i_) ", "; i_ += blockDim.x) ")
        if line.lstrip().startswith("for (int64_t i_ = threadIdx.x"):
            line += " __syncthreads();"
        self.lines.append(ind + line)

    def entry(self, f: Any) -> None:
        start = len(self.lines)
        super().entry(f)
        body = self.lines[start:]
        head = body[0].replace(f"int {entry_symbol(f)}(", f'extern "C" __global__ void '
                               f"{entry_symbol(f)}(").replace("cl_mat* state,",
                                                              "cl_mat* state_g,")
        head = head[:-len(") {")] + ", int* err_out) {"
        out = [head, f"    cl_mat state[{max(len(self.state), 1)}];",
               f"    for (int j_ = 0; j_ < {len(self.state)}; ++j_) state[j_] = state_g[j_];"]
        # C++ forbids a goto across initialisations: the error exits break out of a
        # do { } while (0) around the statements instead
        for ln in body[1:]:
            ln = ln.replace("goto done_;", "break;").replace(
                "memset(&ctx_, 0, sizeof ctx_);", "ctx_ = ctx_t();")
            if ln.strip() == "done_:":
                out.append("    } while (0);")
                continue
            if ln.strip() == "return err_;":
                out += [f"    if (threadIdx.x == 0) {{ *err_out = err_; for (int j_ = 0; j_ < "
                        f"{len(self.state)}; ++j_) state_g[j_] = state[j_]; }}"]
                continue
            out.append(ln)
            if "cl_mat cl_gradv" in ln:
                out.append("    do {")
        self.lines[start:] = out


def render_cuda_rounds(c: Checked) -> Dict[str, Any]:
    """CUDA source of a round program and its kernels (module docstring).

    Returns:
        ``{"source": str, "encode": [...], "decode": [...]}``: each entry point's
        kernel as ``"name:block"`` (one block of any size; ``encode`` lists the
        rounds in order).

    Raises:
        CompllError: a construct this target does not compile (located).
    """
    r = _CudaRounds(c)
    entries = {f.name for f in c.rounds} | {"decode"}
    funcs = [r.ex.function(f, "CL_INLINE") for name, f in c.funcs.items()
             if name not in entries]
    for f in c.rounds + [c.decode]:
        r.entry(f)
    src = "\n".join([CUDA_PRELUDE, CUDA_MATRIX_OPS, ctx_struct(c)] + funcs + r.lines)
    return {"source": src + "\n", "encode": [f"{entry_symbol(f)}:block" for f in c.rounds],
            "decode": [f"{entry_symbol(c.decode)}:block"], "args": _ENTRY_ARGS}
