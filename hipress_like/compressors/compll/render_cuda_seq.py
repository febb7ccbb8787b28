"""CUDA for CompLL programs with state arrays and sparse operators (DGC, GradDrop).

The statement-by-statement counterpart of ``render_seq`` for GPUs: every
statement becomes kernels launched in order on one stream, each either a
single thread (``name:1``, the scalar glue) or a grid-stride sweep
(``name:n``) whose bound is read from the context in device memory, so any
grid runs them and the host never waits for a count:

- ``u = map(u, gradient, f)``: a thread per element (after a NaN/Inf check
  kernel that sets the context's error, which every later kernel obeys);
- ``filter(x, pred)``: stream compaction in three kernels: per-chunk counts
  of the passing elements (a chunk is one block's ``blockDim.x`` elements,
  counted with ``__ballot_sync``/``__popc`` per warp), an exclusive scan of
  the chunk counts (one thread), and the compaction, each block scanning its
  chunk's flags again so the indices stay in ascending order;
- ``threshold(x, density, sample_ratio)``: the sample (the hash positions of
  ``arrays.py``) as 32-bit magnitude keys, then a radix selection of the
  k-th largest: four rounds of an 8-bit digit histogram (``atomicAdd``) over
  the keys that match the prefix so far, and a one-thread pick of the digit;
- ``topk(x, cand, k)``: 64-bit keys ``|x| << 32 | ~index`` (distinct), the same
  radix selection over eight rounds for the k-th largest key K, then the
  order-preserving compaction of the candidates whose key is >= K (exactly
  k of them), which leaves them ascending;
- ``gather``/``scatter``: a thread per index; decode zeroes the output, then
  scatters with the index checks (out of range or not increasing: error 4).

Local arrays and the selection's keys live in one scratch buffer, region j
at ``j * (n + 1) * 8`` bytes (``scratch_regions`` says how many). The
generated source is compile-checked by ``nvcc -ptx`` in the tests, and run
there by a CPU emulation (each GPU thread a CPU thread, barriers for
``__syncthreads``) that must give the hand-written bytes; on a GPU
``cuda_runners.SeqCudaProgram`` runs it (``bench/gpu_check.py`` checks its
bytes against the hand-written compressor there).
"""
from __future__ import annotations

from typing import Any, Dict, List, Set

from .checker import Checked
from .interp import _size, layout
from .lower import ctype
from .prelude import CUDA_PRELUDE as PRELUDE
from .prelude import ctx_locals as _ctx_locals
from .render_base import SeqArrays, SeqExpr, counted_arrays, read_extra_fields
from .syntax import Node

__all__ = ["render_cuda_seq", "SEQ_CUDA_PRELUDE"]

SEQ_CUDA_PRELUDE = r"""
#define CL_CHUNK_SCAN_MAX 32
#define CL_CHUNK 256   /* grid kernels run with 256 threads per block: one chunk per block */
/* exclusive prefix of flag over the block (in thread order) and the block's total */
__device__ __forceinline__ int cl_block_scan(int flag, int* total) {
    __shared__ int warp_sums[CL_CHUNK_SCAN_MAX];
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    const int before = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    int off = 0, all = 0;
    const unsigned nw = (blockDim.x + 31u) >> 5;
    for (unsigned w = 0; w < nw; ++w) {
        if (w < warp) off += warp_sums[w];
        all += warp_sums[w];
    }
    __syncthreads();
    *total = all;
    return off + before;
}
/* one round of radix selection: histogram of digit (key >> shift) & 255 of matching keys */
__device__ __forceinline__ void cl_radix_hist(const unsigned long long* keys, long long m,
        unsigned long long prefix, unsigned long long mask, int shift,
        unsigned long long* hist) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < m;
         i += (long long)gridDim.x * blockDim.x) {
        const unsigned long long k = keys[i];
        if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255ull], 1ull);
    }
}
/* one thread: the digit holding the want-th largest key; narrow prefix/mask, clear hist */
__device__ __forceinline__ void cl_radix_pick(unsigned long long* hist, long long* want,
        unsigned long long* prefix, unsigned long long* mask, int shift) {
    for (int d = 255; d >= 0; --d) {
        const long long h = (long long)hist[d];
        if (*want <= h || d == 0) {
            *prefix |= (unsigned long long)d << shift;
            *mask |= 255ull << shift;
            break;
        }
        *want -= h;
    }
    for (int d = 0; d < 256; ++d) hist[d] = 0;
}
__device__ __forceinline__ long long cl_num_selected(double ratio, long long n) {
    long long k = (long long)ceil(ratio * (double)n - 1e-6);
    k = k < n ? k : n;
    return k > 1 ? k : 1;
}
#define CL_FOR(i, bound) for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; \
    i < (bound); i += (long long)gridDim.x * blockDim.x)
#define CL_REGION(j) (scratch + (long long)(j) * (n + 1) * 8)
"""


