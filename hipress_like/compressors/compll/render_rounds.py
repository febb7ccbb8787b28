"""C for CompLL round programs (``@rounds(k)``, ``matrices.py``): PowerSGD's rounds.

Each entry point (``encode_round0`` .. and ``decode``) becomes one C function
run statement by statement. Matrices are ``cl_mat`` values (data, rows,
cols, row and column strides), so ``m.T`` is a view (strides swapped) and
``matrix(x, r, c)`` views the payload in place; every operator that makes a
matrix allocates it in the call's arena, which the caller frees after
copying the state matrices and the payload arrays out (value semantics: no
operator writes into its input, so the state tensors passed in are never
modified). The operators, in the common operator library of this target
(``CL_MATRIX_OPS`` below, shared with nobody: the C for sweeps has no
matrices):

- ``cl_matmul``: each output element summed over the inner index in the
  lane order (the definition in ``matrices.py``: 8 interleaved lanes from
  -0, then the lanes left to right); the loop nest is chosen by ``a``'s
  layout (rows of ``a`` contiguous: i, l, j into one row's lanes; otherwise
  l, i, j into the whole output's lanes, so ``M^T P`` streams M row by row)
  -- every element sees the same sequence of operations either way, so the
  bits do not depend on the choice;
- ``cl_orthogonalize``: Gram-Schmidt on a copy, the sums in
  ``ops.orthogonalize_``'s steps, each in the lane order;
- ``map`` over one or two matrices, or over ``range(n)``: one loop calling
  the user function with the element's row-major index (``random``'s
  counter).

Entry points (same signature each; ``state`` in/out, ``outs`` the payload's
arrays or decode's gradient matrix):

    int cl_<entry>(const float* g, int64_t n, int64_t grows, int64_t gcols,
                   const double* params, uint32_t seed, int64_t step, int64_t world_size,
                   const uint8_t* extra_in, int64_t extra_len, const uint8_t* body_in,
                   int64_t body_len, cl_mat* state, uint8_t* extra, cl_mat* outs,
                   void** arena, int64_t* n_arena)

They return 0, 3 (a payload shorter than extract reads), 5 (out of memory)
or 7 (matrices of mismatched shapes). Built by ``_build.native.build_shared``
like the other generated C, cached by the source's hash.
"""
from __future__ import annotations

import ctypes
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from .checker import Checked, Func
from .interp import layout
from .lower import ExprC, ctype
from .prelude import C_PRELUDE, ctx_struct
from .render_base import NativeRunner, read_extra_fields, write_extra_fields
from .syntax import Node, Type, find_node

__all__ = ["render_rounds", "RoundsNativeProgram", "CL_MATRIX_OPS", "entry_symbol"]

