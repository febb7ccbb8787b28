#include "hp_native.h"

/* ------------------------------------------------------------------------
 * PowerSGD's products in the lane order (compll/matrices.py, "the lane
 * order", the definition CompLL's matmul and orthogonalize share, so the
 * DSL program gives these bits): a sum over an index t of x_t is
 *
 *   ((L0 + L1) + L2) ... + L7,   Lc = ((-0 + x_c) + x_{c+8}) + x_{c+16} ...
 *
 * float32 products and sums, no contraction; -0 is the additive identity
 * (-0 + x == x for every x, signed zeros included), so an empty lane changes
 * nothing and a sum of at most 8 terms is x_0 + x_1 + ... left to right.
 * Eight lanes are what one AVX register holds, so the long sums vectorise
 * with no reassociation, and the order depends on nothing but the index.
 * ------------------------------------------------------------------------ */
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <math.h>

#define HP_PSGD_MAX_RANK 8
#define HP_PSGD_AHEAD 1024 /* elements: bfloat16 M's software prefetch distance */
#define HP_NEG0 (-0.0f)

static inline float hp_lanes_total(const float *lanes) {
    float s = lanes[0];
    for (int l = 1; l < 8; l++)
        s = s + lanes[l];
    return s;
}

/* sum_t x[t sx] y[t sy] over t < n in the lane order. */
static float hp_lane_dot(const float *x, int64_t sx, const float *y, int64_t sy, int64_t n) {
    float lanes[8];
    for (int l = 0; l < 8; l++)
        lanes[l] = HP_NEG0;
    for (int64_t t = 0; t < n; t++)
        lanes[t & 7] = lanes[t & 7] + x[t * sx] * y[t * sy];
    return hp_lanes_total(lanes);
}

/* The outer products' sum at column j: pi[0]*qt[j] + pi[1]*qt[cols+j] + ... left
 * to right (the lane order of rank <= 8 terms; lowrank._outer_sum's bits). */
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

/* ------------------------------------------------------------------------
 * Round 0 (lowrank.powersgd_form_m), in place (out == e) or into a second
 * buffer (the double buffering of PowerSGD.detach_state), with the same bits
 * either way: per row i in [r0, r1) of a (rows, cols) matrix,
 *
 *   out[i,j] = g[i,j] + (e[i,j] - a[i,j]),  a = P' Q'^T at (i, j) (hp_outer)
 *   p[i,k]   = sum_j out[i,j] * qt[k,j]     for k < rank, in the lane order
 *
 * e - P' Q'^T is the error feedback memory kept in factored form (the
 * previous step's M and its approximation), rounded as the explicit
 * e = M - P^ Q^T would be. The AVX sweep starts where out is 32-byte aligned
 * (for the streaming stores); its vector lane l then holds the index class
 * (h + l) mod 8 of a row whose unaligned head has h elements, so the head
 * seeds those lanes and the tail continues them: the lane order, whatever the
 * address.
 *
 * Why C: out is written with non-temporal stores. A store to a line not in
 * the cache first reads it ("read for ownership"), so an ordinary sweep
 * into a second buffer moves a third more bytes than the same sweep in
 * place; streaming stores skip that read, and keeping the previous error
 * untouched (so a step can be undone without a copy) then costs what
 * forming M in place does.
 * ------------------------------------------------------------------------ */

/* ------------------------------------------------------------------------
 * M kept in bfloat16 (PowerSGD(error_dtype="bfloat16")): the error memory,
 * the matrix a step forms and reads twice, stored in 16 bits, which halves
 * the bytes of two of the step's three gradient-sized reads and one of its
 * two writes. A float rounds to the nearest bfloat16, ties to even, and NaN
 * becomes 0xFFFF, as torch's CPU conversion writes them (so the torch path
 * stores the same bits); a bfloat16 widens exactly. The
 * sums take the stored (rounded) M, so round 0's P, round 1's Q and the
 * error all see one matrix.
 * ------------------------------------------------------------------------ */