class _CudaSeqExpr(SeqExpr):
    def __init__(self, c: Checked, lens: Dict[str, str]) -> None:
        super().__init__(c, "cuda", lens, "long long")
        self.threshold_result = ""

    def call(self, e: Node) -> str:
        if e.args[0] == "threshold":
            if not self.threshold_result:
                raise self.c.prog.error("threshold(...) stands alone on the right of an "
                                        "assignment here (x = threshold(...);)", e)
            return self.threshold_result
        return super().call(e)


class _CudaSeq(SeqArrays):
    def __init__(self, c: Checked) -> None:
        self.c = c
        self.lens: Dict[str, str] = {}
        self.ex = _CudaSeqExpr(c, self.lens)
        self.state = [n for n, t in c.globals.items() if t.array]
        self.src: List[str] = []
        self.kernels: Dict[str, List[str]] = {"encode": [], "decode": []}
        self.regions: Dict[str, int] = {}
        self.fields: List[str] = []
        self.grad = ""
        self.which = "encode"
        self.nsel = 0

    # ---------------------------------------------------------------- plumbing
    def region(self, name: str) -> int:
        if name not in self.regions:
            self.regions[name] = len(self.regions)
        return self.regions[name]

    def field(self, decl: str) -> None:
        if decl not in self.fields:
            self.fields.append(decl)

    def sig(self) -> str:
        if self.which == "encode":
            return ("ctx_t* c, const float* g, long long n, const double* params, float** st, "
                    "unsigned int seed, unsigned int raw_seed, long long step, uint8_t* scratch")
        return ("ctx_t* c, const uint8_t* extra, long long extra_len, const uint8_t* body, "
                "long long body_len, float* out, long long n, const double* params, "
                "uint8_t* scratch")

    def kernel(self, body: List[str], single: bool, guard: bool = True) -> None:
        k = f"cl_s{self.which}_{len(self.kernels[self.which])}"
        self.kernels[self.which].append(k + (":1" if single else ":n"))
        head = [f'extern "C" __global__ void {k}({self.sig()}) {{',
                "    (void)params; (void)scratch; (void)n;"]
        if self.which == "encode":
            head.append("    (void)st; (void)seed; (void)raw_seed; (void)step; (void)g;")
        else:
            head.append("    (void)extra; (void)extra_len; (void)body; (void)body_len; "
                        "(void)out;")
        if guard:
            head.append("    if (c->err) return;")
        if single:
            head.append("    if (blockIdx.x != 0 || threadIdx.x != 0) return;")
        head += self.arrays_in_scope()
        self.src += head + body + ["}"]

    def arrays_in_scope(self) -> List[str]:
        out = []
        if self.which == "encode":
            for j, s in enumerate(self.state):
                out.append(f"    float* s_{s} = st[{j}]; (void)s_{s};")
        for name, j in self.regions.items():
            ct = self.types.get(name, "unsigned long long")
            out.append(f"    {ct}* l_{name} = ({ct}*)CL_REGION({j}); (void)l_{name};")
        return out

    types: Dict[str, str] = {}

    # ---------------------------------------------------------------- operators
    def compact(self, name: str, bound: str, flag: str, source: str) -> None:
        """Order-preserving stream compaction of ``source`` where ``flag`` holds into l_name."""
        cnt = f"cnt_{name}"
        self.region(cnt)
        self.types[cnt] = "long long"
        self.region(name)
        self.types[name] = "int32_t"
        self.field(f"long long len_{name};")
        chunk = "(long long)CL_CHUNK"
        loop = ("    if (blockDim.x != CL_CHUNK) { c->err = 6; return; }",
                f"    for (long long b_ = blockIdx.x; b_ * {chunk} < {bound}; b_ += gridDim.x) {{",
                f"        const long long i_ = b_ * {chunk} + threadIdx.x;",
                f"        const int f_ = i_ < {bound} ? (int)({flag}) : 0;",
                "        int total_ = 0;",
                "        const int pos_ = cl_block_scan(f_, &total_);")
        self.kernel(list(loop) + [f"        if (threadIdx.x == 0) l_{cnt}[b_] = total_;",
                                  "        (void)pos_;", "    }"], False)
        self.kernel(["    long long acc_ = 0;",
                     f"    const long long chunks_ = ({bound} + CL_CHUNK - 1) / CL_CHUNK;",
                     "    for (long long b_ = 0; b_ < chunks_; ++b_) {",
                     f"        const long long t_ = l_{cnt}[b_]; l_{cnt}[b_] = acc_; acc_ += t_;",
                     "    }",
                     f"    c->len_{name} = acc_;"], True)
        self.kernel(list(loop) + [f"        if (f_) l_{name}[l_{cnt}[b_] + pos_] = "
                                  f"(int32_t)({source});", "    }"], False)
        self.lens[name] = f"c->len_{name}"

    def select(self, keys: str, m: str, k: str, bits: int) -> str:
        """Radix selection kernels: the k-th largest of m keys; returns the ctx field."""
        self.nsel += 1
        s = f"sel{self.nsel}_"
        self.field(f"unsigned long long {s}prefix, {s}mask; long long {s}want;")
        self.field("unsigned long long hist[256];")
        self.kernel([f"    c->{s}prefix = 0; c->{s}mask = 0; c->{s}want = {k};",
                     "    for (int d_ = 0; d_ < 256; ++d_) c->hist[d_] = 0;"], True)
        for shift in range(bits - 8, -8, -8):
            self.kernel([f"    cl_radix_hist({keys}, {m}, c->{s}prefix, c->{s}mask, {shift}, "
                         "c->hist);"], False)
            self.kernel([f"    cl_radix_pick(c->hist, &c->{s}want, &c->{s}prefix, &c->{s}mask, "
                         f"{shift});"], True)
        return f"c->{s}prefix"

    def threshold(self, target: Node, e: Node) -> None:
        x, dens, sr = e.args[1]
        xs = self.arr(x)
        self.field("long long thr_s, thr_m, thr_k;")
        keys = "thr_keys_"
        self.region(keys)
        self.types[keys] = "unsigned long long"
        d, r = self.ex.expr(dens), self.ex.expr(sr)
        self.kernel([f"    const double d_ = (double)({d}), r_ = (double)({r});",
                     "    if (!(d_ > 0.0 && d_ <= 1.0 && r_ > 0.0 && r_ <= 1.0)) { c->err = 6; "
                     "return; }",
                     "    long long s_ = (long long)ceil(r_ * (double)n);",
                     "    const long long h_ = (long long)ceil(32.0 / d_);",
                     "    s_ = s_ > h_ ? s_ : h_; s_ = s_ > 1024 ? s_ : 1024;",
                     "    c->thr_s = s_; c->thr_m = s_ >= n ? n : s_;",
                     "    c->thr_k = cl_num_selected(d_, c->thr_m);"], True)
        self.kernel(["    const unsigned long long off_ = (unsigned long long)step * "
                     "(unsigned long long)c->thr_s;",
                     "    CL_FOR(j_, c->thr_m) {",
                     "        long long pos_ = j_;",
                     "        if (c->thr_s < n) {",
                     "            const unsigned int h_ = cl_fmix32((unsigned int)(off_ + "
                     "(unsigned long long)j_) ^ raw_seed);",
                     "            pos_ = (long long)(((unsigned long long)h_ * (unsigned long "
                     "long)n) >> 32);",
                     "        }",
                     f"        l_{keys}[j_] = (unsigned long long)(__float_as_uint({xs}[pos_]) "
                     "& 0x7FFFFFFFu);",
                     "    }"], False)
        kth = self.select(f"l_{keys}", "c->thr_m", "c->thr_k", 32)
        self.ex.threshold_result = f"__uint_as_float((unsigned int){kth})"
        self.scalar(Node("assign", (target, "=", e), e.line, e.col))
        self.ex.threshold_result = ""

    def array_op(self, name: str, e: Node) -> None:
        op, args = e.args
        if op == "filter":
            x = self.arr(args[0])
            f = self.c.funcs[args[1].args[0]]
            self.compact(name, self.length(args[0]), f"u_{f.name}(c, {x}[i_], i_)", "i_")
        elif op == "topk":
            cand = args[1]
            if cand.kind == "call":
                tname = f"t{len(self.regions)}_"
                self.array_op(tname, cand)
                cand = Node("var", (tname,), cand.line, cand.col)
            cn, cl = self.arr(cand), self.length(cand)
            x = self.arr(args[0])
            keys = f"keys_{name}"
            self.region(keys)
            self.types[keys] = "unsigned long long"
            self.field(f"long long k_{name}; unsigned long long kmin_{name};")
            self.kernel([f"    c->k_{name} = (long long)({self.ex.expr(args[2])});"], True)
            self.kernel([f"    CL_FOR(i_, {cl}) l_{keys}[i_] = ((unsigned long long)"
                         f"(__float_as_uint({x}[{cn}[i_]]) & 0x7FFFFFFFu) << 32) | "
                         f"(unsigned int)~(unsigned int){cn}[i_];"], False)
            kth = self.select(f"l_{keys}", cl, f"(c->k_{name} < {cl} ? c->k_{name} : 1)", 64)
            self.kernel([f"    c->kmin_{name} = c->k_{name} < {cl} ? {kth} : 0ull;"], True)
            self.compact(name, cl, f"l_{keys}[i_] >= c->kmin_{name}", f"{cn}[i_]")
        elif op == "gather":
            idx = self.arr(args[1])
            self.region(name)
            self.types[name] = "float"
            self.field(f"long long len_{name};")
            self.kernel([f"    c->len_{name} = {self.length(args[1])};"], True)
            self.kernel([f"    CL_FOR(i_, {self.length(args[1])}) l_{name}[i_] = "
                         f"{self.arr(args[0])}[{idx}[i_]];"], False)
            self.lens[name] = f"c->len_{name}"
        else:
            raise self.c.prog.error(f"an array is made by map, filter, topk or gather, not "
                                    f"{op}", e)

    def scalar(self, s: Node) -> None:
        self.kernel(self.ex.stmt(s, "    ", None), True)

    # ---------------------------------------------------------------- entry points
    def encode(self) -> None:
        f = self.c.encode
        self.grad, out_name = f.params[0][1], f.params[1][1]
        self.ex.locals = [set(_ctx_locals(f)) | {"step"}]
        self.ex.in_ctx = set(self.ex.locals[0])
        self.ex.args = set()
        self.kernel(["    c->err = 0; c->seed = seed; c->l_step = step;"], True, guard=False)
        self.kernel(["    CL_FOR(i_, n) { if ((__float_as_uint(g[i_]) & 0x7F800000u) == "
                     "0x7F800000u) c->err = 1; }"], False)
        self.kernel([f"    c->p_{pn} = ({ctype(pt)})params[{j}];"
                     for j, (pn, pt, _, _) in enumerate(self.c.params)] or ["    ;"], True)
        for s in f.body.args[0]:
            self.stmt(s, out_name)

    def concat(self, e: Node) -> None:
        lay = layout(e.args[1])
        body = ["    uint8_t* extra_ = (uint8_t*)&c->extra_out[0];"]
        for a, t, off in lay.fields:
            v = self.ex.conv(self.ex.expr(a), a.ty, t)
            body.append(f"    {{ {ctype(t)} v_ = {v}; cl_memcpy(extra_ + {off}, &v_, "
                        f"{_size(t)}); }}")
        self.field(f"unsigned long long extra_out[{max(1, (lay.extra_nbytes + 7) // 8)}];")
        self.field(f"long long out_len[{max(1, len(lay.arrays))}];")
        for j, a in self.concat_arrays(lay):
            body.append(f"    c->out_len[{j}] = {self.length(a)} * 4;")
        self.kernel(body, True)

    def state_loop(self, target: str, call: str) -> None:
        self.kernel([f"    CL_FOR(i_, n) s_{target}[i_] = {call};"], False)

    def scatter_loop(self, count: str, store: str) -> None:
        self.kernel([f"    CL_FOR(i_, {count}) {store}"], False)

    def special(self, s: Node) -> bool:
        """threshold(...) runs as its own kernels: sample, select, then the scalar."""
        if not (s.kind in ("assign", "decl") and _is_threshold(s)):
            return False
        if s.kind == "decl":
            self.scalar(Node("decl", (s.args[0], [Node("declarator", (d.args[0], None),
                                                       d.line, d.col)
                                                  for d in s.args[1]]), s.line, s.col))
            d = s.args[1][0]
            self.threshold(Node("var", (d.args[0],), d.line, d.col), d.args[1])
        else:
            self.threshold(s.args[0], s.args[2])
        return True

    def decode(self) -> None:
        f = self.c.decode
        self.which = "decode"
        self.lens.clear()
        self.grad = ""
        out_name = f.params[1][1]
        locs = _ctx_locals(f)
        self.ex.locals = [set(locs)]
        self.ex.in_ctx = set(locs)
        self.kernel(["    c->err = 0;"] + [f"    c->p_{pn} = ({ctype(pt)})params[{j}];"
                                            for j, (pn, pt, _, _) in enumerate(self.c.params)],
                    True, guard=False)
        arrays: Set[str] = set()
        for s in f.body.args[0]:
            if s.kind == "decl" and s.args[0].array:
                arrays |= {d.args[0] for d in s.args[1]}
                continue
            if s.kind == "expr_stmt" and s.args[0].args[0] == "extract":
                self.extract(s.args[0])
            elif s.kind == "assign" and s.args[0].args[0] == out_name:
                idx, vals, ii, vv = self.scatter_output(s.args[2])
                self.kernel([f"    if ({self.length(idx)} != {self.length(vals)}) c->err = 3;"],
                            True)
                self.kernel(["    CL_FOR(i_, n) out[i_] = 0.0f;"], False)
                self.kernel([f"    CL_FOR(i_, {self.length(idx)}) {{",
                             f"        const long long j_ = {ii}[i_];",
                             f"        if (j_ < 0 || j_ >= n || (i_ > 0 && j_ <= {ii}[i_ - 1])) "
                             "{ c->err = 4; continue; }",
                             f"        out[j_] = {vv}[i_];",
                             "    }"], False)
            else:
                self.scalar(s)

    def extract(self, e: Node) -> None:
        lay = layout(e.args[1][1:])
        body = read_extra_fields(lay, self.ex, "{{ c->err = {}; return; }}", "cl_memcpy",
                                 "long long")
        ptrs = []
        for j, name, t, count in counted_arrays(self.c, lay):
            sz = _size(t.elem())
            self.field(f"long long dlen_{name}, off_{name};")
            if j:
                body.append("    off_ = (off_ + 7) / 8 * 8;")
            body += [f"    c->dlen_{name} = (long long)({self.ex.expr(count)});",
                     f"    if (c->dlen_{name} < 0 || c->dlen_{name} > n || off_ + c->dlen_{name} * "
                     f"{sz} > body_len) {{ c->err = 3; return; }}",
                     f"    c->off_{name} = off_; off_ += c->dlen_{name} * {sz};"]
            ptrs.append((name, ctype(t.elem())))
            self.lens[name] = f"c->dlen_{name}"
        self.kernel(body, True)
        self.body_arrays = getattr(self, "body_arrays", []) + ptrs

    def decode_pointers(self) -> List[str]:
        return [f"    const {ct}* l_{name} = (const {ct}*)(body + c->off_{name}); (void)l_{name};"
                for name, ct in getattr(self, "body_arrays", [])]


