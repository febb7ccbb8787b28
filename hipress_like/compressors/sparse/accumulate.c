#include "hp_native.h"

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#define HP_ACC_STREAM 1
#endif
#include <float.h>
#include <math.h>

/* ------------------------------------------------------------------------
 * The step of the sparsifiers that accumulate what they do not send (DGC,
 * GradDrop) in one pass over [i0, i1), with top-k's threshold filter
 * (topk.c) and the NaN/Inf scan folded in. With a velocity u (DGC Eq. 6-7,
 * momentum correction):
 *
 *   uo[i] = fma(m, u[i], g[i])      u = m u + g, one rounding, as
 *                                   torch.add(g, u, alpha=m) and dgc.compll
 *   vo[i] = v[i] + uo[i]            v = v + u
 *
 * and without (u == NULL: GradDrop's residual, Aji & Heafield Alg. 1):
 *
 *   vo[i] = v[i] + g[i]             x = g + residual
 *
 * then the positions with |vo[i]| >= t, in increasing order, at most cap
 * of them into out; returns how many there are (NaN never passes);
 * *nonfinite = 1 when some g[i] is NaN or +-Inf.
 *
 * uo may be u and vo may be v (in place); otherwise the old state is left
 * as it was (the double buffering of detach_state). Unfused, DGC's step
 * reads the gradient three times and the state twice more (the two
 * accumulations, the engine's scan, the filter) and the engine copies the
 * state to undo a step: here each array is read or written once.
 *
 * Into second buffers (32-byte aligned, as torch allocates them) the sweep
 * writes with streaming stores where the CPU has AVX and FMA: an ordinary
 * store to a line not in the cache first reads it, one more pass over each
 * buffer (powersgd.c's form_m says the same); the selected positions are
 * then taken from the registers, never read back.
 * ------------------------------------------------------------------------ */
#define HP_ACC_BLOCK 64

/* One block: the accumulations; whether an entry passes t; whether g holds
 * NaN/Inf (!(|g| <= FLT_MAX) is true for both). ivdep: element i reads only u[i],
 * v[i], g[i] before it writes uo[i], vo[i], so in-place buffers are safe. The
 * velocity flag is a constant in each of the two callers below. */
static inline int hp_acc_block(const float *g, const float *u, const float *v, float m,
                               float *uo, float *vo, float t, int *nonfinite, const int vel) {
    int any = 0, bad = 0;
#pragma GCC ivdep
    for (int j = 0; j < HP_ACC_BLOCK; j++) {
        float un = g[j];
        if (vel) {
            un = fmaf(m, u[j], g[j]);
            uo[j] = un;
        }
        const float vn = v[j] + un;
        vo[j] = vn;
        any |= __builtin_fabsf(vn) >= t;
        bad |= !(__builtin_fabsf(g[j]) <= FLT_MAX);
    }
    *nonfinite |= bad;
    return any;
}

HP_LOOP int hp_acc_block_u(const float *g, const float *u, const float *v, float m, float *uo,
                           float *vo, float t, int *nonfinite) {
    return hp_acc_block(g, u, v, m, uo, vo, t, nonfinite, 1);
}

HP_LOOP int hp_acc_block_g(const float *g, const float *v, float *vo, float t, int *nonfinite) {
    return hp_acc_block(g, NULL, v, 0.0f, NULL, vo, t, nonfinite, 0);
}

static inline int64_t hp_acc_take(const float *vo, int64_t i, int64_t n, float t, int64_t c,
                                  int64_t *out, int64_t cap) {
    for (int64_t j = 0; j < n; j++)
        if (__builtin_fabsf(vo[j]) >= t) {
            if (c < cap)
                out[c] = i + j;
            c++;
        }
    return c;
}

#ifdef HP_ACC_STREAM
/* hp_acc_block with streaming stores into 32-byte aligned uo and vo, the
 * selected positions taken from the registers: returns the new count c. */