static inline uint16_t hp_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float hp_widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Element j of a float (half == 0) or bfloat16 (half == 1) array. */
static inline __attribute__((always_inline)) float hp_psgd_at(const void *a, int half,
                                                              int64_t j) {
    return half ? hp_widen(((const uint16_t *)a)[j]) : ((const float *)a)[j];
}

/* Store m at element j (rounded when half) and return the value stored. */
static inline __attribute__((always_inline)) float hp_psgd_put(void *a, int half, int64_t j,
                                                               float m) {
    if (!half) {
        ((float *)a)[j] = m;
        return m;
    }
    const uint16_t h = hp_bf16(m);
    ((uint16_t *)a)[j] = h;
    return hp_widen(h);
}

#if defined(__AVX2__)
/* 8 bfloat16 widened to floats. */
static inline __m256 hp_widen8(const uint16_t *h) {
    const __m128i v = _mm_loadu_si128((const __m128i *)h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* hp_bf16 of 8 floats: the 8 results packed (*packed) and widened back (returned). */
static inline __m256 hp_round8(__m256 x, __m128i *packed) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i bias = _mm256_add_epi32(
        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
        _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff),
                           _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    *packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    return _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
}
#elif defined(__AVX__)
/* AVX without AVX2's integer lanes: the same results element by element. */
static inline __m256 hp_widen8(const uint16_t *h) {
    float f[8];
    for (int l = 0; l < 8; l++)
        f[l] = hp_widen(h[l]);
    return _mm256_loadu_ps(f);
}

static inline __m256 hp_round8(__m256 x, __m128i *packed) {
    float f[8];
    uint16_t o[8];
    _mm256_storeu_ps(f, x);
    for (int l = 0; l < 8; l++) {
        o[l] = hp_bf16(f[l]);
        f[l] = hp_widen(o[l]);
    }
    *packed = _mm_loadu_si128((const __m128i *)o);
    return _mm256_loadu_ps(f);
}
#endif

/* One element of round 0 into the class lanes cls[k][j mod 8]. */
static inline __attribute__((always_inline)) void
hp_psgd_elem(const void *e, int half, const float *g, const float *pp, const float *qp,
             int prev, const float *qt, int rank, int64_t cols, int64_t j, void *out,
             float cls[][8]) {
    const float ej = hp_psgd_at(e, half, j);
    float m = prev ? g[j] + (ej - hp_outer(pp, qp, prev, cols, j)) : g[j] + ej;
    m = hp_psgd_put(out, half, j, m);
    for (int k = 0; k < rank; k++)
        cls[k][j & 7] = cls[k][j & 7] + m * qt[(int64_t)k * cols + j];
}

/* Round 0 over rows [r0, r1), M (e and out) in floats or, half, in bfloat16; the rank
 * known when inlined, so the sums' accumulators stay in registers (in memory, each
 * 8 columns would wait on a store and a load of the one before). */
static inline __attribute__((always_inline)) void
hp_psgd_form_rows(const int rank, const int half, const void *e, const float *restrict g,
                  const float *restrict pp, const float *restrict qp, int prev,
                  const float *restrict qt, void *out, float *restrict p,
                  int64_t cols, int64_t r0, int64_t r1) {
    const size_t esz = half ? 2 : 4;
    for (int64_t i = r0; i < r1; i++) {
        const char *ei = (const char *)e + (size_t)(i * cols) * esz;
        const float *gi = g + i * cols;
        const float *ppi = prev ? pp + i * prev : NULL;
        char *oi = (char *)out + (size_t)(i * cols) * esz;
        float *pi = p + i * rank;
        float cls[HP_PSGD_MAX_RANK][8];
        for (int k = 0; k < rank; k++)
            for (int l = 0; l < 8; l++)
                cls[k][l] = HP_NEG0;
        int64_t j = 0;
#if defined(__AVX__)
        /* scalar until out is aligned for the streaming stores (32 bytes of floats,
         * 16 of bfloat16), then 8 elements per store */
        const uintptr_t align = half ? 15 : 31;
        for (; j < cols && ((uintptr_t)(oi + (size_t)j * esz) & align); j++)
            hp_psgd_elem(ei, half, gi, ppi, qp, prev, qt, rank, cols, j, oi, cls);
        const int64_t h = j;
        __m256 acc[HP_PSGD_MAX_RANK];
        for (int k = 0; k < rank; k++) {
            float seed[8];
            for (int l = 0; l < 8; l++)
                seed[l] = cls[k][(h + l) & 7];
            acc[k] = _mm256_loadu_ps(seed);
        }
        for (; j + 8 <= cols; j += 8) {
            if (half && !(j & 15)) {
                /* a line of g (and every other one of M) 4 KB ahead: one sweep's reads
                 * alone keep too few misses in flight to fill the bandwidth that the
                 * halved M leaves (float32 M's traffic fills it already) */
                _mm_prefetch((const char *)(gi + j + HP_PSGD_AHEAD), _MM_HINT_T0);
                if (!(j & 31))
                    _mm_prefetch((const char *)((const uint16_t *)ei + j + HP_PSGD_AHEAD),
                                 _MM_HINT_T0);
            }
            __m256 m = half ? hp_widen8((const uint16_t *)ei + j)
                            : _mm256_loadu_ps((const float *)ei + j);
            if (prev)
                m = _mm256_sub_ps(m, hp_outer8(ppi, qp, prev, cols, j));
            m = _mm256_add_ps(_mm256_loadu_ps(gi + j), m);
            if (half) {
                __m128i packed;
                m = hp_round8(m, &packed);
                _mm_stream_si128((__m128i *)((uint16_t *)oi + j), packed);
            } else {
                _mm256_stream_ps((float *)oi + j, m);
            }
            for (int k = 0; k < rank; k++)
                acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(
                    m, _mm256_loadu_ps(qt + (int64_t)k * cols + j)));
        }
        for (int k = 0; k < rank; k++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[k]);
            for (int l = 0; l < 8; l++)
                cls[k][(h + l) & 7] = lanes[l];
        }
#endif
        for (; j < cols; j++)
            hp_psgd_elem(ei, half, gi, ppi, qp, prev, qt, rank, cols, j, oi, cls);
        for (int k = 0; k < rank; k++)
            pi[k] = hp_lanes_total(cls[k]);
    }
