/*
 * The scalar loops of the q8 kernels, of Quest's bound, of the channel
 * scores and of the half-to-float conversion, written once:
 * they are the portable table's kernels (portable/kernels_portable.c) and
 * the fallbacks of the SIMD files for group sizes their vector steps do not
 * take (arm/neon_common.h, x86/x86_common.h).  The includer defines
 *
 *   SA_MULADD(a, b, c)    a * b + c as its vector path computes it: two
 *                         roundings in the portable file; fmaf, one, in the
 *                         SIMD files, whose vector paths fuse it, so that a
 *                         fallback keeps the promises of kernels.h (q8 V
 *                         accumulation is bitwise the float accumulation of
 *                         the same ISA, in the table's order)
 *   SA_SCALAR_FN(kernel)  the name of its copy of <kernel>
 *   SA_Q8_V_SCALED        its q8 V order (kernels.h, q8_v_scaled)
 *
 * Integer group sums are exact; every float operation is spelled out, in
 * the portable order.  A copy the includer does not call is marked unused.
 */
#ifndef SA_SCALAR_KERNELS_H
#define SA_SCALAR_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* Per (head, token): per group the exact int32 dot, then the term
 * (qd * kd) * isum added in group order. */
__attribute__((unused)) static void SA_SCALAR_FN(scores_q8)(
    const int8_t *qq, const float *qd, int G, int D, int gs, const int8_t *k, const float *kd,
    ptrdiff_t row_stride, ptrdiff_t scale_stride, int n, float *const *s, const sa_prefetch *pf)
{
    const int ng = D / gs;
    for (int t = 0; t < n; t++) {
        sa_prefetch_part(pf, t, n);
        const int8_t *row = k + (ptrdiff_t)t * row_stride;
        const float *rd = kd + (ptrdiff_t)t * scale_stride;
        for (int g = 0; g < G; g++) {
            const int8_t *a = qq + (ptrdiff_t)g * D;
            const float *ad = qd + (ptrdiff_t)g * ng;
            float acc = 0.0f;
            for (int grp = 0, i0 = 0; i0 < D; grp++, i0 += gs) {
                int32_t isum = 0;
                for (int i = i0; i < i0 + gs; i++)
                    isum += (int32_t)a[i] * (int32_t)row[i];
                acc = SA_MULADD(ad[grp] * rd[grp], (float)isum, acc);
            }
            s[g][t] = acc;
        }
    }
}

/* Per element scale * (float)q, one rounding (kernels.h). */
__attribute__((unused)) static void SA_SCALAR_FN(dequantize_rows)(
    const int8_t *q, const float *scales, int dim, int gs, int n, ptrdiff_t row_stride,
    ptrdiff_t scale_stride, float *out)
{
    for (int t = 0; t < n; t++) {
        const int8_t *row = q + (ptrdiff_t)t * row_stride;
        const float *sc = scales + (ptrdiff_t)t * scale_stride;
        float *o = out + (ptrdiff_t)t * dim;
        for (int i0 = 0, g = 0; i0 < dim; i0 += gs, g++) {
            const float d = sc[g];
            for (int i = i0; i < i0 + gs; i++)
                o[i] = d * (float)row[i];
        }
    }
}

/* q8 V in the includer's order (kernels.h, q8_v_scaled): SA_Q8_V_SCALED 0,
 * per (head, token, group) the weight p[g][t] * scale (one rounding), then
 * per element that weight times (float)q (exact) added into out; 1, per
 * element the dequantised value scale * (float)q (one rounding, as
 * dequantize_rows), then weighted by p[g][t] into out.  Tokens in order. */
__attribute__((unused)) static void SA_SCALAR_FN(accumulate_v_q8)(
    float *const *out, const float *const *p, int G, int D, int gs, const int8_t *v,
    const float *vd, ptrdiff_t row_stride, ptrdiff_t scale_stride, int n, const sa_prefetch *pf)
{
    for (int t = 0; t < n; t++) {
        sa_prefetch_part(pf, t, n);
        const int8_t *row = v + (ptrdiff_t)t * row_stride;
        const float *rd = vd + (ptrdiff_t)t * scale_stride;
        for (int g = 0; g < G; g++) {
            const float w = p[g][t];
            float *o = out[g];
            for (int d0 = 0, grp = 0; d0 < D; d0 += gs, grp++) {
                const float sc = rd[grp];
                if (SA_Q8_V_SCALED) {
                    for (int d = d0; d < d0 + gs; d++)
                        o[d] = SA_MULADD(w, sc * (float)row[d], o[d]);
                } else {
                    const float wd = w * sc;
                    for (int d = d0; d < d0 + gs; d++)
                        o[d] = SA_MULADD(wd, (float)row[d], o[d]);
                }
            }
        }
    }
}

/* Per (head, block): per group the channel sum of qn * lo + qp * hi, then
 * times the group's scale, added in group order. */
