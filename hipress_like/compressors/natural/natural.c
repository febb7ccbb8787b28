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

#include "hp_native.h"

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

