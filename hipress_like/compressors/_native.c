/* Native CPU loops for onebit's hot paths (see _native.py for the why), and for
 * natural compression further down (its own rules are stated there).
 *
 * Every function produces exactly the bytes and floats of the torch kernels in
 * _fused.py (tests/unit/test_native.py compares them on every path):
 *
 *   layout   n elements, m = n / 8 full bytes; byte j holds elements
 *            j, m + j, ..., 7m + j in bits 0..7 (plane layout, _fused rule 1);
 *            the last n - 8m elements go into byte m, bits 0.., and its
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
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HP_BLOCK 1024

static inline uint32_t hp_abs_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u & 0x7fffffffu;
}

/* max|x| as the bits of a non-negative float: for those, IEEE order is integer
 * order, and NaN (any payload) sorts above +Inf, so NaN/Inf still show. */
static inline uint32_t hp_umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

/* The inner loops are separate, non-inlined functions: inlined into their loop
 * nests, GCC 12 once compiled the add loop into code 15x slower for three or
 * more payloads than for two; alone, each loop vectorises the same every time. */
#define HP_LOOP __attribute__((noinline)) static

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
 * float32, which is what _fused.onebit_residual and then the pack with g do
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

/* onebit's exact fixed-point sums (_fused._onebit_sums_fn) for elements
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

/* ------------------------------------------------------------------------
 * Natural compression C_nat: natural.py says what and why (and defines every
 * rule below); these are its float32 CPU loops, same bytes as its torch path.
 *
 *   random   h = fmix32((uint32)i ^ key) for element i: ops.hash32's stream
 *            (ops.uniform's number i is (h >> 8) / 2**24).
 *   round    e = exponent field, f = mantissa field (a subnormal is first
 *            normalised: (float)f is exact, its exponent field minus 149 is
 *            the value's exponent e <= 0, its mantissa field the fraction);
 *            up iff (h >> 9) < f, a 23-bit uniform below the fraction;
 *            E = min(e + up, cap).
 *   codes    base = max E over the nonzero elements (0 if none); c = base - E,
 *            zero is 255; an element with e < lo = base - 254 (below the code
 *            range) becomes 2**lo with probability |t| / 2**lo, i.e.
 *            h < floor(M 2**(9 - d)) with M = 2**23 | f, d = lo - e, else zero.
 *   signs    one bit plane, onebit's layout (byte j holds elements j, m + j,
 *            ..., 7m + j; the last n - 8m elements in byte m, unused bits 0).
 *
 * The fast path (no subnormal input, the usual case) writes E itself as the
 * byte, 0 for zero, while it finds max E; a second, byte-wide sweep turns E
 * into base - E. With a subnormal in the input it reports so and the caller
 * runs the general two passes (max E, then codes).
 * ------------------------------------------------------------------------ */

static inline uint32_t hp_fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

static inline int32_t hp_imin(int32_t a, int32_t b) { return a < b ? a : b; }
static inline int32_t hp_imax(int32_t a, int32_t b) { return a > b ? a : b; }
static inline uint32_t hp_umin(uint32_t a, uint32_t b) { return a < b ? a : b; }

/* Exponent e and fraction f of |t| = a (bits), subnormals normalised. Written
 * without branches (selects, masks) so the loops using it vectorise. */
static inline void hp_nat_split(uint32_t a, int32_t *e, uint32_t *f) {
    const uint32_t f0 = a & 0x7fffffu;
    const float fm = (float)(int32_t)f0; /* exact: f0 < 2**23 */
    uint32_t fb;
    memcpy(&fb, &fm, sizeof fb);
    const uint32_t sub = 0u - (uint32_t)((a >> 23) == 0); /* all ones for a subnormal */
    *e = (int32_t)((((fb >> 23) - 149u) & sub) | ((a >> 23) & ~sub));
    *f = ((fb & 0x7fffffu) & sub) | (f0 & ~sub);
}

static inline uint8_t hp_nat_code(uint32_t u, uint32_t h, int32_t base, int32_t cap,
                                  int32_t lo) {
    const uint32_t a = u & 0x7fffffffu;
    int32_t e;
    uint32_t f;
    hp_nat_split(a, &e, &f);
    const int32_t E = hp_imin(e + (int32_t)((int32_t)(h >> 9) < (int32_t)f), cap);
    const int32_t d = lo - e; /* >= 1: below the code range */
    const int32_t sl = hp_imin(hp_imax(9 - d, 0), 8);
    const int32_t sr = hp_imin(hp_imax(d - 9, 0), 31);
    const uint32_t T = ((f | 0x800000u) << sl) >> sr;
    const int32_t under = 255 - (int32_t)(h < T);
    int32_t c = d >= 1 ? under : base - E;
    c = a == 0 ? 255 : c;
    return (uint8_t)c;
}

/* Fast path, one plane of a block: the byte is E (0 for zero) and the sign goes
 * to bit k of acc. st = (max |x| bits, min of (|x| bits - 1), max E): the first
 * shows a NaN/Inf (>= 0x7f800000), the second a subnormal (< 0x7fffff). */
HP_LOOP void hp_nat_fast_plane(const float *restrict x, uint8_t *restrict code,
                               uint8_t *restrict acc, int64_t len, int k, uint32_t ctr,
                               uint32_t key, int32_t cap, uint32_t *restrict st) {
    uint32_t amax = st[0], amin1 = st[1];
    int32_t emax = (int32_t)st[2];
    for (int64_t j = 0; j < len; ++j) {
        uint32_t u;
        memcpy(&u, x + j, sizeof u);
        const uint32_t a = u & 0x7fffffffu;
        const uint32_t h = hp_fmix32(ctr++ ^ key);
        const int32_t up = (int32_t)(h >> 9) < (int32_t)(a & 0x7fffffu);
        const int32_t E = hp_imin((int32_t)(a >> 23) + up, cap);
        amax = hp_umax(amax, a);
        amin1 = hp_umin(amin1, a - 1u);
        emax = hp_imax(emax, E);
        code[j] = (uint8_t)E;
        acc[j] |= (uint8_t)((u >> 31) << k);
    }
    st[0] = amax;
    st[1] = amin1;
    st[2] = (uint32_t)emax;
}

/* Fast path over bytes [j0, j1) of the sign plane (8 elements each; with_tail
 * also the last n - 8m); st as hp_nat_fast_plane, initialised here. */
