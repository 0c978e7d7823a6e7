/*
 * The x86 kernel template: the kernel bodies written once for every x86
 * kernel file, as arm/neon_common.h is for the NEON files.  An ISA file
 * (kernels_avx2.c, kernels_avx512_vnni.c, kernels_avx512_amx.c) includes
 * ../kernels.h and x86_helpers.h, defines what is listed here, its own
 * kernels, and includes this once, as its last line.  Nothing here is
 * optional: a step an ISA does not have is a 0 (its names then unused).
 *
 * The vectors:
 *   SA_ISA_ID                 avx2 / avx512_vnni / avx512_amx (names:
 *                             <kernel>_<id>, SA_FN)
 *   SA_VT                     floats per vector (8 / 16), which is also the
 *                             tokens per score block
 *   SA_MM(op)                 the intrinsic _mm256_<op> / _mm512_<op>
 *   sa_vf, sa_vd, sa_vmask    the float vector, the double vector (SA_VT / 2
 *                             lanes), the mask of a partial vector
 *   vf_tail(r)                the mask of the first r (0 .. SA_VT) lanes
 *   vf_load_tail(p, m), vf_store_tail(p, m, x)  masked lanes are neither
 *                             read nor written (a load gives them 0)
 *   vf_store_first(p, n, x)   x's first n (1 .. SA_VT) lanes to p
 *   vf_keep_tail(x, m)        x with the lanes outside m set to 0
 *   vf_max_tail(mv, p, m)     mv, and the max with p[i] in the lanes of m
 *   sa_vnan, vnan_none(), vnan_add(a, x), vnan_any(a)  whether any lane of
 *                             the vectors added was NaN
 *   vf_load_s8(p)             SA_VT int8 -> floats (exact)
 *   SA_HALVES(p)              SA_VT IEEE halves -> floats (F16C: exact, a
 *                             NaN made quiet)
 *   hmax_ps(x), hsum_pd(x)    horizontal max of sa_vf / sum of sa_vd, each
 *                             in a fixed order
 *   vd_add_ps(s0, s1, x)      x's low and high halves added in double into
 *                             *s0 and *s1
 *   vf_exp_finish(poly, z, x)  exp_ps's last step: 2^n (1 + poly) with n
 *                             in z's low bits, 0 where x < SA_LN_FLT_MIN
 *   sum_quads(quad)           the SA_VT / 4 reduce4_ps results of a score
 *                             block -> its SA_VT scores, token order
 *
 * The tiles:
 *   SA_S_HEADS                heads per f32 score block, at most
 *   SA_P_ROWS                 query vectors per block of the GEMM-form
 *                             scores (scores_f32_panels)
 *   SA_V_HEADS                heads per f32 V accumulation block
 *   SA_V_WIDE, SA_V_WIDE_VECS  V accumulation for many heads (prefill) in
 *                             register tiles of SA_V_WIDE heads x
 *                             SA_V_WIDE_VECS vectors (accv_f32_wide)
 *
 * The q8 scores (scores_q8 and its GEMM form):
 *   q8_takes(gs, D, scale_stride)  1 if the SIMD q8 dot takes the shape
 *   scores_q8_tokens(qq, qd, HB, D, gs, rows, srows, kd_t, scale_stride, cnt, ks, res, w)
 *                             HB (1 to SA_Q8_HEADS) heads against one block
 *                             of SA_VT rows (w: the call's prefetch walk,
 *                             kernels.h, a step per SA_Q8_S_STEPS(D, gs)-th
 *                             of the block; ks: q8_block_scales' vectors, or
 *                             NULL)
 *   SA_Q8_S_STEPS(D, gs)      those walk steps per block of heads and tokens
 *   SA_Q8_BLOCK_SCALES        1 if the file gives a block's key scales in its
 *                             own layout once for all its head blocks:
 *                             q8_block_scales(srows, ng, ks), at most
 *                             SA_Q8_MAX_GROUPS vectors
 *   SA_Q8_MANY_HEADS          from how many heads scores_q8 takes
 *                             scores_q8_many(qq, qd, G, D, gs, k, kd,
 *                             row_stride, scale_stride, n, s, pf) when
 *                             q8_many_takes(gs, D) (the same bits, each K
 *                             block prepared once for all the heads); 0: never
 *   SA_Q8_PANEL_KEYS          keys per panel of the GEMM-form q8 scores
 *                             (scores_q8_panels), whose block of at most
 *                             SA_Q8P_ROWS query vectors is
 *                             q8_panel_dot(qq, qd, HB, D, gs, kp, dp, res);
 *                             0: none (the file names scores_q8_panels_<id>
 *                             NULL, kernels.h)
 *
 * The file's own kernel: SA_FN(accumulate_v_q8) (q8 V's head blocks and
 * tiles are where the two vector widths differ most).
 *
 * It gets the score blocks (f32 and q8), the f32 V tiles, exp and the
 * softmax, the loops over token blocks and head blocks, the prefetch hints
 * spread over them (kernels.h: decode's inner loops step a walk, a line
 * every few steps; prefill's many heads take a part per block), the
 * portable fallbacks for shapes the SIMD steps do not take, the Quest bound
 * (8-lane FMA tiles, the same code and results on both ISAs), the channel
 * scores, the streaming sum, and the table.
 *
 * Batching rule (kernels.h): the steps may share loads between heads and
 * tokens, but the operations that produce one (head, token) result never
 * depend on the batch.  A short last block repeats its last row in the
 * unused slots (no read past row n-1, SA_BLOCK_ROWS) and stores only the
 * valid results, so there is no separate "tail token" path whose rounding
 * could differ.  Callers never pass n beyond 2^24 (rows.c), so
 * `t += SA_VT` cannot wrap.  Tails along D use masked loads and stores, so
 * nothing outside [0, D) of a row or [0, n) of the rows is read or written.
 */
