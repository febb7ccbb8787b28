"""Source text shared by CompLL's renderers: the C and CUDA preludes, the context struct.

Each generated file starts with a prelude of helpers (the counter hash of
``ops.uniform``, clamps, frexp's exponent; for CUDA also warp reductions and
atomics) and a context struct holding the params, the scalar globals and the
RNG seed. The fused-sweep renderers (``render_c``, ``render_cuda``) and the
statement-by-statement ones for state-array programs (``render_seq``,
``render_cuda_seq``) share them from here. The helpers both targets spell
alike are written once (``_HASH``, ``_MATH``; ``CL_INLINE`` is each target's
inline qualifier), and a family of one shape (the clamps, the warp min/max
trees) comes from one template.
"""
from __future__ import annotations

from typing import Any, Dict

from .checker import Checked
from .lower import ctype
from .syntax import Node, Type

__all__ = ["C_PRELUDE", "CUDA_PRELUDE", "ctx_struct", "ctx_locals"]


def _clamps() -> str:
    """``cl_clamp_<T>(x, lo, hi)`` for each C type clamp accepts, one template."""
    body = ("CL_INLINE {t} cl_clamp_{t}({t} x, {t} lo, {t} hi) {{\n"
            "    x = x > lo ? x : lo;\n"
            "    return x < hi ? x : hi;\n"
            "}}\n")
    return "".join(body.format(t=t) for t in ("float", "double", "int32_t", "int64_t"))


# the helpers both targets spell alike (CL_INLINE is each target's inline qualifier)
_HASH = r"""CL_INLINE uint32_t cl_fmix32(uint32_t h) {
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16; return h;
}
"""
_UNIFORM_DOC = ("/* ops.uniform: element i of the counter-based hash stream keyed by seed "
                "(24 bits) */\n")
_MATH = r"""CL_INLINE float cl_uniform(uint32_t seed, int64_t i) {
    return (float)((cl_fmix32((uint32_t)i ^ seed) >> 8) & 0xFFFFFFu) * (1.0f / 16777216.0f);
}
CL_INLINE int32_t cl_exponent(double x) {
    int e = 0;
    if (x == 0.0) return 0;
    frexp(x, &e);
    return e;
}
""" + _clamps() + """\
CL_INLINE int64_t cl_packed_nbytes(int64_t n, int bits) { return (n * bits + 7) / 8; }
CL_INLINE int cl_valid_bits(int64_t b) { return b == 1 || b == 2 || b == 4 || b == 8; }
"""

C_PRELUDE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#define CL_INLINE static inline __attribute__((always_inline))
#include <float.h>
#pragma GCC optimize ("no-signed-zeros", "finite-math-only", "no-math-errno", "no-trapping-math")
#define CL_LOOP
""" + _HASH + _UNIFORM_DOC + _MATH + """\
/* threads for sweeps of at least CL_PARALLEL elements (torch.get_num_threads(), set per call) */
#define CL_PARALLEL 1048576
static int cl_threads = 1;
void cl_set_threads(int t) { cl_threads = t > 0 ? t : 1; }
"""


def _warp_minmax() -> str:
    """The warp min/max shuffle trees, one template for float and double."""
    tree = ("CL_INLINE {t} cl_warp_{name}({t} v) {{\n"
            "    for (int o = 16; o; o >>= 1) {{\n"
            "        {t} w = __shfl_down_sync(0xffffffffu, v, o);\n"
            "        v = w {op} v ? w : v;\n"
            "    }}\n"
            "    return v;\n"
            "}}\n")
    return "".join(tree.format(t=t, name=name, op=op) for t, name, op in
                   (("float", "min", "<"), ("float", "max", ">"),
                    ("double", "mind", "<"), ("double", "maxd", ">")))


CUDA_PRELUDE = r"""
#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif
#define CL_INLINE __device__ __forceinline__
""" + _HASH + _MATH + r"""CL_INLINE void cl_memcpy(void* d, const void* s, int k) {
    for (int t = 0; t < k; ++t) ((uint8_t*)d)[t] = ((const uint8_t*)s)[t];
}
/* reductions: one atomic per warp after a shuffle tree */
""" + _warp_minmax() + r"""CL_INLINE long long cl_warp_sumi(long long v) {
    for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}
CL_INLINE double cl_warp_sumd(double v) {
    for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}
CL_INLINE void cl_atomic_min(float* a, float v) {
    unsigned int* p = (unsigned int*)a; unsigned int old = *p, assumed;
    while (v < __uint_as_float(old)) {
        assumed = old;
        old = atomicCAS(p, assumed, __float_as_uint(v));
        if (old == assumed) break;
    }
}
CL_INLINE void cl_atomic_max(float* a, float v) {
    unsigned int* p = (unsigned int*)a; unsigned int old = *p, assumed;
    while (v > __uint_as_float(old)) {
        assumed = old;
        old = atomicCAS(p, assumed, __float_as_uint(v));
        if (old == assumed) break;
    }
}
CL_INLINE void cl_atomic_mind(double* a, double v) {
    unsigned long long* p = (unsigned long long*)a; unsigned long long old = *p, assumed;
    while (v < __longlong_as_double(old)) {
        assumed = old;
        old = atomicCAS(p, assumed, __double_as_longlong(v));
        if (old == assumed) break;
    }
}
CL_INLINE void cl_atomic_maxd(double* a, double v) {
    unsigned long long* p = (unsigned long long*)a; unsigned long long old = *p, assumed;
    while (v > __longlong_as_double(old)) {
        assumed = old;
        old = atomicCAS(p, assumed, __double_as_longlong(v));
        if (old == assumed) break;
    }
}
"""


def ctx_struct(c: Checked) -> str:
    """The context struct: params, globals and the seed."""
    fields = [f"    {ctype(pt)} p_{pn};" for pn, pt, _, _ in c.params]
    fields += [f"    {ctype(t)} g_{n};" for n, t in c.globals.items() if not t.array]
    fields.append("    uint32_t seed;")
    return "typedef struct {\n" + "\n".join(fields) + "\n} ctx_t;\n"


def ctx_locals(f: Any) -> Dict[str, Type]:
    """Entry-point scalars declared anywhere in ``f``'s body, by name."""
    out: Dict[str, Type] = {}

    def walk(s: Any) -> None:
        if isinstance(s, Node):
            if s.kind == "decl" and not s.args[0].array:
                for d in s.args[1]:
                    out[d.args[0]] = s.args[0]
            if s.kind in ("block",):
                for x in s.args[0]:
                    walk(x)
            if s.kind == "if":
                walk(s.args[1])
                walk(s.args[2])
    walk(f.body)
    return out
