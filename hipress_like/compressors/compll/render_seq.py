"""C for CompLL programs with state arrays and data-dependent payloads (DGC, GradDrop).

The fused-sweep renderer (``render_c``) assumes every array is as long as the
gradient and the payload size is known before encode runs. Programs using
the sparsification operators (``arrays.py``) are rendered statement by
statement instead, each operator as one loop or one helper of the prelude:

- ``u = map(u, gradient, f)`` (state update): one flat loop, vectorised;
  the gradient's NaN/Inf are rejected by an integer pass over it first, so
  the state is untouched when encode fails (the hand-written order);
- ``filter(x, pred)``: one pass appending the passing indices (stream
  compaction), into a thread-local buffer reserved for ``n`` indices of which
  only the written pages are ever touched; each block of 64 is first asked
  whether any entry passes (vectorised), as ``sparse/topk.c`` does;
- ``threshold(x, density, sample_ratio)``: the sample (``ops.sample_positions``'
  hash), then a quickselect of the k-th largest magnitude (``cl_kth``);
- ``topk(x, cand, k)``: keys ``|x| << 32 | ~index`` (magnitude first, the lower
  index on ties), a quickselect of the k largest, then those indices sorted;
- ``gather``/``scatter``: loops over the indices.

Entry points (the body arrays stay in thread-local buffers until the caller
has sized the payload and copied them):

    int cl_sencode(const float* g, int64_t n, const double* params, uint8_t* extra,
                   float** state, uint32_t seed, uint32_t raw_seed, int64_t step,
                   int64_t* lens, const uint8_t** ptrs)
    int cl_decode(...)   as render_c's, returning 4 for indices outside [0, n)
                         or not strictly increasing

cl_sencode returns 1 (NaN/Inf), 5 (out of memory) or 6 (a threshold ratio
outside (0, 1]: the param block cannot state ranges, so they are checked here).

Built by ``_native.build_shared`` like the other generated C.
"""
from __future__ import annotations

import ctypes
import time
from typing import Any, Dict, List, Optional

import torch

from .arrays import assemble_body
from .checker import Checked
from .interp import _size, layout
from .lower import ctype
from .prelude import C_PRELUDE as PRELUDE
from .prelude import ctx_struct
from .render_base import (
    NativeRunner,
    SeqArrays,
    SeqExpr,
    counted_arrays,
    read_extra_fields,
    write_extra_fields,
)
from .syntax import Node, Type

__all__ = ["render_seq", "SeqNativeProgram", "SEQ_PRELUDE"]


_SELECT = r"""static uint{B}_t cl_select{B}(uint{B}_t* a, int64_t m, int64_t k) {
    int64_t lo = 0, hi = m - 1, want = k - 1;
    while (lo < hi) {
        uint{B}_t x = a[lo], y = a[(lo + hi) / 2], z = a[hi];
        uint{B}_t p = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > p) ++i;
            while (a[j] < p) --j;
            if (i <= j) { uint{B}_t t = a[i]; a[i] = a[j]; a[j] = t; ++i; --j; }
        }
        if (want <= j) hi = j; else if (want >= i) lo = i; else break;
    }
    return a[want];
}
"""  # one quickselect, instantiated for 64- and 32-bit keys

_SEQ_HEAD = r"""
#include <stdlib.h>
CL_INLINE void* cl_grow(void** buf, int64_t* cap, int64_t bytes) {
    if (*cap < bytes) {
        free(*buf);
        *buf = malloc((size_t)(bytes > 64 ? bytes : 64));
        *cap = *buf ? bytes : 0;
    }
    return *buf;
}
/* 1 when some element of x is NaN or Inf (integer test: finite-math-only is on) */
static int cl_any_nonfinite(const float* x, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t b; memcpy(&b, x + i, 4);
        bad |= ((b & 0x7F800000u) == 0x7F800000u);
    }
    return bad != 0;
}
CL_INLINE int64_t cl_num_selected(double ratio, int64_t n) {
    int64_t k = (int64_t)ceil(ratio * (double)n - 1e-6);
    k = k < n ? k : n;
    return k > 1 ? k : 1;
}
/* the k-th largest (k >= 1) of m unsigned keys, reordering them: keys[0..k) hold the k largest */
"""

