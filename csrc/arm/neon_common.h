/*
 * NEON kernel bodies shared by kernels_neon.c and kernels_neon_dotprod.c.
 *
 * Everything here uses base ARMv8-A Advanced SIMD only.  The one step that
 * differs between the two files, the int8 dot of one q8 group, is the
 * including file's inline function
 *
 *   int32x4_t q8_group_dot(const int8_t *a, const int8_t *b, int gs)
 *
 * an int32x4 whose four lanes add up to sum_i a[i] * b[i] over one group of
 * gs int8 values (gs a multiple of 8; integer sums are exact, so how the
 * lanes split the work is free).  Each file defines it and SA_ISA_ID, then
 * includes this header, so it compiles its own copy of every body for its
 * own target (the dotprod file after its `#pragma GCC target`).  All
 * functions are static and named <kernel>_<SA_ISA_ID> (SA_FN), and the
 * table is defined at the end.
 *
 * The rules every body follows (kernels.h):
 *  - The operations that produce one (query head, token) result never depend
 *    on which other heads or tokens share the call: heads and tokens are
 *    batched only to share loads; each pair keeps its own accumulators and
 *    the tail paths (fewer than 4 tokens, odd heads) repeat the exact
 *    operation sequence of the batched path, one pair at a time.
 *  - V accumulation adds tokens into `out` strictly in token order, always
 *    as one fused multiply-add per element and token (vector lanes and the
 *    scalar fmaf() tails are the same IEEE operation).
 *  - Nothing is read or written outside rows t < n and columns d < D: a
 *    dimension that is not a multiple of the vector width ends in a scalar
 *    loop, in every body.
 */
#ifndef SA_NEON_COMMON_H
#define SA_NEON_COMMON_H

#include <arm_neon.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define SA_INLINE static inline __attribute__((always_inline))

/* Group sizes the vector paths do not take (not a multiple of 8): the
 * scalar loops, with the fused multiply-add of the vector paths
 * (scores_q8_scalar, accumulate_v_q8_scalar, minmax_scores_scalar). */
#define SA_MULADD(a, b, c) fmaf((a), (b), (c))
#define SA_SCALAR_FN(kernel) kernel##_scalar
#include "../scalar_kernels.h"

/* ------------------------------------------------------------------ */
/* scores_f32                                                           */
/* ------------------------------------------------------------------ */

/* One dot keeps 8 lanes in two registers (a = lanes 0-3, b = lanes 4-7),
 * the layout of the portable kernel, and is reduced by its tree:
 * ((a0+a1)+(a2+a3)) + ((b0+b1)+(b2+b3)). */
SA_INLINE float hsum8(float32x4_t a, float32x4_t b)
{
    const float32x4_t p = vpaddq_f32(a, b); /* a0+a1 a2+a3 b0+b1 b2+b3 */
    const float32x4_t r = vpaddq_f32(p, p); /* A B A B */
    return vgetq_lane_f32(r, 0) + vgetq_lane_f32(r, 1);
}

/* The same reduction for four dots at once, dot j in lane j. */
SA_INLINE float32x4_t hsum8x4(const float32x4_t a[4], const float32x4_t b[4])
{
    const float32x4_t r01 = vpaddq_f32(vpaddq_f32(a[0], b[0]), vpaddq_f32(a[1], b[1]));
    const float32x4_t r23 = vpaddq_f32(vpaddq_f32(a[2], b[2]), vpaddq_f32(a[3], b[3]));
    return vpaddq_f32(r01, r23); /* (A0 B0 A1 B1), (A2 B2 A3 B3) -> A0+B0 .. A3+B3 */
}

/* Scores of NH (1 or 2) query heads against NT (1 or 4) key rows, written
 * to sh[h][t .. t+NT).  Called with constant NH and NT, so the arrays below
 * live in registers: 16 accumulators + 8 key + 2 query registers at most.
 * The key loads of a row are shared by both heads. */