void hp_natural_encode_fast(const float *x, uint8_t *signs, uint8_t *codes, int64_t n,
                            int64_t j0, int64_t j1, uint32_t key, int32_t cap, int with_tail,
                            uint32_t *st) {
    const int64_t m = n / 8, t = n - 8 * m;
    uint8_t acc[HP_BLOCK];
    st[0] = 0;
    st[1] = 0xffffffffu;
    st[2] = 0;
    for (int64_t b0 = j0; b0 < j1; b0 += HP_BLOCK) {
        const int64_t len = j1 - b0 < HP_BLOCK ? j1 - b0 : HP_BLOCK;
        memset(acc, 0, sizeof acc);
        for (int k = 0; k < 8; ++k)
            hp_nat_fast_plane(x + k * m + b0, codes + k * m + b0, acc, len, k,
                              (uint32_t)(k * m + b0), key, cap, st);
        memcpy(signs + b0, acc, (size_t)len);
    }
    if (with_tail && t) {
        uint8_t byte = 0;
        for (int64_t k = 0; k < t; ++k) {
            uint8_t bit = 0;
            hp_nat_fast_plane(x + 8 * m + k, codes + 8 * m + k, &bit, 1, 0,
                              (uint32_t)(8 * m + k), key, cap, st);
            byte |= (uint8_t)(bit << k);
        }
        signs[m] = byte;
    }
}

/* Fast path, second sweep over codes [i0, i1): E -> base - E, 0 (zero) -> 255. */
HP_LOOP void hp_nat_rebase_block(uint8_t *restrict codes, int64_t len, uint8_t base) {
    for (int64_t i = 0; i < len; ++i)
        codes[i] = codes[i] == 0 ? (uint8_t)255 : (uint8_t)(base - codes[i]);
}

void hp_natural_rebase(uint8_t *codes, int64_t i0, int64_t i1, int32_t base) {
    if (i1 > i0)
        hp_nat_rebase_block(codes + i0, i1 - i0, (uint8_t)base);
}

/* General path, first pass: max E over the nonzero elements of one plane
 * (INT32_MIN when there are none). */
HP_LOOP int32_t hp_nat_emax_plane(const float *restrict x, int64_t len, uint32_t ctr,
                                  uint32_t key, int32_t cap, int32_t emax) {
    for (int64_t j = 0; j < len; ++j) {
        uint32_t u;
        memcpy(&u, x + j, sizeof u);
        const uint32_t a = u & 0x7fffffffu;
        int32_t e;
        uint32_t f;
        hp_nat_split(a, &e, &f);
        const uint32_t h = hp_fmix32(ctr++ ^ key);
        const int32_t E = hp_imin(e + (int32_t)((int32_t)(h >> 9) < (int32_t)f), cap);
        const int32_t nz = -(int32_t)(a != 0);
        emax = hp_imax(emax, (E & nz) | (INT32_MIN & ~nz));
    }
    return emax;
}

int32_t hp_natural_emax(const float *x, int64_t n, int64_t j0, int64_t j1, uint32_t key,
                        int32_t cap, int with_tail) {
    const int64_t m = n / 8, t = n - 8 * m;
    int32_t emax = INT32_MIN;
    for (int k = 0; k < 8; ++k)
        emax = hp_nat_emax_plane(x + k * m + j0, j1 - j0, (uint32_t)(k * m + j0), key, cap,
                                 emax);
    if (with_tail && t)
        emax = hp_nat_emax_plane(x + 8 * m, t, (uint32_t)(8 * m), key, cap, emax);
    return emax;
}

/* General path, second pass, one plane of a block: codes and sign bits. */
HP_LOOP void hp_nat_enc_plane(const float *restrict x, uint8_t *restrict code,
                              uint8_t *restrict acc, int64_t len, int k, uint32_t ctr,
                              uint32_t key, int32_t base, int32_t cap) {
    const int32_t lo = base - 254;
    for (int64_t j = 0; j < len; ++j) {
        uint32_t u;
        memcpy(&u, x + j, sizeof u);
        const uint32_t h = hp_fmix32(ctr++ ^ key);
        code[j] = hp_nat_code(u, h, base, cap, lo);
        acc[j] |= (uint8_t)((u >> 31) << k);
    }
}

/* General path over bytes [j0, j1) of the sign plane (with_tail: and the rest). */
void hp_natural_encode(const float *x, uint8_t *signs, uint8_t *codes, int64_t n, int64_t j0,
                       int64_t j1, uint32_t key, int32_t base, int32_t cap, int with_tail) {
    const int64_t m = n / 8, t = n - 8 * m;
    uint8_t acc[HP_BLOCK];
    for (int64_t b0 = j0; b0 < j1; b0 += HP_BLOCK) {
        const int64_t len = j1 - b0 < HP_BLOCK ? j1 - b0 : HP_BLOCK;
        memset(acc, 0, sizeof acc);
        for (int k = 0; k < 8; ++k)
            hp_nat_enc_plane(x + k * m + b0, codes + k * m + b0, acc, len, k,
                             (uint32_t)(k * m + b0), key, base, cap);
        memcpy(signs + b0, acc, (size_t)len);
    }
    if (with_tail && t) {
        uint8_t byte = 0;
        for (int64_t k = 0; k < t; ++k) {
            uint8_t bit = 0;
            hp_nat_enc_plane(x + 8 * m + k, codes + 8 * m + k, &bit, 1, 0,
                             (uint32_t)(8 * m + k), key, base, cap);
            byte |= (uint8_t)(bit << k);
        }
        signs[m] = byte;
    }
}

/* The value of code c with sign bit s: +-2**(E - 127), E = base - c, as float
 * bits (E <= 0: a subnormal power; E < -22 or code 255: zero). */
static inline float hp_nat_value(uint32_t c, uint32_t s, int32_t base) {
    const int32_t E = base - (int32_t)c;
    const int32_t sh = hp_imin(hp_imax(E + 22, 0), 31);
    uint32_t mag = E >= 1 ? (uint32_t)E << 23 : (1u << sh);
    mag = (c == 255u || E < -22) ? 0u : mag;
    const uint32_t b = mag | (s << 31);
    float v;
    memcpy(&v, &b, sizeof v);
    return v;
}

HP_LOOP void hp_nat_dec_set(const uint8_t *restrict signs, const uint8_t *restrict code,
                            float *restrict out, int64_t len, int k, int32_t base) {
    for (int64_t j = 0; j < len; ++j)
        out[j] = hp_nat_value(code[j], (uint32_t)(signs[j] >> k) & 1u, base);
}

