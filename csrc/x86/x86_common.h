/*
 * The x86 kernel bodies, written once for kernels_avx2.c and
 * kernels_avx512_vnni.c, as arm/neon_common.h is for the NEON files.  Each
 * file includes this last, after defining its ISA-specific steps:
 *
 *   SA_ISA_ID                 avx2 / avx512_vnni (names: <kernel>_<id>)
 *   SA_VT, sa_vres            tokens per score block (8 / 16) and the vector
 *                             holding their scores
 *   store_scores(dst, cnt, x) the first cnt of SA_VT scores
 *   SA_S_HEADS                heads per score block, at most
 *   scores_f32_block(q, HB, D, rows, res)         HB (1 .. SA_S_HEADS) heads x SA_VT rows
 *   q8_takes(gs, D, scale_stride)                 1 if the SIMD q8 dot takes it
 *   scores_q8_tokens(qq, qd, HB, D, gs, rows, srows, kd_t, scale_stride, cnt, res)
 *   SA_V_HEADS                heads per V accumulation block (2 / 4)
 *   accv_f32_heads(out, p, HB, D, v, row_stride, t0, t1)
 *   SA_V_WIDE, accv_f32_wide(out, p, D, v, row_stride, t0, t1)  optional: a
 *                             register tile of SA_V_WIDE heads for many heads
 *   accv_q8_takes(gs)         1 if the SIMD q8 V accumulation takes it
 *   accv_q8_heads(out, p, HB, D, gs, v, vd, row_stride, scale_stride, t0, t1)
 *   softmax_exp_<id>, stream_sum_<id>
 *
 * and it gets the loops over token blocks and head blocks, the prefetch
 * hints spread over them (kernels.h), the portable fallbacks for shapes the
 * SIMD steps do not take, the Quest bound (8-lane FMA tiles, the same code
 * and results on both ISAs), and the table.
 *
 * Batching rule (kernels.h): the steps may share loads between heads and
 * tokens, but the operations that produce one (head, token) result never
 * depend on the batch.  A short last block repeats its last row in the
 * unused slots (no read past row n-1) and stores only the valid results, so
 * there is no separate "tail token" path whose rounding could differ.
 * Callers never pass n beyond 2^24 (rows.c), so `t += SA_VT` cannot wrap.
 */
#ifndef SA_X86_COMMON_H
#define SA_X86_COMMON_H

#include <math.h>

#include "x86_helpers.h"

/* Row pointers of a block of SA_VT tokens from t: slots past the last valid
 * row repeat it. */
#define SA_BLOCK_ROWS(rows, base, t, cnt, stride)                                   \
    for (int i_ = 0; i_ < SA_VT; i_++)                                              \
        (rows)[i_] = (base) + (ptrdiff_t)((t) + (i_ < (cnt) ? i_ : (cnt) - 1)) * (stride)

/* V accumulation works on blocks of this many tokens: their rows stay in L1
 * while every slice of D and every head block walks over them. */
#define V_TOKENS 16

/* Heads g .. g+HB-1 of one block of SA_VT rows. */
SA_INLINE void scores_f32_heads(const float *q, int HB, int g, int D, const float *const *rows,
                                float *const *s, int t, int cnt)
{
    sa_vres res[SA_S_HEADS];
    scores_f32_block(q + (ptrdiff_t)g * D, HB, D, rows, res);
    for (int h = 0; h < HB; h++)
        store_scores(s[g + h] + t, cnt, res[h]);
}