SA_INLINE void f32_tile(const float *const qh[2], int NH, const float *const kt[4], int NT,
                        int D, float *const sh[2], int t)
{
    float32x4_t a[2][4], b[2][4];
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < NT; j++)
            a[h][j] = b[h][j] = vdupq_n_f32(0.0f);
    int i = 0;
    for (; i + 8 <= D; i += 8) {
        float32x4_t k0[4], k1[4];
        for (int j = 0; j < NT; j++) {
            k0[j] = vld1q_f32(kt[j] + i);
            k1[j] = vld1q_f32(kt[j] + i + 4);
        }
        for (int h = 0; h < NH; h++) {
            const float32x4_t q0 = vld1q_f32(qh[h] + i), q1 = vld1q_f32(qh[h] + i + 4);
            for (int j = 0; j < NT; j++) {
                a[h][j] = vfmaq_f32(a[h][j], q0, k0[j]);
                b[h][j] = vfmaq_f32(b[h][j], q1, k1[j]);
            }
        }
    }
    /* D % 8 tail: scalar, into lane 0, as the portable kernel does. */
    for (; i < D; i++)
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < NT; j++)
                a[h][j] = vsetq_lane_f32(fmaf(qh[h][i], kt[j][i], vgetq_lane_f32(a[h][j], 0)),
                                         a[h][j], 0);
    for (int h = 0; h < NH; h++) {
        if (NT == 4)
            vst1q_f32(sh[h] + t, hsum8x4(a[h], b[h]));
        else
            sh[h][t] = hsum8(a[h][0], b[h][0]);
    }
}

/* Every head against the NT (1 or 4) rows kt: pairs of heads, then a
 * single head. */
SA_INLINE void f32_rows(const float *q, int G, int D, const float *const kt[4], int NT,
                        float *const *s, int t)
{
    int g = 0;
    for (; g + 2 <= G; g += 2) {
        const float *qh[2] = {q + (ptrdiff_t)g * D, q + (ptrdiff_t)(g + 1) * D};
        float *const sh[2] = {s[g], s[g + 1]};
        f32_tile(qh, 2, kt, NT, D, sh, t);
    }
    if (g < G) {
        const float *qh[2] = {q + (ptrdiff_t)g * D, NULL};
        float *const sh[2] = {s[g], NULL};
        f32_tile(qh, 1, kt, NT, D, sh, t);
    }
}

/* Four tokens, then single tokens, so every K row loaded for a token block
 * serves all G heads. */
static void SA_FN(scores_f32)(const float *q, int G, int D, const float *k,
                              ptrdiff_t row_stride, int n, float *const *s,
                              const sa_prefetch *pf)
{
    const int parts = (n + 3) / 4;
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        sa_prefetch_part(pf, t / 4, parts);
        const float *kt[4] = {k + t * row_stride, k + (t + 1) * row_stride,
                              k + (t + 2) * row_stride, k + (t + 3) * row_stride};
        f32_rows(q, G, D, kt, 4, s, t);
    }
    if (t < n)
        sa_prefetch_part(pf, t / 4, parts);
    for (; t < n; t++) {
        const float *kt[4] = {k + t * row_stride, NULL, NULL, NULL};
        f32_rows(q, G, D, kt, 1, s, t);
    }
}

/* ------------------------------------------------------------------ */
/* scores_q8                                                            */
/* ------------------------------------------------------------------ */

/* Rows t .. t+3 of q8 rows x and their scale rows. */
SA_INLINE void q8_rows4(const int8_t *x, const float *xd, ptrdiff_t row_stride,
                        ptrdiff_t scale_stride, int t, const int8_t *r[4], const float *rd[4])
{
    for (int j = 0; j < 4; j++) {
        r[j] = x + (t + j) * row_stride;
        rd[j] = xd + (t + j) * scale_stride;
    }
}

/* gs a multiple of 8: four tokens at a time for each head (the rows of the
 * block stay in L1 for the next head).  Per group, the four tokens' int32
 * partial sums are reduced together by one pairwise-add tree, so token j's
 * group sum lands in lane j and the score of token j accumulates in lane j
 * of one float register: no horizontal sum per token.  A token outside a
 * block of four gets the same operations on scalars. */