#ifndef SA_X86_COMMON_H
#define SA_X86_COMMON_H

#include "x86_helpers.h"

/* -------------------------------------------------------------------------
 * scores_f32 and scores_q8: blocks of SA_VT tokens
 * ---------------------------------------------------------------------- */

/* Four per-token vectors of partial sums -> in each 128-bit lane, lane i is
 * token i's (x0 + x2) + (x1 + x3) of that lane's four values.  Float: the
 * order is fixed. */
SA_INLINE sa_vf reduce4_ps(sa_vf a0, sa_vf a1, sa_vf a2, sa_vf a3)
{
#define SA_PD(x) SA_MM(castps_pd)(x)
    const sa_vf s01 = SA_MM(add_ps)(SA_MM(castpd_ps)(SA_MM(unpacklo_pd)(SA_PD(a0), SA_PD(a1))),
                                    SA_MM(castpd_ps)(SA_MM(unpackhi_pd)(SA_PD(a0), SA_PD(a1))));
    const sa_vf s23 = SA_MM(add_ps)(SA_MM(castpd_ps)(SA_MM(unpacklo_pd)(SA_PD(a2), SA_PD(a3))),
                                    SA_MM(castpd_ps)(SA_MM(unpackhi_pd)(SA_PD(a2), SA_PD(a3))));
#undef SA_PD
    return SA_MM(add_ps)(SA_MM(shuffle_ps)(s01, s23, 0x88), SA_MM(shuffle_ps)(s01, s23, 0xDD));
}

/* HB (1 to SA_S_HEADS) heads x SA_VT rows, in quads of 4 rows.  Each (head,
 * token) keeps one SA_VT-lane FMA accumulator over D (the D % SA_VT tail
 * through masked loads: zero lanes add nothing), then reduce4_ps per quad
 * of tokens and sum_quads.  Per SA_VT channels the heads' query vectors are
 * loaded first and each row once: SA_S_HEADS heads x 4 rows are that many
 * independent FMA chains (prefill, where many query rows share the keys);
 * the arithmetic of one (head, token) is the same for any HB. */