#if defined(__AVX__)
    _mm_sfence(); /* the streamed lines are visible to other threads once this returns */
#endif
}

/* Round 0 (see above): e and out float32 (half == 0) or bfloat16 (half == 1). */
void hp_psgd_form_m(const void *e, const float *restrict g, const float *restrict pp,
                    const float *restrict qp, int prev, const float *restrict qt, int rank,
                    void *out, float *restrict p, int64_t cols, int64_t r0, int64_t r1,
                    int half) {
#define HP_FORM_ROWS(R, H) hp_psgd_form_rows(R, H, e, g, pp, qp, prev, qt, out, p, cols, r0, r1)
    switch (rank) {  /* the rank as a constant, as hp_psgd_mtp */
    case 1: if (half) HP_FORM_ROWS(1, 1); else HP_FORM_ROWS(1, 0); break;
    case 2: if (half) HP_FORM_ROWS(2, 1); else HP_FORM_ROWS(2, 0); break;
    case 4: if (half) HP_FORM_ROWS(4, 1); else HP_FORM_ROWS(4, 0); break;
    default: if (half) HP_FORM_ROWS(rank, 1); else HP_FORM_ROWS(rank, 0); break;
    }
#undef HP_FORM_ROWS
}

/* P = M Q for a formed (rows, cols) matrix (the padded path), rows [r0, r1):
 * p[i,k] = sum_j m[i,j] qt[k,j] in the lane order (hp_psgd_form_m's sums). */
