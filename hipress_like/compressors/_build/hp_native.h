/* What the per-algorithm C files of compressors/ share (_build/native.py builds
 * them into one library): the standard headers, the block size of the byte
 * loops, the float-bits helpers, the noinline loop marker and ops.hash32's
 * finaliser. Each algorithm's .c states its own contract with its torch path.
 */
#ifndef HP_NATIVE_H
#define HP_NATIVE_H

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

/* ops.hash32's finaliser (MurmurHash3's fmix32), the counter-based random
 * stream of natural compression, THC's signs and the Bloom filters' probes. */
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

#endif