SA_INLINE void scores_f32_block(const float *q, int HB, int D, const float *const *rows,
                                sa_vf *res, sa_pf_walk *w, const int STEP)
{
    const int dv = D & ~(SA_VT - 1), rem = D & (SA_VT - 1);
    const sa_vmask tm = vf_tail(rem);
    sa_pf_walk wl = {0}; /* in registers for the loop */
    if (STEP)
        wl = *w;
    sa_vf quad[SA_S_HEADS][SA_VT / 4];
    for (int j = 0; j < SA_VT / 4; j++) {
        const float *const *r = rows + 4 * j;
        sa_vf acc[SA_S_HEADS][4];
        for (int h = 0; h < HB; h++)
            for (int i = 0; i < 4; i++)
                acc[h][i] = SA_MM(setzero_ps)();
        for (int d = 0; d < dv; d += SA_VT) {
            if (STEP)
                sa_pf_walk_step(&wl);
            sa_vf qv[SA_S_HEADS];
            for (int h = 0; h < HB; h++) {
                qv[h] = SA_MM(loadu_ps)(q + (ptrdiff_t)h * D + d);
                SA_KEEP(qv[h]);
            }
            for (int i = 0; i < 4; i++) {
                sa_vf kv = SA_MM(loadu_ps)(r[i] + d);
                SA_KEEP(kv);
                for (int h = 0; h < HB; h++)
                    acc[h][i] = SA_MM(fmadd_ps)(qv[h], kv, acc[h][i]);
            }
        }
        if (rem) {
            sa_vf qv[SA_S_HEADS];
            for (int h = 0; h < HB; h++)
                qv[h] = vf_load_tail(q + (ptrdiff_t)h * D + dv, tm);
            for (int i = 0; i < 4; i++) {
                const sa_vf kv = vf_load_tail(r[i] + dv, tm);
                for (int h = 0; h < HB; h++)
                    acc[h][i] = SA_MM(fmadd_ps)(qv[h], kv, acc[h][i]);
            }
        }
        for (int h = 0; h < HB; h++)
            quad[h][j] = reduce4_ps(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    }
    if (STEP)
        *w = wl;
    for (int h = 0; h < HB; h++)
        res[h] = sum_quads(quad[h]);
}

/* Heads g .. g+HB-1 of one block of SA_VT rows; the prefetch walk w
 * steps when STEP (a constant). */
SA_INLINE void scores_f32_heads(const float *q, int HB, int g, int D, const float *const *rows,
                                float *const *s, int t, int cnt, sa_pf_walk *w, const int STEP)
{
    sa_vf res[SA_S_HEADS];
    scores_f32_block(q + (ptrdiff_t)g * D, HB, D, rows, res, w, STEP);
    for (int h = 0; h < HB; h++)
        vf_store_first(s[g + h] + t, cnt, res[h]);
}

/* scores_f32's blocks; the walk (STEP) steps per SA_VT channels of each
 * quad of the last block of heads. */
SA_INLINE void scores_f32_rows(const float *q, int G, int D, const float *k,
                               ptrdiff_t row_stride, int n, float *const *s, sa_pf_walk *w,
                               const int STEP)
{
    for (int t = 0; t < n; t += SA_VT) {
        const int cnt = n - t < SA_VT ? n - t : SA_VT;
        const float *rows[SA_VT];
        SA_BLOCK_ROWS(rows, k, t, cnt, row_stride);
        int g = 0;
        for (; g + SA_S_HEADS < G; g += SA_S_HEADS)
            scores_f32_heads(q, SA_S_HEADS, g, D, rows, s, t, cnt, w, 0);
        switch (G - g) { /* constant head counts, so each block is unrolled */
#if SA_S_HEADS >= 4
        case 4: scores_f32_heads(q, 4, g, D, rows, s, t, cnt, w, STEP); break;
#endif
        case 3: scores_f32_heads(q, 3, g, D, rows, s, t, cnt, w, STEP); break;
        case 2: scores_f32_heads(q, 2, g, D, rows, s, t, cnt, w, STEP); break;
        case 1: scores_f32_heads(q, 1, g, D, rows, s, t, cnt, w, STEP); break;
        default: break;
        }
    }
}

static void SA_FN(scores_f32)(const float *q, int G, int D, const float *k,
                              ptrdiff_t row_stride, int n, float *const *s,
                              const sa_prefetch *pf)
{
    if (!pf) {
        scores_f32_rows(q, G, D, k, row_stride, n, s, NULL, 0);
        return;
    }
    sa_pf_walk w;
    sa_pf_walk_start(&w, pf, (long)((n + SA_VT - 1) / SA_VT) * (SA_VT / 4) * (D / SA_VT));
    scores_f32_rows(q, G, D, k, row_stride, n, s, &w, 1);
}

/* -------------------------------------------------------------------------
 * scores_f32_panels: GEMM form (kernels.h), panels of two vectors of keys
 * ---------------------------------------------------------------------- */

#define SA_PANEL (2 * SA_VT)
enum { SA_FN(panel_keys) = SA_PANEL };

/* Lane l of x to row[at + l] for the lanes with 0 <= at + l < n. */
SA_INLINE void store_keys(float *row, ptrdiff_t at, int n, sa_vf x)
{
    if (at >= 0 && at + SA_VT <= n) {
        SA_MM(storeu_ps)(row + at, x);
        return;
    }
    float tmp[SA_VT];
    SA_MM(storeu_ps)(tmp, x);
    for (int l = 0; l < SA_VT; l++)
        if (at + l >= 0 && at + l < n)
            row[at + l] = tmp[l];
}

/* HB (at most SA_P_ROWS) query vectors x one panel: 2 * HB accumulators,
 * per channel the panel's two key vectors loaded once and each vector's
 * value broadcast (HB broadcasts and 2 loads per 2 * HB FMAs). */
SA_INLINE void panel_block(const float *q, int HB, int D, const float *kp, float *const *s,
                           ptrdiff_t at, int n)
{
    sa_vf a0[SA_P_ROWS], a1[SA_P_ROWS];
    for (int h = 0; h < HB; h++)
        a0[h] = a1[h] = SA_MM(setzero_ps)();
    for (int d = 0; d < D; d++) {
        sa_vf k0 = SA_MM(loadu_ps)(kp + (ptrdiff_t)d * SA_PANEL);
        sa_vf k1 = SA_MM(loadu_ps)(kp + (ptrdiff_t)d * SA_PANEL + SA_VT);
        SA_KEEP(k0);
        SA_KEEP(k1);
        for (int h = 0; h < HB; h++) {
            const sa_vf qb = SA_MM(set1_ps)(q[(ptrdiff_t)h * D + d]);
            a0[h] = SA_MM(fmadd_ps)(qb, k0, a0[h]);
            a1[h] = SA_MM(fmadd_ps)(qb, k1, a1[h]);
        }
    }
    for (int h = 0; h < HB; h++) {
        store_keys(s[h], at, n, a0[h]);
        store_keys(s[h], at + SA_VT, n, a1[h]);
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

/* -------------------------------------------------------------------------
 * scores_q8_panels: GEMM form (kernels.h), panels of SA_Q8_PANEL_KEYS keys,
 * for a file that has them (the dot is its q8_panel_dot)
 * ---------------------------------------------------------------------- */

enum { SA_FN(q8_panel_keys) = SA_Q8_PANEL_KEYS };

#if SA_Q8_PANEL_KEYS
SA_INLINE void q8_panel_block(const int8_t *qq, const float *qd, int HB, int D, int gs,
                              const int8_t *kp, const float *dp, float *const *s,
                              ptrdiff_t at, int n)
{
    sa_vf res[SA_Q8P_ROWS];
    q8_panel_dot(qq, qd, HB, D, gs, kp, dp, res);
    for (int h = 0; h < HB; h++)
        store_keys(s[h], at, n, res[h]);
}

/* Panel by panel. */
static void SA_FN(scores_q8_panels)(const int8_t *qq, const float *qd, int G, int D, int gs,
                                    const int8_t *k8, const float *kd, int first, int n,
                                    float *const *s)
{
    const int ng = D / gs;
#define SA_BLOCK(g, HB, p, at)                                                              \
    q8_panel_block(qq + (ptrdiff_t)(g) * D, qd + (ptrdiff_t)(g) * ng, (HB), D, gs,            \
                   k8 + (ptrdiff_t)(p) * D * SA_Q8_PANEL_KEYS,                                \
                   kd + (ptrdiff_t)(p) * ng * SA_Q8_PANEL_KEYS, s + (g), (at), n)
    SA_PANEL_WALK(SA_Q8_PANEL_KEYS, SA_Q8P_ROWS, G, first, n, SA_BLOCK);
#undef SA_BLOCK
}
#endif

/* scores_q8 for gs and D the SIMD blocks take, G below the many-heads
 * path's: blocks of SA_VT tokens, heads in pairs (and a block of three). */
SA_INLINE void scores_q8_body(const int8_t *qq, const float *qd, int G, int D, int gs,
                              const int8_t *k, const float *kd, ptrdiff_t row_stride,
                              ptrdiff_t scale_stride, int n, float *const *s,
                              const sa_prefetch *pf)
{
    const int ng = D / gs, iters = (n + SA_VT - 1) / SA_VT;
    const int three = G >= 3 && G % 2 == 1; /* the last three heads as one block */
    const int head_blocks = (G - 3 * three) / 2 + three + (G - 3 * three) % 2;
    sa_pf_walk w;
    sa_pf_walk_start(&w, pf, (long)iters * head_blocks * SA_Q8_S_STEPS(D, gs));
    for (int t = 0; t < n; t += SA_VT) {
        const int cnt = n - t < SA_VT ? n - t : SA_VT;
        const int8_t *rows[SA_VT];
        const float *srows[SA_VT];
        SA_BLOCK_ROWS(rows, k, t, cnt, row_stride);
        SA_BLOCK_ROWS(srows, kd, t, cnt, scale_stride);
        const float *kd_t = kd + (ptrdiff_t)t * scale_stride;
#if SA_Q8_BLOCK_SCALES
        sa_vf ks[SA_Q8_MAX_GROUPS];
        q8_block_scales(srows, ng, ks);
#else
        const sa_vf *const ks = NULL;
#endif
        int h = 0;
        for (; h + 2 <= G - 3 * three; h += 2) {
            sa_vf res[2];
            scores_q8_tokens(qq + (ptrdiff_t)h * D, qd + (ptrdiff_t)h * ng, 2, D, gs, rows, srows,
                             kd_t, scale_stride, cnt, ks, res, &w);
            vf_store_first(s[h] + t, cnt, res[0]);
            vf_store_first(s[h + 1] + t, cnt, res[1]);
        }
        if (three) {
            sa_vf res[3];
            scores_q8_tokens(qq + (ptrdiff_t)h * D, qd + (ptrdiff_t)h * ng, 3, D, gs, rows, srows,
                             kd_t, scale_stride, cnt, ks, res, &w);
            for (int j = 0; j < 3; j++)
                vf_store_first(s[h + j] + t, cnt, res[j]);
            h += 3;
        }
        if (h < G) {
            sa_vf res[1];
            scores_q8_tokens(qq + (ptrdiff_t)h * D, qd + (ptrdiff_t)h * ng, 1, D, gs, rows, srows,
                             kd_t, scale_stride, cnt, ks, res, &w);
            vf_store_first(s[h] + t, cnt, res[0]);
        }
    }
}

static void SA_FN(scores_q8)(const int8_t *qq, const float *qd, int G, int D, int gs,
                             const int8_t *k, const float *kd, ptrdiff_t row_stride,
                             ptrdiff_t scale_stride, int n, float *const *s,
                             const sa_prefetch *pf)
{
    if (!q8_takes(gs, D, scale_stride)) {
        sa_kernels_portable.scores_q8(qq, qd, G, D, gs, k, kd, row_stride, scale_stride, n, s,
                                      pf);
        return;
    }
#if SA_Q8_MANY_HEADS
    if (G >= SA_Q8_MANY_HEADS && q8_many_takes(gs, D)) {
        scores_q8_many(qq, qd, G, D, gs, k, kd, row_stride, scale_stride, n, s, pf);
        return;
    }
#endif
    /* The default group at the common head sizes gets copies with D and gs
     * constant (the group loop unrolled, the offsets immediates; docs/design.md, x86's measured choices). */
    if (gs == 32 && D == 64)
        scores_q8_body(qq, qd, G, 64, 32, k, kd, row_stride, scale_stride, n, s, pf);
    else if (gs == 32 && D == 128)
        scores_q8_body(qq, qd, G, 128, 32, k, kd, row_stride, scale_stride, n, s, pf);
    else
        scores_q8_body(qq, qd, G, D, gs, k, kd, row_stride, scale_stride, n, s, pf);
}

/* -------------------------------------------------------------------------
 * softmax_exp
 * ---------------------------------------------------------------------- */

/* exp(x) for x <= 0 (softmax's scale * (s - max)) or NaN, as the NEON
 * files take it: x = n ln2 + r with n = round(x / ln2) by the 1.5 * 2^23
 * shift (z's low mantissa bits are then n), |r| <= ln2/2 (Cody-Waite, two
 * constants), exp(r) - 1 by the degree-5 minimax polynomial of Arm's
 * optimized-routines (v_expf), then 2^n (1 + that) in one FMA
 * (vf_exp_finish); under 2 ulp.  Below ln(FLT_MIN) the result is 0 (the
 * true one is subnormal: a weight that small is 0 beside the maximum's 1),
 * and NaN stays NaN.  No clamp: below the range (-inf included) a lane is
 * one vf_exp_finish zeroes, and NaN stays NaN.  x > 0 is outside the
 * domain (2^n would not fit the exponent field): softmax_exp's only such
 * lanes are a short last vector's unused ones, which it masks to 0.
 * Written in two halves, the range reduction (exp_reduce: z and r) and
 * the polynomial with 2^n (exp_poly), so softmax_exp can take a run's
 * reductions before their polynomials. */
SA_INLINE sa_vf exp_reduce(sa_vf x, sa_vf *z_out)
{
    const sa_vf shift = SA_MM(set1_ps)(0x1.8p23f);
    const sa_vf z = SA_MM(fmadd_ps)(x, SA_MM(set1_ps)(0x1.715476p+0f), shift);
    const sa_vf n = SA_MM(sub_ps)(z, shift);
    sa_vf r = SA_MM(fnmadd_ps)(n, SA_MM(set1_ps)(0x1.62e4p-1f), x);    /* ln2, high */
    r = SA_MM(fnmadd_ps)(n, SA_MM(set1_ps)(0x1.7f7d1cp-20f), r);       /* ln2, low */
    *z_out = z;
    return r;
}

SA_INLINE sa_vf exp_poly(sa_vf r, sa_vf z, sa_vf x)
{
    const sa_vf r2 = SA_MM(mul_ps)(r, r);
    const sa_vf p = SA_MM(fmadd_ps)(SA_MM(set1_ps)(0x1.0e4020p-7f), r,
                                    SA_MM(set1_ps)(0x1.573e2ep-5f));
    sa_vf poly = SA_MM(fmadd_ps)(SA_MM(set1_ps)(0x1.555e66p-3f), r,
                                 SA_MM(set1_ps)(0x1.fffdb6p-2f));
    poly = SA_MM(fmadd_ps)(p, r2, poly);
    poly = SA_MM(fmadd_ps)(poly, r2, SA_MM(mul_ps)(r, SA_MM(set1_ps)(0x1.ffffecp-1f)));
    return vf_exp_finish(poly, z, x);
}

SA_INLINE sa_vf exp_ps(sa_vf x)
{
    sa_vf z;
    const sa_vf r = exp_reduce(x, &z);
    return exp_poly(r, z, x);
}

/* Two passes: the max, then exp(scale * (s - max)) written back while the
 * sum runs in double lanes, reduced in a fixed order.  Each run of
 * SUM_VECS vectors is summed in float lanes first (at most SUM_VECS values
 * of [0, 1] a lane: relative error under SUM_VECS * 2^-24, about 5e-7) and
 * then added in double, so a long row loses no more than that: the double
 * adds and their conversions had been a quarter of the softmax.  A run's
 * exponentials are taken in two loops, the range reductions of its vectors
 * and then their polynomials (the same operations): one vector's whole
 * chain is ~45 cycles of latency, more than the out-of-order window keeps
 * in flight at the rate the pipes allow (four vectors' whole chains
 * interleaved spill their constants; docs/design.md, x86's measured choices). */
#define SUM_VECS 8
static float SA_FN(softmax_exp)(float *s, int n, float scale, float *max_out)
{
    if (n <= 0)
        return 0.0f;
    const int nv = n & ~(SA_VT - 1), rem = n & (SA_VT - 1);
    const sa_vmask tm = vf_tail(rem);
    /* four running maxima: one would be a chain of maxps latencies; the
     * max of finite values is the same whatever the order.  maxps drops
     * NaN, so when the caller asks for the maximum the NaNs are counted
     * beside it; else a NaN score makes its exp, so the sum, NaN anyway. */
    sa_vf mv = SA_MM(set1_ps)(-__builtin_inff()), m1 = mv, m2 = mv, m3 = mv;
    sa_vnan nan = vnan_none();
    const int n4 = n & ~(4 * SA_VT - 1);
    int t = 0;
#define SA_MAX4(count)                                                                        \
    for (; t < n4; t += 4 * SA_VT) {                                                          \
        const sa_vf x0 = SA_MM(loadu_ps)(s + t), x1 = SA_MM(loadu_ps)(s + t + SA_VT);         \
        const sa_vf x2 = SA_MM(loadu_ps)(s + t + 2 * SA_VT);                                  \
        const sa_vf x3 = SA_MM(loadu_ps)(s + t + 3 * SA_VT);                                  \
        mv = SA_MM(max_ps)(mv, x0);                                                           \
        m1 = SA_MM(max_ps)(m1, x1);                                                           \
        m2 = SA_MM(max_ps)(m2, x2);                                                           \
        m3 = SA_MM(max_ps)(m3, x3);                                                           \
        if (count)                                                                            \
            nan = vnan_add(vnan_add(vnan_add(vnan_add(nan, x0), x1), x2), x3);                 \
    }
    if (max_out) {
        SA_MAX4(1)
    } else {
        SA_MAX4(0)
    }
#undef SA_MAX4
    for (; t < nv; t += SA_VT) {
        const sa_vf x = SA_MM(loadu_ps)(s + t);
        mv = SA_MM(max_ps)(mv, x);
        nan = vnan_add(nan, x);
    }
    if (rem) {
        mv = vf_max_tail(mv, s + nv, tm);
        nan = vnan_add(nan, vf_load_tail(s + nv, tm)); /* unused lanes load 0 */
    }
    mv = SA_MM(max_ps)(SA_MM(max_ps)(mv, m1), SA_MM(max_ps)(m2, m3));
    const int any_nan = max_out && vnan_any(nan);
    const float m = hmax_ps(mv);
    if (max_out)
        *max_out = any_nan ? __builtin_nanf("") : m;

    const sa_vf vs = SA_MM(set1_ps)(scale), vm = SA_MM(set1_ps)(m);
    sa_vd sum0 = SA_MM(setzero_pd)(), sum1 = SA_MM(setzero_pd)();
    for (t = 0; t < nv;) {
        const int end = nv - t > SUM_VECS * SA_VT ? t + SUM_VECS * SA_VT : nv;
        sa_vf run = SA_MM(setzero_ps)();
        sa_vf x[SUM_VECS], z[SUM_VECS], r[SUM_VECS];
        const int nr = (end - t) / SA_VT;
        for (int j = 0; j < nr; j++) {
            x[j] = SA_MM(mul_ps)(vs, SA_MM(sub_ps)(SA_MM(loadu_ps)(s + t + j * SA_VT), vm));
            r[j] = exp_reduce(x[j], &z[j]);
        }
        for (int j = 0; j < nr; j++, t += SA_VT) {
            const sa_vf e = exp_poly(r[j], z[j], x[j]);
            SA_MM(storeu_ps)(s + t, e);
            run = SA_MM(add_ps)(run, e);
        }
        vd_add_ps(&sum0, &sum1, run);
    }
    if (rem) {
        const sa_vf x = vf_load_tail(s + nv, tm);
        const sa_vf e = vf_keep_tail(exp_ps(SA_MM(mul_ps)(vs, SA_MM(sub_ps)(x, vm))), tm);
        vf_store_tail(s + nv, tm, e);
        vd_add_ps(&sum0, &sum1, e); /* unused lanes add 0 */
    }
    return (float)hsum_pd(SA_MM(add_pd)(sum0, sum1));
}

/* -------------------------------------------------------------------------
 * accumulate_v_f32
 * ---------------------------------------------------------------------- */

/* V accumulation works on blocks of V_TOKENS tokens (x86_helpers.h); from
 * V_MANY_HEADS heads on (prefill's tiles) a block is V_TOKENS_MANY, a whole
 * call of a run of keys (rows.c's STRETCH), each tile's accumulators loaded
 * and stored once for more FMAs (bench/prefill_ceiling.c; docs/design.md, x86's measured choices). */
#define V_TOKENS_MANY 32
#define V_MANY_HEADS 16

/* out[h][d .. d + SA_VT*NC) for HB heads over tokens [t0, t1): accumulators
 * stay in registers, one FMA per (head, SA_VT lanes, token) in token order.
 * The last vector is masked by tm when `masked`. */
SA_INLINE void accv_f32_tile(float *const *out, const float *const *p, int HB, int NC,
                             int masked, sa_vmask tm, const float *v, ptrdiff_t row_stride,
                             int t0, int t1, int d, sa_pf_walk *walk, const int STEP)
{
    sa_pf_walk wl = {0}; /* in registers for the loop */
    if (STEP)
        wl = *walk;
    sa_vf acc[SA_V_HEADS][4];
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NC; c++)
            acc[h][c] = masked && c == NC - 1 ? vf_load_tail(out[h] + d + SA_VT * c, tm)
                                              : SA_MM(loadu_ps)(out[h] + d + SA_VT * c);
    for (int t = t0; t < t1; t++) {
        if (STEP)
            sa_pf_walk_step(&wl);
        const float *row = v + (ptrdiff_t)t * row_stride + d;
        sa_vf vv[4];
        for (int c = 0; c < NC; c++)
            vv[c] = masked && c == NC - 1 ? vf_load_tail(row + SA_VT * c, tm)
                                          : SA_MM(loadu_ps)(row + SA_VT * c);
        for (int h = 0; h < HB; h++) {
            const sa_vf w = SA_MM(set1_ps)(p[h][t]);
            for (int c = 0; c < NC; c++)
                acc[h][c] = SA_MM(fmadd_ps)(w, vv[c], acc[h][c]);
        }
    }
    if (STEP)
        *walk = wl;
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NC; c++) {
            if (masked && c == NC - 1)
                vf_store_tail(out[h] + d + SA_VT * c, tm, acc[h][c]);
            else
                SA_MM(storeu_ps)(out[h] + d + SA_VT * c, acc[h][c]);
        }
}

/* Columns [d, D) for HB heads: tiles of 4 vectors, then single vectors,
 * then the masked remainder.  The prefetch walk steps in the 4-vector
 * tiles when STEP (a constant). */
SA_INLINE void accv_f32_cols(float *const *out, const float *const *p, int HB, int d, int D,
                             const float *v, ptrdiff_t row_stride, int t0, int t1,
                             sa_pf_walk *w, const int STEP)
{
    const sa_vmask none = vf_tail(0); /* unused by the unmasked tiles */
    for (; d + 4 * SA_VT <= D; d += 4 * SA_VT)
        accv_f32_tile(out, p, HB, 4, 0, none, v, row_stride, t0, t1, d, w, STEP);
    for (; d + SA_VT <= D; d += SA_VT)
        accv_f32_tile(out, p, HB, 1, 0, none, v, row_stride, t0, t1, d, w, 0);
    if (d < D)
        accv_f32_tile(out, p, HB, 1, 1, vf_tail(D - d), v, row_stride, t0, t1, d, w, 0);
}

/* Heads [0, G) over columns [d, D): SA_V_HEADS at a time, then pairs, then
 * one; the walk steps (STEP) in the last block's tiles only, so a call
 * takes D / (4 * SA_VT) steps per token whatever G is. */
SA_INLINE void accv_f32_heads(float *const *out, const float *const *p, int G, int d, int D,
                              const float *v, ptrdiff_t row_stride, int t0, int t1,
                              sa_pf_walk *w, const int STEP)
{
    int g = 0;
    for (; g + SA_V_HEADS < G; g += SA_V_HEADS)
        accv_f32_cols(out + g, p + g, SA_V_HEADS, d, D, v, row_stride, t0, t1, w, 0);
    if (G - g == SA_V_HEADS) {
        accv_f32_cols(out + g, p + g, SA_V_HEADS, d, D, v, row_stride, t0, t1, w, STEP);
        return;
    }
    for (; g + 2 < G; g += 2)
        accv_f32_cols(out + g, p + g, 2, d, D, v, row_stride, t0, t1, w, 0);
    if (G - g == 2)
        accv_f32_cols(out + g, p + g, 2, d, D, v, row_stride, t0, t1, w, STEP);
    else if (g < G)
        accv_f32_cols(out + g, p + g, 1, d, D, v, row_stride, t0, t1, w, STEP);
}

/* SA_V_WIDE heads over tokens [t0, t1), columns in tiles of SA_V_WIDE_VECS
 * vectors; returns the columns it did (the rest go through accv_f32_heads).
 * Each token's values are loaded once (SA_KEEP) for all the heads, so the
 * tile needs fewer loads per FMA than accv_f32_tile's; it does the same
 * per-element FMA in token order, so the results are the same bits. */
SA_INLINE int accv_f32_wide(float *const *out, const float *const *p, int D, const float *v,
                            ptrdiff_t row_stride, int t0, int t1)
{
    enum { W = SA_V_WIDE_VECS * SA_VT };
    int d = 0;
    for (; d + W <= D; d += W) {
        sa_vf a[SA_V_WIDE][SA_V_WIDE_VECS];
        for (int h = 0; h < SA_V_WIDE; h++)
            for (int c = 0; c < SA_V_WIDE_VECS; c++)
                a[h][c] = SA_MM(loadu_ps)(out[h] + d + SA_VT * c);
        for (int t = t0; t < t1; t++) {
            const float *row = v + (ptrdiff_t)t * row_stride + d;
            sa_vf vv[SA_V_WIDE_VECS];
            for (int c = 0; c < SA_V_WIDE_VECS; c++) {
                vv[c] = SA_MM(loadu_ps)(row + SA_VT * c);
                SA_KEEP(vv[c]);
            }
            for (int h = 0; h < SA_V_WIDE; h++) {
                const sa_vf w = SA_MM(set1_ps)(p[h][t]);
                for (int c = 0; c < SA_V_WIDE_VECS; c++)
                    a[h][c] = SA_MM(fmadd_ps)(w, vv[c], a[h][c]);
            }
        }
        for (int h = 0; h < SA_V_WIDE; h++)
            for (int c = 0; c < SA_V_WIDE_VECS; c++)
                SA_MM(storeu_ps)(out[h] + d + SA_VT * c, a[h][c]);
    }
    return d;
}

/* Blocks of V_TOKENS (or V_TOKENS_MANY) tokens, all of D and all heads per
 * block (SA_V_WIDE heads at a time when the ISA has the wide tile, then
 * accv_f32_heads), tokens in order into each accumulator. */
static void SA_FN(accumulate_v_f32)(float *const *out, const float *const *p, int G, int D,
                                    const float *v, ptrdiff_t row_stride, int n,
                                    const sa_prefetch *pf)
{
    const int bt = G >= V_MANY_HEADS ? V_TOKENS_MANY : V_TOKENS;
    const int iters = (n + bt - 1) / bt;
    /* decode (few heads): the walk, in the last head block's 4-vector
     * tiles; prefill's many heads, and calls without such a tile to walk
     * in (D below 4 vectors, or heads the wide tiles take all of): a part
     * per block */
    sa_pf_walk w, *walk = NULL;
    const int walks = G < V_MANY_HEADS && D >= 4 * SA_VT && G % SA_V_WIDE != 0;
    if (pf && walks) {
        sa_pf_walk_start(&w, pf, (long)n * (D / (4 * SA_VT)));
        walk = &w;
    }
    for (int t0 = 0, it = 0; t0 < n; t0 += bt, it++) {
        const int t1 = n - t0 < bt ? n : t0 + bt;
        if (!walk)
            sa_prefetch_part(pf, it, iters);
        int g = 0;
        for (; g + SA_V_WIDE <= G; g += SA_V_WIDE) {
            const int d = accv_f32_wide(out + g, p + g, D, v, row_stride, t0, t1);
            if (d < D)
                accv_f32_heads(out + g, p + g, SA_V_WIDE, d, D, v, row_stride, t0, t1, NULL, 0);
        }
        if (walk)
            accv_f32_heads(out + g, p + g, G - g, 0, D, v, row_stride, t0, t1, walk, 1);
        else
            accv_f32_heads(out + g, p + g, G - g, 0, D, v, row_stride, t0, t1, NULL, 0);
    }
}

/* -------------------------------------------------------------------------
 * dequantize_rows: a product per vector (gs a multiple of SA_VT, else the
 * scalar loop; one product per element either way).
 * ---------------------------------------------------------------------- */

static void SA_FN(dequantize_rows)(const int8_t *q, const float *scales, int dim, int gs,
                                   int n, ptrdiff_t row_stride, ptrdiff_t scale_stride,
                                   float *out)
{
    if (gs % SA_VT != 0) {
        dequantize_rows_scalar(q, scales, dim, gs, n, row_stride, scale_stride, out);
        return;
    }
    for (int t = 0; t < n; t++) {
        const int8_t *row = q + (ptrdiff_t)t * row_stride;
        const float *rd = scales + (ptrdiff_t)t * scale_stride;
        float *o = out + (ptrdiff_t)t * dim;
        for (int d = 0; d < dim; d += SA_VT)
            SA_MM(storeu_ps)(o + d, SA_MM(mul_ps)(SA_MM(set1_ps)(rd[d / gs]), vf_load_s8(row + d)));
    }
}

/* -------------------------------------------------------------------------
 * channel_scores: the tile loop of ../channel_tiles.h (weights for 8
 * blocks at once, the prefetch, blocks that are not 32 rows through the
 * scalar loop) around a 32-row block as 32 / SA_VT vectors per head,
 * SA_C_HEADS heads at a time, each scored channel's 32 bytes loaded and
 * widened once for those heads, and each (head, row) sum the fused
 * multiply-add chain of the scalar loop.  The weights are formed per tile,
 * and each channel's offset once per call, which takes the scalar work per
 * channel out of the block loop (docs/design.md, x86's measured choices).
 * ---------------------------------------------------------------------- */

#define SA_C_VECS (32 / SA_VT)
#define SA_C_HEADS (SA_VT == 8 ? 2 : 4)

/* NB adjacent 32-row blocks of the tile (slots t .. t + NB - 1, NB 1 or 2,
 * cs bytes apart per channel), their bytes at db + off[j] for channel j,
 * heads g0 .. g0+HB: HB and NB are constants at every call, so the loops
 * unroll with no test.  Each (head, row) is the same fused multiply-add
 * chain whatever NB, so a block scored in a pair is the same bits as
 * alone. */
SA_INLINE void channel_block_simd(int G, int r, const int8_t *db, ptrdiff_t cs,
                                  const ptrdiff_t *off, const float *w, int t, int g0,
                                  const int HB, const int NB, float *const *s, int b)
{
    sa_vf a[2][SA_C_HEADS][SA_C_VECS];
    for (int k = 0; k < NB; k++)
        for (int h = 0; h < HB; h++)
            for (int v = 0; v < SA_C_VECS; v++)
                a[k][h][v] = SA_MM(setzero_ps)();
    const float *wj = w + (ptrdiff_t)g0 * SA_CHANNEL_TILE + t;
    const ptrdiff_t wstep = (ptrdiff_t)G * SA_CHANNEL_TILE;
    for (int j = 0; j < r; j++, wj += wstep) {
        const int8_t *x = db + off[j];
        sa_vf xv[2][SA_C_VECS];
        for (int k = 0; k < NB; k++)
            for (int v = 0; v < SA_C_VECS; v++)
                xv[k][v] = vf_load_s8(x + k * cs + v * SA_VT);
        for (int h = 0; h < HB; h++)
            for (int k = 0; k < NB; k++) {
                const sa_vf wv = SA_MM(set1_ps)(wj[h * SA_CHANNEL_TILE + k]);
                for (int v = 0; v < SA_C_VECS; v++)
                    a[k][h][v] = SA_MM(fmadd_ps)(wv, xv[k][v], a[k][h][v]);
            }
    }
    for (int k = 0; k < NB; k++)
        for (int h = 0; h < HB; h++) {
            sa_vf m = a[k][h][0];
            for (int v = 1; v < SA_C_VECS; v++)
                m = SA_MM(max_ps)(m, a[k][h][v]);
            s[g0 + h][b + k] = hmax_ps(m);    /* max is exact in any order */
        }
}

/* AVX-512 scores adjacent 32-row blocks in pairs (NB = 2): each channel's
 * 64 bytes (both blocks: a whole cache line when cs is 32) read together,
 * and twice the independent fused multiply-add chains to hide their
 * latency and the loads' (docs/design.md, x86's measured choices).  With AVX2's 16 registers the pair's 16
 * accumulators spill, so AVX2 scores one block at a time. */
#if SA_VT == 16
#define SA_C_PAIR 1
#endif

SA_INLINE void channel_weights8(float *dst, float qv, const float *sc)
{
    _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_set1_ps(qv), _mm256_loadu_ps(sc)));
}