__attribute__((unused)) static void SA_SCALAR_FN(minmax_scores)(
    const float *qp, const float *qn, int G, int D, int gs, const int8_t *mn, const int8_t *mx,
    const float *sc, ptrdiff_t block_stride, int n, float *const *s)
{
    const ptrdiff_t sc_stride = block_stride / gs;
    for (int b = 0; b < n; b++) {
        const int8_t *lo = mn + (ptrdiff_t)b * block_stride;
        const int8_t *hi = mx + (ptrdiff_t)b * block_stride;
        const float *scale = sc + (ptrdiff_t)b * sc_stride;
        for (int g = 0; g < G; g++) {
            const float *p = qp + (ptrdiff_t)g * D, *m = qn + (ptrdiff_t)g * D;
            float acc = 0.0f;
            for (int i0 = 0, grp = 0; i0 < D; i0 += gs, grp++) {
                float part = 0.0f;
                for (int i = i0; i < i0 + gs; i++)
                    part += m[i] * (float)lo[i] + p[i] * (float)hi[i];
                acc = SA_MULADD(scale[grp], part, acc);
            }
            s[g][b] = acc;
        }
    }
}

/* Per block: each head's row sums over the chosen channels, channel by
 * channel (the loop over rows vectorises; one channel's bytes serve every
 * head), then the max over the block's rows.  Block after block, each
 * chosen channel is read front to back. */
__attribute__((unused)) static void SA_SCALAR_FN(channel_scores)(
    const float *q, int G, int D, const int32_t *idx, int r, const int8_t *d, const float *sc,
    int cs, ptrdiff_t cstride, int bs, int n, int last_rows, float *acc, float *const *s)
{
    /* a head's row sums: bs of them, or last_rows when that is the only block */
    const int stride = n > 1 ? bs : last_rows;
    for (int b = 0; b < n; b++) {
        const int rows = b == n - 1 ? last_rows : bs;
        for (ptrdiff_t i = 0; i < (ptrdiff_t)G * stride; i++)
            acc[i] = 0.0f;
        for (int j = 0; j < r; j++) {
            const int c = idx[j];
            const ptrdiff_t at = (ptrdiff_t)c * cstride + b;
            const int8_t *x = d + at * cs;
            for (int g = 0; g < G; g++) {
                const float w = q[(ptrdiff_t)g * D + c] * sc[at];
                float *a = acc + (ptrdiff_t)g * stride;
                for (int t = 0; t < rows; t++)
                    a[t] = SA_MULADD(w, (float)x[t], a[t]);
            }
        }
        for (int g = 0; g < G; g++) {
            const float *a = acc + (ptrdiff_t)g * stride;
            float m = a[0];
            for (int t = 1; t < rows; t++)
                m = a[t] > m ? a[t] : m;
            s[g][b] = m;
        }
    }
}

/* The SIMD files' path for a block that is not 32 rows: block b alone, one
 * head at a time, through the loop above (the same operations per (head,
 * row) as their vector bodies, whose fused multiply-add it uses). */
__attribute__((unused)) static void SA_SCALAR_FN(channel_block)(
    const float *q, int G, int D, const int32_t *idx, int r, const int8_t *d, const float *sc,
    int cs, ptrdiff_t cstride, int bs, int b, int rows, float *acc, float *const *s)
{
    for (int g = 0; g < G; g++) {
        float *const one = s[g] + b;
        SA_SCALAR_FN(channel_scores)(q + (ptrdiff_t)g * D, 1, D, idx, r, d + (ptrdiff_t)b * cs,
                                     sc + b, cs, cstride, bs, 1, rows, acc, &one);
    }
}

/* IEEE halves to floats (kernels.h), branch-free so that the compiler
 * vectorises it with the baseline ISA: a normal half rebiased in its
 * integer bits; a subnormal or zero as m * 2^-24 (an exact product, never a
 * subnormal float operand, which some cores take a slow assist for); Inf
 * and NaN with the float's exponent, a NaN made quiet.  With a branch per
 * value instead, converting took 80% of a portable f16 decode call. */
__attribute__((unused)) static void SA_SCALAR_FN(halves_to_floats)(const uint16_t *h, float *out,
                                                                   int n)
{
    for (int i = 0; i < n; i++) {
        const uint32_t em = h[i] & 0x7fffu;
        const uint32_t normal = (em << 13) + ((uint32_t)(127 - 15) << 23);
        const uint32_t quiet = (0u - (uint32_t)(em > 0x7c00u)) & 0x00400000u;
        const uint32_t special = (em << 13) | 0x7f800000u | quiet;
        const float small = (float)(int32_t)em * 0x1p-24f;
        uint32_t small_bits;
        memcpy(&small_bits, &small, sizeof small_bits);
        /* selects as masks: a conditional kept GCC from vectorising */
        const uint32_t is_special = 0u - (uint32_t)(em >= 0x7c00u);
        const uint32_t is_normal = (0u - (uint32_t)(em >= 0x0400u)) & ~is_special;
        const uint32_t bits = (special & is_special) | (normal & is_normal) |
                              (small_bits & ~(is_special | is_normal)) |
                              (uint32_t)(h[i] & 0x8000u) << 16;
        memcpy(&out[i], &bits, sizeof bits);
    }
}

#endif