HP_LOOP void hp_nat_dec_add(const uint8_t *restrict signs, const uint8_t *restrict code,
                            float *restrict out, int64_t len, int k, int32_t base) {
    for (int64_t j = 0; j < len; ++j)
        out[j] = out[j] + hp_nat_value(code[j], (uint32_t)(signs[j] >> k) & 1u, base);
}

HP_LOOP void hp_nat_dec_div(const uint8_t *restrict signs, const uint8_t *restrict code,
                            float *restrict out, int64_t len, int k, int32_t base, float d) {
    for (int64_t j = 0; j < len; ++j)
        out[j] = hp_nat_value(code[j], (uint32_t)(signs[j] >> k) & 1u, base) / d;
}

static void hp_nat_dec(const uint8_t *signs, const uint8_t *code, float *out, int64_t len,
                       int k, int32_t base, int mode, float d) {
    if (mode == 0)
        hp_nat_dec_set(signs, code, out, len, k, base);
    else if (mode == 1)
        hp_nat_dec_add(signs, code, out, len, k, base);
    else
        hp_nat_dec_div(signs, code, out, len, k, base, d);
}

/* Decode bytes [j0, j1) of the sign plane (8 elements each; with_tail also the
 * last n - 8m): out = v (mode 0), out += v (mode 1) or out = v / d (mode 2). */
void hp_natural_decode(const uint8_t *signs, const uint8_t *codes, float *out, int64_t n,
                       int64_t j0, int64_t j1, int32_t base, int mode, float d,
                       int with_tail) {
    const int64_t m = n / 8, t = n - 8 * m;
    for (int k = 0; k < 8; ++k)
        hp_nat_dec(signs + j0, codes + k * m + j0, out + k * m + j0, j1 - j0, k, base, mode, d);
    if (with_tail)
        for (int64_t k = 0; k < t; ++k)
            hp_nat_dec(signs + m, codes + 8 * m + k, out + 8 * m + k, 1, (int)k, base, mode, d);
}

/* ------------------------------------------------------------------------
 * THC's randomized Hadamard transform (thc.py, THC Sec. 5.1), per block of
 * B = 2^logb floats, in the L1 cache:
 *
 *   forward  y_j = H (D (x_j * s_j)): D_ii = -1 iff the top bit of
 *            fmix32((uint32)(first + i) ^ key) is set (thc._rademacher),
 *            then the unnormalised Walsh-Hadamard butterflies.
 *   fwht     y_j = H y_j in place (the decode's inverse, on exact integers).
 *
 * The butterflies are the radix-2 stages h = 1, 2, 4, ..., B/2 in that order,
 * each (a, b) -> (a + b, a - b): the same operations, in the same order, as
 * thc._fwht_rows' butterfly path, so the floats are identical to it. The
 * first three stages run on eight values in registers; the rest are plain
 * loops over contiguous runs, which the compiler vectorises.
 * ------------------------------------------------------------------------ */

static inline void hp_fwht8(float *v) {
    float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    float a4 = v[4] + v[5], a5 = v[4] - v[5], a6 = v[6] + v[7], a7 = v[6] - v[7];
    float b0 = a0 + a2, b2 = a0 - a2, b1 = a1 + a3, b3 = a1 - a3;
    float b4 = a4 + a6, b6 = a4 - a6, b5 = a5 + a7, b7 = a5 - a7;
    v[0] = b0 + b4; v[4] = b0 - b4; v[1] = b1 + b5; v[5] = b1 - b5;
    v[2] = b2 + b6; v[6] = b2 - b6; v[3] = b3 + b7; v[7] = b3 - b7;
}

static void hp_fwht_block(float *restrict y, int64_t size) {
    int64_t h, i, j;
    if (size < 8) {
        for (h = 1; h < size; h *= 2)
            for (i = 0; i < size; i += 2 * h)
                for (j = i; j < i + h; j++) {
                    float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        return;
    }
    for (i = 0; i < size; i += 8)
        hp_fwht8(y + i);
    for (h = 8; h < size; h *= 2)
        for (i = 0; i < size; i += 2 * h) {
            float *restrict p = y + i, *restrict q = y + i + h;
            for (j = 0; j < h; j++) {
                float a = p[j], b = q[j];
                p[j] = a + b;
                q[j] = a - b;
            }
        }
}

/* Rows [r0, r1) of B = size floats: y = H D (x * scale[row]), elements
 * numbered from first (D's counter). */
void hp_thc_rht(const float *restrict x, float *restrict y, int64_t size,
                const float *restrict scale, uint32_t key, int64_t first, int64_t r0,
                int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * size;
        float *yr = y + r * size;
        const float s = scale[r];
        const uint32_t base = (uint32_t)(first + r * size);
        for (int64_t i = 0; i < size; i++) {
            const float v = xr[i] * s;
            const uint32_t neg = hp_fmix32((base + (uint32_t)i) ^ key) >> 31;
            yr[i] = neg ? -v : v;
        }
        hp_fwht_block(yr, size);
    }
}

/* Rows [r0, r1) of B = size floats: y = H y in place. */
void hp_thc_fwht(float *y, int64_t size, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        hp_fwht_block(y + r * size, size);
}

/* ------------------------------------------------------------------------
 * THC's aggregator (thc.py merge_round(1)) for 4-bit indices summed into
 * 8-bit lanes, the common case (b = 4, N g <= 255): out = sum_i T[z_i],
 * plus partial sums of width 8. Index word j holds fields k = 0..7 (bits
 * 4k..4k+3); the sum has two arrays of m words, array a's word j holding
 * fields 4a..4a+3 in its bytes. With AVX2 a 16-entry byte table is one
 * vpshufb: per 32 bytes of indices (64 values) two lookups, two unpacks
 * (which put array 0's and array 1's words side by side), byte adds (no
 * lane carries: every sum is at most 255), and one shuffle at the end that
 * separates the arrays. Words past the last multiple of 8 run in scalar.
 * ------------------------------------------------------------------------ */
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline void hp_thc_merge_word(const uint32_t *const *idx, int nidx,
                                     const uint32_t *const *sums, int nsum,
                                     const uint8_t *T, uint32_t *out, int64_t m, int64_t j) {
    uint32_t a0 = 0, a1 = 0;
    for (int i = 0; i < nidx; i++) {
        const uint32_t v = idx[i][j];
        for (int k = 0; k < 4; k++) {
            a0 += (uint32_t)T[(v >> (4 * k)) & 15u] << (8 * k);
            a1 += (uint32_t)T[(v >> (4 * k + 16)) & 15u] << (8 * k);
        }
    }
    for (int i = 0; i < nsum; i++) {
        a0 += sums[i][j];
        a1 += sums[i][m + j];
    }
    out[j] = a0;
    out[m + j] = a1;
}

