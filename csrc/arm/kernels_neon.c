/*
 * Plain ARMv8-A NEON kernels (Advanced SIMD is baseline on aarch64).
 *
 * The float kernels live in neon_common.h, shared with the dotprod file.
 * The q8 dot here multiplies int8 x int8 into int16 lanes, the high half's
 * products added to the low half's in the same lanes (vmull_s8, then
 * vmlal_high_s8), and adds adjacent int16 lanes into int32 ones
 * (vpadalq_s16): each int16 lane holds two products, at most 2 * 127 * 128
 * = 32512 in magnitude since q8 values are in [-127, 127] (spec §4; a
 * -128 in one operand still fits), so nothing overflows and the group sum
 * is exact.  Three operations per 16 bytes, where a widening multiply per
 * half and a pairwise add each took four.
 */
#if defined(__aarch64__)

#include <arm_neon.h>

#include "../kernels.h"
#define SA_ISA_ID neon

/* acc + the 16 products a[i] * b[i], spread over acc's four lanes (which
 * lane gets which product is free: the sums are exact). */
static inline int32x4_t q8_dot16(int32x4_t acc, int8x16_t a, int8x16_t b)
{
    return vpadalq_s16(acc, vmlal_high_s8(vmull_s8(vget_low_s8(a), vget_low_s8(b)), a, b));
}

/* The same for 8 products. */
static inline int32x4_t q8_dot8(int32x4_t acc, int8x8_t a, int8x8_t b)
{
    return vpadalq_s16(acc, vmull_s8(a, b));
}

/* acc[j] (0 if first) + the 16 products a[i] * k[j][i], for four rows j:
 * each step taken for the four rows before the next, so the in-order A55
 * has four independent products to issue while one's latency runs (one
 * row's multiply, multiply-add and pairwise add back to back waited out
 * each other's); with first, the pairwise add needs no zeroed accumulator. */
static inline void q8_dot16x4(int32x4_t acc[4], int8x16_t a, const int8x16_t k[4], int first)
{
    int16x8_t p[4];
    for (int j = 0; j < 4; j++)
        p[j] = vmull_s8(vget_low_s8(a), vget_low_s8(k[j]));
    for (int j = 0; j < 4; j++)
        p[j] = vmlal_high_s8(p[j], a, k[j]);
    for (int j = 0; j < 4; j++)
        acc[j] = first ? vpaddlq_s16(p[j]) : vpadalq_s16(acc[j], p[j]);
}

#include "neon_common.h"

#endif