SA_INLINE void q8_scores_body(const int8_t *qq, const float *qd, int G, int D, int gs,
                              const int8_t *k, const float *kd, ptrdiff_t row_stride,
                              ptrdiff_t scale_stride, int n, float *const *s,
                              const sa_prefetch *pf)
{
    if (gs % 8) {
        scores_q8_scalar(qq, qd, G, D, gs, k, kd, row_stride, scale_stride, n, s, pf);
        return;
    }
    const int ng = D / gs, parts = (n + 3) / 4;
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        sa_prefetch_part(pf, t / 4, parts);
        const int8_t *r[4];
        const float *rd[4];
        q8_rows4(k, kd, row_stride, scale_stride, t, r, rd);
        for (int g = 0; g < G; g++) {
            const int8_t *a = qq + (ptrdiff_t)g * D;
            const float *ad = qd + (ptrdiff_t)g * ng;
            float32x4_t acc = vdupq_n_f32(0.0f);
            for (int grp = 0, i0 = 0; grp < ng; grp++, i0 += gs) {
                const int32x4_t p01 = vpaddq_s32(q8_group_dot(a + i0, r[0] + i0, gs),
                                                 q8_group_dot(a + i0, r[1] + i0, gs));
                const int32x4_t p23 = vpaddq_s32(q8_group_dot(a + i0, r[2] + i0, gs),
                                                 q8_group_dot(a + i0, r[3] + i0, gs));
                const int32x4_t isum = vpaddq_s32(p01, p23);
                const float32x4_t dk = {rd[0][grp], rd[1][grp], rd[2][grp], rd[3][grp]};
                acc = vfmaq_f32(acc, vcvtq_f32_s32(isum), vmulq_n_f32(dk, ad[grp]));
            }
            vst1q_f32(s[g] + t, acc);
        }
    }
    if (t < n)
        sa_prefetch_part(pf, t / 4, parts);
    for (; t < n; t++) {
        const int8_t *row = k + t * row_stride;
        const float *rd = kd + t * scale_stride;
        for (int g = 0; g < G; g++) {
            const int8_t *a = qq + (ptrdiff_t)g * D;
            const float *ad = qd + (ptrdiff_t)g * ng;
            float acc = 0.0f;
            for (int grp = 0, i0 = 0; grp < ng; grp++, i0 += gs) {
                const int32_t isum = vaddvq_s32(q8_group_dot(a + i0, row + i0, gs));
                acc = fmaf((float)isum, rd[grp] * ad[grp], acc);
            }
            s[g][t] = acc;
        }
    }
}

static void SA_FN(scores_q8)(const int8_t *qq, const float *qd, int G, int D, int gs,
                             const int8_t *k, const float *kd, ptrdiff_t row_stride,
                             ptrdiff_t scale_stride, int n, float *const *s,
                             const sa_prefetch *pf)
{
    /* The default group size gets a copy of its own, with the group's dot
     * unrolled and the query loads shared by the four tokens; same results. */
    if (gs == 32)
        q8_scores_body(qq, qd, G, D, 32, k, kd, row_stride, scale_stride, n, s, pf);
    else
        q8_scores_body(qq, qd, G, D, gs, k, kd, row_stride, scale_stride, n, s, pf);
}

/* ------------------------------------------------------------------ */
/* softmax_exp                                                          */
/* ------------------------------------------------------------------ */

/* exp(x), four lanes: x = n*ln2 + r with n = round(x/ln2), |r| <= ln2/2;
 * exp(r) - 1 by the degree-5 minimax polynomial of Arm's optimized-routines
 * (v_expf), 2^n put straight into the exponent field; under 2 ulp.
 * Valid for x <= 88.37 (n <= 127; the caller routes larger x elsewhere);
 * x below ln(FLT_MIN) gives 0 (the true result is subnormal, and a softmax
 * weight that small is 0 beside the maximum's 1); NaN stays NaN. */