/* Words [j0, j1) of the two output arrays. Returns 1 (AVX2) or 0 (scalar). */
int hp_thc_merge_b4w8(const uint32_t *const *idx, int nidx, const uint32_t *const *sums,
                      int nsum, const uint8_t *T, uint32_t *out, int64_t m, int64_t j0,
                      int64_t j1) {
    int64_t j = j0;
#if defined(__AVX2__)
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)T));
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (; j + 8 <= j1; j += 8) {
        __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
        for (int i = 0; i < nidx; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(idx[i] + j));
            const __m256i tlo = _mm256_shuffle_epi8(tab, _mm256_and_si256(v, low));
            const __m256i thi = _mm256_shuffle_epi8(
                tab, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            /* per 128-bit lane: words (w0 a0, w0 a1, w1 a0, w1 a1) and (w2 ..., w3 ...) */
            acc0 = _mm256_add_epi8(acc0, _mm256_unpacklo_epi8(tlo, thi));
            acc1 = _mm256_add_epi8(acc1, _mm256_unpackhi_epi8(tlo, thi));
        }
        __m256i r0 = _mm256_castps_si256(_mm256_shuffle_ps(
            _mm256_castsi256_ps(acc0), _mm256_castsi256_ps(acc1), _MM_SHUFFLE(2, 0, 2, 0)));
        __m256i r1 = _mm256_castps_si256(_mm256_shuffle_ps(
            _mm256_castsi256_ps(acc0), _mm256_castsi256_ps(acc1), _MM_SHUFFLE(3, 1, 3, 1)));
        for (int i = 0; i < nsum; i++) {
            r0 = _mm256_add_epi8(r0, _mm256_loadu_si256((const __m256i *)(sums[i] + j)));
            r1 = _mm256_add_epi8(r1, _mm256_loadu_si256((const __m256i *)(sums[i] + m + j)));
        }
        _mm256_storeu_si256((__m256i *)(out + j), r0);
        _mm256_storeu_si256((__m256i *)(out + m + j), r1);
    }
#endif
    for (; j < j1; j++)
        hp_thc_merge_word(idx, nidx, sums, nsum, T, out, m, j);
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------
 * Bloom filters of bloom.py (it says why): the universe [0, n) is cut into
 * blocks of 2**log2u positions; block b has its own filter of mb[b] bits
 * starting at byte off[b]. Element x of block b probes, for i < nh,
 *
 *   h1 = fmix32(x ^ s1), h2 = fmix32(x ^ s2) | 1      (x below 2**32)
 *   bit ((h1 + i * h2) mod 2**32) * mb[b] >> 32        (Lemire's reduction)
 *
 * of that filter, bit p being bit (p & 7) of byte p >> 3: exactly the
 * positions of bloom.py's torch path.
 * ------------------------------------------------------------------------ */
static inline uint64_t hp_probe(uint32_t h, uint64_t m) { return ((uint64_t)h * m) >> 32; }

/* Set the probe bits of the r elements of x (the filters zeroed by the caller). */
void hp_bloom_build(const int64_t *x, int64_t r, int32_t log2u, const int64_t *mb,
                    const int64_t *off, int32_t nh, uint32_t s1, uint32_t s2,
                    uint8_t *filter) {
    for (int64_t e = 0; e < r; e++) {
        const uint32_t v = (uint32_t)x[e];
        const int64_t b = x[e] >> log2u;
        const uint64_t m = (uint64_t)mb[b];
        uint8_t *f = filter + off[b];
        uint32_t h = hp_fmix32(v ^ s1);
        const uint32_t h2 = hp_fmix32(v ^ s2) | 1u;
        for (int32_t i = 0; i < nh; i++, h += h2) {
            const uint64_t p = hp_probe(h, m);
            f[p >> 3] |= (uint8_t)(1u << (p & 7));
        }
    }
}

/* Membership of every element of blocks [b0, b1) (universe size n). Per run
 * of HP_BQ elements, probe i runs over the survivors of probe i - 1 only
 * (about half of them when a filter is half full, its optimal fill), and
 * each pass compacts its survivors without a branch (write, then advance by
 * the bit): a data-dependent branch per probe would be mispredicted half the
 * time. With AVX-512, sixteen survivors are probed at once (a gather of the
 * filter words, then a compress of the survivors); a gather reads four
 * bytes, so a block whose filter ends within three bytes of the filters'
 * end (nbytes) is probed by the scalar loop. Writes the positives in
 * increasing order into out (at most cap of them) and returns how many
 * there were. */
#define HP_BQ 512

#if defined(__AVX512F__)
static inline __m512i hp_fmix32_x16(__m512i h) {
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x85ebca6bu));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0xc2b2ae35u));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

/* The lanes of valid whose probe bit ((h * m) >> 32) is set in filter f. */
static inline __mmask16 hp_probe_x16(__m512i h, __m512i mv, const uint8_t *f, __mmask16 valid) {
    const __m512i lo = _mm512_srli_epi64(_mm512_mul_epu32(h, mv), 32);
    const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(h, 32), mv);
    const __m512i p = _mm512_mask_blend_epi32(0xAAAA, lo, hi);
    const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid,
                                                  _mm512_srli_epi32(p, 3), f, 1);
    const __m512i bit = _mm512_srlv_epi32(w, _mm512_and_si512(p, _mm512_set1_epi32(7)));
    return _mm512_mask_test_epi32_mask(valid, bit, _mm512_set1_epi32(1));
}

/* One run of len elements from base through the nh probes (the scalar loop's
 * steps, sixteen at a time); returns the survivors left in xs. */
