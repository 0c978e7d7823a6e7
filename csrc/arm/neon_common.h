/*
 * NEON kernel bodies shared by kernels_neon.c and kernels_neon_dotprod.c.
 *
 * Everything here uses base ARMv8-A Advanced SIMD only.  The one step that
 * differs between the two files, the int8 dot, is the including file's pair
 * of inline functions
 *
 *   int32x4_t q8_dot16(int32x4_t acc, int8x16_t a, int8x16_t b)
 *   int32x4_t q8_dot8(int32x4_t acc, int8x8_t a, int8x8_t b)
 *   void q8_dot16x4(int32x4_t acc[4], int8x16_t a, const int8x16_t k[4], int first)
 *
 * acc plus the 16 (or 8) products a[i] * b[i], spread over its four int32
 * lanes (integer sums are exact, so how the lanes split the work is free);
 * q8_dot16x4 is q8_dot16 for four rows k[j] into acc[j] (from 0 if first),
 * in whatever order of steps suits the file's instructions.
 * Each file defines them and SA_ISA_ID, then includes this header, so it
 * compiles its own copy of every body for its own target (the dotprod file
 * after its `#pragma GCC target`).  All functions are static and named
 * <kernel>_<SA_ISA_ID> (SA_FN), and the table is defined at the end.
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
/* q8 V: the scale in the weight, as on every path (kernels.h, spec §4). */
#define SA_Q8_V_SCALED 0
#include "../scalar_kernels.h"

/* An int32x4 whose lanes add up to sum_i a[i] * b[i] over one group of gs
 * int8 values (gs a multiple of 8). */
SA_INLINE int32x4_t q8_group_dot(const int8_t *a, const int8_t *b, int gs)
{
    int32x4_t acc = vdupq_n_s32(0);
    int i = 0;
    for (; i + 16 <= gs; i += 16)
        acc = q8_dot16(acc, vld1q_s8(a + i), vld1q_s8(b + i));
    if (i < gs)
        acc = q8_dot8(acc, vld1_s8(a + i), vld1_s8(b + i));
    return acc;
}

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
/* scores_f32_panels: GEMM form (kernels.h), panels of 8 keys          */
/* ------------------------------------------------------------------ */

#define SA_PANEL 8
#define SA_P_ROWS 8 /* 16 accumulators, 8 query vectors and 2 keys: 26 registers */
enum { SA_FN(panel_keys) = SA_PANEL };

/* Lanes of x to row[at + l] for the lanes with 0 <= at + l < n. */
SA_INLINE void store_keys4(float *row, ptrdiff_t at, int n, float32x4_t x)
{
    if (at >= 0 && at + 4 <= n) {
        vst1q_f32(row + at, x);
        return;
    }
    float tmp[4];
    vst1q_f32(tmp, x);
    for (int l = 0; l < 4; l++)
        if (at + l >= 0 && at + l < n)
            row[at + l] = tmp[l];
}

/* HB (at most SA_P_ROWS) query vectors x one panel: per 4 channels each
 * vector's 4 values loaded once and used lane by lane (fused, channel
 * order), each channel's 8 keys loaded once for every vector. */
SA_INLINE void panel_block(const float *q, int HB, int D, const float *kp, float *const *s,
                           ptrdiff_t at, int n)
{
    float32x4_t a0[SA_P_ROWS], a1[SA_P_ROWS];
    for (int h = 0; h < HB; h++)
        a0[h] = a1[h] = vdupq_n_f32(0.0f);
    int d = 0;
    for (; d + 4 <= D; d += 4) {
        float32x4_t qv[SA_P_ROWS];
        for (int h = 0; h < HB; h++)
            qv[h] = vld1q_f32(q + (ptrdiff_t)h * D + d);
#define SA_PANEL_LANE(j)                                                        \
    do {                                                                        \
        const float32x4_t k0 = vld1q_f32(kp + (ptrdiff_t)(d + (j)) * SA_PANEL);     \
        const float32x4_t k1 = vld1q_f32(kp + (ptrdiff_t)(d + (j)) * SA_PANEL + 4); \
        for (int h = 0; h < HB; h++) {                                          \
            a0[h] = vfmaq_laneq_f32(a0[h], k0, qv[h], (j));                     \
            a1[h] = vfmaq_laneq_f32(a1[h], k1, qv[h], (j));                     \
        }                                                                       \
    } while (0)
        SA_PANEL_LANE(0);
        SA_PANEL_LANE(1);
        SA_PANEL_LANE(2);
        SA_PANEL_LANE(3);
#undef SA_PANEL_LANE
    }
    for (; d < D; d++) {
        const float32x4_t k0 = vld1q_f32(kp + (ptrdiff_t)d * SA_PANEL);
        const float32x4_t k1 = vld1q_f32(kp + (ptrdiff_t)d * SA_PANEL + 4);
        for (int h = 0; h < HB; h++) {
            a0[h] = vfmaq_n_f32(a0[h], k0, q[(ptrdiff_t)h * D + d]);
            a1[h] = vfmaq_n_f32(a1[h], k1, q[(ptrdiff_t)h * D + d]);
        }
    }
    for (int h = 0; h < HB; h++) {
        store_keys4(s[h], at, n, a0[h]);
        store_keys4(s[h], at + 4, n, a1[h]);
    }
}

/* Panel by panel (it stays in L1 while every block of vectors reads it). */
static void SA_FN(scores_f32_panels)(const float *q, int G, int D, const float *kt, int first,
                                     int n, float *const *s)
{
#define SA_BLOCK(g, HB, p, at)                                                             \
    panel_block(q + (ptrdiff_t)(g) * D, (HB), D, kt + (ptrdiff_t)(p) * D * SA_PANEL, s + (g), \
                (at), n)
    SA_PANEL_WALK(SA_PANEL, SA_P_ROWS, G, first, n, SA_BLOCK);
#undef SA_BLOCK
}

/* ------------------------------------------------------------------ */
/* scores_q8                                                            */
/* ------------------------------------------------------------------ */

/* Four consecutive q8 rows from x (and their scale rows from xd): each a
 * stride past the last, not a multiply per row and quad. */
SA_INLINE void q8_rows4(const int8_t *x, const float *xd, ptrdiff_t row_stride,
                        ptrdiff_t scale_stride, const int8_t *r[4], const float *rd[4])
{
    r[0] = x;
    rd[0] = xd;
    for (int j = 1; j < 4; j++) {
        r[j] = r[j - 1] + row_stride;
        rd[j] = rd[j - 1] + scale_stride;
    }
}

