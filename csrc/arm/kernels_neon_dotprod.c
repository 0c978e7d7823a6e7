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

/* acc + the 16 products a[i] * b[i], four per lane. */
static inline int32x4_t q8_dot16(int32x4_t acc, int8x16_t a, int8x16_t b)
{
    return vdotq_s32(acc, a, b);
}

/* The same for 8 products, into lanes 0 and 1. */
static inline int32x4_t q8_dot8(int32x4_t acc, int8x8_t a, int8x8_t b)
{
    return vcombine_s32(vdot_s32(vget_low_s32(acc), a, b), vget_high_s32(acc));
}

/* acc[j] (0 if first) + the 16 products a[i] * k[j][i], for four rows j. */
static inline void q8_dot16x4(int32x4_t acc[4], int8x16_t a, const int8x16_t k[4], int first)
{
    for (int j = 0; j < 4; j++)
        acc[j] = vdotq_s32(first ? vdupq_n_s32(0) : acc[j], a, k[j]);
}

/* acc + per lane j the 4 products a[4j + i] * b[4j + i] (prefill's q8
 * panels: one lane per key). */
#define SA_Q8_DOT4(acc, a, b) vdotq_s32((acc), (a), (b))
/* The same with b's 4 bytes taken from 32-bit lane `lane` of a 16-byte
 * vector (the by-element sdot: no broadcast). */
#define SA_Q8_DOT4_LANE(acc, a, b, lane) vdotq_laneq_s32((acc), (a), (b), (lane))

#include "neon_common.h"

#endif