_SEQ_TAIL = r"""static __thread void* cl_thr_buf = 0; static __thread int64_t cl_thr_cap = 0;
/* arrays.py's threshold: the k-th largest magnitude of a sample keyed by (seed, step) */
static __thread int cl_bad_ratio = 0;
static float cl_threshold(const float* x, int64_t n, double density, double sr, uint32_t seed,
                          int64_t step) {
    if (!(density > 0.0 && density <= 1.0 && sr > 0.0 && sr <= 1.0)) {
        cl_bad_ratio = 1;
        return 0.0f;
    }
    int64_t s = (int64_t)ceil(sr * (double)n);
    int64_t h = (int64_t)ceil(32.0 / density);
    s = s > h ? s : h;
    s = s > 1024 ? s : 1024;
    int64_t m = s >= n ? n : s;
    uint32_t* mag = (uint32_t*)cl_grow(&cl_thr_buf, &cl_thr_cap, m * 4);
    if (!mag) return 0.0f;
    if (s >= n) {
        for (int64_t i = 0; i < n; ++i) {
            uint32_t b; memcpy(&b, x + i, 4); mag[i] = b & 0x7FFFFFFFu;
        }
    } else {
        const uint64_t off = (uint64_t)step * (uint64_t)s;
        for (int64_t j = 0; j < s; ++j) {
            uint32_t hh = cl_fmix32((uint32_t)(off + (uint64_t)j) ^ seed);
            int64_t pos = (int64_t)(((uint64_t)hh * (uint64_t)n) >> 32);
            uint32_t b; memcpy(&b, x + pos, 4); mag[j] = b & 0x7FFFFFFFu;
        }
    }
    uint32_t kb = cl_select32(mag, m, cl_num_selected(density, m));
    float t; memcpy(&t, &kb, 4);
    return t;
}
static int cl_cmp_i32(const void* a, const void* b) {
    int32_t x = *(const int32_t*)a, y = *(const int32_t*)b;
    return (x > y) - (x < y);
}
static __thread void* cl_top_buf = 0; static __thread int64_t cl_top_cap = 0;
/* arrays.py's topk: the k candidates of largest |x| (lower index on ties), ascending */
static int64_t cl_topk(const float* x, const int32_t* cand, int64_t m, int64_t k, int32_t* out) {
    if (m <= k) { if (out != cand) memcpy(out, cand, (size_t)m * 4); return m; }
    if (k <= 0) return 0;
    uint64_t* key = (uint64_t*)cl_grow(&cl_top_buf, &cl_top_cap, m * 8);
    if (!key) return -1;
    for (int64_t i = 0; i < m; ++i) {
        uint32_t b; memcpy(&b, x + cand[i], 4);
        key[i] = ((uint64_t)(b & 0x7FFFFFFFu) << 32) | (uint32_t)~(uint32_t)cand[i];
    }
    cl_select64(key, m, k);
    for (int64_t i = 0; i < k; ++i) out[i] = (int32_t)~(uint32_t)(key[i] & 0xFFFFFFFFu);
    qsort(out, (size_t)k, 4, cl_cmp_i32);
    return k;
}
"""
SEQ_PRELUDE = (_SEQ_HEAD + _SELECT.replace("{B}", "64") + _SELECT.replace("{B}", "32")
               + _SEQ_TAIL)


class _SeqExpr(SeqExpr):
    """ExprC with the sparse operators' scalars: ``threshold(...)``, ``idx.size``."""

    def __init__(self, c: Checked, arr: Any, lens: Dict[str, str]) -> None:
        super().__init__(c, "c", lens, "int64_t")
        self.arr = arr

    def call(self, e: Node) -> str:
        name, args = e.args
        if name == "threshold":
            return (f"cl_threshold({self.arr(args[0])}, n, (double)({self.expr(args[1])}), "
                    f"(double)({self.expr(args[2])}), raw_seed_, step_)")
        return super().call(e)


