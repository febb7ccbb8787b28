"""CompLL's C renderer for CPUs, and the loaded library (``NativeProgram``).

One C file per program: a context struct (globals, params, the RNG seed),
one ``static inline`` function per user function, and two entry points,

    int cl_encode(const float* g, int64_t n, const double* params,
                  uint8_t* extra, uint8_t* body, int64_t body_len, uint32_t seed)
    int cl_decode(const uint8_t* extra, int64_t extra_len, const uint8_t* body,
                  int64_t body_len, float* out, int64_t n, const double* params)

returning 0, or 1 (NaN/Inf in the gradient), 2 (a width outside 1, 2, 4, 8),
3 (a body shorter than the program reads). Loops come from ``lower``: each
fused group is one sweep; a group that packs sub-byte codes walks the
planar layout with the field loop fully unrolled, once per possible width
when the width is a parameter (``switch``), so the compiler vectorises it.
The file compiles under ``finite-math-only`` and ``no-signed-zeros`` (so
min/max reductions vectorise; rounding is unchanged, contraction stays off);
the gradient's NaN/Inf are caught by an integer test of the exponent bits in
the first sweep over it. Sweeps of at least 2**20 elements split across
``torch.get_num_threads()`` OpenMP threads (as the hand-written kernels split
theirs) unless a reduction is a floating-point sum, whose rounding would then
depend on the split: min, max and integer sums are exact in any order, so the
bytes do not depend on the thread count. The file is built by
``_build.native.build_shared`` (the project's compiler, flags and hash cache).
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import Any, Dict, List, Optional

import torch

from .checker import Checked
from .interp import layout
from .lower import ExprC, Loop, Lowered, ctype, lower, reduction
from .prelude import C_PRELUDE, ctx_struct
from .render_base import LoopRenderer, NativeRunner, read_extra_fields, write_extra_fields
from .syntax import Node, Type

__all__ = ["render_c", "NativeProgram", "PRELUDE"]

PRELUDE = C_PRELUDE

_INIT = {("min", "float"): "FLT_MAX", ("min", "double"): "DBL_MAX",
         ("max", "float"): "(-FLT_MAX)", ("max", "double"): "(-DBL_MAX)",
         ("min", "int32_t"): "INT32_MAX", ("max", "int32_t"): "INT32_MIN",
         ("min", "int64_t"): "INT64_MAX", ("max", "int64_t"): "INT64_MIN"}


_OMP_OP = {"sum": "+", "min": "min", "max": "max", "maxabs": "max"}


class _Render(LoopRenderer):
    def __init__(self, c: Checked, target: str = "c") -> None:
        self.c = c
        self.ex = ExprC(c, target)
        self.lines: List[str] = []
        self.checked_finite = False

    # ------------------------------------------------------------ elements
    def _array_elem(self, n: Node, ty: Optional[Type]) -> str:
        name = n.args[0]
        if ty is None:
            raise self.c.prog.error(f"{name!r} is not an array made in this function", n)
        if ty.name == "uint" and ty.bits != 8:
            raise self.c.prog.error("reading a packed sub-byte array elementwise is only "
                                    "compiled in decode's output map", n)
        return f"l_{name}[i_]"

    # ------------------------------------------------------------ encode
    def group(self, items: List[Loop], grad: str, ind: str) -> None:
        packed = [x for x in items if x.kind == "map" and x.packed_bits is not None]
        uses_grad = any(_source(x) == grad for x in items)
        check = uses_grad and not self.checked_finite
        if check:
            self.checked_finite = True
        for x in items:
            if x.kind == "reduce":
                ct = ctype(x.ty)
                op = reduction(x)
                init = "0" if op in ("sum", "maxabs") else _INIT[(op, ct)]
                self.lines.append(f"{ind}{ct} {x.target} = {init};")
        if check:
            self.lines.append(f"{ind}uint32_t nf_ = 0;")
        if packed:
            bits = packed[0].packed_bits
            if isinstance(bits, int):
                self._planar(items, packed[0], bits, grad, check, ind)
            else:
                bexpr = f"c->p_{bits}"
                self.lines.append(f"{ind}switch ({bexpr}) {{")
                for b in (1, 2, 4, 8):
                    self.lines.append(f"{ind}case {b}: {{")
                    self._planar(items, packed[0], b, grad, check, ind + "    ")
                    self.lines.append(f"{ind}    break; }}")
                self.lines.append(f"{ind}default: return 2;")
                self.lines.append(f"{ind}}}")
        else:
            self._flat(items, grad, check, ind)
        if check:
            self.lines.append(f"{ind}if (nf_) return 1;")
        for x in items:  # a 3-argument reduce folds its initial value in
            if x.kind == "reduce" and len(x.node.args[1]) == 3:
                init = x.node.args[1][1]
                v = self.ex.conv(self.ex.expr(init), init.ty, x.ty)
                op = {"sum": "+", "min": "<", "max": ">", "maxabs": ">"}[reduction(x)]
                if op == "+":
                    self.lines.append(f"{ind}{x.target} = {x.target} + {v};")
                else:
                    self.lines.append(f"{ind}{x.target} = ({x.target} {op} {v}) ? {x.target} : "
                                      f"{v};")

    def _element(self, items: List[Loop], grad: str, check: bool, ind: str,
                 code_var: Optional[str] = None) -> List[str]:
        out = []
        if any(_source(x) == grad for x in items):
            out.append(f"{ind}const float x_ = g[i_];")
            if check:
                out.append(f"{ind}{{ uint32_t b_; memcpy(&b_, &x_, 4); "
                           "nf_ |= (b_ & 0x7F800000u) == 0x7F800000u; }")
        return out + self._element_stmts(items, grad, ind, code_var)

    def _omp(self, items: List[Loop], check: bool, trips: str) -> str:
        """An OpenMP pragma splitting the sweep across threads, or "" when a reduction
        is a floating-point sum (its rounding would depend on the split)."""
        red = []
        for x in items:
            if x.kind != "reduce":
                continue
            op = reduction(x)
            if op == "sum" and x.ty.name in ("float", "double"):
                return ""
            red.append(f"reduction({_OMP_OP[op]}:{x.target})")
        if check:
            red.append("reduction(|:nf_)")
        return (f"_Pragma(\"omp parallel for schedule(static) num_threads(cl_threads) "
                f"{' '.join(red)} if(n >= CL_PARALLEL && cl_threads > 1)\") ")

    def _flat(self, items: List[Loop], grad: str, check: bool, ind: str) -> None:
        n = self._length(items[0])
        omp = self._omp(items, check, n) if n == "n" else ""
        self.lines.append(f"{ind}{omp}for (int64_t i_ = 0; i_ < {n}; ++i_) {{")
        self.lines += self._element(items, grad, check, ind + "    ")
        self.lines.append(f"{ind}}}")

    def _planar(self, items: List[Loop], pk: Loop, bits: int, grad: str, check: bool,
                ind: str) -> None:
        per, mask = 8 // bits, (1 << bits) - 1
        q = f"l_{pk.target}"
        n = self._length(items[0])
        ln = self.lines
        ln.append(f"{ind}{{ const int64_t m_ = {n} / {per};")
        # blocks of bytes, one plane (field k) at a time: each inner loop is a contiguous,
        # vectorisable sweep, and the block of bytes stays in L1 across the planes
        omp = self._omp(items, check, "m_") if n == "n" else ""
        ln.append(f"{ind}{omp}for (int64_t j0_ = 0; j0_ < m_; j0_ += 2048) {{")
        ln.append(f"{ind}    const int64_t jn_ = m_ - j0_ < 2048 ? m_ - j0_ : 2048;")
        # a private copy of the context: inside an OpenMP region gcc otherwise cannot
        # tell the stores from the context's loads and does not vectorise
        ln.append(f"{ind}    const ctx_t cx_ = *c; const ctx_t* const c = &cx_;")
        ln.append(f"{ind}    uint8_t* restrict q_ = {q} + j0_;")
        ln.append(f"{ind}    for (int k_ = 0; k_ < {per}; ++k_) {{")
        ln.append(f"{ind}        const float* restrict gk_ = g + (int64_t)k_ * m_ + j0_;"
                  if any(_source(x) == grad for x in items) else f"{ind}        ;")
        ln.append(f"{ind}        for (int64_t jj_ = 0; jj_ < jn_; ++jj_) {{")
        ln.append(f"{ind}            const int64_t i_ = (int64_t)k_ * m_ + j0_ + jj_; "
                  "uint32_t code_;")
        ln += [x.replace("g[i_]", "gk_[jj_]") for x in
               self._element(items, grad, check, ind + "            ", "code_")]
        ln.append(f"{ind}            const uint8_t f_ = (uint8_t)((code_ & {mask}u) << "
                  f"(k_ * {bits}));")
        ln.append(f"{ind}            q_[jj_] = k_ ? (uint8_t)(q_[jj_] | f_) : f_;")
        ln.append(f"{ind}        }}")
        ln.append(f"{ind}    }}")
        ln.append(f"{ind}}}")
        ln.append(f"{ind}if ({n} > m_ * {per}) {{")
        ln.append(f"{ind}    uint32_t byte_ = 0;")
        ln.append(f"{ind}    for (int k_ = 0; k_ < {per}; ++k_) {{")
        ln.append(f"{ind}        const int64_t i_ = m_ * {per} + k_; uint32_t code_ = 0;")
        ln.append(f"{ind}        if (i_ < {n}) {{")
        ln += self._element(items, grad, check, ind + "            ", "code_")
        ln.append(f"{ind}        }}")
        margs = pk.node.args[1]
        if len(margs) == 3:  # the padding element of the last byte
            fn = self.c.funcs[margs[1].args[0]]
            pt = fn.params[0][0]
            pad = self.ex.conv(self.ex.expr(margs[2]), margs[2].ty, pt)
            ln.append(f"{ind}        else code_ = (uint32_t)(u_{fn.name}(c, {pad}, i_));")
        ln.append(f"{ind}        byte_ |= (code_ & {mask}u) << (k_ * {bits});")
        ln.append(f"{ind}    }}")
        ln.append(f"{ind}    {q}[m_] = (uint8_t)byte_;")
        ln.append(f"{ind}}} }}")

    # ------------------------------------------------------------ entry points
    def scalar_stmt(self, s: Node, ind: str) -> None:
        self.lines += self.ex.stmt(s, ind, None)

    def encode(self, low: Lowered) -> None:
        f = low.func
        grad, out_name = f.params[0][1], f.params[1][1]
        self.arrays = low.arrays
        ln = self.lines
        ln.append("CL_LOOP int cl_encode(const float* g, int64_t n, const double* params, "
                  "uint8_t* extra, uint8_t* body, int64_t body_len, uint32_t seed) {")
        ln += self._ctx()
        ln.append("    (void)body_len;")
        concat = _concat(f.body, out_name)
        lay = layout(concat.args[1])
        body_arrays = [a.args[0] for a, _ in lay.arrays if a.kind == "var"]
        if len(body_arrays) != len(lay.arrays):
            raise self.c.prog.error("concat's arrays must be named arrays made by map", concat)
        ln.append("    int64_t off_ = 0;")
        for name in body_arrays:
            t = low.arrays[name]
            nb = self._nbytes(t)
            ln.append(f"    uint8_t* l_{name} = body + off_; off_ += {nb};")
        temps = [a for a in low.arrays if a not in body_arrays]
        for name in temps:
            t = low.arrays[name]
            ln.append(f"    static __thread uint8_t* l_{name}_buf = 0; static __thread int64_t "
                      f"l_{name}_cap = 0;")
            ln.append(f"    if (l_{name}_cap < {self._nbytes(t)}) {{ free(l_{name}_buf); "
                      f"l_{name}_buf = (uint8_t*)malloc({self._nbytes(t)}); l_{name}_cap = "
                      f"{self._nbytes(t)}; }}")
            ln.append(f"    uint8_t* l_{name} = l_{name}_buf;")
        self.ex.locals = [set()]
        self.ex.args = set()
        for op in low.ops:
            if isinstance(op, list):
                self.group(op, grad, "    ")
            elif op.kind == "assign" and op.args[0].args[0] == out_name:
                ln += write_extra_fields(lay, self.ex, "memcpy")
            else:
                self.scalar_stmt(op, "    ")
        ln.append("    (void)x_dummy_;" if False else "    return 0;")
        ln.append("}")

    def _ctx(self) -> List[str]:
        out = ["    ctx_t C_; memset(&C_, 0, sizeof C_); ctx_t* c = &C_; c->seed = seed;"
               if "seed" in self._sig else "    ctx_t C_; memset(&C_, 0, sizeof C_); ctx_t* c "
               "= &C_;"]
        for k, (pn, pt, _, _) in enumerate(self.c.params):
            out.append(f"    c->p_{pn} = ({ctype(pt)})params[{k}];")
        for name, t in self.c.globals.items():
            if t.array:
                raise self.c.prog.error(f"global array {name!r} is not compiled yet: declare it "
                                        "inside encode/decode")
        return out

    def decode(self, low: Lowered) -> None:
        f = low.func
        out_name = f.params[1][1]
        self.arrays = low.arrays
        ln = self.lines
        ln.append("CL_LOOP int cl_decode(const uint8_t* extra, int64_t extra_len, const "
                  "uint8_t* body, int64_t body_len, float* out, int64_t n, const double* "
                  "params) {")
        self._sig = "decode"
        ln += self._ctx()
        self.ex.locals = [set(low.arrays)]
        self.ex.args = set()
        for op in low.ops:
            if isinstance(op, list):
                self.group(op, "", "    ")
            elif op.kind == "decl" and not op.args[0].array:
                self.scalar_stmt(op, "    ")
            elif op.kind == "decl":
                continue
            elif op.kind == "expr_stmt":
                self._extract(op.args[0])
            elif op.kind == "assign" and op.args[0].args[0] == out_name:
                self._out_map(op.args[2])
            else:
                self.scalar_stmt(op, "    ")
        ln.append("    return 0;")
        ln.append("}")

    def _extract(self, e: Node) -> None:
        ln = self.lines
        lay = layout(e.args[1][1:])
        ln += read_extra_fields(lay, self.ex, "return {};", "memcpy", "int64_t")
        for a, t in lay.arrays:
            name = a.args[0]
            if t.name == "uint" and t.bits != 8:
                ln.append(f"    if (!cl_valid_bits({self.bits_expr(t)})) return 2;")
            nb = self._nbytes(t)
            ln.append(f"    const uint8_t* l_{name} = body + off_; off_ += {nb};")
        ln.append("    if (off_ > body_len) return 3;")

    def _out_map(self, e: Node) -> None:
        if e.kind != "call" or e.args[0] != "map":
            raise self.c.prog.error("decode's output is assigned map(array, function)", e)
        src, fn = e.args[1][0], e.args[1][1]
        f = self.c.funcs[fn.args[0]]
        pt = f.params[0][0]
        ln = self.lines
        st = self.arrays.get(src.args[0]) if src.kind == "var" else None
        if st is not None and st.name == "uint" and st.bits != 8:
            ln.append(f"    switch ({self.bits_expr(st)}) {{")
            for b in (1, 2, 4, 8):
                per, mask = 8 // b, (1 << b) - 1
                call = f"u_{f.name}(c, {self.ex.conv('code_', Type('int32'), pt)}, i_)"
                val = self.ex.conv(call, f.ret, Type("float"))
                q = f"l_{src.args[0]}"
                # one parallel region over blocks of bytes; planes inside (contiguous runs)
                ln += [f"    case {b}: {{ const int64_t m_ = n / {per};",
                       "        _Pragma(\"omp parallel for schedule(static) "
                       "num_threads(cl_threads) if(n >= CL_PARALLEL && cl_threads > 1)\")",
                       "        for (int64_t j0_ = 0; j0_ < m_; j0_ += 4096) {",
                       "            const int64_t jn_ = m_ - j0_ < 4096 ? m_ - j0_ : 4096;",
                       "            const ctx_t cx_ = *c; const ctx_t* const c = &cx_;",
                       "            float* const ol_ = out; const int64_t ml_ = m_;",
                       f"            for (int k_ = 0; k_ < {per}; ++k_) {{",
                       "                float* restrict o_ = ol_ + (int64_t)k_ * ml_ + j0_;",
                       f"                const uint8_t* restrict q_ = {q} + j0_;",
                       "                for (int64_t j_ = 0; j_ < jn_; ++j_) {",
                       "                    const int64_t i_ = (int64_t)k_ * m_ + j0_ + j_;",
                       f"                    const int32_t code_ = "
                       f"(q_[j_] >> (k_ * {b})) & {mask};",
                       f"                    o_[j_] = {val};",
                       "                }",
                       "            }",
                       "        }",
                       f"        for (int64_t t_ = 0; t_ < n - m_ * {per}; ++t_) {{",
                       f"            const int64_t i_ = m_ * {per} + t_;",
                       f"            const int32_t code_ = ({q}[m_] >> (t_ * {b})) & {mask};",
                       f"            out[i_] = {val};",
                       "        }",
                       "        break; }"]
            ln += ["    default: return 2;", "    }"]
            return
        self.arrays = dict(self.arrays)
        ln.append("    _Pragma(\"omp parallel for schedule(static) num_threads(cl_threads) "
                  "if(n >= CL_PARALLEL && cl_threads > 1)\")")
        ln.append("    for (int64_t i_ = 0; i_ < n; ++i_) {")
        call = f"u_{f.name}(c, {self.ex.conv(self.elem(src, None), src.ty.elem(), pt)}, i_)"
        ln.append(f"        out[i_] = {self.ex.conv(call, f.ret, Type('float'))};")
        ln.append("    }")

    _sig = "encode seed"


def _source(item: Loop) -> Any:
    n = item.node.args[1][0]
    while n.kind == "call" and n.args[0] == "map":
        n = n.args[1][0]
    return n.args[0] if n.kind == "var" else None


def _concat(body: Node, out_name: str) -> Node:
    for s in body.args[0]:
        if s.kind == "assign" and s.args[0].args[0] == out_name:
            e = s.args[2]
            if e.kind == "call" and e.args[0] == "concat":
                return e
            raise _err(e)
    raise ValueError("encode never assigns concat(...) to its output")


def _err(e: Node) -> Exception:
    return ValueError(f"line {e.line}: the output is assigned concat(...)")


def render_c(c: Checked) -> str:
    """The C source of checked program ``c`` (see the module docstring).

    Raises:
        CompllError: a construct the C target does not compile (located).
    """
    from .checker import is_sparse
    if is_sparse(c):  # state arrays, data-dependent payloads: statement by statement
        from .render_seq import render_seq
        return render_seq(c)
    if c.rounds:  # @rounds(k): matrices, entry points per round
        from .render_rounds import render_rounds
        return render_rounds(c)
    r = _Render(c, "c")
    parts = [PRELUDE, "#include <stdlib.h>", ctx_struct(c)]
    for name, f in c.funcs.items():
        if name not in ("encode", "decode"):
            parts.append(r.ex.function(f, "CL_INLINE"))
    enc = lower(c, c.encode, r.ex, c.encode.params[1][1])
    r.encode(enc)
    if c.decode is not None:
        r.checked_finite = True
        dec = lower(c, c.decode, r.ex, c.decode.params[1][1])
        r.decode(dec)
    parts.append("\n".join(r.lines))
    return "\n".join(parts) + "\n"


class NativeProgram(NativeRunner):
    """A program's generated C, built (or taken from the cache) and loaded with ctypes.

    Attributes:
        compile_s: seconds spent building (0 when it came from the cache).
        cache_hit: True when the library was already built for this source and machine.
    """

    def __init__(self, c: Checked) -> None:
        from .._build import native as _native
        self.c = c
        self.source = render_c(c)
        t0 = time.perf_counter()
        stem = self._stem(c)
        # OpenMP waits passively (the cores are shared with torch's own pool): libgomp
        # reads OMP_WAIT_POLICY when the library loads, so it is set only around the load
        saved = os.environ.get("OMP_WAIT_POLICY")
        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
        try:
            self.lib, self.cache_hit = _native.build_shared(self.source, stem, ["-fopenmp"])
        finally:
            if saved is None:
                os.environ.pop("OMP_WAIT_POLICY", None)
        self.lib.cl_set_threads.argtypes = [ctypes.c_int]
        self.lib.cl_set_threads.restype = None
        self.compile_s = 0.0 if self.cache_hit else time.perf_counter() - t0
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.lib.cl_encode.argtypes = [p, i64, p, p, p, i64, ctypes.c_uint32]
        self.lib.cl_encode.restype = ctypes.c_int
        self._bind_decode()

    def encode(self, g: torch.Tensor, extra: torch.Tensor, body: torch.Tensor,
               params: Dict[str, Any], seed: int) -> None:
        """Encode flat float32 ``g`` into the payload's ``extra`` and ``body`` views.

        Raises:
            ValueError: NaN/Inf in ``g`` (the standard message), or a bad width.
        """
        self.lib.cl_set_threads(torch.get_num_threads())
        rc = self.lib.cl_encode(g.data_ptr(), g.numel(), self._params(params),
                                extra.data_ptr(), body.data_ptr(), body.numel(),
                                seed & 0xFFFFFFFF)
        _raise(rc, self.c, g)

    def decode(self, extra: bytes, body: torch.Tensor, out: torch.Tensor,
               params: Dict[str, Any]) -> None:
        """Decode into flat float32 ``out``.

        Raises:
            ValueError: a width outside 1, 2, 4, 8 or a short body in the payload.
        """
        buf = ctypes.create_string_buffer(bytes(extra), max(len(extra), 1))
        self.lib.cl_set_threads(torch.get_num_threads())
        rc = self.lib.cl_decode(ctypes.addressof(buf), len(extra), body.data_ptr(),
                                body.numel(), out.data_ptr(), out.numel(), self._params(params))
        _raise(rc, self.c, None)


def _raise(rc: int, c: Checked, g: Optional[torch.Tensor]) -> None:
    if rc == 0:
        return
    if rc == 1 and g is not None:
        from ..base import check_gradient
        check_gradient(g, nonfinite="always")
    msg = {1: "NaN or Inf in the gradient", 2: "a uint<k> width outside 1, 2, 4, 8",
           3: "the payload is shorter than the program reads"}.get(rc, f"error {rc}")
    raise ValueError(f"{c.prog.filename}: {msg}")