/* The scales of groups grp .. grp+nc-1 (nc <= 4) of four rows, into
 * dk[4*k + j] for row j and group grp+k: whole scale rows loaded and
 * transposed rather than gathered one lane at a time. */
SA_INLINE void key_scales4(const float *const rd[4], int grp, int nc, float dk[16])
{
    if (nc == 4) {
        const float32x4_t a0 = vld1q_f32(rd[0] + grp), a1 = vld1q_f32(rd[1] + grp);
        const float32x4_t a2 = vld1q_f32(rd[2] + grp), a3 = vld1q_f32(rd[3] + grp);
        const float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(a0, a1));
        const float64x2_t t1 = vreinterpretq_f64_f32(vtrn2q_f32(a0, a1));
        const float64x2_t t2 = vreinterpretq_f64_f32(vtrn1q_f32(a2, a3));
        const float64x2_t t3 = vreinterpretq_f64_f32(vtrn2q_f32(a2, a3));
        vst1q_f32(dk, vreinterpretq_f32_f64(vzip1q_f64(t0, t2)));
        vst1q_f32(dk + 4, vreinterpretq_f32_f64(vzip1q_f64(t1, t3)));
        vst1q_f32(dk + 8, vreinterpretq_f32_f64(vzip2q_f64(t0, t2)));
        vst1q_f32(dk + 12, vreinterpretq_f32_f64(vzip2q_f64(t1, t3)));
        return;
    }
    int k = 0;
    if (nc >= 2) {
        const float32x4_t a = vcombine_f32(vld1_f32(rd[0] + grp), vld1_f32(rd[2] + grp));
        const float32x4_t b = vcombine_f32(vld1_f32(rd[1] + grp), vld1_f32(rd[3] + grp));
        vst1q_f32(dk, vtrn1q_f32(a, b));
        vst1q_f32(dk + 4, vtrn2q_f32(a, b));
        k = 2;
    }
    for (; k < nc; k++)
        for (int j = 0; j < 4; j++)
            dk[4 * k + j] = rd[j][grp + k];
}

/* Scores of HB (1 to 4, constant) heads g0 .. g0+HB-1 against the four rows
 * r, groups grp0 .. grp0+nc-1 (dk: their key scales), into s[g][t .. t+3]
 * (which holds the earlier groups' sum unless grp0 is 0).  Each 16-byte
 * chunk of the four rows is loaded once for the HB heads; per (head, row)
 * the group's int32 lanes are exact, and one pairwise-add tree per head
 * puts row j's group sum in lane j, so the score of token j is lane j of
 * one float chain: fma(sum, kscale * qscale) per group, in group order,
 * whichever heads and rows share the tile. */
SA_INLINE void q8_scores_tile(const int8_t *qq, const float *qd, int D, int gs, int ng,
                              const int8_t *const r[4], const float *dk, int grp0, int nc,
                              int g0, const int HB, float *const *s, int t)
{
    float32x4_t acc[4];
    for (int h = 0; h < HB; h++)
        acc[h] = grp0 ? vld1q_f32(s[g0 + h] + t) : vdupq_n_f32(0.0f);
    const int8_t *q = qq + (ptrdiff_t)g0 * D;
    const float *qs = qd + (ptrdiff_t)g0 * ng + grp0;
    for (int k = 0, i0 = grp0 * gs; k < nc; k++, i0 += gs) {
        int32x4_t is[4][4];
        for (int h = 0; h < HB; h++)
            for (int j = 0; j < 4; j++)
                is[h][j] = vdupq_n_s32(0);
        int i = i0;
        for (int c = 0; c < gs / 16; c++, i += 16) {
            int8x16_t kv[4];
            for (int j = 0; j < 4; j++)
                kv[j] = vld1q_s8(r[j] + i);
            for (int h = 0; h < HB; h++) /* the first chunk needs no zeroed sums */
                q8_dot16x4(is[h], vld1q_s8(q + (ptrdiff_t)h * D + i), kv, c == 0);
        }
        if (gs % 16) {
            int8x8_t kv[4];
            for (int j = 0; j < 4; j++)
                kv[j] = vld1_s8(r[j] + i);
            for (int h = 0; h < HB; h++) {
                const int8x8_t qv = vld1_s8(q + (ptrdiff_t)h * D + i);
                for (int j = 0; j < 4; j++)
                    is[h][j] = q8_dot8(is[h][j], qv, kv[j]);
            }
        }
        const float32x4_t dkv = vld1q_f32(dk + 4 * k);
        for (int h = 0; h < HB; h++) {
            const int32x4_t isum = vpaddq_s32(vpaddq_s32(is[h][0], is[h][1]),
                                              vpaddq_s32(is[h][2], is[h][3]));
            acc[h] = vfmaq_f32(acc[h], vcvtq_f32_s32(isum),
                               vmulq_n_f32(dkv, qs[(ptrdiff_t)h * ng + k]));
        }
    }
    for (int h = 0; h < HB; h++)
        vst1q_f32(s[g0 + h] + t, acc[h]);
}

/* Heads g0 .. g0+left-1 (left 1 to 4; none for any other) as one tile. */
SA_INLINE void q8_scores_last(const int8_t *qq, const float *qd, int D, int gs, int ng,
                              const int8_t *const r[4], const float *dk, int grp0, int nc,
                              int g0, int left, float *const *s, int t)
{
    switch (left) {
    case 4: q8_scores_tile(qq, qd, D, gs, ng, r, dk, grp0, nc, g0, 4, s, t); break;
    case 3: q8_scores_tile(qq, qd, D, gs, ng, r, dk, grp0, nc, g0, 3, s, t); break;
    case 2: q8_scores_tile(qq, qd, D, gs, ng, r, dk, grp0, nc, g0, 2, s, t); break;
    case 1: q8_scores_tile(qq, qd, D, gs, ng, r, dk, grp0, nc, g0, 1, s, t); break;
    default: break;
    }
}

/* Every head, in tiles of up to four (a constant per q8_scores_tile).  Up
 * to eight heads (every model's group so far) see each tile's first head,
 * and so the query's offsets, as a constant. */