static void SA_FN(scores_f32)(const float *q, int G, int D, const float *k,
                              ptrdiff_t row_stride, int n, float *const *s,
                              const sa_prefetch *pf)
{
    const int iters = (n + SA_VT - 1) / SA_VT;
    for (int t = 0, it = 0; t < n; t += SA_VT, it++) {
        const int cnt = n - t < SA_VT ? n - t : SA_VT;
        const float *rows[SA_VT];
        SA_BLOCK_ROWS(rows, k, t, cnt, row_stride);
        sa_prefetch_part(pf, it, iters);
        int g = 0;
        for (; g + SA_S_HEADS <= G; g += SA_S_HEADS)
            scores_f32_heads(q, SA_S_HEADS, g, D, rows, s, t, cnt);
        switch (G - g) { /* constant head counts, so each block is unrolled */
        case 3: scores_f32_heads(q, 3, g, D, rows, s, t, cnt); break;
        case 2: scores_f32_heads(q, 2, g, D, rows, s, t, cnt); break;
        case 1: scores_f32_heads(q, 1, g, D, rows, s, t, cnt); break;
        default: break;
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
    const int ng = D / gs, iters = (n + SA_VT - 1) / SA_VT;
    for (int t = 0, it = 0; t < n; t += SA_VT, it++) {
        const int cnt = n - t < SA_VT ? n - t : SA_VT;
        const int8_t *rows[SA_VT];
        const float *srows[SA_VT];
        SA_BLOCK_ROWS(rows, k, t, cnt, row_stride);
        SA_BLOCK_ROWS(srows, kd, t, cnt, scale_stride);
        const float *kd_t = kd + (ptrdiff_t)t * scale_stride;
        sa_prefetch_part(pf, it, iters);
        int h = 0;
        for (; h + 2 <= G; h += 2) {
            sa_vres res[2];
            scores_q8_tokens(qq + (ptrdiff_t)h * D, qd + (ptrdiff_t)h * ng, 2, D, gs, rows, srows,
                             kd_t, scale_stride, cnt, res);
            store_scores(s[h] + t, cnt, res[0]);
            store_scores(s[h + 1] + t, cnt, res[1]);
        }
        if (h < G) {
            sa_vres res[1];
            scores_q8_tokens(qq + (ptrdiff_t)h * D, qd + (ptrdiff_t)h * ng, 1, D, gs, rows, srows,
                             kd_t, scale_stride, cnt, res);
            store_scores(s[h] + t, cnt, res[0]);
        }
    }
}

/* Group sizes the vector steps do not take: per element the dequantised
 * value, then one fused multiply-add (fmaf is the FMA instruction under
 * this file's target), so the result is still bitwise sa_dequantize_rows
 * followed by accumulate_v_f32 (kernels.h). */
static void accv_q8_scalar(float *const *out, const float *const *p, int G, int D, int gs,
                           const int8_t *v, const float *vd, ptrdiff_t row_stride,
                           ptrdiff_t scale_stride, int n, const sa_prefetch *pf)
{
    for (int t = 0; t < n; t++) {
        sa_prefetch_part(pf, t, n);
        const int8_t *row = v + (ptrdiff_t)t * row_stride;
        const float *rd = vd + (ptrdiff_t)t * scale_stride;
        for (int g = 0; g < G; g++) {
            const float w = p[g][t];
            for (int d0 = 0, grp = 0; d0 < D; d0 += gs, grp++)
                for (int d = d0; d < d0 + gs; d++)
                    out[g][d] = fmaf(w, rd[grp] * (float)row[d], out[g][d]);
        }
    }
}

/* Blocks of V_TOKENS tokens, all of D and all heads per block (SA_V_HEADS,
 * then pairs, then one), tokens in order into each accumulator. */
static void SA_FN(accumulate_v_f32)(float *const *out, const float *const *p, int G, int D,
                                    const float *v, ptrdiff_t row_stride, int n,
                                    const sa_prefetch *pf)
{
    const int iters = (n + V_TOKENS - 1) / V_TOKENS;
    for (int t0 = 0, it = 0; t0 < n; t0 += V_TOKENS, it++) {
        const int t1 = n - t0 < V_TOKENS ? n : t0 + V_TOKENS;
        sa_prefetch_part(pf, it, iters);
        int g = 0;
#ifdef SA_V_WIDE
        for (; g + SA_V_WIDE <= G; g += SA_V_WIDE)
            accv_f32_wide(out + g, p + g, D, v, row_stride, t0, t1);
#endif
        for (; g + SA_V_HEADS <= G; g += SA_V_HEADS)
            accv_f32_heads(out + g, p + g, SA_V_HEADS, D, v, row_stride, t0, t1);
        for (; g + 2 <= G; g += 2)
            accv_f32_heads(out + g, p + g, 2, D, v, row_stride, t0, t1);
        if (g < G)
            accv_f32_heads(out + g, p + g, 1, D, v, row_stride, t0, t1);
    }
}

static void SA_FN(accumulate_v_q8)(float *const *out, const float *const *p, int G, int D,
                                   int gs, const int8_t *v, const float *vd,
                                   ptrdiff_t row_stride, ptrdiff_t scale_stride, int n,
                                   const sa_prefetch *pf)
{
    if (!accv_q8_takes(gs)) {
        accv_q8_scalar(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, pf);
        return;
    }
    const int iters = (n + V_TOKENS - 1) / V_TOKENS;
    for (int t0 = 0, it = 0; t0 < n; t0 += V_TOKENS, it++) {
        const int t1 = n - t0 < V_TOKENS ? n : t0 + V_TOKENS;
        sa_prefetch_part(pf, it, iters);
        int g = 0;
        for (; g + SA_V_HEADS <= G; g += SA_V_HEADS)
            accv_q8_heads(out + g, p + g, SA_V_HEADS, D, gs, v, vd, row_stride, scale_stride,
                          t0, t1);
        for (; g + 2 <= G; g += 2)
            accv_q8_heads(out + g, p + g, 2, D, gs, v, vd, row_stride, scale_stride, t0, t1);
        if (g < G)
            accv_q8_heads(out + g, p + g, 1, D, gs, v, vd, row_stride, scale_stride, t0, t1);
    }
}

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

SA_DEFINE_KERNELS_OF(SA_ISA_ID);

#endif