static int hp_query_run_x16(const uint8_t *f, uint32_t m, uint32_t base, int len, int32_t nh,
                            uint32_t s1, uint32_t s2, uint32_t *xs, uint32_t *hs,
                            uint32_t *h2) {
    const __m512i mv = _mm512_set1_epi32((int)m), s1v = _mm512_set1_epi32((int)s1);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int c = 0;
    for (int j = 0; j < len; j += 16) {
        const __mmask16 valid = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1);
        const __m512i x = _mm512_add_epi32(_mm512_set1_epi32((int)(base + (uint32_t)j)), iota);
        const __m512i h = hp_fmix32_x16(_mm512_xor_si512(x, s1v));
        const __mmask16 k = hp_probe_x16(h, mv, f, valid);
        _mm512_storeu_si512(xs + c, _mm512_maskz_compress_epi32(k, x));
        _mm512_storeu_si512(hs + c, _mm512_maskz_compress_epi32(k, h));
        c += __builtin_popcount(k);
    }
    const __m512i s2v = _mm512_set1_epi32((int)s2), one = _mm512_set1_epi32(1);
    for (int j = 0; j < c; j += 16)
        _mm512_storeu_si512(h2 + j, _mm512_or_si512(hp_fmix32_x16(_mm512_xor_si512(
            _mm512_loadu_si512(xs + j), s2v)), one));
    for (int32_t i = 1; i < nh && c; i++) {
        int c2 = 0;
        for (int j = 0; j < c; j += 16) {
            const __mmask16 valid = c - j >= 16 ? 0xFFFF : (__mmask16)((1u << (c - j)) - 1);
            const __m512i x = _mm512_loadu_si512(xs + j), d = _mm512_loadu_si512(h2 + j);
            const __m512i h = _mm512_add_epi32(_mm512_loadu_si512(hs + j), d);
            const __mmask16 k = hp_probe_x16(h, mv, f, valid);
            _mm512_storeu_si512(xs + c2, _mm512_maskz_compress_epi32(k, x));
            _mm512_storeu_si512(hs + c2, _mm512_maskz_compress_epi32(k, h));
            _mm512_storeu_si512(h2 + c2, _mm512_maskz_compress_epi32(k, d));
            c2 += __builtin_popcount(k);
        }
        c = c2;
    }
    return c;
}
#endif

/* The scalar run (hp_query_run_x16's steps, one element at a time). */
static int hp_query_run(const uint8_t *f, uint64_t m, uint32_t base, int len, int32_t nh,
                        uint32_t s1, uint32_t s2, uint32_t *xs, uint32_t *hs, uint32_t *h2) {
    int c = 0;
    for (int j = 0; j < len; j++)
        h2[j] = hp_fmix32((base + (uint32_t)j) ^ s1); /* h2 holds h1 for a moment */
    for (int j = 0; j < len; j++) {
        const uint64_t p = hp_probe(h2[j], m);
        xs[c] = base + (uint32_t)j;
        hs[c] = h2[j];
        c += (f[p >> 3] >> (p & 7)) & 1u;
    }
    for (int j = 0; j < c; j++)
        h2[j] = hp_fmix32(xs[j] ^ s2) | 1u;
    for (int32_t i = 1; i < nh && c; i++) {
        int c2 = 0;
        for (int j = 0; j < c; j++) {
            const uint32_t h = hs[j] + h2[j];
            const uint64_t p = hp_probe(h, m);
            xs[c2] = xs[j];
            hs[c2] = h;
            h2[c2] = h2[j];
            c2 += (f[p >> 3] >> (p & 7)) & 1u;
        }
        c = c2;
    }
    return c;
}

int64_t hp_bloom_query(const uint8_t *filter, int64_t nbytes, const int64_t *mb,
                       const int64_t *off, int32_t log2u, int32_t nh, uint32_t s1, uint32_t s2,
                       int64_t n, int64_t b0, int64_t b1, int64_t *out, int64_t cap) {
#if !defined(__AVX512F__)
    (void)nbytes; /* the scalar loop reads only inside each filter */
#endif
    int64_t cnt = 0;
    uint32_t xs[HP_BQ + 16], hs[HP_BQ + 16], h2[HP_BQ + 16]; /* + 16: a vector's slack */
    for (int64_t blk = b0; blk < b1; blk++) {
        const uint64_t m = (uint64_t)mb[blk];
        if (!m)
            continue; /* an empty block: its filter holds nothing */
        const uint8_t *f = filter + off[blk];
        const int64_t x0 = blk << log2u, x1 = (x0 + (1LL << log2u) < n) ? x0 + (1LL << log2u) : n;
#if defined(__AVX512F__)
        const int wide = off[blk] + (int64_t)((m + 7) >> 3) + 3 <= nbytes;
#endif
        for (int64_t b = x0; b < x1; b += HP_BQ) {
            const int len = (int)(x1 - b < HP_BQ ? x1 - b : HP_BQ);
            int c;
#if defined(__AVX512F__)
            if (wide)
                c = hp_query_run_x16(f, (uint32_t)m, (uint32_t)b, len, nh, s1, s2, xs, hs, h2);
            else
#endif
                c = hp_query_run(f, m, (uint32_t)b, len, nh, s1, s2, xs, hs, h2);
            for (int j = 0; j < c; j++) {
                if (cnt < cap)
                    out[cnt] = (int64_t)xs[j];
                cnt++;
            }
        }
    }
    return cnt;
}

/* ------------------------------------------------------------------------
 * bloom.py's "conflict" policy (bloom._conflict says what its rounds do;
 * this is the same algorithm on the same integers, so both select the
 * same candidates). cand: the p sorted positives; key_out: their hash keys
 * fmix32(x ^ kseed), written for the caller; sel: in/out selection flags.
 * Each candidate's nh probe positions are sorted, repeats dropped.
 *
 * An order is (((nh - live) << 20 | min(sizes summed, 2**20 - 1)) << 32) | key
 * (a live pair: an unselected candidate's probe of an uncovered bit; a
 * bit's size: its live pairs).
 *
 * Layout for the cache: the live pairs are sorted by bit once (a counting
 * sort), so each bit's candidates (its conflict set) sit together and a
 * round walks them in order. A selected candidate covers all its bits, so
 * an uncovered bit's candidates are all unselected and its size never
 * changes; a set dies when one of its candidates is selected. Each round
 * drops the dead sets, counts per candidate its live pairs, their summed
 * sizes and its singleton sets, then (no singleton anywhere) finds each
 * set's first candidate by order: a candidate is accepted when it is
 * first in all its live sets. After the rounds, the rest is drawn by smallest
 * key. Returns the number of rounds run, or -1 when out of memory.
 * ------------------------------------------------------------------------ */
#define HP_BIG 0x7FFFFFFFFFFFFFFFULL
#define HP_TOTAL_CAP ((1LL << 20) - 1)

static int hp_cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* One thread's workspace for the blocks it resolves, sized for its largest
 * block and reused (a block's arrays are a megabyte; allocating them per
 * block cost a page fault per 4 KB touched). */
typedef struct {
    int32_t *pos, *members, *gstart, *glive, *nlive, *nsingle, *wins, *bitcount, *gid, *act,
        *fresh;
    int64_t *total;
    uint64_t *order, *tmp;
    uint8_t *acc, *covered, *gdead;
} hp_conflict_ws;

