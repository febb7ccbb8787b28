/* Native CPU loops for onebit's hot paths (onebit/native.py says why).
 *
 * Every function produces exactly the bytes and floats of onebit's torch
 * kernels (onebit/fused.py; tests/unit/test_native.py compares them on every path):
 *
 *   layout   n elements, m = n / 8 full bytes; byte j holds elements
 *            j, m + j, ..., 7m + j in bits 0..7 (plane layout, _build/fused.py
 *            rule 1); the last n - 8m elements go into byte m, bits 0.., and its
 *            unused bits are 1 (the torch path packs a copy padded with 0.0,
 *            and 0.0 >= 0).
 *   floats   float32 only, no contraction (built with -ffp-contract=off), so
 *            each add/divide rounds as torch's does; decode values arrive
 *            already cast (and divided) by the caller.
 *   sums     onebit's fixed-point sums are integers, summed as integers:
 *            exact in any order, like torch's float64 sums of the same
 *            integers (below 2**53).
 *
 * Functions work on a range of bytes [j0, j1) so callers can split one call
 * over threads; each range writes only its own bytes and elements.
 */
#include "hp_native.h"

/* One plane of a block: bit k of acc[j] = (x[j] >= 0), after x[j] += g[j]
 * when g is set (error feedback's compensation, stored back). Returns max|x| bits. */
HP_LOOP uint32_t hp_pack_plane(float *restrict x, const float *restrict g, uint8_t *restrict acc,
                               int64_t len, int k) {
    uint32_t amax = 0;
    if (g) {
        for (int64_t j = 0; j < len; ++j) {
            const float v = x[j] + g[j];
            x[j] = v;
            amax = hp_umax(amax, hp_abs_bits(v));
            acc[j] |= (uint8_t)((v >= 0.0f) << k);
        }
    } else {
        for (int64_t j = 0; j < len; ++j) {
            const float v = x[j];
            amax = hp_umax(amax, hp_abs_bits(v));
            acc[j] |= (uint8_t)((v >= 0.0f) << k);
        }
    }
    return amax;
}

/* hp_pack_plane with g, after first taking last step's residual out of x:
 * x[j] = (x[j] - (x[j] >= 0 ? rp : rn)) + g[j], each operation rounded to
 * float32, which is what fused.onebit_residual and then the pack with g do
 * in two sweeps (error feedback's deferred residual, OneBit.apply_residual_). */
HP_LOOP uint32_t hp_pack_plane_res(float *restrict x, const float *restrict g,
                                   uint8_t *restrict acc, int64_t len, int k, float rp,
                                   float rn) {
    uint32_t amax = 0;
    for (int64_t j = 0; j < len; ++j) {
        const float r = x[j] - (x[j] >= 0.0f ? rp : rn);
        const float v = r + g[j];
        x[j] = v;
        amax = hp_umax(amax, hp_abs_bits(v));
        acc[j] |= (uint8_t)((v >= 0.0f) << k);
    }
    return amax;
}

/* Sign bits of x[8m] for bytes [j0, j1), in blocks whose bytes stay in L1
 * while the eight planes are swept. Returns max|x| bits. */
static uint32_t hp_pack_range(float *x, const float *g, uint8_t *out, int64_t m, int64_t j0,
                              int64_t j1, const float *res) {
    uint32_t amax = 0;
    uint8_t acc[HP_BLOCK];
    for (int64_t b0 = j0; b0 < j1; b0 += HP_BLOCK) {
        const int64_t len = j1 - b0 < HP_BLOCK ? j1 - b0 : HP_BLOCK;
        memset(acc, 0, sizeof acc);
        for (int k = 0; k < 8; ++k) {
            float *xk = x + k * m + b0;
            const float *gk = g ? g + k * m + b0 : NULL;
            const uint32_t a = res ? hp_pack_plane_res(xk, gk, acc, len, k, res[0], res[1])
                                   : hp_pack_plane(xk, gk, acc, len, k);
            amax = hp_umax(amax, a);
        }
        memcpy(out + b0, acc, (size_t)len);
    }
    return amax;
}

/* The partial last byte (n % 8 elements), with the same residual and x += g. */
static uint32_t hp_pack_tail(float *restrict x, const float *restrict g, uint8_t *restrict out,
                             int64_t n, const float *res) {
    const int64_t m = n / 8, t = n - 8 * m;
    uint32_t amax = 0;
    if (!t)
        return 0;
    uint8_t byte = 0;
    for (int k = 0; k < 8; ++k) {
        float v = 0.0f; /* padding */
        if (k < t) {
            v = x[8 * m + k];
            if (res)
                v = v - (v >= 0.0f ? res[0] : res[1]);
            if (g) {
                v = v + g[8 * m + k];
                x[8 * m + k] = v;
            }
        }
        amax = hp_umax(amax, hp_abs_bits(v));
        byte |= (uint8_t)((v >= 0.0f) << k);
    }
    out[m] = byte;
    return amax;
}

