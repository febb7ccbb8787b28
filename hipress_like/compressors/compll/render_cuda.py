"""CompLL's CUDA renderer for GPUs (``cuda_runners`` runs what it renders).

The same lowered tree as the C target (``lower``), cut into kernels run in
order on one stream:

- ``cl_<e>_init``: params into the context struct (device memory), body
  offsets, the reductions' identities;
- one kernel per fused loop group: a grid-stride sweep, flat (thread per
  element) or planar (thread per byte j, its fields k = elements k*m + j,
  the HiPress map operator writing packed codes); reductions go warp by warp
  (``__shfl_down_sync``) into one atomic per warp: min/max by compare-and-swap,
  integer sums by 64-bit atomicAdd, double sums by atomicAdd (exact for the
  integer-valued sums the shipped programs use, order-dependent otherwise);
- one single-thread kernel per run of scalar statements (the program's
  scalar glue: a few flops), which also writes concat's header fields or
  reads extract's;
- decode's output map: a thread per element, reading its planar field.

Entry-point scalars live in the context so they outlive a kernel. The
generated source is compile-checked with ``nvcc -ptx`` in the tests on any
machine with nvcc; ``cuda_runners.CudaProgram`` loads it with ``cupy.RawModule``
where a GPU exists (bench/gpu_check.py). Both compile with ``--fmad=false``: a fused
multiply-add rounds once where the CPU rounds twice, and payloads must match
the CPU's bytes. The CUDA encode does not test for NaN/Inf (the caller does).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

from .checker import Checked
from .interp import layout
from .lower import ExprC, Loop, Lowered, ctype, lower, reduction
from .prelude import CUDA_PRELUDE
from .prelude import ctx_locals as _ctx_locals
from .render_base import LoopRenderer, read_extra_fields, write_extra_fields
from .render_c import _concat, _source
from .syntax import Node, Type

__all__ = ["render_cuda"]

PRELUDE = CUDA_PRELUDE

_BIG = {"float": "3.402823466e+38f", "double": "1.7976931348623157e+308",
        "int32_t": "2147483647", "int64_t": "9223372036854775807LL"}


class _Cuda(LoopRenderer):
    def __init__(self, c: Checked) -> None:
        self.c = c
        self.ex = ExprC(c, "cuda")
        self.kernels: Dict[str, List[str]] = {"encode": [], "decode": []}
        self.src: List[str] = []

    def _array_elem(self, n: Node, ty: Optional[Type]) -> str:
        if ty is None or (ty.name == "uint" and ty.bits != 8):
            raise self.c.prog.error("only the gradient, map(...) and range(n) are swept by "
                                    "the CUDA target", n)
        return f"((const {ctype(ty.elem()) if ty.name != 'uint' else 'uint8_t'}*)(body + " \
            f"c->off_{n.args[0]}))[i_]"

    def _sig(self, which: str) -> str:
        if which == "encode":
            return ("ctx_t* c, const float* g, long long n, const double* params, uint8_t* "
                    "extra, uint8_t* body, unsigned int seed")
        return ("ctx_t* c, const uint8_t* extra, long long extra_len, const uint8_t* body, "
                "long long body_len, float* out, long long n, const double* params")

    def _kernel(self, which: str, body: List[str], single: bool) -> None:
        k = f"cl_{which}_{len(self.kernels[which])}"
        self.kernels[which].append(k + (":1" if single else ":n"))
        head = f'extern "C" __global__ void {k}({self._sig(which)}) {{'
        if single:
            body = ["    if (blockIdx.x != 0 || threadIdx.x != 0) return;"] + body
        self.src += [head, "    (void)params;"] + body + ["}"]

    def group(self, which: str, items: List[Loop], grad: str) -> None:
        init = []
        for x in items:
            if x.kind == "reduce":
                init.append(f"    c->{x.target} = {_identity(x)};")
        if init:
            self._kernel(which, init, True)
        packed = [x for x in items if x.kind == "map" and x.packed_bits is not None]
        lines = ["    const long long stride_ = (long long)gridDim.x * blockDim.x;",
                 "    const long long t0_ = (long long)blockIdx.x * blockDim.x + threadIdx.x;"]
        accs = []
        for x in items:
            if x.kind == "reduce":
                lines.append(f"    {ctype(x.ty)} a_{x.target} = {_identity(x)};")
                accs.append(x)
        uses_grad = any(_source(x) == grad for x in items)
        if packed:
            pk = packed[0]
            bits = pk.packed_bits
            if isinstance(bits, int):
                lines += self._planar(items, pk, bits, grad, uses_grad)
            else:
                lines.append(f"    switch (c->p_{bits}) {{")
                for b in (1, 2, 4, 8):
                    lines.append(f"    case {b}: {{")
                    lines += ["    " + x for x in self._planar(items, pk, b, grad, uses_grad)]
                    lines.append("        break; }")
                lines.append("    default: c->err = 2; return;")
                lines.append("    }")
        else:
            ln = self._length(items[0])
            lines.append(f"    for (long long i_ = t0_; i_ < {ln}; i_ += stride_) {{")
            lines += self._element(items, grad, uses_grad, "        ", None)
            lines.append("    }")
        for x in accs:
            ct = ctype(x.ty)
            op = reduction(x)
            t = x.target
            if op == "sum":
                if ct == "double":
                    lines.append(f"    {{ double v_ = cl_warp_sumd(a_{t}); if ((threadIdx.x & 31) "
                                 f"== 0) atomicAdd(&c->{t}, v_); }}")
                else:
                    lines.append(f"    {{ long long v_ = cl_warp_sumi((long long)a_{t}); if "
                                 f"((threadIdx.x & 31) == 0) atomicAdd((unsigned long long*)"
                                 f"&c->{t}, (unsigned long long)v_); }}")
            else:
                kind = "min" if op == "min" else "max"
                if ct in ("float", "double"):
                    d = "d" if ct == "double" else ""
                    lines.append(f"    {{ {ct} v_ = cl_warp_{kind}{d}(a_{t}); if ((threadIdx.x "
                                 f"& 31) == 0) cl_atomic_{kind}{d}(&c->{t}, v_); }}")
                else:
                    lines.append(f"    atomic{kind.capitalize()}((long long*)&c->{t}, "
                                 f"(long long)a_{t});")
        self._kernel(which, lines, False)
        fold = []
        for x in items:
            if x.kind == "reduce" and len(x.node.args[1]) == 3:
                init_n = x.node.args[1][1]
                v = self.ex.conv(self.ex.expr(init_n), init_n.ty, x.ty)
                op = {"sum": "+", "min": "<", "max": ">", "maxabs": ">"}[reduction(x)]
                t = f"c->{x.target}"
                fold.append(f"    {t} = {t} + {v};" if op == "+" else
                            f"    {t} = ({t} {op} {v}) ? {t} : {v};")
        if fold:
            self._kernel(which, fold, True)

    def _element(self, items: List[Loop], grad: str, uses_grad: bool, ind: str,
                 code_var: Any) -> List[str]:
        out = []
        if uses_grad:
            out.append(f"{ind}const float x_ = g[i_];")
        return out + self._element_stmts(items, grad, ind, code_var)

    def _planar(self, items: List[Loop], pk: Loop, bits: int, grad: str,
                uses_grad: bool) -> List[str]:
        per, mask = 8 // bits, (1 << bits) - 1
        n = self._length(items[0])
        out = [f"    {{ const long long m_ = {n} / {per};",
               f"    uint8_t* q_ = body + c->off_{pk.target};",
               "    for (long long j_ = t0_; j_ <= m_; j_ += stride_) {",
               f"        if (j_ == m_ && {n} == m_ * {per}) break;",
               "        uint32_t byte_ = 0;",
               f"        for (int k_ = 0; k_ < {per}; ++k_) {{",
               f"            const long long i_ = j_ < m_ ? (long long)k_ * m_ + j_ : m_ * {per} "
               "+ k_;",
               "            uint32_t code_ = 0;",
               f"            if (i_ < {n}) {{"]
        out += self._element(items, grad, uses_grad, "                ", "code_")
        out.append("            }")
        margs = pk.node.args[1]
        if len(margs) == 3:
            fn = self.c.funcs[margs[1].args[0]]
            pad = self.ex.conv(self.ex.expr(margs[2]), margs[2].ty, fn.params[0][0])
            out.append(f"            else code_ = (uint32_t)(u_{fn.name}(c, {pad}, i_));")
        out += [f"            byte_ |= (code_ & {mask}u) << (k_ * {bits});",
                "        }",
                "        q_[j_] = (uint8_t)byte_;",
                "    } }"]
        return out

    INT64 = "long long"

    def _acc(self, x: Loop) -> str:
        return f"a_{x.target}"

    def _store(self, x: Loop) -> str:
        return f"(body + c->off_{x.target})"

    def encode(self, low: Lowered) -> None:
        f = low.func
        grad, out_name = f.params[0][1], f.params[1][1]
        self.arrays = low.arrays
        self.ex.in_ctx = set(_ctx_locals(f))
        self.ex.locals = [set()]
        concat = _concat(f.body, out_name)
        lay = layout(concat.args[1])
        init = ["    c->err = 0; c->seed = seed;"]
        init += [f"    c->p_{pn} = ({ctype(pt)})params[{k}];"
                 for k, (pn, pt, _, _) in enumerate(self.c.params)]
        init.append("    long long off_ = 0;")
        for a, _t in lay.arrays:
            t = low.arrays[a.args[0]]
            init.append(f"    c->off_{a.args[0]} = off_; off_ += {self._nbytes(t)};")
        for name in low.arrays:
            if name not in [a.args[0] for a, _ in lay.arrays]:
                raise self.c.prog.error(f"array {name!r} is not in concat: the CUDA target keeps "
                                        "arrays in the payload body", f.node)
        self._kernel("encode", init, True)
        scal: List[str] = []
        for op in low.ops:
            if isinstance(op, list):
                if scal:
                    self._kernel("encode", scal, True)
                    scal = []
                self.group("encode", op, grad)
            elif op.kind == "assign" and op.args[0].args[0] == out_name:
                scal += write_extra_fields(lay, self.ex, "cl_memcpy")
            else:
                scal += self.ex.stmt(op, "    ", None)
        if scal:
            self._kernel("encode", scal, True)

    def decode(self, low: Lowered) -> None:
        f = low.func
        out_name = f.params[1][1]
        self.arrays = low.arrays
        self.ex.in_ctx = set(_ctx_locals(f))
        self.ex.locals = [set(low.arrays) | set(self.ex.in_ctx)]
        scal = ["    c->err = 0;"] + [f"    c->p_{pn} = ({ctype(pt)})params[{k}];"
                                       for k, (pn, pt, _, _) in enumerate(self.c.params)]
        for op in low.ops:
            if isinstance(op, list):
                if scal:
                    self._kernel("decode", scal, True)
                    scal = []
                self.group("decode", op, "")
            elif op.kind == "decl" and op.args[0].array:
                continue
            elif op.kind == "expr_stmt":
                e = op.args[0]
                lay = layout(e.args[1][1:])
                scal += read_extra_fields(lay, self.ex, "{{ c->err = {}; return; }}",
                                          "cl_memcpy", "long long")
                for a, t in lay.arrays:
                    if t.name == "uint" and t.bits != 8:
                        b = self.bits_expr(t)
                        scal.append(f"    if (!cl_valid_bits({b})) {{ c->err = 2; return; }}")
                        scal.append(f"    c->bits_{a.args[0]} = {b};")
                    scal.append(f"    c->off_{a.args[0]} = off_; off_ += "
                                f"{self._nbytes(t)};")
                scal.append("    if (off_ > body_len) { c->err = 3; return; }")
            elif op.kind == "assign" and op.args[0].args[0] == out_name:
                if scal:
                    self._kernel("decode", scal, True)
                    scal = []
                self._out_map(op.args[2])
            else:
                scal += self.ex.stmt(op, "    ", None)
        if scal:
            self._kernel("decode", scal, True)

    def _out_map(self, e: Node) -> None:
        src, fn = e.args[1][0], e.args[1][1]
        f = self.c.funcs[fn.args[0]]
        pt = f.params[0][0]
        st = self.arrays.get(src.args[0]) if src.kind == "var" else None
        lines = ["    if (c->err) return;",
                 "    const long long stride_ = (long long)gridDim.x * blockDim.x;",
                 "    const long long t0_ = (long long)blockIdx.x * blockDim.x + threadIdx.x;"]
        if st is not None and st.name == "uint" and st.bits != 8:
            q = f"(body + c->off_{src.args[0]})"
            call = f"u_{f.name}(c, {self.ex.conv('code_', Type('int32'), pt)}, i_)"
            val = self.ex.conv(call, f.ret, Type("float"))
            lines += [f"    const int b_ = c->bits_{src.args[0]}; const int per_ = 8 / b_; "
                      "const uint32_t mask_ = (1u << b_) - 1u;",
                      "    const long long m_ = n / per_;",
                      "    for (long long i_ = t0_; i_ < n; i_ += stride_) {",
                      "        const long long j_ = i_ < m_ * per_ ? i_ % m_ : m_;",
                      "        const int k_ = i_ < m_ * per_ ? (int)(i_ / m_) : (int)(i_ - m_ * "
                      "per_);",
                      f"        const int32_t code_ = ({q}[j_] >> (k_ * b_)) & mask_;",
                      f"        out[i_] = {val};",
                      "    }"]
        else:
            val = f"u_{f.name}(c, {self.ex.conv(self.elem(src, ''), src.ty.elem(), pt)}, i_)"
            lines += ["    for (long long i_ = t0_; i_ < n; i_ += stride_) {",
                      f"        out[i_] = {self.ex.conv(val, f.ret, Type('float'))};",
                      "    }"]
        self._kernel("decode", lines, False)


def _identity(x: Loop) -> str:
    """The identity of reduction ``x`` (0 for sums, the type's extreme for min/max)."""
    ct, op = ctype(x.ty), reduction(x)
    if op in ("sum", "maxabs"):
        return "0"
    return _BIG[ct] if op == "min" else "-" + _BIG[ct]


def _ctx(c: Checked, r: _Cuda, lows: List[Lowered]) -> str:
    fields = ["    int err;", "    unsigned int seed;"]
    fields += [f"    {ctype(pt)} p_{pn};" for pn, pt, _, _ in c.params]
    fields += [f"    {ctype(t)} g_{n};" for n, t in c.globals.items() if not t.array]
    seen: Set[str] = set()
    for low in lows:
        for n, t in _ctx_locals(low.func).items():
            if n not in seen:
                seen.add(n)
                fields.append(f"    {ctype(t)} l_{n};")
        for a in low.arrays:
            if a not in seen:
                seen.add(a)
                fields.append(f"    long long off_{a}; int bits_{a};")
        for item in low.ops:
            if isinstance(item, list):
                for x in item:
                    if x.kind == "reduce":
                        fields.append(f"    {ctype(x.ty)} {x.target};")
    return "typedef struct {\n" + "\n".join(fields) + "\n} ctx_t;\n"


def _temps_in_ctx(ex: ExprC) -> None:
    """Reduction results live in the context (they outlive their kernel)."""
    for k, v in ex.temps.items():
        if not v.startswith("c->"):
            ex.temps[k] = "c->" + v


def render_cuda(c: Checked) -> Dict[str, Any]:
    """CUDA source of ``c`` and its kernel schedule.

    Returns:
        ``{"source": str, "encode": [...], "decode": [...]}``: the kernels in launch
        order, each ``"name:1"`` (one thread) or ``"name:n"`` (a grid over the gradient).

    Raises:
        CompllError: a construct the CUDA target does not compile (located).
    """
    from .checker import is_sparse
    if is_sparse(c):  # state arrays, sparse operators: statement by statement
        from .render_cuda_seq import render_cuda_seq
        return render_cuda_seq(c)
    if c.rounds:  # @rounds(k): one block-cooperative kernel per entry point
        from .render_cuda_rounds import render_cuda_rounds
        return render_cuda_rounds(c)
    r = _Cuda(c)
    funcs = [r.ex.function(f, "CL_INLINE") for name, f in c.funcs.items()
             if name not in ("encode", "decode")]
    lows = [lower(c, c.encode, r.ex, c.encode.params[1][1])]
    _temps_in_ctx(r.ex)
    r.encode(lows[0])
    if c.decode is not None:
        lows.append(lower(c, c.decode, r.ex, c.decode.params[1][1]))
        _temps_in_ctx(r.ex)
        r.decode(lows[1])
    src = "\n".join([PRELUDE, _ctx(c, r, lows)] + funcs + r.src) + "\n"
    return {"source": src, "encode": r.kernels["encode"], "decode": r.kernels["decode"]}