SA_INLINE float32x4_t exp_f32x4(float32x4_t x)
{
    const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 0x1.715476p+0f)); /* x / ln2 */
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0x1.62e4p-1f));       /* ln2, high */
    r = vfmsq_f32(r, n, vdupq_n_f32(0x1.7f7d1cp-20f));                /* ln2, low */
    const float32x4_t r2 = vmulq_f32(r, r);
    const float32x4_t p = vfmaq_f32(vdupq_n_f32(0x1.573e2ep-5f), vdupq_n_f32(0x1.0e4020p-7f), r);
    float32x4_t poly = vfmaq_f32(vdupq_n_f32(0x1.fffdb6p-2f), vdupq_n_f32(0x1.555e66p-3f), r);
    poly = vfmaq_f32(poly, p, r2);
    poly = vfmaq_f32(vmulq_n_f32(r, 0x1.ffffecp-1f), poly, r2); /* exp(r) - 1 */
    /* 2^n: (n + 127) << 23 is its bit pattern for -126 <= n <= 127. */
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const float32x4_t two_n = vreinterpretq_f32_s32(e);
    const float32x4_t y = vfmaq_f32(two_n, poly, two_n);
    const uint32x4_t tiny = vcltq_f32(x, vdupq_n_f32(-0x1.5d589ep+6f)); /* ln(FLT_MIN) */
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), tiny));
}

/* exp(scale * (s - max)) for four scores: the argument is <= 0 (or NaN),
 * inside exp_f32x4's range, and 0 exactly at the maximum. */
SA_INLINE float32x4_t softmax_exp4(float32x4_t sv, float32x4_t vscale, float32x4_t vm)
{
    return exp_f32x4(vmulq_f32(vsubq_f32(sv, vm), vscale));
}

/* Two passes: the maximum (vmaxq propagates NaN: a NaN score makes the sum
 * NaN, as on every ISA), then exp in place.  The sum is kept in double
 * (four lanes), as the portable kernel does, so a long context loses
 * nothing to it.  The last n % 4 scores are padded to a vector with the
 * maximum, so every element goes through the same exp. */
static float SA_FN(softmax_exp)(float *s, int n, float scale)
{
    int t = 0;
    float m = s[0];
    if (n >= 4) {
        float32x4_t vm = vld1q_f32(s);
        for (t = 4; t <= n - 4; t += 4)   /* not t + 4 <= n: n may be INT_MAX */
            vm = vmaxq_f32(vm, vld1q_f32(s + t));
        m = vmaxvq_f32(vm);
    }
    for (; t < n; t++)
        m = s[t] > m ? s[t] : m;

    const float32x4_t vscale = vdupq_n_f32(scale), vmax = vdupq_n_f32(m);
    float64x2_t sum_lo = vdupq_n_f64(0.0), sum_hi = vdupq_n_f64(0.0);
    for (t = 0; t <= n - 4; t += 4) {
        const float32x4_t e = softmax_exp4(vld1q_f32(s + t), vscale, vmax);
        vst1q_f32(s + t, e);
        sum_lo = vaddq_f64(sum_lo, vcvt_f64_f32(vget_low_f32(e)));
        sum_hi = vaddq_f64(sum_hi, vcvt_high_f64_f32(e));
    }
    double tail = 0.0;
    if (t < n) {
        float buf[4] = {m, m, m, m};
        memcpy(buf, s + t, (size_t)(n - t) * sizeof(float));
        vst1q_f32(buf, softmax_exp4(vld1q_f32(buf), vscale, vmax));
        for (int j = 0; t + j < n; j++) {
            s[t + j] = buf[j];
            tail += buf[j];
        }
    }
    const float64x2_t sum = vaddq_f64(sum_lo, sum_hi);
    return (float)((vgetq_lane_f64(sum, 0) + vgetq_lane_f64(sum, 1)) + tail);
}

/* ------------------------------------------------------------------ */
/* accumulate_v_f32 / accumulate_v_q8                                   */
/* ------------------------------------------------------------------ */