CL_MATRIX_OPS = r"""
#include <stdlib.h>
typedef struct { float* d; int64_t r, c, rs, cs; } cl_mat;
#define CL_AT(m, i, j) ((m).d[(i) * (m).rs + (j) * (m).cs])
/* element i in row-major order of the (possibly transposed) matrix m */
#define CL_EL(m, i) (((m).cs == 1 && (m).rs == (m).c) ? (m).d[i] : \
                     CL_AT(m, (i) / (m).c, (i) % (m).c))
static cl_mat cl_empty(void) { cl_mat m = {0, 0, 0, 0, 1}; return m; }
/* a new r x c matrix in the call's arena (freed by the caller): d NULL when out of memory */
static cl_mat cl_alloc(void** arena, int64_t* n_arena, int64_t r, int64_t c) {
    cl_mat m = {0, r, c, c, 1};
    m.d = (float*)malloc((size_t)(r * c > 0 ? r * c : 1) * sizeof(float));
    if (m.d) arena[(*n_arena)++] = m.d;
    return m;
}
static cl_mat cl_transpose(cl_mat m) {
    cl_mat t = {m.d, m.c, m.r, m.cs, m.rs};
    return t;
}
static int cl_contiguous(cl_mat m) { return m.cs == 1 && m.rs == m.c; }
static cl_mat cl_contig(void** A, int64_t* nA, cl_mat m) {
    if (cl_contiguous(m) || m.r * m.c == 0) return m;
    cl_mat o = cl_alloc(A, nA, m.r, m.c);
    if (!o.d) return o;
    for (int64_t i = 0; i < m.r; ++i)
        for (int64_t j = 0; j < m.c; ++j) o.d[i * m.c + j] = CL_AT(m, i, j);
    return o;
}
/* The lane order (matrices.py): a sum over t of x_t is ((L0 + L1) ...) + L7,
 * Lc = ((-0 + x_c) + x_{c+8}) + ..., float32, no contraction. */
static float cl_lanes_total(const float* L, int64_t stride) {
    float s = L[0];
    for (int l = 1; l < 8; ++l) s = s + L[l * stride];
    return s;
}
static float cl_lane_dot(const float* x, int64_t sx, const float* y, int64_t sy, int64_t n) {
    float L[8];
    for (int l = 0; l < 8; ++l) L[l] = -0.0f;
    for (int64_t t = 0; t < n; ++t) L[t & 7] = L[t & 7] + x[t * sx] * y[t * sy];
    return cl_lanes_total(L, 1);
}
/* matmul: out[i,j] = sum_l a[i,l] b[l,j] in the lane order (matrices.py) */
static cl_mat cl_matmul(void** A, int64_t* nA, cl_mat a, cl_mat b, int* err) {
    if (a.c != b.r) { *err = 7; return cl_empty(); }
    cl_mat o = cl_alloc(A, nA, a.r, b.c);
    if (!o.d) { *err = 5; return o; }
    int64_t k = a.c, R = a.r, C = b.c;
    if (k == 0) { for (int64_t i = 0; i < R * C; ++i) o.d[i] = 0.0f; return o; }
    if (a.cs == 1) {  /* rows of a contiguous: per output row, 8 lanes of C floats */
        cl_mat L = cl_alloc(A, nA, 8, C);
        if (!L.d) { *err = 5; return o; }
        for (int64_t i = 0; i < R; ++i) {
            for (int64_t e = 0; e < 8 * C; ++e) L.d[e] = -0.0f;
            for (int64_t l = 0; l < k; ++l) {
                float x = CL_AT(a, i, l);
                float* Ll = L.d + (l & 7) * C;
                for (int64_t j = 0; j < C; ++j) Ll[j] = Ll[j] + x * CL_AT(b, l, j);
            }
            for (int64_t j = 0; j < C; ++j) o.d[i * C + j] = cl_lanes_total(L.d + j, C);
        }
        return o;
    }
    /* a^T of a row-major matrix (M^T P): l outermost, a's storage read row by row,
     * into 8 lanes of the whole output */
    cl_mat L = cl_alloc(A, nA, 8, R * C);
    if (!L.d) { *err = 5; return o; }
    for (int64_t e = 0; e < 8 * R * C; ++e) L.d[e] = -0.0f;
    for (int64_t l = 0; l < k; ++l) {
        float* Ll = L.d + (l & 7) * R * C;
        for (int64_t i = 0; i < R; ++i) {
            float x = CL_AT(a, i, l);
            float* Li = Ll + i * C;
            for (int64_t j = 0; j < C; ++j) Li[j] = Li[j] + x * CL_AT(b, l, j);
        }
    }
    for (int64_t e = 0; e < R * C; ++e) o.d[e] = cl_lanes_total(L.d + e, R * C);
    return o;
}
/* Gram-Schmidt on the columns of a copy (ops.orthogonalize_'s steps; sums in the lane order) */
static cl_mat cl_orthogonalize(void** A, int64_t* nA, cl_mat a, int* err) {
    cl_mat m = cl_alloc(A, nA, a.r, a.c);
    if (!m.d) { *err = 5; return m; }
    int64_t R = a.r, C = a.c;
    for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < C; ++j) m.d[i * C + j] = CL_AT(a, i, j);
    float* d = (float*)malloc((size_t)(C > 0 ? C : 1) * sizeof(float));
    if (!d) { *err = 5; return m; }
    for (int64_t i = 0; i < C && R > 0; ++i) {
        if (i) {
            for (int64_t l = 0; l < i; ++l)        /* d = prev^T col */
                d[l] = cl_lane_dot(m.d + l, C, m.d + i, C, R);
            for (int64_t j = 0; j < R; ++j)        /* col -= prev d */
                m.d[j * C + i] = m.d[j * C + i] - cl_lane_dot(m.d + j * C, 1, d, 1, i);
        }
        float den = sqrtf(cl_lane_dot(m.d + i, C, m.d + i, C, R)) + 1e-8f;
        for (int64_t j = 0; j < R; ++j) m.d[j * C + i] = m.d[j * C + i] / den;
    }
    free(d);
    return m;
}
/* a matrix's first n elements (row-major) as a gradient-length array (n x 1) */
static cl_mat cl_first_n(void** A, int64_t* nA, cl_mat m, int64_t n, int* err) {
    if (m.r * m.c < n) { *err = 7; return cl_empty(); }
    cl_mat o = cl_alloc(A, nA, n, 1);
    if (!o.d) { *err = 5; return o; }
    for (int64_t i = 0; i < n; ++i) o.d[i] = CL_EL(m, i);
    return o;
}
/* matrix(x): x (n elements) as the gradient's grows x gcols view, zero-padded */
static cl_mat cl_view(void** A, int64_t* nA, const float* x, int64_t n, int64_t r, int64_t c,
                      int* err) {
    cl_mat m = {(float*)x, r, c, c, 1};
    if (r * c == n) return m;
    if (r * c < n) { *err = 7; return cl_empty(); }
    m = cl_alloc(A, nA, r, c);
    if (!m.d) { *err = 5; return m; }
    for (int64_t i = 0; i < n; ++i) m.d[i] = x[i];
    for (int64_t i = n; i < r * c; ++i) m.d[i] = 0.0f;
    return m;
}
"""