static void hp_conflict_free(hp_conflict_ws *w) {
    void *all[] = {w->pos,  w->members, w->gstart, w->glive, w->nlive, w->nsingle,
                   w->wins, w->bitcount, w->gid,   w->act,   w->fresh, w->total,
                   w->order, w->tmp,     w->acc,   w->covered, w->gdead};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        free(all[i]);
}

static int hp_conflict_alloc(hp_conflict_ws *w, int64_t p, int64_t m, int32_t nh) {
    const size_t P = (size_t)(p ? p : 1), L = P * (size_t)nh, M = (size_t)m + 1;
    memset(w, 0, sizeof *w);
    w->pos = malloc(sizeof(int32_t) * L);
    w->members = malloc(sizeof(int32_t) * L);
    w->gstart = malloc(sizeof(int32_t) * (L + 1));
    w->glive = malloc(sizeof(int32_t) * L);
    w->nlive = malloc(sizeof(int32_t) * P);
    w->nsingle = malloc(sizeof(int32_t) * P);
    w->wins = malloc(sizeof(int32_t) * P);
    w->bitcount = malloc(sizeof(int32_t) * M);
    w->gid = malloc(sizeof(int32_t) * M);
    w->act = malloc(sizeof(int32_t) * P);
    w->fresh = malloc(sizeof(int32_t) * P);
    w->total = malloc(sizeof(int64_t) * P);
    w->order = malloc(sizeof(uint64_t) * P);
    w->tmp = malloc(sizeof(uint64_t) * P);
    w->acc = malloc(P);
    w->covered = malloc(M);
    w->gdead = malloc(L);
    if (!w->pos || !w->members || !w->gstart || !w->glive || !w->nlive || !w->nsingle ||
        !w->wins || !w->bitcount || !w->gid || !w->act || !w->fresh || !w->total ||
        !w->order || !w->tmp || !w->acc || !w->covered || !w->gdead) {
        hp_conflict_free(w);
        return -1;
    }
    return 0;
}

/* The smallest-`need` bound of the n orders in tmp (they are distinct):
 * every order is kept when there are at most `need` of them. */
static uint64_t hp_limit(uint64_t *tmp, int64_t n, int64_t need) {
    if (n <= need)
        return HP_BIG;
    qsort(tmp, (size_t)n, sizeof(uint64_t), hp_cmp_u64);
    return tmp[need - 1];
}

/* One block (the comment above says what it does). Each candidate's probe
 * row keeps its distinct bits, a repeat replaced by the sentinel bit m (as
 * the torch path's sort-then-mark does; the row's order is never read).
 * The conflict sets are the bits' lists of live pairs, built by a counting
 * sort over the bits (one pass; within a bit the candidates stay in
 * increasing order, as a stable sort of the (bit, candidate) pairs would
 * leave them). A round recounts the live sets only, and finds the dead ones
 * without reading their members: a set dies when one of its candidates is
 * selected, so last round's selections mark their bits' sets dead through
 * their rows. Only the candidates still in a live set (act) are ranked. */