class _Seq(SeqArrays):
    def __init__(self, c: Checked) -> None:
        self.c = c
        self.lens: Dict[str, str] = {}
        self.ex = _SeqExpr(c, self.arr, self.lens)
        self.lines: List[str] = []
        self.state = [n for n, t in c.globals.items() if t.array]
        self.grad = ""
        self.tmp = 0

    def buffer(self, name: str, ctype_: str, count: str) -> None:
        """A thread-local buffer ``l_name`` for ``count`` elements."""
        self.lines += [f"    static __thread void* b_{name} = 0; static __thread int64_t "
                       f"cap_{name} = 0;",
                       f"    {ctype_}* l_{name} = ({ctype_}*)cl_grow(&b_{name}, &cap_{name}, "
                       f"((int64_t)({count}) + 1) * (int64_t)sizeof({ctype_}));",
                       f"    if (!l_{name}) return 5;"]

    def array_op(self, name: str, e: Node) -> None:
        """``name = filter/topk/gather(...)`` into a buffer, with ``len_name``."""
        op, args = e.args
        ln = self.lines
        if op == "filter":
            x = self.arr(args[0])
            f = self.c.funcs[args[1].args[0]]
            self.buffer(name, "int32_t", self.length(args[0]))
            n, take = self.length(args[0]), f"l_{name}[len_{name}++] = (int32_t)"
            # blocks of 64 asked first whether any entry passes (an OR the compiler
            # vectorises; at top-k densities most blocks stop there), then walked
            ln += [f"    int64_t len_{name} = 0, i_ = 0;",
                   f"    for (; i_ + 64 <= {n}; i_ += 64) {{",
                   "        int any_ = 0;",
                   "        for (int64_t j_ = i_; j_ < i_ + 64; ++j_)",
                   f"            any_ |= u_{f.name}(c, {x}[j_], j_) != 0;",
                   "        if (!any_) continue;",
                   "        for (int64_t j_ = i_; j_ < i_ + 64; ++j_)",
                   f"            if (u_{f.name}(c, {x}[j_], j_)) {take}j_;",
                   "    }",
                   f"    for (; i_ < {n}; ++i_)",
                   f"        if (u_{f.name}(c, {x}[i_], i_)) {take}i_;"]
        elif op == "topk":
            cand = args[1]
            if cand.kind == "call":
                self.tmp += 1
                tname = f"t{self.tmp}_"
                self.array_op(tname, cand)
                cand = Node("var", (tname,), cand.line, cand.col)
                self.lens[tname] = f"len_{tname}"
            cn, cl = self.arr(cand), self.length(cand)
            k = f"(int64_t)({self.ex.expr(args[2])})"
            self.buffer(name, "int32_t", cl)
            ln += [f"    int64_t len_{name} = cl_topk({self.arr(args[0])}, {cn}, {cl}, {k}, "
                   f"l_{name});",
                   f"    if (len_{name} < 0) return 5;"]
        elif op == "gather":
            idx = self.arr(args[1])
            self.buffer(name, "float", self.length(args[1]))
            ln += [f"    const int64_t len_{name} = {self.length(args[1])};",
                   f"    for (int64_t i_ = 0; i_ < len_{name}; ++i_) l_{name}[i_] = "
                   f"{self.arr(args[0])}[{idx}[i_]];"]
        else:
            raise self.c.prog.error(f"an array is made by map, filter, topk or gather, not "
                                    f"{op}", e)
        self.lens[name] = f"len_{name}"

    def state_loop(self, target: str, call: str) -> None:
        self.lines += ["    for (int64_t i_ = 0; i_ < n; ++i_) {",
                       f"        s_{target}[i_] = {call};",
                       "    }"]

    def scatter_loop(self, count: str, store: str) -> None:
        self.lines.append(f"    for (int64_t i_ = 0; i_ < {count}; ++i_) {store}")

    def scalar(self, s: Node) -> None:
        self.lines += self.ex.stmt(s, "    ", None)

    def encode(self) -> None:
        f = self.c.encode
        self.grad, out_name = f.params[0][1], f.params[1][1]
        ln = self.lines
        ln.append("int cl_sencode(const float* g, int64_t n, const double* params, uint8_t* "
                  "extra, float** state, uint32_t seed, uint32_t raw_seed_, int64_t step_, "
                  "int64_t* lens, const uint8_t** ptrs) {")
        ln.append("    ctx_t C_; memset(&C_, 0, sizeof C_); ctx_t* c = &C_; c->seed = seed;")
        ln.append("    (void)raw_seed_; (void)step_;")
        for k, (pn, pt, _, _) in enumerate(self.c.params):
            ln.append(f"    c->p_{pn} = ({ctype(pt)})params[{k}];")
        for j, name in enumerate(self.state):
            ln.append(f"    float* restrict s_{name} = state[{j}];")
        ln.append("    if (cl_any_nonfinite(g, n)) return 1;")
        ln.append("    cl_bad_ratio = 0;")
        ln.append("    const int64_t l_step = step_;")
        self.ex.locals = [{"step"}]
        self.ex.args = set()
        for s in f.body.args[0]:
            self.stmt(s, out_name)
        ln += ["    return 0;", "}"]

    def concat(self, e: Node) -> None:
        ln = self.lines
        lay = layout(e.args[1])
        ln.append("    if (cl_bad_ratio) return 6;")
        ln += write_extra_fields(lay, self.ex, "memcpy")
        for j, a in self.concat_arrays(lay):
            ln += [f"    lens[{j}] = {self.length(a)} * 4;",
                   f"    ptrs[{j}] = (const uint8_t*){self.arr(a)};"]

    def decode(self) -> None:
        f = self.c.decode
        out_name = f.params[1][1]
        self.lens.clear()  # encode's arrays are not decode's
        self.grad = ""
        ln = self.lines
        ln.append("int cl_decode(const uint8_t* extra, int64_t extra_len, const uint8_t* body, "
                  "int64_t body_len, float* out, int64_t n, const double* params) {")
        ln.append("    ctx_t C_; memset(&C_, 0, sizeof C_); ctx_t* c = &C_;")
        for k, (pn, pt, _, _) in enumerate(self.c.params):
            ln.append(f"    c->p_{pn} = ({ctype(pt)})params[{k}];")
        arrays = {}
        for s in f.body.args[0]:
            if s.kind == "decl" and s.args[0].array:
                for d in s.args[1]:
                    arrays[d.args[0]] = s.args[0]
        self.ex.locals = [set(arrays)]
        self.ex.args = set()
        for s in f.body.args[0]:
            if s.kind == "decl" and s.args[0].array:
                continue
            if s.kind == "expr_stmt" and s.args[0].args[0] == "extract":
                self.extract(s.args[0], arrays)
            elif s.kind == "assign" and s.args[0].args[0] == out_name:
                idx, vals, ii, vv = self.scatter_output(s.args[2])
                ln += [f"    if ({self.length(idx)} != {self.length(vals)}) return 3;",
                       "    memset(out, 0, (size_t)n * sizeof(float));",
                       "    int64_t prev_ = -1;",
                       f"    for (int64_t i_ = 0; i_ < {self.length(idx)}; ++i_) {{",
                       f"        const int64_t j_ = {ii}[i_];",
                       "        if (j_ <= prev_ || j_ >= n) return 4;",
                       f"        out[j_] = {vv}[i_];",
                       "        prev_ = j_;",
                       "    }"]
            else:
                ln += self.ex.stmt(s, "    ", None)
        ln += ["    return 0;", "}"]

    def extract(self, e: Node, arrays: Dict[str, Type]) -> None:
        ln = self.lines
        lay = layout(e.args[1][1:])
        ln += read_extra_fields(lay, self.ex, "return {};", "memcpy", "int64_t")
        for j, name, t, count in counted_arrays(self.c, lay):
            ct = ctype(t.elem())
            cnt = f"cnt_{name}"
            if j:
                ln.append("    off_ = (off_ + 7) / 8 * 8;")
            ln += [f"    const int64_t {cnt} = (int64_t)({self.ex.expr(count)});",
                   f"    if ({cnt} < 0 || {cnt} > n || off_ + {cnt} * {_size(t.elem())} > "
                   "body_len) return 3;",
                   f"    const {ct}* l_{name} = (const {ct}*)(body + off_); off_ += {cnt} * "
                   f"{_size(t.elem())};"]
            self.lens[name] = cnt