_ENTRY_ARGS = ("const float* g, int64_t n, int64_t grows, int64_t gcols, const double* params, "
               "uint32_t seed, int64_t step, int64_t world_size, const uint8_t* extra_in, "
               "int64_t extra_len, const uint8_t* body_in, int64_t body_len, cl_mat* state, "
               "uint8_t* extra, cl_mat* outs, void** arena, int64_t* n_arena")


def entry_symbol(f: Func) -> str:
    """The C symbol of an entry point: ``cl_encode_round0`` .. ``cl_decode``."""
    return f"cl_{f.name}"


class _RoundExpr(ExprC):
    """Scalars of round entry points: ``.size``, ``.rows``, ``.cols`` of named matrices."""

    def __init__(self, c: Checked, r: "_Rounds") -> None:
        super().__init__(c, "c")
        self.r = r

    def expr(self, e: Node) -> str:
        if e.kind == "field" and e.args[1] in ("size", "rows", "cols"):
            obj, fname = e.args
            if obj.kind == "var" and obj.args[0] == self.r.grad:
                return {"size": "n", "rows": "grows", "cols": "gcols"}[fname]
            m = self.r.mat(obj)
            return {"size": f"({m}.r * {m}.c)", "rows": f"{m}.r", "cols": f"{m}.c"}[fname]
        if e.ty is not None and getattr(e.ty, "array", False) and e.kind not in ("field",):
            raise self.c.prog.error("a matrix or array stands in its own assignment here "
                                    "(m = matmul(a, b);), not inside a scalar expression", e)
        return super().expr(e)