void hp_psgd_mq(const float *restrict m, const float *restrict qt, int rank,
                float *restrict p, int64_t cols, int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; i++) {
        const float *mi = m + i * cols;
        for (int k = 0; k < rank; k++) {
            const float *qk = qt + (int64_t)k * cols;
            float lanes[8];
            for (int l = 0; l < 8; l++)
                lanes[l] = HP_NEG0;
            int64_t j = 0;
            for (; j + 8 <= cols; j += 8)
                for (int l = 0; l < 8; l++)  /* one vector add per 8 columns */
                    lanes[l] = lanes[l] + mi[j + l] * qk[j + l];
            for (; j < cols; j++)
                lanes[j & 7] = lanes[j & 7] + mi[j] * qk[j];
            p[i * rank + k] = hp_lanes_total(lanes);
        }
    }
}

/* Round 1's Q = M^T P for the columns [c0, c1) of a (rows, cols) matrix:
 * q[j,k] = sum_i m[i,j] p[i,k] in the lane order over i. Per block of B
 * columns, the lanes (8 x rank x B floats) stay in the cache; M is read in
 * passes of 8 G rows, and each lane c takes the pass's G rows of its class
 * (c, c + 8, ...) in order in registers between one load and one store, so the
 * lanes cost 1/G of a load and a store per element of M and the loop over a
 * block's columns vectorises with no reassociation. Returns 0, or -1 when the
 * lanes cannot be allocated. */
#define HP_MTP_B 2048
#define HP_MTP_G 8

/* One pass of 8 G rows from row i (lanes per class c; rank R and half known when
 * inlined; M in floats or, half, in bfloat16). */
static inline __attribute__((always_inline)) void
hp_mtp_pass(const int R, const int half, const void *restrict m, const float *restrict p,
            float *lanes, int64_t cols, int64_t jb, int64_t w, int64_t i) {
    for (int c = 0; c < 8; c++) {
        const void *mr[HP_MTP_G];
        const float *pr[HP_MTP_G];
        for (int g = 0; g < HP_MTP_G; g++) {
            const int64_t at = (i + 8 * g + c) * cols + jb;
            mr[g] = half ? (const void *)((const uint16_t *)m + at)
                         : (const void *)((const float *)m + at);
            pr[g] = p + (i + 8 * g + c) * R;
        }
        float *lc = lanes + (int64_t)c * R * HP_MTP_B;
        int64_t j = 0;
#if defined(__AVX__)
        for (; j + 8 <= w; j += 8) {
            __m256 acc[HP_PSGD_MAX_RANK];
            for (int k = 0; k < R; k++)
                acc[k] = _mm256_load_ps(lc + (int64_t)k * HP_MTP_B + j);
            for (int g = 0; g < HP_MTP_G; g++) {
                const __m256 mv = half ? hp_widen8((const uint16_t *)mr[g] + j)
                                       : _mm256_loadu_ps((const float *)mr[g] + j);
                for (int k = 0; k < R; k++)
                    acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(mv, _mm256_broadcast_ss(pr[g] + k)));
            }
            for (int k = 0; k < R; k++)
                _mm256_store_ps(lc + (int64_t)k * HP_MTP_B + j, acc[k]);
        }
#endif
        for (; j < w; j++)
            for (int k = 0; k < R; k++) {
                float a = lc[(int64_t)k * HP_MTP_B + j];
                for (int g = 0; g < HP_MTP_G; g++)
                    a = a + hp_psgd_at(mr[g], half, j) * pr[g][k];
                lc[(int64_t)k * HP_MTP_B + j] = a;
            }
    }
}