def render_seq(c: Checked) -> str:
    """The C source of a program with state arrays or sparse operators (module docstring).

    Raises:
        CompllError: a construct this target does not compile (located).
    """
    r = _Seq(c)
    parts = [PRELUDE, SEQ_PRELUDE, ctx_struct(c)]
    for name, f in c.funcs.items():
        if name not in ("encode", "decode"):
            parts.append(r.ex.function(f, "CL_INLINE"))
    r.encode()
    if c.decode is not None:
        r.decode()
    parts.append("\n".join(r.lines))
    return "\n".join(parts) + "\n"


class SeqNativeProgram(NativeRunner):
    """The generated C of a sparse program, built (or cached) and loaded with ctypes.

    Attributes:
        compile_s: seconds spent building (0 from the cache).
        cache_hit: True when the library came from the cache.
    """

    def __init__(self, c: Checked) -> None:
        from .. import _native
        self.c = c
        self.source = render_seq(c)
        self.n_state = sum(1 for t in c.globals.values() if t.array)
        self.n_arrays = len(layout(_concat_args(c)).arrays)
        t0 = time.perf_counter()
        stem = self._stem(c)
        self.lib, self.cache_hit = _native.build_shared(self.source, stem)
        self.compile_s = 0.0 if self.cache_hit else time.perf_counter() - t0
        p, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
        self.lib.cl_sencode.argtypes = [p, i64, p, p, p, u32, u32, i64, p, p]
        self.lib.cl_sencode.restype = ctypes.c_int
        self._bind_decode()

    def encode_arrays(self, g: torch.Tensor, state: Dict[str, torch.Tensor],
                      params: Dict[str, Any], raw_seed: int, step: int, seed: int = 0):
        """Run encode on flat float32 ``g`` with the flat float32 state arrays (in place).

        Returns:
            (the header extra bytes, the body as a uint8 tensor).

        Raises:
            ValueError: NaN/Inf in ``g`` (the standard message), or out of memory.
        """
        names = [n for n, t in self.c.globals.items() if t.array]
        sp = (ctypes.c_void_p * max(len(names), 1))(*[state[k].data_ptr() for k in names])
        lay = layout(_concat_args(self.c))
        extra = ctypes.create_string_buffer(max(lay.extra_nbytes, 1))
        lens = (ctypes.c_int64 * max(self.n_arrays, 1))()
        ptrs = (ctypes.c_void_p * max(self.n_arrays, 1))()
        rc = self.lib.cl_sencode(g.data_ptr(), g.numel(), self._params(params), extra, sp,
                                 seed & 0xFFFFFFFF, raw_seed & 0xFFFFFFFF, step, lens, ptrs)
        _raise(rc, self.c, g)
        parts = []
        for j in range(self.n_arrays):
            nb = int(lens[j])
            buf = (ctypes.c_uint8 * nb).from_address(ptrs[j]) if nb else None
            parts.append(torch.frombuffer(buf, dtype=torch.uint8).clone() if nb else
                         torch.zeros(0, dtype=torch.uint8))
        return extra.raw[:lay.extra_nbytes], assemble_body(parts)

    def decode(self, extra: bytes, body: torch.Tensor, out: torch.Tensor,
               params: Dict[str, Any]) -> None:
        """Decode into flat float32 ``out``.

        Raises:
            ValueError: a short or inconsistent payload, or bad indices.
        """
        buf = ctypes.create_string_buffer(bytes(extra), max(len(extra), 1))
        body = body.contiguous()
        rc = self.lib.cl_decode(ctypes.addressof(buf), len(extra), body.data_ptr(),
                                body.numel(), out.data_ptr(), out.numel(), self._params(params))
        _raise(rc, self.c, None)


def _concat_args(c: Checked) -> List[Node]:
    node = next((s.args[2] for s in c.encode.body.args[0] if s.kind == "assign" and
                 s.args[2].kind == "call" and s.args[2].args[0] == "concat"), None)
    if node is None:
        raise c.prog.error("encode never calls concat(...)", c.encode.node)
    return node.args[1]


def _raise(rc: int, c: Checked, g: Optional[torch.Tensor]) -> None:
    if rc == 0:
        return
    if rc == 1 and g is not None:
        from ..base import check_gradient
        check_gradient(g, nonfinite="always")
    msg = {1: "NaN or Inf in the gradient", 3: "the payload is shorter than the program reads "
           "or its arrays disagree in length", 4: "indices outside [0, n) or not strictly "
           "increasing", 5: "out of memory", 6: "threshold's density or sample_ratio outside "
           "(0, 1]"}.get(rc, f"error {rc}")
    raise ValueError(f"{c.prog.filename}: {msg}")