class _Rounds:
    """Renders the entry points of a round program (module docstring).

    The CUDA renderer (``render_cuda_rounds``) subclasses it: the statements
    are the same text, calling its block-cooperative operator library.
    """

    memcpy = "memcpy"

    def __init__(self, c: Checked) -> None:
        self.c = c
        self.ex = _RoundExpr(c, self)
        self.state = [n for n, t in c.globals.items() if t.array]
        self.lines: List[str] = []
        self.tmp = 0
        self.grad = ""
        self.arrays: Dict[str, str] = {}  # local float* array -> its length variable

    # -- names ---------------------------------------------------------------
    def mat(self, n: Node) -> str:
        """The C cl_mat of a named matrix (state, local) or array (as an n x 1 matrix)."""
        if n.kind != "var":
            raise self.c.prog.error("expected a named matrix here", n)
        name = n.args[0]
        if name in self.state:
            return f"state[{self.state.index(name)}]"
        if name == self.grad:
            return "cl_gradv"
        if name in self.arrays or name in self.mats:
            return f"m_{name}"
        raise self.c.prog.error(f"{name!r} has no value here", n)

    def new(self) -> str:
        self.tmp += 1
        return f"t{self.tmp}"

    def emit(self, line: str, ind: str) -> None:
        self.lines.append(ind + line)

    # -- matrix expressions ----------------------------------------------------
    def mexpr(self, e: Node, ind: str) -> str:
        """Emit the statements computing matrix/array expression ``e``; return its cl_mat."""
        k = e.kind
        if k == "var":
            return self.mat(e)
        if k == "field" and e.args[1] == "T":
            return f"cl_transpose({self.mexpr(e.args[0], ind)})"
        if k != "call":
            raise self.c.prog.error(f"cannot compile a matrix expression of kind {k} here", e)
        name, args = e.args
        t = self.new()
        chk = "if (err_) goto done_;"
        if name == "matmul":
            a, b = (self.mexpr(x, ind) for x in args)
            self.emit(f"cl_mat {t} = cl_matmul(arena, n_arena, {a}, {b}, &err_); {chk}", ind)
        elif name == "orthogonalize":
            a = self.mexpr(args[0], ind)
            self.emit(f"cl_mat {t} = cl_orthogonalize(arena, n_arena, {a}, &err_); {chk}", ind)
        elif name == "matrix":
            x = self.mexpr(args[0], ind)
            if len(args) == 1:
                self.emit(f"if (!cl_contiguous({x}) || {x}.r * {x}.c != n) {{ err_ = 7; "
                          "goto done_; }", ind)
                self.emit(f"cl_mat {t} = cl_view(arena, n_arena, {x}.d, n, grows, gcols, "
                          f"&err_); {chk}", ind)
            else:
                r, cc = (self.ex.conv(self.ex.expr(a), a.ty, _I64) for a in args[1:])
                self.emit(f"if ({r} < 0 || {cc} < 0 || {r} * {cc} > {x}.r * {x}.c || "
                          f"!cl_contiguous({x})) {{ err_ = 7; goto done_; }}", ind)
                self.emit(f"cl_mat {t} = {{{x}.d, {r}, {cc}, {cc}, 1}};", ind)
        elif name == "map":
            self._map(t, e, args, ind)
        else:
            raise self.c.prog.error(f"{name} does not make a matrix here", e)
        return t

    def _map(self, t: str, e: Node, args: List[Node], ind: str) -> None:
        fn = args[-1]
        f = self.c.funcs[fn.args[0]]
        ret = f.ret
        if args[0].kind == "call" and args[0].args[0] == "range":
            cnt = self.ex.conv(self.ex.expr(args[0].args[1][0]), args[0].args[1][0].ty, _I64)
            self.emit(f"cl_mat {t} = cl_alloc(arena, n_arena, {cnt} > 0 ? {cnt} : 0, 1);", ind)
            self.emit(f"if (!{t}.d) {{ err_ = 5; goto done_; }}", ind)
            call = self.ex.conv(f"u_{f.name}(&ctx_, ({ctype(f.params[0][0])})i_, i_)", ret,
                                _F32)
            self.emit(f"for (int64_t i_ = 0; i_ < {t}.r; ++i_) {t}.d[i_] = {call};", ind)
            return
        srcs = [self.mexpr(a, ind) for a in args[:-1]]
        a0 = srcs[0]
        if len(srcs) == 2:
            self.emit(f"if ({a0}.r != {srcs[1]}.r || {a0}.c != {srcs[1]}.c) {{ err_ = 7; "
                      "goto done_; }", ind)
        self.emit(f"cl_mat {t} = cl_alloc(arena, n_arena, {a0}.r, {a0}.c);", ind)
        self.emit(f"if (!{t}.d) {{ err_ = 5; goto done_; }}", ind)
        vals = [self.ex.conv(f"CL_EL({s}, i_)", _F32, pt)
                for s, (pt, _) in zip(srcs, f.params)]
        call = self.ex.conv(f"u_{f.name}(&ctx_, {', '.join(vals)}, i_)", ret, _F32)
        self.emit(f"for (int64_t i_ = 0; i_ < {a0}.r * {a0}.c; ++i_) {t}.d[i_] = {call};", ind)

    # -- statements ------------------------------------------------------------
    mats: Dict[str, bool] = {}

    def stmts(self, s: Node, ind: str, out_name: str) -> None:
        k = s.kind
        if k == "block":
            self.emit("{", ind)
            for x in s.args[0]:
                self.stmts(x, ind + "    ", out_name)
            self.emit("}", ind)
            return
        if k == "decl" and s.args[0].array:
            for d in s.args[1]:
                if d.args[1] is None:
                    self.arrays[d.args[0]] = "0"  # filled by extract
                    self.emit(f"cl_mat m_{d.args[0]} = cl_empty();", ind)
                    continue
                v = self.mexpr(d.args[1], ind)
                self.mats[d.args[0]] = True
                self.emit(f"cl_mat m_{d.args[0]} = {v};", ind)
            return
        if k == "assign" and s.args[0].args[0] == out_name:
            self.output(s.args[2], ind)
            return
        if k == "assign" and s.args[0].ty is not None and s.args[0].ty.array:
            v = self.mexpr(s.args[2], ind)
            if not s.args[0].ty.matrix and s.args[2].ty.matrix:  # the first n elements
                t = self.new()
                self.emit(f"cl_mat {t} = cl_first_n(arena, n_arena, {v}, n, &err_); "
                          "if (err_) goto done_;", ind)
                v = t
            self.emit(f"{self.mat(s.args[0])} = {v};", ind)
            return
        if k == "expr_stmt" and s.args[0].kind == "call" and s.args[0].args[0] == "extract":
            self.extract(s.args[0], ind)
            return
        if k == "if":
            self.emit(f"if ({self.ex.expr(s.args[0])}) {{", ind)
            self.stmts(_blk(s.args[1]), ind + "    ", out_name)
            if s.args[2] is not None:
                self.emit("} else {", ind)
                self.stmts(_blk(s.args[2]), ind + "    ", out_name)
            self.emit("}", ind)
            return
        if k == "decl":
            for d in s.args[1]:
                self.ex.locals[-1].add(d.args[0])
        for line in self.ex.stmt(s, ind, None):
            self.lines.append(line)

    def output(self, e: Node, ind: str) -> None:
        if self.f.name == "decode":
            v = self.mexpr(e, ind)
            self.emit(f"outs[0] = cl_contig(arena, n_arena, {v}); if (!outs[0].d && "
                      "outs[0].r * outs[0].c) { err_ = 5; goto done_; }", ind)
            return
        if not (e.kind == "call" and e.args[0] == "concat"):
            raise self.c.prog.error("a round's payload is concat(...)", e)
        lay = layout(e.args[1])
        for line in write_extra_fields(lay, self.ex, self.memcpy):
            self.lines.append(ind + line.strip())
        for j, (a, _t) in enumerate(lay.arrays):
            v = self.mexpr(a, ind)
            self.emit(f"outs[{j}] = cl_contig(arena, n_arena, {v});", ind)

    def extract(self, e: Node, ind: str) -> None:
        lay = layout(e.args[1][1:])
        # the fields come from the aggregate's header (extra_in)
        for line in read_extra_fields(lay, self.ex, "{{ err_ = {}; goto done_; }}",
                                      self.memcpy, "int64_t"):
            line = line.replace("extra +", "extra_in +")
            self.lines.append(ind + line.strip().replace("= extra[", "= extra_in["))
        for a, t in lay.arrays:
            if a.kind != "index" or t.name != "float":
                raise self.c.prog.error("a round program extracts float arrays as "
                                        "name[count]", a)
            name = a.args[0].args[0]
            cnt = self.ex.conv(self.ex.expr(a.args[1]), a.args[1].ty, _I64)
            self.emit("off_ = (off_ + 7) / 8 * 8;", ind)
            self.emit(f"if ({cnt} < 0 || off_ + {cnt} * 4 > body_len) {{ err_ = 3; "
                      "goto done_; }", ind)
            self.emit(f"m_{name}.d = (float*)(body_in + off_); m_{name}.r = {cnt}; "
                      f"m_{name}.c = 1; m_{name}.rs = 1; m_{name}.cs = 1; off_ += {cnt} * 4;",
                      ind)

    def entry(self, f: Func) -> None:
        self.f = f
        self.arrays, self.mats = {}, {}
        names = [pn for pt, pn in f.params if pt.name != "struct"]
        self.grad = names[1] if f.name != "encode_round0" else names[0]
        out_name = names[-1] if f.name != "decode" else names[1]
        self.ex.locals = [{"step", "world_size"}]
        self.ex.args = set()
        self.emit(f"int {entry_symbol(f)}({_ENTRY_ARGS}) {{", "")
        ind = "    "
        self.emit("int err_ = 0; ctx_t ctx_; ctx_t* c = &ctx_; memset(&ctx_, 0, sizeof ctx_);",
                  ind)
        for j, (pn, pt, _, _) in enumerate(self.c.params):
            self.emit(f"ctx_.p_{pn} = ({ctype(pt)})params[{j}];", ind)
        self.emit("ctx_.seed = seed; int64_t l_step = step, l_world_size = world_size;", ind)
        self.emit("(void)l_step; (void)l_world_size; (void)extra_in; (void)extra_len; "
                  "(void)body_in; (void)body_len; (void)extra; (void)g;", ind)
        self.emit("cl_mat cl_gradv = {(float*)g, n, 1, 1, 1}; (void)cl_gradv;", ind)
        for s in f.body.args[0]:
            self.stmts(s, ind, out_name)
        for j in range(len(self.state)):
            self.emit(f"state[{j}] = cl_contig(arena, n_arena, state[{j}]);", ind)
        self.lines += ["done_:", "    return err_;", "}", ""]