static int32_t hp_conflict_block(hp_conflict_ws *w, const int64_t *cand, int64_t p, int64_t m,
                                 int32_t nh, uint32_t s1, uint32_t s2, uint32_t kseed,
                                 int64_t *key_out, uint8_t *sel, int64_t r, int32_t rounds) {
    int32_t *pos = w->pos, *members = w->members, *gstart = w->gstart, *glive = w->glive;
    int32_t *nlive = w->nlive, *nsingle = w->nsingle, *wins = w->wins, *bitcount = w->bitcount;
    int32_t *gid = w->gid, *act = w->act, *fresh = w->fresh;
    int64_t *total = w->total;
    uint64_t *order = w->order, *tmp = w->tmp;
    uint8_t *acc = w->acc, *covered = w->covered, *gdead = w->gdead;
    const size_t P = (size_t)(p ? p : 1);
    int32_t t;
    for (int64_t x = 0; x < p; x++) {
        const uint32_t v = (uint32_t)cand[x];
        key_out[x] = (int64_t)hp_fmix32(v ^ kseed);
        int32_t *row = pos + x * nh;
        uint32_t h = hp_fmix32(v ^ s1);
        const uint32_t h2 = hp_fmix32(v ^ s2) | 1u;
        for (int32_t i = 0; i < nh; i++, h += h2) { /* a repeat becomes m, without a branch */
            const int32_t q = (int32_t)hp_probe(h, (uint64_t)m);
            int32_t dup = 0;
            for (int32_t k = 0; k < i; k++)
                dup |= row[k] == q;
            row[i] = dup ? (int32_t)m : q;
        }
    }
    memset(covered, 0, (size_t)m + 1);
    covered[m] = 1;
    int64_t nsel = 0;
    for (int64_t x = 0; x < p; x++)
        if (sel[x]) {
            nsel++;
            for (int32_t i = 0; i < nh; i++)
                covered[pos[x * nh + i]] = 1;
        }
    /* counting sort of the live pairs by bit: bitcount[j] becomes bit j's first slot */
    memset(bitcount, 0, sizeof(int32_t) * ((size_t)m + 1));
    for (int64_t x = 0; x < p; x++)
        if (!sel[x])
            for (int32_t i = 0; i < nh; i++) {
                const int32_t j = pos[x * nh + i];
                bitcount[j] += !covered[j];
            }
    int64_t ng = 0, np = 0;
    for (int64_t j = 0; j < m; j++) {
        const int32_t c = bitcount[j];
        bitcount[j] = (int32_t)np;
        gid[j] = c ? (int32_t)ng : -1;
        if (c) {
            gstart[ng] = (int32_t)np;
            glive[ng] = (int32_t)ng;
            ng++;
            np += c;
        }
    }
    gid[m] = -1;
    gstart[ng] = (int32_t)np;
    memset(gdead, 0, (size_t)(ng ? ng : 1));
    for (int64_t x = 0; x < p; x++)
        if (!sel[x])
            for (int32_t i = 0; i < nh; i++) {
                const int32_t j = pos[x * nh + i];
                if (!covered[j])
                    members[bitcount[j]++] = (int32_t)x;
            }
    /* the first round's counts (every set is live before a selection) */
    memset(nlive, 0, sizeof(int32_t) * P);
    memset(nsingle, 0, sizeof(int32_t) * P);
    memset(total, 0, sizeof(int64_t) * P);
    for (int64_t g = 0; g < ng; g++) {
        const int32_t g0 = gstart[g], g1 = gstart[g + 1];
        for (int32_t q = g0; q < g1; q++) {
            nlive[members[q]]++;
            total[members[q]] += g1 - g0;
            nsingle[members[q]] += g1 - g0 == 1;
        }
    }
    int64_t nact = 0, nfresh = 0;
    for (int64_t x = 0; x < p; x++)
        if (nlive[x])
            act[nact++] = (int32_t)x;
    for (t = 0; t < rounds; t++) {
        const int64_t need = r - nsel;
        if (need <= 0)
            break;
        if (t) { /* the sets of last round's selections die; count the live pairs again */
            for (int64_t f = 0; f < nfresh; f++) {
                const int32_t *row = pos + (int64_t)fresh[f] * nh;
                for (int32_t i = 0; i < nh; i++) {
                    const int32_t g = gid[row[i]];
                    if (g >= 0)
                        gdead[g] = 1;
                }
            }
            int64_t kept = 0;
            for (int64_t a = 0; a < nact; a++) {
                const int32_t x = act[a];
                nlive[x] = nsingle[x] = 0;
                total[x] = 0;
            }
            for (int64_t b = 0; b < ng; b++) {
                const int32_t g = glive[b], g0 = gstart[g], g1 = gstart[g + 1];
                if (gdead[g])
                    continue;
                glive[kept++] = g;
                for (int32_t q = g0; q < g1; q++) {
                    const int32_t y = members[q];
                    nlive[y]++;
                    total[y] += g1 - g0;
                    nsingle[y] += g1 - g0 == 1;
                }
            }
            ng = kept;
            kept = 0;
            for (int64_t a = 0; a < nact; a++)
                if (nlive[act[a]])
                    act[kept++] = act[a];
            nact = kept;
        }
        if (!ng)
            break;
        int64_t nforced = 0;
        for (int64_t a = 0; a < nact; a++)
            nforced += nsingle[act[a]] != 0;
        if (nforced) {
            for (int64_t a = 0; a < nact; a++) {
                const int32_t x = act[a];
                order[x] = (uint64_t)key_out[x];
                acc[x] = nsingle[x] != 0;
            }
        } else {
            for (int64_t a = 0; a < nact; a++) {
                const int32_t x = act[a];
                const int64_t tot = total[x] < HP_TOTAL_CAP ? total[x] : HP_TOTAL_CAP;
                order[x] = ((((uint64_t)nh - (uint64_t)nlive[x]) << 20 | (uint64_t)tot) << 32) |
                           (uint64_t)key_out[x];
                wins[x] = 0;
            }
            for (int64_t b = 0; b < ng; b++) {
                const int32_t g = glive[b];
                int32_t first = members[gstart[g]];
                for (int32_t q = gstart[g] + 1; q < gstart[g + 1]; q++)
                    if (order[members[q]] < order[first])
                        first = members[q];
                wins[first]++;
            }
            for (int64_t a = 0; a < nact; a++)
                acc[act[a]] = wins[act[a]] == nlive[act[a]];
        }
        int64_t nacc = 0;
        for (int64_t a = 0; a < nact; a++)
            if (acc[act[a]])
                tmp[nacc++] = order[act[a]];
        const uint64_t limit = hp_limit(tmp, nacc, need);
        nfresh = 0;
        for (int64_t a = 0; a < nact; a++) {
            const int32_t x = act[a];
            if (acc[x] && order[x] <= limit) {
                sel[x] = 1;
                fresh[nfresh++] = x;
            }
        }
        nsel += nfresh;
    }
    if (r - nsel > 0) { /* the rest by smallest key, as bloom.select does */
        int64_t nacc = 0;
        for (int64_t x = 0; x < p; x++)
            if (!sel[x])
                tmp[nacc++] = (uint64_t)key_out[x];
        const uint64_t limit = hp_limit(tmp, nacc, r - nsel);
        for (int64_t x = 0; x < p; x++)
            if (!sel[x] && (uint64_t)key_out[x] <= limit)
                sel[x] = 1;
    }
    return t;
}

/* The conflict policy of blocks [b0, b1): block b's candidates are
 * cand[cstart[b] .. cstart[b + 1]), drawn against its own mb[b] bits and rb[b]
 * positions. Returns the fewest rounds run in a block, or -1 when out of memory. */
int32_t hp_bloom_conflict_blocks(const int64_t *cand, const int64_t *cstart, const int64_t *mb,
                                 const int64_t *rb, int64_t b0, int64_t b1, int32_t nh,
                                 uint32_t s1, uint32_t s2, uint32_t kseed, int64_t *key_out,
                                 uint8_t *sel, int32_t rounds) {
    int64_t pmax = 0, mmax = 0;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t pb = cstart[b + 1] - cstart[b];
        pmax = pb > pmax ? pb : pmax;
        mmax = mb[b] > mmax ? mb[b] : mmax;
    }
    hp_conflict_ws w;
    if (hp_conflict_alloc(&w, pmax, mmax, nh))
        return -1;
    int32_t fewest = rounds;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t c0 = cstart[b], c1 = cstart[b + 1];
        const int32_t t = hp_conflict_block(&w, cand + c0, c1 - c0, mb[b], nh, s1, s2, kseed,
                                            key_out + c0, sel + c0, rb[b], rounds);
        if (t < fewest)
            fewest = t;
    }
    hp_conflict_free(&w);
    return fewest;
}

/* ------------------------------------------------------------------------
 * ops.topk_abs's filter (ops.abs_at_least + torch.nonzero in one pass): the
 * positions i in [i0, i1) with |x[i]| >= t, in increasing order, at most cap
 * of them written to out; returns how many there are. NaN is never taken
 * (a comparison with NaN is false), as in the torch path. Sixteen
 * comparisons make a bit mask the compiler vectorises; the few set bits
 * (top-k keeps about 1%) are then walked.
 * ------------------------------------------------------------------------ */
int64_t hp_abs_at_least(const float *restrict x, int64_t i0, int64_t i1, float t,
                        int64_t *restrict out, int64_t cap) {
    int64_t c = 0, i = i0;
    for (; i + 16 <= i1; i += 16) {
        uint32_t m = 0;
        for (int j = 0; j < 16; j++)
            m |= (uint32_t)(__builtin_fabsf(x[i + j]) >= t) << j;
        while (m) {
            const int j = __builtin_ctz(m);
            m &= m - 1;
            if (c < cap)
                out[c] = i + j;
            c++;
        }
    }
    for (; i < i1; i++)
        if (__builtin_fabsf(x[i]) >= t) {
            if (c < cap)
                out[c] = i;
            c++;
        }
    return c;
}