SA_INLINE void q8_scores_heads(const int8_t *qq, const float *qd, int G, int D, int gs, int ng,
                               const int8_t *const r[4], const float *dk, int grp0, int nc,
                               float *const *s, int t)
{
    if (G <= 4) {
        q8_scores_last(qq, qd, D, gs, ng, r, dk, grp0, nc, 0, G, s, t);
        return;
    }
    if (G <= 8) {
        q8_scores_tile(qq, qd, D, gs, ng, r, dk, grp0, nc, 0, 4, s, t);
        q8_scores_last(qq, qd, D, gs, ng, r, dk, grp0, nc, 4, G - 4, s, t);
        return;
    }
    int g0 = 0;
    for (; g0 + 4 <= G; g0 += 4)
        q8_scores_tile(qq, qd, D, gs, ng, r, dk, grp0, nc, g0, 4, s, t);
    q8_scores_last(qq, qd, D, gs, ng, r, dk, grp0, nc, g0, G - g0, s, t);
}

/* gs a multiple of 8: four tokens at a time, groups in runs of up to four
 * (their key scales transposed once), heads in tiles of up to four sharing
 * each load of the rows.  A token outside a block of four gets the same
 * operations on scalars. */
SA_INLINE void q8_scores_body(const int8_t *qq, const float *qd, int G, int D, int gs,
                              const int8_t *k, const float *kd, ptrdiff_t row_stride,
                              ptrdiff_t scale_stride, int n, float *const *s,
                              const sa_prefetch *pf)
{
    if (gs % 8) {
        scores_q8_scalar(qq, qd, G, D, gs, k, kd, row_stride, scale_stride, n, s, pf);
        return;
    }
    const int ng = D / gs;
    sa_pf_walk w;
    sa_pf_burst_start(&w, pf, (n + 3) / 4);
    /* the quad's first row and scale row, as addresses: advanced past the
     * last quad they may point beyond the rows, which a pointer may not */
    uintptr_t kt = (uintptr_t)k, kdt = (uintptr_t)kd;
    int t = 0;
    for (; t + 4 <= n; t += 4, kt += 4 * (uintptr_t)row_stride,
                       kdt += 4 * sizeof(float) * (uintptr_t)scale_stride) {
        sa_pf_burst_step(&w);
        const int8_t *r[4];
        const float *rd[4];
        q8_rows4((const int8_t *)kt, (const float *)kdt, row_stride, scale_stride, r, rd);
        for (int grp0 = 0; grp0 < ng; grp0 += 4) {
            const int nc = ng - grp0 < 4 ? ng - grp0 : 4;
            float dk[16];
            key_scales4(rd, grp0, nc, dk);
            if (nc == 4)
                q8_scores_heads(qq, qd, G, D, gs, ng, r, dk, grp0, 4, s, t);
            else
                q8_scores_heads(qq, qd, G, D, gs, ng, r, dk, grp0, nc, s, t);
        }
    }
    if (t < n)
        sa_pf_burst_step(&w);
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

static void __attribute__((optimize("no-schedule-insns")))
SA_FN(scores_q8)(const int8_t *qq, const float *qd, int G, int D, int gs,
                 const int8_t *k, const float *kd, ptrdiff_t row_stride,
                 ptrdiff_t scale_stride, int n, float *const *s,
                 const sa_prefetch *pf)
{
    /* The default group size gets a copy of its own, with the group's dot
     * unrolled and the query loads shared by the four tokens, and at the
     * common head sizes copies with D constant too: the group loop gone,
     * the query's offsets immediates (A55 model, G = 2: 95 -> 67 cycles per
     * token at D = 64, with the rows and heads of q8_scores_body and
     * q8_scores_heads; docs/design.md).  Same results. */
    if (gs == 32 && D == 64)
        q8_scores_body(qq, qd, G, 64, 32, k, kd, row_stride, scale_stride, n, s, pf);
    else if (gs == 32 && D == 128)
        q8_scores_body(qq, qd, G, 128, 32, k, kd, row_stride, scale_stride, n, s, pf);
    else if (gs == 32)
        q8_scores_body(qq, qd, G, D, 32, k, kd, row_stride, scale_stride, n, s, pf);
    else
        q8_scores_body(qq, qd, G, D, gs, k, kd, row_stride, scale_stride, n, s, pf);
}

/* ------------------------------------------------------------------ */
/* softmax_exp                                                          */
/* ------------------------------------------------------------------ */

/* exp(x) of N (1 to 4, constant) vectors in place, four lanes each:
 * x = n*ln2 + r with n = round(x/ln2), |r| <= ln2/2; exp(r) - 1 by the
 * degree-5 minimax polynomial of Arm's optimized-routines (v_expf), 2^n
 * put straight into the exponent field; under 2 ulp.  Valid for
 * x <= 88.37 (n <= 127; the caller routes larger x elsewhere); x below
 * ln(FLT_MIN) gives 0 (the true result is subnormal, and a softmax weight
 * that small is 0 beside the maximum's 1); NaN stays NaN.  Each step is
 * taken for the N vectors before the next: one vector's exp is a chain of
 * about fifteen dependent operations, which an in-order core (the A55)
 * waits out one by one, so N side by side fill those waits (llvm-mca,
 * A55 softmax: 15.5 -> 9 cycles a score at N = 4).  A lane's operations
 * are the same for every N, so are its bits. */
SA_INLINE void exp_f32xn(float32x4_t x[], const int N)
{
    float32x4_t n[4], r[4], r2[4], p[4], poly[4];
    for (int j = 0; j < N; j++)
        n[j] = vrndnq_f32(vmulq_n_f32(x[j], 0x1.715476p+0f)); /* x / ln2 */
    for (int j = 0; j < N; j++)
        r[j] = vfmsq_f32(x[j], n[j], vdupq_n_f32(0x1.62e4p-1f)); /* ln2, high */
    for (int j = 0; j < N; j++)
        r[j] = vfmsq_f32(r[j], n[j], vdupq_n_f32(0x1.7f7d1cp-20f)); /* ln2, low */
    for (int j = 0; j < N; j++)
        r2[j] = vmulq_f32(r[j], r[j]);
    for (int j = 0; j < N; j++)
        p[j] = vfmaq_f32(vdupq_n_f32(0x1.573e2ep-5f), vdupq_n_f32(0x1.0e4020p-7f), r[j]);
    for (int j = 0; j < N; j++)
        poly[j] = vfmaq_f32(vdupq_n_f32(0x1.fffdb6p-2f), vdupq_n_f32(0x1.555e66p-3f), r[j]);
    for (int j = 0; j < N; j++)
        poly[j] = vfmaq_f32(poly[j], p[j], r2[j]);
    for (int j = 0; j < N; j++) /* exp(r) - 1 */
        poly[j] = vfmaq_f32(vmulq_n_f32(r[j], 0x1.ffffecp-1f), poly[j], r2[j]);
    for (int j = 0; j < N; j++) {
        /* 2^n: (n + 127) << 23 is its bit pattern for -126 <= n <= 127. */
        const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n[j]), vdupq_n_s32(127)), 23);
        const float32x4_t two_n = vreinterpretq_f32_s32(e);
        const float32x4_t y = vfmaq_f32(two_n, poly[j], two_n);
        const uint32x4_t tiny = vcltq_f32(x[j], vdupq_n_f32(-0x1.5d589ep+6f)); /* ln(FLT_MIN) */
        x[j] = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), tiny));
    }
}