_I64, _F32 = Type("int64"), Type("float")


def _blk(s: Node) -> Node:
    return s if s.kind == "block" else Node("block", ([s],), s.line, s.col)


def arena_size(c: Checked, f: Func) -> int:
    """An upper bound of the allocations of one call of ``f`` (the language has no loops;
    a node allocates at most twice: ``cl_matmul``'s result and its lanes)."""
    def nodes(x: Any) -> int:
        if isinstance(x, Node):
            return 1 + nodes(x.args)
        if isinstance(x, (list, tuple)):
            return sum(nodes(a) for a in x)
        return 0
    return 2 * nodes(f.body) + len(c.globals) + 4


def render_rounds(c: Checked) -> str:
    """The C source of a round program (module docstring).

    Raises:
        CompllError: a construct this target does not compile (located).
    """
    r = _Rounds(c)
    parts = [C_PRELUDE, CL_MATRIX_OPS, ctx_struct(c)]
    entries = set(f.name for f in c.rounds) | {"decode"}
    for name, f in c.funcs.items():
        if name not in entries:
            parts.append(r.ex.function(f, "CL_INLINE"))
    for f in c.rounds + [c.decode]:
        r.entry(f)
    parts.append("\n".join(r.lines))
    parts.append("void cl_free_arena(void** arena, int64_t n) {\n"
                 "    for (int64_t i = 0; i < n; ++i) free(arena[i]);\n}\n")
    return "\n".join(parts) + "\n"


