#include "hp_native.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