/* ------------------------------------------------------------------------
 * PowerSGD's round 0 (_fused_lowrank.powersgd_form_m), in place (out == e)
 * or into a second buffer (the double buffering of PowerSGD.detach_state),
 * with the same bits either way: per row i in [r0, r1) of a (rows, cols)
 * matrix,
 *
 *   out[i,j] = (g[i,j] + e[i,j]) - a[i,j],  a = pp[i,0]*qp[0,j]; a = a + pp[i,1]*qp[1,j] ...
 *   p[i,k]   = sum_j out[i,j] * qt[k,j]     for k < rank
 *
 * M rounds as the torch kernels' pointwise formula (no contraction, the
 * outer products summed in the same order); P is a local payload and sums
 * in this loop's own fixed order (8 lanes, then the lanes in order, then
 * the row's unaligned head and tail), the same on every run.
 *
 * Why C: out is written with non-temporal stores. A store to a line not in
 * the cache first reads it ("read for ownership"), so an ordinary sweep
 * into a second buffer moves a third more bytes than the same sweep in
 * place; streaming stores skip that read, and keeping the previous error
 * untouched (so a step can be undone without a copy) then costs what
 * forming M in place does.
 * ------------------------------------------------------------------------ */
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define HP_PSGD_MAX_RANK 8

/* The outer products' sum at column j: a = pi[0]*qt[j], then a = a + pi[k]*qt[k,j]
 * for k = 1.. in order (the torch kernels' _outer_sum, rounding alike). */
static inline float hp_outer(const float *pi, const float *qt, int rank, int64_t cols,
                             int64_t j) {
    float a = pi[0] * qt[j];
    for (int k = 1; k < rank; k++)
        a = a + pi[k] * qt[(int64_t)k * cols + j];
    return a;
}

#if defined(__AVX__)
/* hp_outer for columns j .. j+7. */
static inline __m256 hp_outer8(const float *pi, const float *qt, int rank, int64_t cols,
                               int64_t j) {
    __m256 a = _mm256_mul_ps(_mm256_set1_ps(pi[0]), _mm256_loadu_ps(qt + j));
    for (int k = 1; k < rank; k++)
        a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(pi[k]),
                                           _mm256_loadu_ps(qt + (int64_t)k * cols + j)));
    return a;
}
#endif

/* One element of round 0: out[j] = (g[j] + e[j]) - hp_outer(pp, qp), and
 * acc[k] += out[j] * qt[k,j]. */
static inline void hp_psgd_elem(const float *e, const float *g, const float *pp,
                                const float *qp, int prev, const float *qt, int rank,
                                int64_t cols, int64_t j, float *out, float *acc) {
    float m = g[j] + e[j];
    if (prev)
        m = m - hp_outer(pp, qp, prev, cols, j);
    out[j] = m;
    for (int k = 0; k < rank; k++)
        acc[k] = acc[k] + m * qt[(int64_t)k * cols + j];
}

void hp_psgd_form_m(const float *e, const float *restrict g,
                    const float *restrict pp, const float *restrict qp, int prev,
                    const float *restrict qt, int rank, float *out,
                    float *restrict p, int64_t cols, int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; i++) {
        const float *ei = e + i * cols, *gi = g + i * cols;
        const float *ppi = prev ? pp + i * prev : NULL;
        float *oi = out + i * cols, *pi = p + i * rank;
        int64_t j = 0;
#if defined(__AVX__)
        if (rank <= HP_PSGD_MAX_RANK) {
            float head[HP_PSGD_MAX_RANK] = {0}, tail[HP_PSGD_MAX_RANK] = {0};
            /* scalar until out is 32-byte aligned, then 8 floats per streaming store */
            for (; j < cols && ((uintptr_t)(oi + j) & 31); j++)
                hp_psgd_elem(ei, gi, ppi, qp, prev, qt, rank, cols, j, oi, head);
            __m256 acc[HP_PSGD_MAX_RANK];
            for (int k = 0; k < rank; k++)
                acc[k] = _mm256_setzero_ps();
            for (; j + 8 <= cols; j += 8) {
                __m256 m = _mm256_add_ps(_mm256_loadu_ps(gi + j), _mm256_loadu_ps(ei + j));
                if (prev)
                    m = _mm256_sub_ps(m, hp_outer8(ppi, qp, prev, cols, j));
                _mm256_stream_ps(oi + j, m);
                for (int k = 0; k < rank; k++)
                    acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(
                        m, _mm256_loadu_ps(qt + (int64_t)k * cols + j)));
            }
            for (; j < cols; j++)
                hp_psgd_elem(ei, gi, ppi, qp, prev, qt, rank, cols, j, oi, tail);
            for (int k = 0; k < rank; k++) {
                float lanes[8];
                _mm256_storeu_ps(lanes, acc[k]);
                float s = lanes[0];
                for (int l = 1; l < 8; l++)
                    s = s + lanes[l];
                pi[k] = (s + head[k]) + tail[k];
            }
            continue;
        }
#endif
        for (int k = 0; k < rank; k++)
            pi[k] = 0.0f;
        for (; j < cols; j++)
            hp_psgd_elem(ei, gi, ppi, qp, prev, qt, rank, cols, j, oi, pi);
    }
#if defined(__AVX__)
    _mm_sfence(); /* the streamed lines are visible to other threads once this returns */
#endif
}

/* PowerSGD's decode, out = P Q^T (_fused_lowrank.powersgd_lowrank): hp_outer per
 * element, the bits of the torch kernels' outer-product sum, written with
 * streaming stores (out is the gradient's buffer, not in the cache: no read for
 * ownership). */
void hp_psgd_lowrank(const float *restrict p, const float *restrict qt, int rank,
                     float *restrict out, int64_t cols, int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; i++) {
        const float *pi = p + i * rank;
        float *oi = out + i * cols;
        int64_t j = 0;
#if defined(__AVX__)
        for (; j < cols && ((uintptr_t)(oi + j) & 31); j++)
            oi[j] = hp_outer(pi, qt, rank, cols, j);
        for (; j + 8 <= cols; j += 8)
            _mm256_stream_ps(oi + j, hp_outer8(pi, qt, rank, cols, j));
#endif
        for (; j < cols; j++)
            oi[j] = hp_outer(pi, qt, rank, cols, j);
    }
#if defined(__AVX__)
    _mm_sfence();
#endif
}