/* Bytes [j0, j1) of the full part; with_tail adds the last byte. res, when
 * set (only with g), is the (value for 1, value for 0) of a residual still to
 * subtract from x first. Returns max|x| bits. */
uint32_t hp_onebit_pack(float *x, const float *g, uint8_t *out, int64_t n, int64_t j0,
                        int64_t j1, int with_tail, const float *res) {
    if (!g)
        res = NULL;
    uint32_t amax = hp_pack_range(x, g, out, n / 8, j0, j1, res);
    if (with_tail)
        amax = hp_umax(amax, hp_pack_tail(x, g, out, n, res));
    return amax;
}

/* onebit's exact fixed-point sums (fused._onebit_sums_fn) for elements
 * [i0, i1), added into res = (sum of q over x >= 0, sum of q, count of x >= 0)
 * with q = rint(x * scale). The caller guarantees finite x, a power-of-two
 * scale inside float32's normal range and |x * scale| <= 2**20, so float32
 * computes q exactly as torch does in float64 (the product only scales the
 * exponent; a product too small for a normal float32 rounds to 0 either
 * way), and q is an integer of at most 21 bits: blocks of 1024 sum in int32,
 * blocks add in int64, exact and order independent. */
HP_LOOP __attribute__((optimize("no-math-errno", "no-trapping-math")))
void hp_sums_block(const float *restrict x, int64_t len, float scale, int64_t *restrict res) {
    int32_t sp = 0, st = 0, c = 0;
    for (int64_t j = 0; j < len; ++j) {
        const int32_t q = (int32_t)__builtin_rintf(x[j] * scale);
        const int32_t p = x[j] >= 0.0f;
        st += q;
        sp += p ? q : 0;
        c += p;
    }
    res[0] += sp;
    res[1] += st;
    res[2] += c;
}

void hp_onebit_sums(const float *x, int64_t i0, int64_t i1, float scale, int64_t *res) {
    res[0] = res[1] = res[2] = 0;
    for (int64_t b0 = i0; b0 < i1; b0 += HP_BLOCK)
        hp_sums_block(x + b0, i1 - b0 < HP_BLOCK ? i1 - b0 : HP_BLOCK, scale, res);
}

/* out[j] = bit k of bits[j] ? a : b, or out[j] += that. */
HP_LOOP void hp_set_plane(const uint8_t *restrict bits, float *restrict out, int64_t len, int k,
                          float a, float b) {
    for (int64_t j = 0; j < len; ++j)
        out[j] = ((bits[j] >> k) & 1) ? a : b;
}

HP_LOOP void hp_add_plane(const uint8_t *restrict bits, float *restrict out, int64_t len, int k,
                          float a, float b) {
    for (int64_t j = 0; j < len; ++j)
        out[j] = out[j] + (((bits[j] >> k) & 1) ? a : b);
}

/* Decode bytes [j0, j1) of the full part: out[k*m + j] = bit k of byte j ? a : b
 * (mode 0), or out += that (mode 1). with_tail also does the last byte. */
void hp_onebit_unpack(const uint8_t *bits, float *out, int64_t n, int64_t j0, int64_t j1,
                      int mode, float a, float b, int with_tail) {
    const int64_t m = n / 8, t = n - 8 * m;
    for (int k = 0; k < 8; ++k) {
        if (mode == 0)
            hp_set_plane(bits + j0, out + k * m + j0, j1 - j0, k, a, b);
        else
            hp_add_plane(bits + j0, out + k * m + j0, j1 - j0, k, a, b);
    }
    if (with_tail)
        for (int64_t k = 0; k < t; ++k) {
            const float v = ((bits[m] >> k) & 1) ? a : b;
            out[8 * m + k] = mode == 0 ? v : out[8 * m + k] + v;
        }
}

/* out += decode(payload i) for i = 0..count-1, in that order per element, for
 * bytes [j0, j1) (and the last byte with with_tail): the PS aggregator's merge.
 * vals holds (a_i, b_i) per payload. One pass over a plane per payload
 * measured faster than blocking the planes through L1 (the copies cost more
 * than the cache misses they save). */
void hp_onebit_unpack_add_many(const uint8_t *const *bodies, const float *vals, int count,
                               float *out, int64_t n, int64_t j0, int64_t j1, int with_tail) {
    const int64_t m = n / 8, t = n - 8 * m;
    for (int k = 0; k < 8; ++k)
        for (int i = 0; i < count; ++i)
            hp_add_plane(bodies[i] + j0, out + k * m + j0, j1 - j0, k, vals[2 * i],
                         vals[2 * i + 1]);
    if (with_tail)
        for (int64_t k = 0; k < t; ++k) {
            float v = out[8 * m + k];
            for (int i = 0; i < count; ++i)
                v = v + (((bodies[i][m] >> k) & 1) ? vals[2 * i] : vals[2 * i + 1]);
            out[8 * m + k] = v;
        }
}