static inline int64_t hp_acc_block_nt(const float *g, const float *u, const float *v, float m,
                                      float *uo, float *vo, float t, int64_t i, int64_t c,
                                      int64_t *out, int64_t cap, int *nonfinite,
                                      const int vel) {
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(t), big = _mm256_set1_ps(FLT_MAX);
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 bad = _mm256_setzero_ps();
    for (int j = 0; j < HP_ACC_BLOCK; j += 8) {
        const __m256 gj = _mm256_loadu_ps(g + j);
        __m256 un = gj;
        if (vel) {
            un = _mm256_fmadd_ps(vm, _mm256_loadu_ps(u + j), gj);
            _mm256_stream_ps(uo + j, un);
        }
        const __m256 vn = _mm256_add_ps(_mm256_loadu_ps(v + j), un);
        _mm256_stream_ps(vo + j, vn);
        /* !(|g| <= FLT_MAX): unordered-or-greater, true for NaN and +-Inf */
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(gj, abs), big, _CMP_NLE_UQ));
        unsigned mask = (unsigned)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_and_ps(vn, abs), vt, _CMP_GE_OQ));  /* NaN never */
        while (mask) {
            const int l = __builtin_ctz(mask);
            mask &= mask - 1;
            if (c < cap)
                out[c] = i + j + l;
            c++;
        }
    }
    *nonfinite |= _mm256_movemask_ps(bad) != 0;
    return c;
}

HP_LOOP int64_t hp_acc_block_nt_u(const float *g, const float *u, const float *v, float m,
                                  float *uo, float *vo, float t, int64_t i, int64_t c,
                                  int64_t *out, int64_t cap, int *nonfinite) {
    return hp_acc_block_nt(g, u, v, m, uo, vo, t, i, c, out, cap, nonfinite, 1);
}

HP_LOOP int64_t hp_acc_block_nt_g(const float *g, const float *v, float *vo, float t, int64_t i,
                                  int64_t c, int64_t *out, int64_t cap, int *nonfinite) {
    return hp_acc_block_nt(g, NULL, v, 0.0f, NULL, vo, t, i, c, out, cap, nonfinite, 0);
}
#endif

int64_t hp_acc_select(const float *g, const float *u, const float *v, float m, float *uo,
                      float *vo, int64_t i0, int64_t i1, float t, int64_t *out, int64_t cap,
                      int32_t *nonfinite) {
    const int vel = u != NULL;
    int64_t c = 0, i = i0;
    int bad = 0;
#ifdef HP_ACC_STREAM
    const uintptr_t align = (uintptr_t)(vo + i0) | (vel ? (uintptr_t)(uo + i0) : 0);
    if (vo != v && (!vel || uo != u) && !(align & 31)) {
        for (; i + HP_ACC_BLOCK <= i1; i += HP_ACC_BLOCK)
            c = vel ? hp_acc_block_nt_u(g + i, u + i, v + i, m, uo + i, vo + i, t, i, c, out,
                                        cap, &bad)
                    : hp_acc_block_nt_g(g + i, v + i, vo + i, t, i, c, out, cap, &bad);
        _mm_sfence(); /* the streamed lines are visible to other threads once this returns */
    }
#endif
    for (; i + HP_ACC_BLOCK <= i1; i += HP_ACC_BLOCK) {
        const int any = vel ? hp_acc_block_u(g + i, u + i, v + i, m, uo + i, vo + i, t, &bad)
                            : hp_acc_block_g(g + i, v + i, vo + i, t, &bad);
        if (any)
            c = hp_acc_take(vo + i, i, HP_ACC_BLOCK, t, c, out, cap);
    }
    for (int64_t j = i; j < i1; j++) {
        float un = g[j];
        if (vel) {
            un = fmaf(m, u[j], g[j]);
            uo[j] = un;
        }
        vo[j] = v[j] + un;
        bad |= !(__builtin_fabsf(g[j]) <= FLT_MAX);
    }
    c = hp_acc_take(vo + i, i, i1 - i, t, c, out, cap);
    *nonfinite = bad;
    return c;
}