/* o + w[0]*r0 + w[1]*r1 + w[2]*r2 + w[3]*r3, one fma per token, in token order. */
SA_INLINE float32x4_t fma_4tokens(float32x4_t o, float32x4_t w, float32x4_t r0,
                                  float32x4_t r1, float32x4_t r2, float32x4_t r3)
{
    o = vfmaq_laneq_f32(o, r0, w, 0);
    o = vfmaq_laneq_f32(o, r1, w, 1);
    o = vfmaq_laneq_f32(o, r2, w, 2);
    return vfmaq_laneq_f32(o, r3, w, 3);
}

/* out[g][d .. d + 4*NV) for every head, from NV (1, 2 or 4, constant)
 * vectors of each of the four tokens t .. t+3 (f[j]: token t+j), loaded
 * once for all heads: the heads' weights of the four tokens in one
 * register, fma_4tokens. */
SA_INLINE void add_4tokens(float *const *out, const float *const *p, int G, int t, int d, int NV,
                           float32x4_t f[4][4])
{
    for (int g = 0; g < G; g++) {
        const float32x4_t w = vld1q_f32(p[g] + t);
        float *o = out[g] + d;
        for (int i = 0; i < NV; i++)
            vst1q_f32(o + 4 * i, fma_4tokens(vld1q_f32(o + 4 * i), w, f[0][i], f[1][i], f[2][i],
                                             f[3][i]));
    }
}

/* The same for the single token t: one fma per element. */
SA_INLINE void add_1token(float *const *out, const float *const *p, int G, int t, int d, int NV,
                          float32x4_t f[4])
{
    for (int g = 0; g < G; g++) {
        const float w = p[g][t];
        float *o = out[g] + d;
        for (int i = 0; i < NV; i++)
            vst1q_f32(o + 4 * i, vfmaq_n_f32(vld1q_f32(o + 4 * i), f[i], w));
    }
}

/* NV (1 or 4, constant) vectors of a float row from column d. */
SA_INLINE void f32_load(const float *row, int d, int NV, float32x4_t f[4])
{
    for (int i = 0; i < NV; i++)
        f[i] = vld1q_f32(row + d + 4 * i);
}

/* Blocks of four tokens: 16 columns of the four V rows are loaded once into
 * 16 registers and serve every head (out stays in L1, it is G*D floats);
 * then 4-column steps, then scalar columns; then the remaining tokens one
 * at a time with the same per-element operations. */
static void SA_FN(accumulate_v_f32)(float *const *out, const float *const *p, int G, int D,
                                    const float *v, ptrdiff_t row_stride, int n,
                                    const sa_prefetch *pf)
{
    const int parts = (n + 3) / 4;
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        sa_prefetch_part(pf, t / 4, parts);
        const float *r[4] = {v + t * row_stride, v + (t + 1) * row_stride,
                             v + (t + 2) * row_stride, v + (t + 3) * row_stride};
        float32x4_t f[4][4];
        int d = 0;
        for (; d + 16 <= D; d += 16) {
            for (int j = 0; j < 4; j++)
                f32_load(r[j], d, 4, f[j]);
            add_4tokens(out, p, G, t, d, 4, f);
        }
        for (; d + 4 <= D; d += 4) {
            for (int j = 0; j < 4; j++)
                f32_load(r[j], d, 1, f[j]);
            add_4tokens(out, p, G, t, d, 1, f);
        }
        for (; d < D; d++)
            for (int g = 0; g < G; g++) {
                const float *w = p[g] + t;
                float o = out[g][d];
                o = fmaf(w[0], r[0][d], o);
                o = fmaf(w[1], r[1][d], o);
                o = fmaf(w[2], r[2][d], o);
                out[g][d] = fmaf(w[3], r[3][d], o);
            }
    }
    if (t < n)
        sa_prefetch_part(pf, t / 4, parts);
    for (; t < n; t++) {
        const float *row = v + t * row_stride;
        float32x4_t f[4];
        int d = 0;
        for (; d + 16 <= D; d += 16) {
            f32_load(row, d, 4, f);
            add_1token(out, p, G, t, d, 4, f);
        }
        for (; d + 4 <= D; d += 4) {
            f32_load(row, d, 1, f);
            add_1token(out, p, G, t, d, 1, f);
        }
        for (; d < D; d++)
            for (int g = 0; g < G; g++)
                out[g][d] = fmaf(p[g][t], row[d], out[g][d]);
    }
}