def _is_threshold(s: Node) -> bool:
    if s.kind == "assign":
        e = s.args[2]
    elif len(s.args[1]) == 1 and s.args[1][0].args[1] is not None:
        e = s.args[1][0].args[1]
    else:
        return False
    return e.kind == "call" and e.args[0] == "threshold"


def render_cuda_seq(c: Checked) -> Dict[str, Any]:
    """CUDA source of a sparse program and its kernel schedule (module docstring).

    Returns:
        ``{"source": str, "encode": [...], "decode": [...], "scratch_regions": int,
        "encode_regions": {array: region}}``: kernels in launch order, each ``"name:1"``
        (one thread) or ``"name:n"`` (any grid of 256-thread blocks); after encode the
        concat's arrays lie in their scratch regions, their byte counts and the header
        fields in the context (``out_len``, ``extra_out``).

    Raises:
        CompllError: a construct this target does not compile (located).
    """
    r = _CudaSeq(c)
    r.types = {}
    funcs = [r.ex.function(f, "CL_INLINE") for name, f in c.funcs.items()
             if name not in ("encode", "decode")]
    r.encode()
    enc_src, r.src = r.src, []
    regions_enc = dict(r.regions)
    if c.decode is not None:
        r.regions = {}
        r.decode()
        r.src = _with_body_pointers(r.src, r.decode_pointers())  # arrays in the payload body
    locals_ = {}
    for f in (c.encode, c.decode):
        if f is not None:
            locals_.update(_ctx_locals(f))
    ctx = ["typedef struct {", "    int err;", "    unsigned int seed;", "    long long l_step;"]
    ctx += [f"    {ctype(pt)} p_{pn};" for pn, pt, _, _ in c.params]
    ctx += [f"    {ctype(t)} g_{n};" for n, t in c.globals.items() if not t.array]
    ctx += [f"    {ctype(t)} l_{n};" for n, t in locals_.items() if n != "step"]
    ctx += [f"    {f}" for f in r.fields]
    ctx.append("} ctx_t;")
    src = "\n".join([PRELUDE, SEQ_CUDA_PRELUDE, "\n".join(ctx)] + funcs + enc_src + r.src)
    return {"source": src + "\n", "encode": r.kernels["encode"], "decode": r.kernels["decode"],
            "scratch_regions": max(len(regions_enc), len(r.regions), 1),
            "encode_regions": regions_enc}


def _with_body_pointers(lines: List[str], ptrs: List[str]) -> List[str]:
    """Insert decode's body-array pointers after each kernel's head."""
    out: List[str] = []
    for ln in lines:
        out.append(ln)
        if ln.startswith("    (void)extra; (void)extra_len;"):
            out += ptrs
    return out