#include "../channel_tiles.h"

/* -------------------------------------------------------------------------
 * minmax_scores
 * ---------------------------------------------------------------------- */

/* Quest's bound (spec §6): up to 4 blocks for one head, q- * lo and q+ * hi
 * accumulated by FMA in separate chains per block, so the 4 blocks' 8 chains
 * hide the FMA latency that a single chain per block is bound by; per group
 * the two chains are added, scaled and added in group order; one horizontal
 * sum per block.  A block's arithmetic does not depend on the blocks beside
 * it.  At 32K tokens this is the largest cost of a minmax selection, bound by
 * widening the int8 bounds and by loads. */
SA_INLINE void minmax_tile4(const float *qp, const float *qn, int D, int gs, const int8_t *lo,
                            const int8_t *hi, const float *sc, ptrdiff_t block_stride,
                            ptrdiff_t sc_stride, int cnt, float *out)
{
    __m256 tot[4];
    for (int j = 0; j < 4; j++)
        tot[j] = _mm256_setzero_ps();
    for (int i0 = 0, grp = 0; i0 < D; i0 += gs, grp++) {
        __m256 pa[4], pb[4];
        for (int j = 0; j < 4; j++)
            pa[j] = pb[j] = _mm256_setzero_ps();
        for (int i = i0; i < i0 + gs; i += 8) {
            const __m256 m = _mm256_loadu_ps(qn + i), p = _mm256_loadu_ps(qp + i);
            for (int j = 0; j < cnt; j++) {
                pa[j] = _mm256_fmadd_ps(m, load8_s8_ps(lo + j * block_stride + i), pa[j]);
                pb[j] = _mm256_fmadd_ps(p, load8_s8_ps(hi + j * block_stride + i), pb[j]);
            }
        }
        for (int j = 0; j < cnt; j++)
            tot[j] = _mm256_fmadd_ps(_mm256_add_ps(pa[j], pb[j]),
                                     _mm256_set1_ps(sc[j * sc_stride + grp]), tot[j]);
    }
    for (int j = 0; j < cnt; j++)
        out[j] = hsum8_ps(tot[j]);
}

