/*
 * Plain ARMv8-A NEON kernels (Advanced SIMD is baseline on aarch64).
 *
 * The float kernels live in neon_common.h, shared with the dotprod file.
 * The q8 dot here widens int8 x int8 to int16 products (vmull_s8 /
 * vmull_high_s8: 127*127 and even -128*-128 fit in int16) and adds adjacent
 * pairs of products into int32 lanes (vpadalq_s16), so nothing can overflow
 * and the group sum is exact.
 */
#if defined(__aarch64__)

#include <arm_neon.h>

#include "../kernels.h"
#define SA_ISA_ID neon

/* acc + the 16 products a[i] * b[i], spread over acc's four lanes (which
 * lane gets which product is free: the sums are exact). */
static inline int32x4_t q8_dot16(int32x4_t acc, int8x16_t a, int8x16_t b)
{
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
}

/* The same for 8 products. */
static inline int32x4_t q8_dot8(int32x4_t acc, int8x8_t a, int8x8_t b)
{
    return vpadalq_s16(acc, vmull_s8(a, b));
}

#include "neon_common.h"

#endif