class _Mat(ctypes.Structure):
    _fields_ = [("d", ctypes.c_void_p), ("r", ctypes.c_int64), ("c", ctypes.c_int64),
                ("rs", ctypes.c_int64), ("cs", ctypes.c_int64)]


def _from_mat(m: _Mat) -> torch.Tensor:
    n = int(m.r) * int(m.c)
    if n == 0 or not m.d:
        return torch.zeros(int(m.r), int(m.c), dtype=torch.float32)
    buf = (ctypes.c_float * n).from_address(m.d)
    return torch.frombuffer(buf, dtype=torch.float32).clone().view(int(m.r), int(m.c))


def raise_round_error(rc: int, c: Checked, f: Func) -> None:
    """Raise the ValueError of an entry point's error code ``rc`` (0: return).

    Raises:
        ValueError: a short payload (3), out of memory (5), mismatched matrices (7).
    """
    if not rc:
        return
    msg = {3: "the payload is shorter than the program reads", 5: "out of memory",
           7: "matrices of mismatched shapes (matmul's inner sizes, map's operands, a "
           "matrix view larger than its array)"}.get(rc, f"error {rc}")
    raise ValueError(f"{c.prog.filename}: {f.name}: {msg}")


class RoundsNativeProgram(NativeRunner):
    """The generated C of a round program, built (or cached) and loaded with ctypes.

    Attributes:
        compile_s: seconds spent building (0 from the cache).
        cache_hit: True when the library came from the cache.
    """

    def __init__(self, c: Checked) -> None:
        from .._build import native as _native
        self.c = c
        self.source = render_rounds(c)
        t0 = time.perf_counter()
        self.lib, self.cache_hit = _native.build_shared(self.source, self._stem(c))
        self.compile_s = 0.0 if self.cache_hit else time.perf_counter() - t0
        p, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
        for f in c.rounds + [c.decode]:
            fn = getattr(self.lib, entry_symbol(f))
            fn.argtypes = [p, i64, i64, i64, p, u32, i64, i64, p, i64, p, i64, p, p, p, p, p]
            fn.restype = ctypes.c_int
        self.lib.cl_free_arena.argtypes = [p, i64]
        self.lib.cl_free_arena.restype = None
        self.names = [n for n, t in c.globals.items() if t.array]

    def run(self, rnd: Optional[int], g: torch.Tensor, shape: Tuple[int, ...],
            aggregate: Optional[Tuple[bytes, torch.Tensor]], mats: Dict[str, torch.Tensor],
            params: Dict[str, Any], seed: int, step: int, world_size: int
            ) -> Tuple[Any, Dict[str, torch.Tensor]]:
        """Run round ``rnd`` (None: decode) on flat float32 CPU ``g``; the state matrices
        ``mats`` (contiguous float32 CPU) are read, never written.

        Returns:
            ((extra bytes, body arrays) or the flat gradient, the new state matrices).

        Raises:
            ValueError: a short payload or matrices of mismatched shapes.
        """
        from .matrices import matrix_shape
        f = self.c.decode if rnd is None else self.c.rounds[rnd]
        rows, cols = matrix_shape(shape)
        st = (_Mat * max(len(self.names), 1))()
        ptrs = [mats[n].data_ptr() if mats[n].numel() else None for n in self.names]
        for j, n in enumerate(self.names):
            t = mats[n]
            t2 = t if t.dim() == 2 else t.reshape(-1, 1)  # a gradient-length array: n x 1
            st[j] = _Mat(t2.data_ptr() if t2.numel() else None, t2.shape[0], t2.shape[1],
                         t2.shape[1], 1)
        node = None if rnd is None else find_node(f.body, lambda x: x.kind == "call"
                                                  and x.args[0] == "concat")
        lay = layout(node.args[1]) if node is not None else None
        n_out = len(lay.arrays) if lay is not None else 1
        outs = (_Mat * max(n_out, 1))()
        extra = ctypes.create_string_buffer(max(lay.extra_nbytes if lay else 0, 1))
        cap = arena_size(self.c, f)
        arena = (ctypes.c_void_p * cap)()
        n_arena = ctypes.c_int64(0)
        ex_in, body_in = aggregate if aggregate is not None else (b"", torch.zeros(0,
                                                                                 dtype=torch.uint8))
        ex_buf = ctypes.create_string_buffer(bytes(ex_in), max(len(ex_in), 1))
        body_in = body_in.contiguous()
        try:
            rc = getattr(self.lib, entry_symbol(f))(
                g.data_ptr(), g.numel(), rows, cols, self._params(params), seed & 0xFFFFFFFF,
                step, world_size, ctypes.addressof(ex_buf), len(ex_in),
                body_in.data_ptr() if body_in.numel() else None, body_in.numel(), st, extra,
                outs, arena, ctypes.byref(n_arena))
            raise_round_error(rc, self.c, f)
            new = {}
            for j, n in enumerate(self.names):
                if st[j].d is not None and st[j].d == ptrs[j] and \
                        st[j].r * st[j].c == mats[n].numel():
                    new[n] = mats[n]  # not reassigned: no operator wrote into it, keep it
                else:
                    m = _from_mat(st[j])
                    new[n] = m if self.c.globals[n].matrix else m.reshape(-1)
            if rnd is None:
                res = _from_mat(outs[0]).reshape(-1)[:g.numel()]
                return res, new
            parts = [_from_mat(outs[j]).reshape(-1).view(torch.uint8) for j in range(n_out)]
            return (extra.raw[:lay.extra_nbytes], parts), new
        finally:
            self.lib.cl_free_arena(arena, n_arena.value)