/* Columns [c0, c1) of Q = M^T P (see above), M float32 (half == 0) or bfloat16. */
static inline __attribute__((always_inline)) int
hp_mtp_cols(const int half, const void *restrict m, const float *restrict p, int rank,
            float *restrict q, int64_t rows, int64_t cols, int64_t c0, int64_t c1) {
    float *lanes = (float *)aligned_alloc(32, sizeof(float) * 8 * (size_t)rank * HP_MTP_B);
    if (!lanes)
        return -1;
    for (int64_t jb = c0; jb < c1; jb += HP_MTP_B) {
        const int64_t w = c1 - jb < HP_MTP_B ? c1 - jb : HP_MTP_B;
        for (int64_t t = 0; t < 8 * (int64_t)rank; t++)  /* the block's part of each lane */
            for (int64_t j = 0; j < w; j++)
                lanes[t * HP_MTP_B + j] = HP_NEG0;
        int64_t i = 0;
        for (; i + 8 * HP_MTP_G <= rows; i += 8 * HP_MTP_G)
            switch (rank) {  /* the rank as a constant: the accumulators stay in registers */
            case 1: hp_mtp_pass(1, half, m, p, lanes, cols, jb, w, i); break;
            case 2: hp_mtp_pass(2, half, m, p, lanes, cols, jb, w, i); break;
            case 4: hp_mtp_pass(4, half, m, p, lanes, cols, jb, w, i); break;
            default: hp_mtp_pass(rank, half, m, p, lanes, cols, jb, w, i); break;
            }
        for (; i < rows; i++) {  /* the last rows, one at a time (each its class's next) */
            const int64_t at = i * cols + jb;
            const float *pi = p + i * rank;
            float *li = lanes + (i & 7) * (int64_t)rank * HP_MTP_B;
            for (int k = 0; k < rank; k++) {
                float *restrict lk = li + (int64_t)k * HP_MTP_B;
                for (int64_t j = 0; j < w; j++)
                    lk[j] = lk[j] + hp_psgd_at(m, half, at + j) * pi[k];
            }
        }
        for (int k = 0; k < rank; k++)
            for (int64_t j = 0; j < w; j++) {
                float s = lanes[(int64_t)k * HP_MTP_B + j];
                for (int l = 1; l < 8; l++)
                    s = s + lanes[((int64_t)l * rank + k) * HP_MTP_B + j];
                q[(jb + j) * rank + k] = s;
            }
    }
    free(lanes);
    return 0;
}

int hp_psgd_mtp(const void *restrict m, const float *restrict p, int rank, float *restrict q,
                int64_t rows, int64_t cols, int64_t c0, int64_t c1, int half) {
    return half ? hp_mtp_cols(1, m, p, rank, q, rows, cols, c0, c1)
                : hp_mtp_cols(0, m, p, rank, q, rows, cols, c0, c1);
}

/* Gram-Schmidt on the columns of a contiguous (rows, cols) matrix, in place
 * (ops.orthogonalize_'s steps, Vogels et al. 2019 Alg. 1 ORTHOGONALIZE), every
 * sum in the lane order: for column i, d[l] = a[:,l] . a[:,i] (l < i),
 * a[j,i] -= sum_l a[j,l] d[l], then a[:,i] /= sqrtf(a[:,i] . a[:,i]) + 1e-8.
 * Returns 0, or -1 when d cannot be allocated. */
int hp_psgd_orthogonalize(float *a, int64_t rows, int64_t cols) {
    float *d = (float *)malloc(sizeof(float) * (size_t)(cols > 0 ? cols : 1));
    if (!d)
        return -1;
    for (int64_t i = 0; i < cols && rows > 0; i++) {
        if (i) {
            for (int64_t l = 0; l < i; l++)
                d[l] = hp_lane_dot(a + l, cols, a + i, cols, rows);
            for (int64_t j = 0; j < rows; j++)
                a[j * cols + i] = a[j * cols + i] - hp_lane_dot(a + j * cols, 1, d, 1, i);
        }
        const float den = sqrtf(hp_lane_dot(a + i, cols, a + i, cols, rows)) + 1e-8f;
        for (int64_t j = 0; j < rows; j++)
            a[j * cols + i] = a[j * cols + i] / den;
    }
    free(d);
    return 0;
}

