#include "hp_native.h"

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

