#include "hp_native.h"

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