/* PowerSGD's decode, out = P Q^T (lowrank.powersgd_lowrank): hp_outer per
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

/* PowerSGD's decode applied by torch.optim.SGD's step in the same sweep
 * (deferred.py): per element, g = P Q^T (hp_outer's bits, the decode's) is
 * streamed into g_out (the gradient, as the decode writes it), then torch's
 * _single_tensor_sgd on g, with its roundings (measured against torch):
 *   d = maximize ? -g : g;        wd:  d = fma(w, wd, d)     (grad.add(param, alpha=wd))
 *   momentum: b = init ? d : fma(d, 1 - dampening, buf * momentum);  buf = b
 *             d = nesterov ? fma(b, momentum, d) : b
 *   w = fma(d, -lr, w)                                        (param.add_(d, alpha=-lr))
 * The decode's write and the step's read of the gradient leave the memory
 * traffic: a gradient-sized matrix not written and read again. */
static inline __attribute__((always_inline)) void
hp_sgd_elem(float g, float *w, float *buf, float lr, float mom, float damp1, float wd,
            int nesterov, int maximize, int init) {
    float d = maximize ? -g : g;
    if (wd != 0.0f)
        d = fmaf(*w, wd, d);
    if (mom != 0.0f) {
        const float b = init ? d : fmaf(d, damp1, *buf * mom);
        *buf = b;
        d = nesterov ? fmaf(b, mom, d) : b;
    }
    *w = fmaf(d, -lr, *w);
}

void hp_psgd_lowrank_sgd(const float *restrict p, const float *restrict qt, int rank,
                         float *restrict g_out, float *restrict w, float *restrict buf,
                         int64_t cols, int64_t r0, int64_t r1, float lr, float mom,
                         float damp1, float wd, int nesterov, int maximize, int init) {
    for (int64_t i = r0; i < r1; i++) {
        const float *pi = p + i * rank;
        float *gi = g_out + i * cols, *wi = w + i * cols;
        float *bi = mom != 0.0f ? buf + i * cols : NULL;
        int64_t j = 0;
#if defined(__AVX__) && defined(__FMA__)
        for (; j < cols && ((uintptr_t)(gi + j) & 31); j++) {
            const float g = hp_outer(pi, qt, rank, cols, j);
            gi[j] = g;
            hp_sgd_elem(g, wi + j, bi ? bi + j : NULL, lr, mom, damp1, wd, nesterov,
                        maximize, init);
        }
        const __m256 vlr = _mm256_set1_ps(-lr), vmom = _mm256_set1_ps(mom),
                     vd1 = _mm256_set1_ps(damp1), vwd = _mm256_set1_ps(wd);
        for (; j + 8 <= cols; j += 8) {
            const __m256 g = hp_outer8(pi, qt, rank, cols, j);
            _mm256_stream_ps(gi + j, g);
            __m256 d = maximize ? _mm256_sub_ps(_mm256_set1_ps(HP_NEG0), g) : g;
            __m256 wv = _mm256_loadu_ps(wi + j);
            if (wd != 0.0f)
                d = _mm256_fmadd_ps(wv, vwd, d);
            if (bi) {
                const __m256 b = init ? d : _mm256_fmadd_ps(
                    d, vd1, _mm256_mul_ps(_mm256_loadu_ps(bi + j), vmom));
                _mm256_storeu_ps(bi + j, b);
                d = nesterov ? _mm256_fmadd_ps(b, vmom, d) : b;
            }
            _mm256_storeu_ps(wi + j, _mm256_fmadd_ps(d, vlr, wv));
        }
#endif
        for (; j < cols; j++) {
            const float g = hp_outer(pi, qt, rank, cols, j);
            gi[j] = g;
            hp_sgd_elem(g, wi + j, bi ? bi + j : NULL, lr, mom, damp1, wd, nesterov,
                        maximize, init);
        }
    }
#if defined(__AVX__)
    _mm_sfence();
#endif
}