/* exp(scale * (s - max)) for N (1 to 4, constant) vectors of scores in
 * place: the argument is <= 0 (or NaN), inside exp_f32xn's range, and 0
 * exactly at the maximum. */
SA_INLINE void softmax_expn(float32x4_t x[], const int N, float32x4_t vscale, float32x4_t vm)
{
    for (int j = 0; j < N; j++)
        x[j] = vmulq_f32(vsubq_f32(x[j], vm), vscale);
    exp_f32xn(x, N);
}

/* Two passes: the maximum (vmaxq propagates NaN: a NaN score makes the sum
 * NaN, as on every ISA), then exp in place.  The sum is kept in double, each
 * run of SUM_VECS vectors summed in float lanes first (at most SUM_VECS
 * values of [0, 1] a lane: relative error under SUM_VECS * 2^-24), as the
 * x86 files do, so a long context loses no more than that.  The last
 * n % 4 scores are padded to a vector with the maximum, so every element
 * goes through the same exp. */
#define SUM_VECS 8

static float SA_FN(softmax_exp)(float *s, int n, float scale, float *max_out)
{
    int t = 0;
    float m = s[0];
    if (n >= 4) {
        /* four running maxima, not one chain of fmax latencies; fmax is
         * commutative (NaN in, NaN out; max(-0, +0) = +0), so the order
         * changes nothing */
        float32x4_t vm = vld1q_f32(s);
        t = 4;
        if (n >= 16) {
            float32x4_t m1 = vld1q_f32(s + 4), m2 = vld1q_f32(s + 8), m3 = vld1q_f32(s + 12);
            for (t = 16; t <= n - 16; t += 16) {  /* not t + 16 <= n: n may be INT_MAX */
                vm = vmaxq_f32(vm, vld1q_f32(s + t));
                m1 = vmaxq_f32(m1, vld1q_f32(s + t + 4));
                m2 = vmaxq_f32(m2, vld1q_f32(s + t + 8));
                m3 = vmaxq_f32(m3, vld1q_f32(s + t + 12));
            }
            vm = vmaxq_f32(vmaxq_f32(vm, m1), vmaxq_f32(m2, m3));
        }
        for (; t <= n - 4; t += 4)
            vm = vmaxq_f32(vm, vld1q_f32(s + t));
        m = vmaxvq_f32(vm);
    }
    int nan = m != m;
    for (; t < n; t++) {
        m = s[t] > m ? s[t] : m;
        nan |= s[t] != s[t];
    }
    if (max_out)
        *max_out = nan ? __builtin_nanf("") : m;

    const float32x4_t vscale = vdupq_n_f32(scale), vmax = vdupq_n_f32(m);
    float64x2_t sum_lo = vdupq_n_f64(0.0), sum_hi = vdupq_n_f64(0.0);
    for (t = 0; t <= n - 4;) {
        const int left = (n - t) / 4; /* whole vectors from t */
        const int end = t + 4 * (left < SUM_VECS ? left : SUM_VECS);
        float32x4_t run = vdupq_n_f32(0.0f);
        for (; t <= end - 16; t += 16) {
            float32x4_t e[4] = {vld1q_f32(s + t), vld1q_f32(s + t + 4), vld1q_f32(s + t + 8),
                                vld1q_f32(s + t + 12)};
            softmax_expn(e, 4, vscale, vmax);
            for (int j = 0; j < 4; j++) {
                vst1q_f32(s + t + 4 * j, e[j]);
                run = vaddq_f32(run, e[j]);
            }
        }
        for (; t < end; t += 4) {
            float32x4_t e = vld1q_f32(s + t);
            softmax_expn(&e, 1, vscale, vmax);
            vst1q_f32(s + t, e);
            run = vaddq_f32(run, e);
        }
        sum_lo = vaddq_f64(sum_lo, vcvt_f64_f32(vget_low_f32(run)));
        sum_hi = vaddq_f64(sum_hi, vcvt_high_f64_f32(run));
    }
    double tail = 0.0;
    if (t < n) {
        float buf[4] = {m, m, m, m};
        memcpy(buf, s + t, (size_t)(n - t) * sizeof(float));
        float32x4_t e = vld1q_f32(buf);
        softmax_expn(&e, 1, vscale, vmax);
        vst1q_f32(buf, e);
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

/* A tile of HB heads (1-4) x NV vectors (1 or 4, constant) of out from
 * column d, kept in registers over all n tokens: per token its NV vectors
 * of V, one multiply-add into each of the tile's HB x NV accumulators, the
 * heads' weights four tokens at a time (by lane).  Every accumulator takes
 * one fma per token in token order, as a head's row of out always does, so
 * the loop order changes no bits; but the HB x NV chains are independent,
 * where an output vector loaded, advanced four tokens and stored per head
 * made one chain of four dependent fmas at a time (the in-order A55 waited
 * out each one's latency: 167 cycles per (vector, key) at D=128 by llvm-mca,
 * now 53; the A76 model 24.5 -> 21.6).  hint: the call's prefetch, spread
 * over the first tile's 4-token steps. */
#define SA_V_STEP(lane)                                                                      \
    do {                                                                                     \
        const float *row = v + (t + (lane)) * row_stride + d;                                \
        float32x4_t r[4];                                                                    \
        for (int i = 0; i < NV; i++)                                                         \
            r[i] = vld1q_f32(row + 4 * i);                                                   \
        for (int h = 0; h < HB; h++)                                                         \
            for (int i = 0; i < NV; i++)                                                     \
                acc[h][i] = vfmaq_laneq_f32(acc[h][i], r[i], w[h], (lane));                  \
    } while (0)
SA_INLINE void v_f32_tile(float *const *out, const float *const *p, const int HB, const int NV,
                          int d, const float *v, ptrdiff_t row_stride, int n,
                          const sa_prefetch *hint)
{
    const int parts = (n + 3) / 4;
    float32x4_t acc[4][4];
    for (int h = 0; h < HB; h++)
        for (int i = 0; i < NV; i++)
            acc[h][i] = vld1q_f32(out[h] + d + 4 * i);
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        sa_prefetch_part(hint, t / 4, parts);
        float32x4_t w[4];
        for (int h = 0; h < HB; h++)
            w[h] = vld1q_f32(p[h] + t);
        SA_V_STEP(0);
        SA_V_STEP(1);
        SA_V_STEP(2);
        SA_V_STEP(3);
    }
    if (t < n)
        sa_prefetch_part(hint, t / 4, parts);
    for (; t < n; t++) {
        const float *row = v + t * row_stride + d;
        for (int i = 0; i < NV; i++) {
            const float32x4_t r = vld1q_f32(row + 4 * i);
            for (int h = 0; h < HB; h++)
                acc[h][i] = vfmaq_n_f32(acc[h][i], r, p[h][t]);
        }
    }
    for (int h = 0; h < HB; h++)
        for (int i = 0; i < NV; i++)
            vst1q_f32(out[h] + d + 4 * i, acc[h][i]);
}
#undef SA_V_STEP

/* HB (1-4) heads' tiles over all of D: 16 columns, then 4, then single
 * columns (scalar fmas in token order: the same operations). */
SA_INLINE void v_f32_heads(float *const *out, const float *const *p, const int HB, int D,
                           const float *v, ptrdiff_t row_stride, int n, const sa_prefetch **hint)
{
    int d = 0;
    for (; d + 16 <= D; d += 16, *hint = NULL)
        v_f32_tile(out, p, HB, 4, d, v, row_stride, n, *hint);
    for (; d + 4 <= D; d += 4, *hint = NULL)
        v_f32_tile(out, p, HB, 1, d, v, row_stride, n, *hint);
    for (; d < D; d++)
        for (int h = 0; h < HB; h++) {
            float o = out[h][d];
            for (int t = 0; t < n; t++)
                o = fmaf(p[h][t], v[t * row_stride + d], o);
            out[h][d] = o;
        }
}

/* Heads four at a time (then the last one to three), each tile's outputs
 * in registers for the whole call. */
static void SA_FN(accumulate_v_f32)(float *const *out, const float *const *p, int G, int D,
                                    const float *v, ptrdiff_t row_stride, int n,
                                    const sa_prefetch *pf)
{
    if (n <= 0)
        return;
    const sa_prefetch *hint = pf;
    int g = 0;
    for (; g + 4 <= G; g += 4)
        v_f32_heads(out + g, p + g, 4, D, v, row_stride, n, &hint);
    switch (G - g) {
    case 3: v_f32_heads(out + g, p + g, 3, D, v, row_stride, n, &hint); break;
    case 2: v_f32_heads(out + g, p + g, 2, D, v, row_stride, n, &hint); break;
    case 1: v_f32_heads(out + g, p + g, 1, D, v, row_stride, n, &hint); break;
    default: break;
    }
}

/* Byte i of a q8 chunk as the top byte of int32 lane i % 4 of vector i / 4
 * (index 255 selects 0): one table lookup per vector widens four values to
 * v << 24, instead of two widening steps. */
static const uint8_t sa_q8_spread[16 * 4] = {
    255, 255, 255, 0,  255, 255, 255, 1,  255, 255, 255, 2,  255, 255, 255, 3,
    255, 255, 255, 4,  255, 255, 255, 5,  255, 255, 255, 6,  255, 255, 255, 7,
    255, 255, 255, 8,  255, 255, 255, 9,  255, 255, 255, 10, 255, 255, 255, 11,
    255, 255, 255, 12, 255, 255, 255, 13, 255, 255, 255, 14, 255, 255, 255, 15,
};

/* NV (2, 4 or 8, constant) vectors of floats from 4*NV int8 of a q8 row,
 * exactly: the conversion of v << 24 with 24 fraction bits is (float)v. */
SA_INLINE void q8_widen(const int8_t *x, int NV, float32x4_t f[8])
{
    const int8x16_t b = NV >= 4 ? vld1q_s8(x) : vcombine_s8(vld1_s8(x), vdup_n_s8(0));
    const int8x16_t b1 = NV == 8 ? vld1q_s8(x + 16) : b;
    int8x16_t top[8];
    /* Step by step over the vectors, so that where the source order is the
     * issue order an in-order core has work between dependent steps. */
    for (int i = 0; i < NV; i++)
        top[i] = vqtbl1q_s8(i < 4 ? b : b1, vld1q_u8(sa_q8_spread + 16 * (i % 4)));
    for (int i = 0; i < NV; i++)
        f[i] = vcvtq_n_f32_s32(vreinterpretq_s32_s8(top[i]), 24);
}

/* The same, each times the row's group scale sc (one rounding, as
 * dequantize_rows). */
SA_INLINE void q8_load(const int8_t *x, float sc, int NV, float32x4_t f[8])
{
    q8_widen(x, NV, f);
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
            float32x4_t f[8];
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

/* o + f * w[j], j a constant. */
SA_INLINE float32x4_t fma_lane(float32x4_t o, float32x4_t f, float32x4_t w, const int j)
{
    switch (j) {
    case 0: return vfmaq_laneq_f32(o, f, w, 0);
    case 1: return vfmaq_laneq_f32(o, f, w, 1);
    case 2: return vfmaq_laneq_f32(o, f, w, 2);
    default: return vfmaq_laneq_f32(o, f, w, 3);
    }
}

/* The weights of a call are computed for up to SA_V_BLOCK tokens, SA_V_RUN
 * groups and SA_V_HEADS heads at once (a call of rows.c is one block of 32
 * tokens; a GQA group of up to 8 heads is one tile of heads): 4 KB of
 * stack. */
#define SA_V_BLOCK 32
#define SA_V_RUN 4
#define SA_V_HEADS 8
/* head h's weight of token t0 + i, group grp0 + k */
#define SA_V_W(wq, k, h, i) ((wq)[((k) * SA_V_HEADS + (h)) * SA_V_BLOCK + (i)])

/* The weights of groups grp0 .. grp0+nc-1 (nc <= SA_V_RUN) for heads g0 ..
 * g0+HW-1 (HW <= SA_V_HEADS) and tokens [t0, t1) (at most SA_V_BLOCK):
 * p[g0 + h][t] * vd[t][grp], one rounding (spec §4: the token's group scale
 * in the weight, so no element is scaled).  Four tokens' scale rows are
 * transposed once (key_scales4), then one product per head and group; the
 * leftover tokens take the same products on scalars. */
SA_INLINE void q8_v_weights(const float *const *p, int g0, int HW, int grp0, int nc,
                            const float *vd, ptrdiff_t scale_stride, int t0, int t1, float *wq)
{
    uintptr_t xd = (uintptr_t)(vd + (ptrdiff_t)t0 * scale_stride); /* may pass the rows */
    int t = t0;
    for (; t + 4 <= t1; t += 4, xd += 4 * sizeof(float) * (uintptr_t)scale_stride) {
        const float *rd[4] = {(const float *)xd, (const float *)xd + scale_stride,
                              (const float *)xd + 2 * scale_stride,
                              (const float *)xd + 3 * scale_stride};
        float dk[16];
        key_scales4(rd, grp0, nc, dk);
        for (int h = 0; h < HW; h++) {
            const float32x4_t pv = vld1q_f32(p[g0 + h] + t);
            for (int k = 0; k < nc; k++)
                vst1q_f32(&SA_V_W(wq, k, h, t - t0), vmulq_f32(pv, vld1q_f32(dk + 4 * k)));
        }
    }
    for (; t < t1; t++) {
        const float *rd = vd + (ptrdiff_t)t * scale_stride + grp0;
        for (int h = 0; h < HW; h++)
            for (int k = 0; k < nc; k++)
                SA_V_W(wq, k, h, t - t0) = p[g0 + h][t] * rd[k];
    }
}

/* Token j (a constant) of a block of four: its chunk x widened once, then
 * added to the HB heads' accumulators with their weights w[h]. */
SA_INLINE void q8_v_token(float32x4_t acc[8][8], const float32x4_t w[8], const int HB,
                          const int NV, const int8_t *x, const int j)
{
    float32x4_t f[8];
    q8_widen(x, NV, f);
    for (int h = 0; h < HB; h++)
        for (int i = 0; i < NV; i++)
            acc[h][i] = fma_lane(acc[h][i], f[i], w[h], j);
}

/* One chunk of NV (2, 4 or 8, constant) vectors, columns d .. d+4*NV of one
 * group, for the HB (constant, HB*NV <= 16) heads g0 .. g0+HB-1 over tokens
 * [t0, t1) with their weights wq (q8_v_weights): the chunk of out stays in
 * HB*NV registers from the first token to the last, each token's chunk of V
 * is widened once for the HB heads, and the HB*NV accumulators are
 * independent chains an in-order core can interleave.  Per element the
 * operations are those of accumulate_v_f32 over the values as floats with
 * the weights p * d: one fused multiply-add per token in token order. */
SA_INLINE void q8_v_chunk(float *const *out, const float *wq, int g0, const int HB, const int NV,
                          int d, const int8_t *v, ptrdiff_t row_stride, int t0, int t1)
{
    float32x4_t acc[8][8];
    for (int h = 0; h < HB; h++)
        for (int i = 0; i < NV; i++)
            acc[h][i] = vld1q_f32(out[g0 + h] + d + 4 * i);
    const int8_t *x = v + (ptrdiff_t)t0 * row_stride + d;
    const float *wt = wq;
    int t = t0;
    for (; t + 4 <= t1; t += 4, x += 4 * row_stride, wt += 4) {
        float32x4_t w[8];
        for (int h = 0; h < HB; h++)
            w[h] = vld1q_f32(wt + h * SA_V_BLOCK);
        q8_v_token(acc, w, HB, NV, x, 0);
        q8_v_token(acc, w, HB, NV, x + row_stride, 1);
        q8_v_token(acc, w, HB, NV, x + 2 * row_stride, 2);
        q8_v_token(acc, w, HB, NV, x + 3 * row_stride, 3);
    }
    for (; t < t1; t++, x += row_stride, wt++) {
        float32x4_t f[8];
        q8_widen(x, NV, f);
        for (int h = 0; h < HB; h++)
            for (int i = 0; i < NV; i++)
                acc[h][i] = vfmaq_n_f32(acc[h][i], f[i], wt[h * SA_V_BLOCK]);
    }
    for (int h = 0; h < HB; h++)
        for (int i = 0; i < NV; i++)
            vst1q_f32(out[g0 + h] + d + 4 * i, acc[h][i]);
}

/* Columns [d, d1) of one group (chunks of NV vectors) for heads g0 ..
 * g0+HB-1 over tokens [t0, t1), with the group's weights wq (head 0's row
 * first), a prefetch burst per chunk. */
SA_INLINE void q8_v_tile(float *const *out, const float *wq, int g0, const int HB, const int NV,
                         int d, int d1, const int8_t *v, ptrdiff_t row_stride, int t0, int t1,
                         sa_pf_walk *w)
{
    for (; d < d1; d += 4 * NV) {
        sa_pf_burst_step(w);
        q8_v_chunk(out, wq, g0, HB, NV, d, v, row_stride, t0, t1);
    }
}

/* Heads g0 .. g0+HW-1 in tiles of up to 2 (NV 8), 3 (NV 4) or 8 (NV 2), a
 * constant per call of q8_v_tile; wq: the group's weights of head g0 on;
 * q8_v_tiles: the number of tiles for G heads. */
static inline int q8_v_tiles(int G, int NV)
{
    const int hb = NV == 8 ? 2 : NV == 4 ? 3 : 8;
    return (G + hb - 1) / hb;
}

SA_INLINE void q8_v_heads(float *const *out, const float *wq, int g0, int HW, const int NV,
                          int d, int d1, const int8_t *v, ptrdiff_t row_stride, int t0, int t1,
                          sa_pf_walk *w)
{
#define SA_V_TILE(HB) \
    q8_v_tile(out, wq + (g - g0) * SA_V_BLOCK, g, HB, NV, d, d1, v, row_stride, t0, t1, w)
    const int G = g0 + HW;
    int g = g0;
    if (NV == 8) {
        for (; g + 2 <= G; g += 2)
            SA_V_TILE(2);
        if (g < G)
            SA_V_TILE(1);
    } else if (NV == 4) {
        for (; g + 3 <= G; g += 3)
            SA_V_TILE(3);
        switch (G - g) {
        case 2: SA_V_TILE(2); break;
        case 1: SA_V_TILE(1); break;
        default: break;
        }
    } else {
        switch (G - g) {
        case 8: SA_V_TILE(8); break;
        case 7: SA_V_TILE(7); break;
        case 6: SA_V_TILE(6); break;
        case 5: SA_V_TILE(5); break;
        case 4: SA_V_TILE(4); break;
        case 3: SA_V_TILE(3); break;
        case 2: SA_V_TILE(2); break;
        case 1: SA_V_TILE(1); break;
        default: break;
        }
    }
#undef SA_V_TILE
}

/* gs a multiple of 8 (so 32-, 16- and 8-wide chunks never straddle a
 * group): per block of up to SA_V_BLOCK tokens, run of up to SA_V_RUN
 * groups and up to SA_V_HEADS heads, the weights p * d once
 * (q8_v_weights), then per group its columns in chunks; within a chunk
 * tokens inner, so out is read and written once per block and chunk and
 * every token's V chunk serves all the heads of a tile.  One or two heads
 * take 32-column chunks (16 accumulators and 8 widened vectors: each
 * 4-token step's weights, loop and prefetch burst serve twice the columns
 * of a 16-column chunk); three heads take 16-column chunks (12
 * accumulators); more take 8-column chunks, so up to eight heads share
 * each widened chunk (16 accumulators).
 * Other group sizes take the scalar loop, with the same per-element
 * operations.  Pre-RA scheduling is off here and in scores_q8: with it GCC
 * stretches the accumulators' live ranges until they spill to the stack
 * (bench/arm_model.py shows the cost on both core models).  The call's
 * prefetch goes out in bursts, one per chunk and head tile (kernels.h,
 * sa_pf_burst_step). */
SA_INLINE void q8_v_body(float *const *out, const float *const *p, int G, int D, int gs,
                         const int8_t *v, const float *vd, ptrdiff_t row_stride,
                         ptrdiff_t scale_stride, int n, const sa_prefetch *pf)
{
    const int wide = G <= 3, wider = G <= 2;
    const int n32 = wider ? gs / 32 : 0;
    const int n16 = wide ? (gs - 32 * n32) / 16 : 0;
    const int n8 = (gs - 32 * n32 - 16 * n16) / 8;
    const long per_group = (long)n32 * q8_v_tiles(G, 8) + (long)n16 * q8_v_tiles(G, 4) +
                           (long)n8 * ((G + SA_V_HEADS - 1) / SA_V_HEADS);
    const int ng = D / gs;
    const long blocks = (n + SA_V_BLOCK - 1) / SA_V_BLOCK;
    sa_pf_walk w;
    sa_pf_burst_start(&w, pf, blocks * ng * per_group);
    float wq[SA_V_RUN * SA_V_HEADS * SA_V_BLOCK];
    for (int t0 = 0; t0 < n; t0 += SA_V_BLOCK) {
        const int t1 = n - t0 < SA_V_BLOCK ? n : t0 + SA_V_BLOCK;
        for (int grp0 = 0; grp0 < ng; grp0 += SA_V_RUN) {
            const int nc = ng - grp0 < SA_V_RUN ? ng - grp0 : SA_V_RUN;
            for (int g0 = 0; g0 < G; g0 += SA_V_HEADS) {
                const int HW = G - g0 < SA_V_HEADS ? G - g0 : SA_V_HEADS;
                if (nc == SA_V_RUN)
                    q8_v_weights(p, g0, HW, grp0, SA_V_RUN, vd, scale_stride, t0, t1, wq);
                else
                    q8_v_weights(p, g0, HW, grp0, nc, vd, scale_stride, t0, t1, wq);
                for (int k = 0; k < nc; k++) {
                    const float *wk = &SA_V_W(wq, k, 0, 0);
                    const int d0 = (grp0 + k) * gs, e32 = d0 + 32 * n32, e16 = e32 + 16 * n16;
                    if (n32)
                        q8_v_heads(out, wk, g0, HW, 8, d0, e32, v, row_stride, t0, t1, &w);
                    if (n16)
                        q8_v_heads(out, wk, g0, HW, 4, e32, e16, v, row_stride, t0, t1, &w);
                    if (n8)
                        q8_v_heads(out, wk, g0, HW, 2, e16, d0 + gs, v, row_stride, t0, t1,
                                   &w);
                }
            }
        }
    }
}

/* The body as its own functions: with a constant D = 64 and group (its run
 * of two groups unrolled) and with both at run time, each allocated alone
 * (inlined into one function, the copies' registers spilled each other's,
 * as bench/arm_model.py's trace shows; docs/design.md). */
#define SA_V_D64 SA_CAT(SA_FN(accumulate_v_q8), d64)
#define SA_V_ANY SA_CAT(SA_FN(accumulate_v_q8), any)
#define SA_V_FN(name)                                                                        \
    static void __attribute__((noinline, optimize("no-schedule-insns")))                      \
    name(float *const *out, const float *const *p, int G, int D, int gs, const int8_t *v,     \
         const float *vd, ptrdiff_t row_stride, ptrdiff_t scale_stride, int n,                \
         const sa_prefetch *pf)
SA_V_FN(SA_V_D64)
{
    (void)D, (void)gs;
    q8_v_body(out, p, G, 64, 32, v, vd, row_stride, scale_stride, n, pf);
}
SA_V_FN(SA_V_ANY)
{
    q8_v_body(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, pf);
}
#undef SA_V_FN

static void SA_FN(accumulate_v_q8)(float *const *out, const float *const *p, int G, int D,
                                   int gs, const int8_t *v, const float *vd,
                                   ptrdiff_t row_stride, ptrdiff_t scale_stride, int n,
                                   const sa_prefetch *pf)
{
    if (gs % 8) {
        accumulate_v_q8_scalar(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, pf);
        return;
    }
    if (n <= 0)
        return;
    if (gs == 32 && D == 64)
        SA_V_D64(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, pf);
    else
        SA_V_ANY(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, pf);
}
#undef SA_V_D64
#undef SA_V_ANY

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
/* halves_to_floats: FCVTL, 4 halves a step (exact, a NaN made quiet),  */
/* the scalar loop for the rest (the same bits)                         */
/* ------------------------------------------------------------------ */

static void SA_FN(halves_to_floats)(const uint16_t *h, float *out, int n)
{
    int i = 0;
    for (; i + 4 <= n; i += 4)
        vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
    halves_to_floats_scalar(h + i, out + i, n - i);
}

/* ------------------------------------------------------------------ */
/* stream_sum: the bandwidth probe                                      */
/* ------------------------------------------------------------------ */

#define SA_STREAM_BYTES 16
#include "../stream_sum.h"

/* GEMM-form q8 scores: only where the includer has the int8 dot of 4
 * bytes per lane (SA_Q8_DOT4, dotprod); plain NEON's widening multiplies
 * gain nothing from panels, and its table has NULL (kernels.h). */
#ifdef SA_Q8_DOT4
/* Panels of 8 keys, two vectors of 4 keys' 4 bytes per 4 channels; per
 * vector of a block 2 int32 and 2 float accumulators (4 vectors: 16, with
 * the keys and the query bytes 22 of the 32 registers). */
#define SA_Q8P_ROWS 4
enum { SA_FN(q8_panel_keys) = 8 };

/* HB query vectors x one panel: per 4 channels the 8 keys' bytes loaded
 * once and dotted with each vector's 4 bytes (one int32 lane per key,
 * exact): by lane from 16 query bytes loaded at once where the includer
 * has the by-element dot (SA_Q8_DOT4_LANE: a group of 16 channels or
 * more), else replicated to every lane; per group the term added as
 * scores_q8 adds it here, fused: acc + isum * (kd * qd).  By lane the
 * A76 model (llvm-mca, LLVM 19's Neoverse N1) takes 8.5 cycles per
 * (vector, key) at D=128 instead of 10.0 (the A55's 38.6, 37.2 before). */
SA_INLINE void q8_panel_block(const int8_t *qq, const float *qd, int HB, int D, int gs,
                              const int8_t *kp, const float *dp, float *const *s,
                              ptrdiff_t at, int n)
{
    const int ng = D / gs, per = gs / 4;
    float32x4_t r0[SA_Q8P_ROWS], r1[SA_Q8P_ROWS];
    for (int h = 0; h < HB; h++)
        r0[h] = r1[h] = vdupq_n_f32(0.0f);
    for (int grp = 0; grp < ng; grp++) {
        int32x4_t i0[SA_Q8P_ROWS], i1[SA_Q8P_ROWS];
        for (int h = 0; h < HB; h++)
            i0[h] = i1[h] = vdupq_n_s32(0);
        int c4 = grp * per;
#ifdef SA_Q8_DOT4_LANE
        /* 16 channels a step: each vector's 16 query bytes in one register,
         * each 4 of them dotted by lane (the same exact int32 sums) */
        for (; c4 + 4 <= (grp + 1) * per; c4 += 4) {
            int8x16_t qv[SA_Q8P_ROWS];
            for (int h = 0; h < HB; h++)
                qv[h] = vld1q_s8(qq + (ptrdiff_t)h * D + 4 * c4);
#define SA_Q8P_STEP(j)                                                                       \
    do {                                                                                     \
        const int8x16_t k0 = vld1q_s8(kp + (ptrdiff_t)(c4 + (j)) * 32);                      \
        const int8x16_t k1 = vld1q_s8(kp + (ptrdiff_t)(c4 + (j)) * 32 + 16);                 \
        for (int h = 0; h < HB; h++) {                                                       \
            i0[h] = SA_Q8_DOT4_LANE(i0[h], k0, qv[h], (j));                                  \
            i1[h] = SA_Q8_DOT4_LANE(i1[h], k1, qv[h], (j));                                  \
        }                                                                                    \
    } while (0)
            SA_Q8P_STEP(0);
            SA_Q8P_STEP(1);
            SA_Q8P_STEP(2);
            SA_Q8P_STEP(3);
#undef SA_Q8P_STEP
        }
#endif
        for (; c4 < (grp + 1) * per; c4++) {
            const int8x16_t k0 = vld1q_s8(kp + (ptrdiff_t)c4 * 32);
            const int8x16_t k1 = vld1q_s8(kp + (ptrdiff_t)c4 * 32 + 16);
            for (int h = 0; h < HB; h++) {
                int32_t q4;
                memcpy(&q4, qq + (ptrdiff_t)h * D + 4 * c4, sizeof q4);
                const int8x16_t qb = vreinterpretq_s8_s32(vdupq_n_s32(q4));
                i0[h] = SA_Q8_DOT4(i0[h], k0, qb);
                i1[h] = SA_Q8_DOT4(i1[h], k1, qb);
            }
        }
        const float32x4_t d0 = vld1q_f32(dp + (ptrdiff_t)grp * 8);
        const float32x4_t d1 = vld1q_f32(dp + (ptrdiff_t)grp * 8 + 4);
        for (int h = 0; h < HB; h++) {
            const float w = qd[(ptrdiff_t)h * ng + grp];
            r0[h] = vfmaq_f32(r0[h], vcvtq_f32_s32(i0[h]), vmulq_n_f32(d0, w));
            r1[h] = vfmaq_f32(r1[h], vcvtq_f32_s32(i1[h]), vmulq_n_f32(d1, w));
        }
    }
    for (int h = 0; h < HB; h++) {
        store_keys4(s[h], at, n, r0[h]);
        store_keys4(s[h], at + 4, n, r1[h]);
    }
}

/* Panel by panel. */
static void SA_FN(scores_q8_panels)(const int8_t *qq, const float *qd, int G, int D, int gs,
                                    const int8_t *k8, const float *kd, int first, int n,
                                    float *const *s)
{
    const int ng = D / gs;
#define SA_BLOCK(g, HB, p, at)                                                              \
    q8_panel_block(qq + (ptrdiff_t)(g) * D, qd + (ptrdiff_t)(g) * ng, (HB), D, gs,            \
                   k8 + (ptrdiff_t)(p) * D * 8, kd + (ptrdiff_t)(p) * ng * 8, s + (g), (at), n)
    SA_PANEL_WALK(8, SA_Q8P_ROWS, G, first, n, SA_BLOCK);
#undef SA_BLOCK
}
#else
#define scores_q8_panels_neon NULL
enum { SA_FN(q8_panel_keys) = 0 };
#endif

enum { SA_FN(q8_v_scaled) = SA_Q8_V_SCALED };

SA_DEFINE_KERNELS_OF(SA_ISA_ID);

#endif
