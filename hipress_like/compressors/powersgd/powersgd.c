#include "hp_native.h"

/* ------------------------------------------------------------------------
 * PowerSGD's round 0 (lowrank.powersgd_form_m), in place (out == e)
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
