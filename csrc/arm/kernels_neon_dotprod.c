/*
 * NEON + dot product (ARMv8.2 FEAT_DotProd: Cortex-A76/A55 of the RK3588).
 *
 * The only file allowed to use dotprod instructions: the whole extension is
 * built without -march, and cpu_features.c picks this table only when
 * HWCAP_ASIMDDP is set.  The pragma must come before <arm_neon.h>; it names
 * armv8.2-a because GCC's arm_neon.h declares vdotq_s32 under that target,
 * and every CPU with dotprod implements ARMv8.2.
 *
 * vdotq_s32 multiplies signed by signed and adds each group of four
 * products into one int32 lane, so unlike x86 VNNI no offset trick is
 * needed.  Everything else is shared with the plain NEON file.
 */
#if defined(__aarch64__)

#pragma GCC target("arch=armv8.2-a+dotprod")

#include <arm_neon.h>

#include "../kernels.h"
#define SA_ISA_ID neon_dotprod

/* One group of gs int8 values (gs a multiple of 8): 16 per vdotq, then a
 * 64-bit vdot for the last 8 when gs % 16 == 8. */
static inline int32x4_t q8_group_dot(const int8_t *a, const int8_t *b, int gs)
{
    int32x4_t acc = vdupq_n_s32(0);
    int i = 0;
    for (; i + 16 <= gs; i += 16)
        acc = vdotq_s32(acc, vld1q_s8(a + i), vld1q_s8(b + i));
    if (i < gs)
        acc = vcombine_s32(vdot_s32(vget_low_s32(acc), vld1_s8(a + i), vld1_s8(b + i)),
                           vget_high_s32(acc));
    return acc;
}

#include "neon_common.h"

#endif