/* NV (2 or 4, constant) vectors of floats from 4*NV int8 of a q8 row, each
 * times the row's group scale sc (one rounding, as dequantize_rows). */
SA_INLINE void q8_load(const int8_t *x, float sc, int NV, float32x4_t f[4])
{
    if (NV == 4) {
        const int8x16_t b = vld1q_s8(x);
        const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
        f[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
        f[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
        f[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
        f[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
    } else {
        const int16x8_t w = vmovl_s8(vld1_s8(x));
        f[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
        f[1] = vcvtq_f32_s32(vmovl_high_s16(w));
    }
    for (int i = 0; i < NV; i++)
        f[i] = vmulq_n_f32(f[i], sc);
}

/* dequantize_rows: q8_load per 16 (or 8) values when gs is a multiple of
 * 8, else the scalar loop; one product per element either way. */
static void SA_FN(dequantize_rows)(const int8_t *q, const float *scales, int dim, int gs,
                                   int n, ptrdiff_t row_stride, ptrdiff_t scale_stride,
                                   float *out)
{
    if (gs % 8) {
        dequantize_rows_scalar(q, scales, dim, gs, n, row_stride, scale_stride, out);
        return;
    }
    for (int t = 0; t < n; t++) {
        const int8_t *row = q + (ptrdiff_t)t * row_stride;
        const float *rd = scales + (ptrdiff_t)t * scale_stride;
        float *o = out + (ptrdiff_t)t * dim;
        for (int grp = 0, d0 = 0; d0 < dim; grp++, d0 += gs) {
            float32x4_t f[4];
            int d = d0;
            for (; d + 16 <= d0 + gs; d += 16) {
                q8_load(row + d, rd[grp], 4, f);
                for (int i = 0; i < 4; i++)
                    vst1q_f32(o + d + 4 * i, f[i]);
            }
            if (d < d0 + gs) { /* gs % 16 == 8 */
                q8_load(row + d, rd[grp], 2, f);
                vst1q_f32(o + d, f[0]);
                vst1q_f32(o + d + 4, f[1]);
            }
        }
    }
}

/* gs a multiple of 8 (so 16- and 8-wide chunks never straddle a group):
 * four tokens at a time, each chunk widened to float and times its token's
 * scale once for all heads, then added as accumulate_v_f32 adds float rows.
 * The last n % 4 tokens, and every token for other group sizes, get the
 * same per-element operations one token at a time. */
static void SA_FN(accumulate_v_q8)(float *const *out, const float *const *p, int G, int D,
                                   int gs, const int8_t *v, const float *vd,
                                   ptrdiff_t row_stride, ptrdiff_t scale_stride, int n,
                                   const sa_prefetch *pf)
{
    if (gs % 8) {
        accumulate_v_q8_scalar(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, pf);
        return;
    }
    const int parts = (n + 3) / 4;
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        sa_prefetch_part(pf, t / 4, parts);
        const int8_t *r[4];
        const float *rd[4];
        q8_rows4(v, vd, row_stride, scale_stride, t, r, rd);
        float32x4_t f[4][4];
        for (int grp = 0, d0 = 0; d0 < D; grp++, d0 += gs) {
            int d = d0;
            for (; d + 16 <= d0 + gs; d += 16) {
                for (int j = 0; j < 4; j++)
                    q8_load(r[j] + d, rd[j][grp], 4, f[j]);
                add_4tokens(out, p, G, t, d, 4, f);
            }
            if (d < d0 + gs) { /* gs % 16 == 8 */
                for (int j = 0; j < 4; j++)
                    q8_load(r[j] + d, rd[j][grp], 2, f[j]);
                add_4tokens(out, p, G, t, d, 2, f);
            }
        }
    }
    if (t < n)
        sa_prefetch_part(pf, t / 4, parts);
    for (; t < n; t++) {
        const int8_t *row = v + t * row_stride;
        const float *rd = vd + t * scale_stride;
        float32x4_t f[4];
        for (int grp = 0, d0 = 0; d0 < D; grp++, d0 += gs) {
            int d = d0;
            for (; d + 16 <= d0 + gs; d += 16) {
                q8_load(row + d, rd[grp], 4, f);
                add_1token(out, p, G, t, d, 4, f);
            }
            if (d < d0 + gs) {
                q8_load(row + d, rd[grp], 2, f);
                add_1token(out, p, G, t, d, 2, f);
            }
        }
    }
}

/* ------------------------------------------------------------------ */
/* minmax_scores (Quest's bound, spec §6)                               */
/* ------------------------------------------------------------------ */

/* One block for NH (1 or 2, constant) heads, gs a multiple of 8: the block's
 * bounds are widened to float once, 8 channels at a time, for both heads.
 * A group's channel sum keeps 8 lanes (two registers) reduced by hsum8, then
 * one fma with the group's scale, so a (head, block) result never depends
 * on the heads beside it. */
SA_INLINE void minmax_tile(const float *const ph[2], const float *const mh[2], int NH,
                           const int8_t *lo, const int8_t *hi, const float *scale, int D,
                           int gs, float *const sh[2], int b)
{
    float acc[2] = {0.0f, 0.0f};
    for (int i0 = 0, grp = 0; i0 < D; i0 += gs, grp++) {
        float32x4_t pa[2], pb[2];
        for (int h = 0; h < NH; h++)
            pa[h] = pb[h] = vdupq_n_f32(0.0f);
        for (int i = i0; i < i0 + gs; i += 8) {
            const int16x8_t l = vmovl_s8(vld1_s8(lo + i)), u = vmovl_s8(vld1_s8(hi + i));
            const float32x4_t l0 = vcvtq_f32_s32(vmovl_s16(vget_low_s16(l)));
            const float32x4_t l1 = vcvtq_f32_s32(vmovl_high_s16(l));
            const float32x4_t u0 = vcvtq_f32_s32(vmovl_s16(vget_low_s16(u)));
            const float32x4_t u1 = vcvtq_f32_s32(vmovl_high_s16(u));
            for (int h = 0; h < NH; h++) {
                const float *p = ph[h] + i, *m = mh[h] + i;
                pa[h] = vaddq_f32(pa[h], vaddq_f32(vmulq_f32(vld1q_f32(m), l0),
                                                   vmulq_f32(vld1q_f32(p), u0)));
                pb[h] = vaddq_f32(pb[h], vaddq_f32(vmulq_f32(vld1q_f32(m + 4), l1),
                                                   vmulq_f32(vld1q_f32(p + 4), u1)));
            }
        }
        for (int h = 0; h < NH; h++)
            acc[h] = fmaf(scale[grp], hsum8(pa[h], pb[h]), acc[h]);
    }
    for (int h = 0; h < NH; h++)
        sh[h][b] = acc[h];
}

/* Blocks outer, heads in pairs inner: each block's bounds are read once per
 * pair of heads (and from L1 for the next pair). */
static void SA_FN(minmax_scores)(const float *qp, const float *qn, int G, int D, int gs,
                               const int8_t *mn, const int8_t *mx, const float *sc,
                               ptrdiff_t block_stride, int n, float *const *s)
{
    if (gs % 8) {
        minmax_scores_scalar(qp, qn, G, D, gs, mn, mx, sc, block_stride, n, s);
        return;
    }
    const ptrdiff_t sc_stride = block_stride / gs;
    for (int b = 0; b < n; b++) {
        const int8_t *lo = mn + b * block_stride, *hi = mx + b * block_stride;
        const float *scale = sc + b * sc_stride;
        int g = 0;
        for (; g + 2 <= G; g += 2) {
            const float *ph[2] = {qp + (ptrdiff_t)g * D, qp + (ptrdiff_t)(g + 1) * D};
            const float *mh[2] = {qn + (ptrdiff_t)g * D, qn + (ptrdiff_t)(g + 1) * D};
            float *const sh[2] = {s[g], s[g + 1]};
            minmax_tile(ph, mh, 2, lo, hi, scale, D, gs, sh, b);
        }
        if (g < G) {
            const float *ph[2] = {qp + (ptrdiff_t)g * D, NULL};
            const float *mh[2] = {qn + (ptrdiff_t)g * D, NULL};
            float *const sh[2] = {s[g], NULL};
            minmax_tile(ph, mh, 1, lo, hi, scale, D, gs, sh, b);
        }
    }
}

/* ------------------------------------------------------------------ */
/* channel_scores: the tile loop of ../channel_tiles.h, as on x86,     */
/* around a 32-row block as 8 vectors per head, two heads at a time,    */
/* each channel's 32 bytes widened once for both, and the fused         */
/* multiply-add chain per (head, row) of the scalar loop                */
/* ------------------------------------------------------------------ */

/* One 32-row block (tile slot t), channel j's bytes at db + off[j], heads
 * g0 .. g0+HB (a constant at each call). */
SA_INLINE void channel_block_neon(int G, int r, const int8_t *db, const ptrdiff_t *off,
                                  const float *w, int t, int g0, const int HB,
                                  float *const *s, int b)
{
    float32x4_t a[2][8];
    for (int h = 0; h < HB; h++)
        for (int v = 0; v < 8; v++)
            a[h][v] = vdupq_n_f32(0.0f);
    const float *wj = w + (ptrdiff_t)g0 * SA_CHANNEL_TILE + t;
    const ptrdiff_t wstep = (ptrdiff_t)G * SA_CHANNEL_TILE;
    for (int j = 0; j < r; j++, wj += wstep) {
        const int8_t *x = db + off[j];
        float32x4_t xv[8];
        for (int half = 0; half < 2; half++) {
            const int8x16_t raw = vld1q_s8(x + 16 * half);
            const int16x8_t lo = vmovl_s8(vget_low_s8(raw));
            const int16x8_t hi = vmovl_s8(vget_high_s8(raw));
            xv[4 * half + 0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
            xv[4 * half + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
            xv[4 * half + 2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
            xv[4 * half + 3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
        }
        for (int h = 0; h < HB; h++) {
            const float32x4_t wv = vdupq_n_f32(wj[h * SA_CHANNEL_TILE]);
            for (int v = 0; v < 8; v++)
                a[h][v] = vfmaq_f32(a[h][v], wv, xv[v]);
        }
    }
    for (int h = 0; h < HB; h++) {
        float32x4_t m = a[h][0];
        for (int v = 1; v < 8; v++)
            m = vmaxq_f32(m, a[h][v]);
        s[g0 + h][b] = vmaxvq_f32(m);   /* max is exact in any order */
    }
}

SA_INLINE void channel_weights8(float *dst, float qv, const float *sc)
{
    const float32x4_t v = vdupq_n_f32(qv);
    vst1q_f32(dst, vmulq_f32(v, vld1q_f32(sc)));
    vst1q_f32(dst + 4, vmulq_f32(v, vld1q_f32(sc + 4)));
}

#define SA_C_HEADS 2
/* one block at a time (no SA_C_PAIR): NB is 1, cs unused */
#define channel_block_simd(G, r, db, cs, off, w, t, g0, HB, NB, s, b) \
    ((void)(cs), (void)(NB), channel_block_neon(G, r, db, off, w, t, g0, HB, s, b))
#include "../channel_tiles.h"
#undef channel_block_simd

/* ------------------------------------------------------------------ */
/* stream_sum: the bandwidth probe                                      */
/* ------------------------------------------------------------------ */

#define SA_STREAM_BYTES 16
#include "../stream_sum.h"

SA_DEFINE_KERNELS_OF(SA_ISA_ID);

#endif
