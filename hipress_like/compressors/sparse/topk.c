#include "hp_native.h"

#include <float.h>

/* ------------------------------------------------------------------------
 * ops.topk_abs's filter (ops.abs_at_least + torch.nonzero in one pass): the
 * positions i in [i0, i1) with |x[i]| >= t, in increasing order, at most cap
 * of them written to out; returns how many there are. NaN is never taken
 * (a comparison with NaN is false), as in the torch path. *nonfinite = 1
 * when some x[i] is NaN or +-Inf (top-k's NaN/Inf check, which a filter
 * could not otherwise give: NaN never passes it).
 *
 * Speed: a block of 64 is first asked whether any entry passes, an OR of
 * comparisons GCC vectorises; at the densities top-k and DGC keep (0.1-1%)
 * most blocks have none and cost one read. A block that has one is walked
 * as four bit masks of 16 comparisons, whose set bits are then visited.
 * Building the mask alone for every block (the previous loop) is not
 * vectorised and ran 4-5x slower than the read at DGC's density.
 * ------------------------------------------------------------------------ */
HP_LOOP int hp_any_at_least(const float *restrict x, float t, int *nonfinite) {
    int any = 0, bad = 0;
    for (int j = 0; j < 64; j++) {
        any |= __builtin_fabsf(x[j]) >= t;
        bad |= !(__builtin_fabsf(x[j]) <= FLT_MAX);  /* true for NaN and +-Inf */
    }
    *nonfinite |= bad;
    return any;
}

int64_t hp_abs_at_least(const float *restrict x, int64_t i0, int64_t i1, float t,
                        int64_t *restrict out, int64_t cap, int32_t *nonfinite) {
    int64_t c = 0, i = i0;
    int bad = 0;
    for (; i + 64 <= i1; i += 64) {
        if (!hp_any_at_least(x + i, t, &bad))
            continue;
        for (int64_t s = i; s < i + 64; s += 16) {
            uint32_t m = 0;
            for (int j = 0; j < 16; j++)
                m |= (uint32_t)(__builtin_fabsf(x[s + j]) >= t) << j;
            while (m) {
                const int j = __builtin_ctz(m);
                m &= m - 1;
                if (c < cap)
                    out[c] = s + j;
                c++;
            }
        }
    }
    for (; i < i1; i++) {
        bad |= !(__builtin_fabsf(x[i]) <= FLT_MAX);
        if (__builtin_fabsf(x[i]) >= t) {
            if (c < cap)
                out[c] = i;
            c++;
        }
    }
    *nonfinite = bad;
    return c;
}

