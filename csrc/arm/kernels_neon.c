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

/* One group of gs int8 values (gs a multiple of 8): 16 per step, then an
 * 8-wide step when gs % 16 == 8. */
static inline int32x4_t q8_group_dot(const int8_t *a, const int8_t *b, int gs)
{
    int32x4_t acc = vdupq_n_s32(0);
    int i = 0;
    for (; i + 16 <= gs; i += 16) {
        const int8x16_t x = vld1q_s8(a + i), y = vld1q_s8(b + i);
        acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(x), vget_low_s8(y)));
        acc = vpadalq_s16(acc, vmull_high_s8(x, y));
    }
    if (i < gs)
        acc = vpadalq_s16(acc, vmull_s8(vld1_s8(a + i), vld1_s8(b + i)));
    return acc;
}

#include "neon_common.h"

#endif