/* gs a multiple of 8 (else the portable loop): tiles of 4 blocks, one head
 * at a time (the bounds of a tile stay in L1 for the next head). */
static void SA_FN(minmax_scores)(const float *qp, const float *qn, int G, int D, int gs,
                                 const int8_t *mn, const int8_t *mx, const float *sc,
                                 ptrdiff_t block_stride, int n, float *const *s)
{
    if (gs % 8 != 0) {
        sa_kernels_portable.minmax_scores(qp, qn, G, D, gs, mn, mx, sc, block_stride, n, s);
        return;
    }
    const ptrdiff_t sc_stride = block_stride / gs;
    for (int b = 0; b < n; b += 4) {
        const int cnt = n - b < 4 ? n - b : 4;
        for (int h = 0; h < G; h++)
            minmax_tile4(qp + (ptrdiff_t)h * D, qn + (ptrdiff_t)h * D, D, gs,
                         mn + (ptrdiff_t)b * block_stride, mx + (ptrdiff_t)b * block_stride,
                         sc + (ptrdiff_t)b * sc_stride, block_stride, sc_stride, cnt, s[h] + b);
    }
}

/* -------------------------------------------------------------------------
 * halves_to_floats: F16C's conversion (the includer's SA_HALVES), SA_VT
 * halves a step, the scalar loop for the rest (the same bits).
 * ---------------------------------------------------------------------- */

static void SA_FN(halves_to_floats)(const uint16_t *h, float *out, int n)
{
    int i = 0;
    for (; i + SA_VT <= n; i += SA_VT)
        SA_MM(storeu_ps)(out + i, SA_HALVES(h + i));
    halves_to_floats_scalar(h + i, out + i, n - i);
}

/* -------------------------------------------------------------------------
 * stream_sum: the bandwidth probe, vector loads into four accumulators.
 * ---------------------------------------------------------------------- */

#define SA_STREAM_BYTES (SA_VT * 4)
#include "../stream_sum.h"

enum { SA_FN(q8_v_scaled) = SA_Q8_V_SCALED };

SA_DEFINE_KERNELS_OF(SA_ISA_ID);

#endif
