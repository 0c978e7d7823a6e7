/*
 * AVX2 + FMA + F16C kernels (x86-64 v3).  Compiled with the same flags as
 * the rest of the extension: the pragma below, not the command line, lets
 * this one file use AVX2/FMA/F16C, and cpu_features.c only hands the table
 * out when the CPU and OS support it.
 *
 * The kernel bodies are x86_common.h's, written once for the x86 files
 * (its header lists what a file defines and states the batching rule they
 * keep); this file supplies its 256-bit vectors, the steps that differ
 * from AVX-512 and its q8 V accumulation, and includes it last.
 */
#pragma GCC target("avx2,fma,f16c")
/* GCC implements _mm256_mul_ps/_mm256_add_ps as plain vector operators, so
 * by default (-ffp-contract=fast) it fuses them into FMAs wherever it likes.
 * Every FMA here is written out explicitly; a mul followed by an add stays
 * two roundings (the q8 scores then equal the portable ones bit for bit, and
 * scale*s - scale*max is exactly 0 at the max). */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>

#include <stdint.h>
#include <string.h>

#include "../kernels.h"
/* q8 V's weights hold 32 tokens: the last three heads' pass
 * (accv_q8_last3) takes a whole 32-row call as one block, the others
 * blocks of SA_QV_BLOCK (x86_helpers.h's V_TOKENS), each in rows of as
 * many tokens. */
#define SA_QV_TOKENS 32
#define SA_QV_BLOCK 16
#include "x86_helpers.h"

/* The vectors and steps x86_common.h's bodies are written in (its header
 * lists them): 256-bit vectors, 8 floats. */
#define SA_ISA_ID avx2
#define SA_VT 8
#define SA_MM(op) _mm256_##op
typedef __m256 sa_vf;
typedef __m256d sa_vd;
typedef __m256i sa_vmask; /* a lane is on when its sign bit is set (vmaskmov) */

/* The first r (0..8) lanes set. */
#define vf_tail tail8

/* vmaskmov never touches the masked lanes' memory. */
#define vf_load_tail(p, m) _mm256_maskload_ps((p), (m))
#define vf_store_tail(p, m, x) _mm256_maskstore_ps((p), (m), (x))
#define vf_keep_tail(x, m) _mm256_and_ps((x), _mm256_castsi256_ps(m))

/* The first n (1 .. 8) lanes of x: a plain store for all 8 (vmaskmov
 * stores are slow on AMD). */
SA_INLINE void vf_store_first(float *p, int n, __m256 x)
{
    if (n == 8)
        _mm256_storeu_ps(p, x);
    else
        _mm256_maskstore_ps(p, tail8(n), x);
}

/* The max with -inf in the lanes outside m. */
SA_INLINE __m256 vf_max_tail(__m256 mv, const float *p, __m256i m)
{
    const __m256 x = _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), _mm256_maskload_ps(p, m),
                                      _mm256_castsi256_ps(m));
    return _mm256_max_ps(mv, x);
}

/* Which lanes have seen a NaN: an OR of unordered compares. */
typedef __m256 sa_vnan;
#define vnan_none() _mm256_setzero_ps()
#define vnan_add(a, x) _mm256_or_ps((a), _mm256_cmp_ps((x), (x), _CMP_UNORD_Q))
#define vnan_any(a) (_mm256_movemask_ps(a) != 0)

#define vf_load_s8 load8_s8_ps
/* 8 halves -> 8 floats (F16C's vcvtph2ps). */
#define SA_HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define hmax_ps hmax8_ps
#define hsum_pd hsum4_pd

SA_INLINE void vd_add_ps(__m256d *s0, __m256d *s1, __m256 x)
{
    *s0 = _mm256_add_pd(*s0, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    *s1 = _mm256_add_pd(*s1, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}

/* -------------------------------------------------------------------------
 * scores_f32: 8 tokens per block, their dots reduced together.
 * ---------------------------------------------------------------------- */

/* 3 heads x 4 rows are 12 independent FMA chains on 7 loads per 8
 * channels, enough to keep both FMA pipes busy when many query rows share
 * the keys (prefill). */
#define SA_S_HEADS 3

/* Prefill's GEMM-form scores: 6 vectors x 2 key vectors, 12 accumulators
 * (with the 2 keys and a broadcast, 15 of the 16 registers). */
#define SA_P_ROWS 6

/* The two quads' reduce4_ps results (tokens 0-3 and 4-7) -> the 8 token
 * sums, low half + high half. */
SA_INLINE __m256 sum_quads(const __m256 *quad)
{
    return _mm256_add_ps(_mm256_permute2f128_ps(quad[0], quad[1], 0x20),
                         _mm256_permute2f128_ps(quad[0], quad[1], 0x31));
}

/* -------------------------------------------------------------------------
 * scores_q8
 * ---------------------------------------------------------------------- */

/* 32 bytes of q . k into 8 int32 lanes (4 products each).  maddubs multiplies
 * u8 x s8 with int16 saturation, so it gets |k| as the unsigned operand and
 * q * sign(k) as the signed one: products are exact and a pair stays within
 * 2 * 127 * 127 < 32767.  |k| is computed once and shared by the heads. */
SA_INLINE __m256i dot32_s8(__m256i k, __m256i kabs, __m256i q)
{
    const __m256i p16 = _mm256_maddubs_epi16(kabs, _mm256_sign_epi8(q, k));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* Group g of HB (1 to 3) heads against 4 rows: each (head, row) gets 8 int32
 * lanes, and the 4 rows' lanes are reduced together (the unpack/shuffle
 * tree of reduce4_ps, integer so exact). */
SA_INLINE void dot_group4_s8(const int8_t *const *qh, int HB, const int8_t *const *rows, int off,
                             int nc, __m256i *half, sa_pf_walk *w)
{
    sa_pf_walk_step(w);
    __m256i acc[3][4];
    for (int i = 0; i < 4; i++) {
        const __m256i k = _mm256_loadu_si256((const __m256i *)(rows[i] + off));
        const __m256i ka = _mm256_abs_epi8(k);
        for (int h = 0; h < HB; h++)
            acc[h][i] = dot32_s8(k, ka, _mm256_loadu_si256((const __m256i *)(qh[h] + off)));
    }
    for (int c = 1; c < nc; c++) /* groups of 64, 96, ... bytes */
        for (int i = 0; i < 4; i++) {
            const int o = off + 32 * c;
            const __m256i k = _mm256_loadu_si256((const __m256i *)(rows[i] + o));
            const __m256i ka = _mm256_abs_epi8(k);
            for (int h = 0; h < HB; h++)
                acc[h][i] = _mm256_add_epi32(
                    acc[h][i], dot32_s8(k, ka, _mm256_loadu_si256((const __m256i *)(qh[h] + o))));
        }
    for (int h = 0; h < HB; h++) {
        const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi64(acc[h][0], acc[h][1]),
                                             _mm256_unpackhi_epi64(acc[h][0], acc[h][1]));
        const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi64(acc[h][2], acc[h][3]),
                                             _mm256_unpackhi_epi64(acc[h][2], acc[h][3]));
        half[h] = _mm256_add_epi32(
            _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(s01),
                                                  _mm256_castsi256_ps(s23), 0x88)),
            _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(s01),
                                                  _mm256_castsi256_ps(s23), 0xDD)));
    }
}

/* The scales of groups g .. g+3 for the 8 tokens whose scale rows are srow:
 * out[j] lane i = srow[i][g + j].  Rows i and i+4 share a vector (one
 * 16-byte load each), then a 4x4 transpose per 128-bit half; cheaper than
 * four gathers. */
SA_INLINE void scales_8x4(const float *const *srow, int g, __m256 *out)
{
    __m256 r[4];
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(srow[i] + g)),
                                    _mm_loadu_ps(srow[i + 4] + g), 1);
    const __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(r[0], r[1]));
    const __m256d t1 = _mm256_castps_pd(_mm256_unpackhi_ps(r[0], r[1]));
    const __m256d t2 = _mm256_castps_pd(_mm256_unpacklo_ps(r[2], r[3]));
    const __m256d t3 = _mm256_castps_pd(_mm256_unpackhi_ps(r[2], r[3]));
    out[0] = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2));
    out[1] = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2));
    out[2] = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3));
    out[3] = _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3));
}

/* The scales of groups g, g+1 for the 8 tokens: 8-byte loads (a row's
 * scales may end at g+1), rows i and i+4 in one vector, then unpacks. */
SA_INLINE void scales_8x2(const float *const *srow, int g, __m256 *out)
{
    __m256 r[4];
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_castsi256_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(srow[i] + g))),
            _mm_loadl_epi64((const __m128i *)(srow[i + 4] + g)), 1));
    const __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(r[0], r[1]));
    const __m256d t1 = _mm256_castps_pd(_mm256_unpacklo_ps(r[2], r[3]));
    out[0] = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t1));
    out[1] = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t1));
}

/* The 8 tokens' scales of every group, 4 or 2 groups per transpose. */
SA_INLINE void scales_8xng(const float *const *srow, int ng, __m256 *kd)
{
    int g = 0;
    for (; g + 4 <= ng; g += 4)
        scales_8x4(srow, g, kd + g);
    for (; g + 2 <= ng; g += 2)
        scales_8x2(srow, g, kd + g);
    if (g < ng)
        kd[g] = _mm256_setr_ps(srow[0][g], srow[1][g], srow[2][g], srow[3][g], srow[4][g],
                               srow[5][g], srow[6][g], srow[7][g]);
}

/* The most groups per row the SIMD scores take (their scales are kept on
 * the stack for a block); more go through the portable loop. */
#define SA_Q8_MAX_GROUPS 64

/* A block's 8 tokens' scales, transposed once for all its head blocks
 * (x86_common.h) rather than again in each (docs/design.md, x86's measured choices). */
#define SA_Q8_BLOCK_SCALES 1
#define q8_block_scales scales_8xng

/* HB heads x one block of 8 rows: per group, the 8 tokens' exact int32 sums
 * side by side, then the group term (qd * kd) * isum added in group order,
 * the portable kernel's operations (so the scores are bitwise the portable
 * ones).  kd[g] are the tokens' scales of group g (scales_8xng; slots past
 * n repeat the last row, like rows).  NC (32-byte chunks per group) is a
 * constant for the default group of 32, so its dot has no chunk loop. */
SA_INLINE void scores_q8_group_loop(const int8_t *qq, const float *qd, int HB, int D, int gs,
                                    const int NC, const int8_t *const *rows, const __m256 *kd,
                                    __m256 *res, sa_pf_walk *w)
{
    const int ng = D / gs;
    const int8_t *qh[3] = {qq, qq + (HB > 1 ? D : 0), qq + (HB > 2 ? 2 * D : 0)};
    for (int h = 0; h < HB; h++)
        res[h] = _mm256_setzero_ps();
    sa_pf_walk wl = *w; /* in registers for the loop */
    for (int g = 0; g < ng; g++) {
        __m256i lo[3], hi[3];
        dot_group4_s8(qh, HB, rows, g * gs, NC, lo, &wl);
        dot_group4_s8(qh, HB, rows + 4, g * gs, NC, hi, &wl);
        for (int h = 0; h < HB; h++) {
            const __m256i isum = _mm256_add_epi32(_mm256_permute2x128_si256(lo[h], hi[h], 0x20),
                                                  _mm256_permute2x128_si256(lo[h], hi[h], 0x31));
            const __m256 wq = _mm256_mul_ps(_mm256_set1_ps(qd[h * ng + g]), kd[g]);
            res[h] = _mm256_add_ps(res[h], _mm256_mul_ps(wq, _mm256_cvtepi32_ps(isum)));
        }
    }
    *w = wl;
}

SA_INLINE void scores_q8_block(const int8_t *qq, const float *qd, int HB, int D, int gs,
                               const int8_t *const *rows, const __m256 *kd, __m256 *res,
                               sa_pf_walk *w)
{
    if (gs == 32)
        scores_q8_group_loop(qq, qd, HB, D, gs, 1, rows, kd, res, w);
    else
        scores_q8_group_loop(qq, qd, HB, D, gs, gs / 32, rows, kd, res, w);
}

/* Prefetch steps per block of heads and tokens: one per half group. */
#define SA_Q8_S_STEPS(D, gs) (2 * ((D) / (gs)))

/* gs a multiple of 32 (the dot works on 32-byte chunks of one group). */
SA_INLINE int q8_takes(int gs, int D, ptrdiff_t scale_stride)
{
    (void)scale_stride;
    return gs % 32 == 0 && D / gs <= SA_Q8_MAX_GROUPS;
}

/* Heads per score block (SA_Q8_HEADS, x86_helpers.h): pairs, and three for
 * an odd group, so a GQA group of 3 or 7 loads and takes |k| of its rows
 * once for the last three heads instead of for a pair and again for one.
 * 12 accumulators leave little room in 16 registers: the three pay only
 * with the scores' copies for D = 64 and 128, where the run-time D takes
 * none of it (docs/design.md, x86's measured choices). */

SA_INLINE void scores_q8_tokens(const int8_t *qq, const float *qd, int HB, int D, int gs,
                                const int8_t *const *rows, const float *const *srows,
                                const float *kd_t, ptrdiff_t scale_stride, int cnt,
                                const __m256 *ks, __m256 *res, sa_pf_walk *w)
{
    (void)srows, (void)kd_t, (void)scale_stride, (void)cnt;
    scores_q8_block(qq, qd, HB, D, gs, rows, ks, res, w);
}

/* -------------------------------------------------------------------------
 * softmax_exp: the exponent's steps
 * ---------------------------------------------------------------------- */

/* 2^n + poly * 2^n, one rounding: 2^n's bits are (n + 127) << 23, and z
 * holds n in its low mantissa bits (exp_ps), so they shift straight into
 * the exponent field (valid for -126 <= n <= 127); lanes where x is below
 * ln(FLT_MIN) (-inf included) are 0.  NaN stays NaN (the compare is false). */
SA_INLINE __m256 vf_exp_finish(__m256 poly, __m256 z, __m256 x)
{
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(z),
                                                         _mm256_set1_epi32(127)), 23);
    const __m256 two_n = _mm256_castsi256_ps(e);
    const __m256 y = _mm256_fmadd_ps(poly, two_n, two_n);
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(SA_LN_FLT_MIN), _CMP_LT_OQ), y);
}

/* -------------------------------------------------------------------------
 * accumulate_v_f32: V accumulation blocks of 2 heads, and a wide tile
 * ---------------------------------------------------------------------- */

#define SA_V_HEADS 2

/* Many heads (prefill): 6 heads x 2 vectors (16 columns), 12 accumulators;
 * each token's 16 values loaded once for the 6 heads: 8 loads per 12 FMAs
 * instead of 10 per 8 (x86_common.h, accv_f32_wide). */
#define SA_V_WIDE 6
#define SA_V_WIDE_VECS 2

/* -------------------------------------------------------------------------
 * accumulate_v_q8: one block of tokens for all the heads at a time
 * ---------------------------------------------------------------------- */

/* q8 V's weights (spec §4), token-major: for HB heads, tokens [t0, t1) (at
 * most TQ, a constant: SA_QV_BLOCK or SA_QV_TOKENS) and groups
 * [g0, g0 + gn) (gn at most SA_QV_GROUPS),
 * w[h * SA_QV_GROUPS * TQ + (grp - g0) * TQ + t - t0]
 * = p[h][t] * vd[t * scale_stride + grp].  Per 8 tokens, their scales
 * transposed as the scores transpose theirs (scales_8xng) and one product
 * per head and group; the last (t1 - t0) % 8 tokens one product each.  The
 * same products as x86_helpers.h's q8_v_weights, which takes a product per
 * token, head and 8 groups: a tile then broadcasts one weight per token
 * from each head's row of TQ.  It pays with the copies for D = 64 and 128
 * (accv_q8_blocks), whose loops have constant trip counts; with D a
 * run-time value it did not (docs/design.md, x86's measured choices). */
SA_INLINE void q8_v_weights_t(const float *const *p, int HB, const float *vd,
                              ptrdiff_t scale_stride, int t0, int t1, int g0, int gn, float *w,
                              const int TQ)
{
    int t = t0;
    for (; t + 8 <= t1; t += 8) {
        const float *srow[8];
        for (int i = 0; i < 8; i++)
            srow[i] = vd + (ptrdiff_t)(t + i) * scale_stride + g0;
        __m256 sc[SA_QV_GROUPS];
        scales_8xng(srow, gn, sc);
        for (int h = 0; h < HB; h++) {
            const __m256 x = _mm256_loadu_ps(p[h] + t);
            for (int g = 0; g < gn; g++)
                _mm256_storeu_ps(w + h * SA_QV_GROUPS * TQ + g * TQ + (t - t0),
                                 _mm256_mul_ps(x, sc[g]));
        }
    }
    for (; t < t1; t++)
        for (int h = 0; h < HB; h++)
            for (int g = 0; g < gn; g++)
                w[h * SA_QV_GROUPS * TQ + g * TQ + (t - t0)] =
                    p[h][t] * vd[(ptrdiff_t)t * scale_stride + g0 + g];
}

/* The tiles: out[h][d .. d + 8*NV) for HB heads over tokens [t0, t1), all
 * in one q8 group, whose weights for head h are wq[h * HS + t - t0]
 * (q8_v_weights_t): each token's 8*NV values are widened and converted
 * once for the HB heads (exact), then added by one FMA per head and vector
 * in token order, as accumulate_v_f32 adds a float row with those weights.
 * HB, NV and HS (the distance between two heads' weights) are constants
 * at every call: HB * NV accumulators stay in the 16 registers, the
 * weights are broadcast from memory.  A tile that walks
 * (STEP) takes a step of the prefetch walk per token with 12 accumulators
 * and per SA_QV_STEP_TOKENS tokens with at most 8: with the walk's state in
 * registers beside 8 accumulators GCC spilled the loop's pointer; stepping
 * every 4 tokens through the caller's walk (the lines in twos or threes
 * instead of one a token) does not (docs/design.md, x86's measured choices). */
#define SA_QV_STEP_TOKENS 4

/* 12 accumulators: the heads' weights in registers, the values one vector
 * at a time (16 registers in all); a walk step per token. */
SA_INLINE void accv_q8_tile12(float *const *out, const float *wq, const int HS, const int HB,
                              const int NV, const int8_t *v, ptrdiff_t row_stride, int t0, int t1,
                              int d, sa_pf_walk *w, const int STEP)
{
    __m256 a[4][4];
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NV; c++)
            a[h][c] = _mm256_loadu_ps(out[h] + d + 8 * c);
    const int8_t *row = v + (ptrdiff_t)t0 * row_stride + d;
    sa_pf_walk wl = {0}; /* in registers for the loop */
    if (STEP)
        wl = *w;
    for (int t = t0; t < t1; t++, row += row_stride, wq++) {
        if (STEP)
            sa_pf_walk_step(&wl);
        __m256 wt[4];
        for (int h = 0; h < HB; h++)
            wt[h] = _mm256_broadcast_ss(wq + h * HS);
        for (int c = 0; c < NV; c++) {
            const __m256 x = load8_s8_ps(row + 8 * c);
            for (int h = 0; h < HB; h++)
                a[h][c] = _mm256_fmadd_ps(wt[h], x, a[h][c]);
        }
    }
    if (STEP)
        *w = wl;
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NV; c++)
            _mm256_storeu_ps(out[h] + d + 8 * c, a[h][c]);
}

/* One token of an 8-accumulator tile: its values widened and converted
 * once, one FMA per head and vector. */
SA_INLINE void accv_q8_token8(__m256 (*a)[4], const float *wq, const int HS, const int HB,
                              const int NV, const int8_t *row)
{
    __m256 x[4];
    for (int c = 0; c < NV; c++)
        x[c] = load8_s8_ps(row + 8 * c);
    for (int h = 0; h < HB; h++) {
        const __m256 wt = _mm256_broadcast_ss(wq + h * HS);
        for (int c = 0; c < NV; c++)
            a[h][c] = _mm256_fmadd_ps(wt, x[c], a[h][c]);
    }
}

/* At most 8 accumulators: a walk step per SA_QV_STEP_TOKENS tokens.  (Its
 * loads and stores of the accumulators are tile12's, written out again:
 * as helpers shared by the two, GCC's code was slower, docs/design.md, x86's measured choices.) */
SA_INLINE void accv_q8_tile8(float *const *out, const float *wq, const int HS, const int HB,
                             const int NV, const int8_t *v, ptrdiff_t row_stride, int t0, int t1,
                             int d, sa_pf_walk *w, const int STEP)
{
    __m256 a[4][4];
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NV; c++)
            a[h][c] = _mm256_loadu_ps(out[h] + d + 8 * c);
    const int8_t *row = v + (ptrdiff_t)t0 * row_stride + d;
    int t = t0;
    for (; t + SA_QV_STEP_TOKENS <= t1; t += SA_QV_STEP_TOKENS) {
        if (STEP)
            sa_pf_walk_step(w);
        for (int u = 0; u < SA_QV_STEP_TOKENS; u++, row += row_stride, wq++)
            accv_q8_token8(a, wq, HS, HB, NV, row);
    }
    if (STEP && t < t1)
        sa_pf_walk_step(w);
    for (; t < t1; t++, row += row_stride, wq++)
        accv_q8_token8(a, wq, HS, HB, NV, row);
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NV; c++)
            _mm256_storeu_ps(out[h] + d + 8 * c, a[h][c]);
}

SA_INLINE void accv_q8_tile(float *const *out, const float *wq, const int HS, const int HB,
                            const int NV, const int8_t *v, ptrdiff_t row_stride, int t0, int t1,
                            int d, sa_pf_walk *w, const int STEP)
{
    if (HB * NV > 8)
        accv_q8_tile12(out, wq, HS, HB, NV, v, row_stride, t0, t1, d, w, STEP);
    else
        accv_q8_tile8(out, wq, HS, HB, NV, v, row_stride, t0, t1, d, w, STEP);
}

/* Columns [d0, d1) (whole groups from group g0, whose weights wq holds) for
 * HB heads: tiles of NV vectors while they fit (gs a multiple of 8 * NV, so
 * a tile never straddles two groups), then single vectors.  The group is
 * counted along, not divided out per tile. */
SA_INLINE void accv_q8_cols(float *const *out, const float *wq, const int TQ, const int HB,
                            const int NV, int d0, int d1, int gs, const int8_t *v,
                            ptrdiff_t row_stride, int t0, int t1, sa_pf_walk *w)
{
    const int HS = SA_QV_GROUPS * TQ; /* a head's weights */
    int d = d0, g = 0, left = gs;
    for (; d + 8 * NV <= d1; d += 8 * NV) {
        if (w && d % 32 == 0)
            accv_q8_tile(out, wq + g * TQ, HS, HB, NV, v, row_stride, t0, t1, d, w, 1);
        else
            accv_q8_tile(out, wq + g * TQ, HS, HB, NV, v, row_stride, t0, t1, d, w, 0);
        if ((left -= 8 * NV) == 0)
            g++, left = gs;
    }
    for (; d < d1; d += 8) {
        if (w && d % 32 == 0)
            accv_q8_tile(out, wq + g * TQ, HS, HB, 1, v, row_stride, t0, t1, d, w, 1);
        else
            accv_q8_tile(out, wq + g * TQ, HS, HB, 1, v, row_stride, t0, t1, d, w, 0);
        if ((left -= 8) == 0)
            g++, left = gs;
    }
}

/* HB heads with the widest tile their group size allows, SA_QV_GROUPS
 * groups at a time: their weights first, then their columns.  The tokens
 * [t0, t1) are at most TQ (the caller's block, SA_QV_BLOCK or
 * SA_QV_TOKENS), the weights' row per head and group; the buffer holds
 * the longest. */
SA_INLINE void accv_q8_heads_avx2(float *const *out, const float *const *p, const int HB,
                                  const int NV, int D, int gs, const int8_t *v, const float *vd,
                                  ptrdiff_t row_stride, ptrdiff_t scale_stride, int t0, int t1,
                                  sa_pf_walk *w, const int TQ)
{
    float wq[SA_QV_TOKENS * 4 * SA_QV_GROUPS] __attribute__((aligned(32)));
    const int ng = D / gs;
    for (int g0 = 0; g0 < ng; g0 += SA_QV_GROUPS) {
        const int gn = ng - g0 < SA_QV_GROUPS ? ng - g0 : SA_QV_GROUPS;
        const int d0 = g0 * gs, d1 = (g0 + gn) * gs;
        q8_v_weights_t(p, HB, vd, scale_stride, t0, t1, g0, gn, wq, TQ);
        if (NV >= 4 && gs % 32 == 0)
            accv_q8_cols(out, wq, TQ, HB, 4, d0, d1, gs, v, row_stride, t0, t1, w);
        else if (NV >= 2 && gs % 16 == 0)
            accv_q8_cols(out, wq, TQ, HB, 2, d0, d1, gs, v, row_stride, t0, t1, w);
        else
            accv_q8_cols(out, wq, TQ, HB, 1, d0, d1, gs, v, row_stride, t0, t1, w);
    }
}

/* Heads in blocks of 4 (two vectors of 16 columns: 8 accumulators), then
 * the last 1 or 2 as one block (one or two heads x four vectors), so each
 * token is converted once per block.  A group of 3 or 7 ends on three
 * heads x four vectors instead (accv_q8_last3: 12 accumulators leave room
 * for the heads' weights and one vector of values at a time), for one and
 * two conversions per token instead of the pair-and-one blocks' two and
 * four: the convert runs on the FMA ports (docs/design.md, x86's measured choices).  The prefetch walk
 * steps in the last block's tiles that start a 32-column stretch
 * (accv_q8_call_steps_avx2): a step in every tile (16 tiles per token at
 * G = 7) costs time in cache for nothing streamed, where the arithmetic,
 * not the memory, is the bound. */
SA_INLINE void accv_q8_block_avx2(float *const *out, const float *const *p, int G, int D,
                                  int gs, const int8_t *v, const float *vd,
                                  ptrdiff_t row_stride, ptrdiff_t scale_stride, int t0, int t1,
                                  sa_pf_walk *w)
{
    int g = 0;
    for (; g + 4 <= G; g += 4)
        accv_q8_heads_avx2(out + g, p + g, 4, 2, D, gs, v, vd, row_stride, scale_stride, t0, t1,
                           g + 4 == G ? w : NULL, SA_QV_BLOCK);
    switch (G - g) {
    case 2:
        accv_q8_heads_avx2(out + g, p + g, 2, 4, D, gs, v, vd, row_stride, scale_stride, t0, t1,
                           w, SA_QV_BLOCK);
        break;
    case 1:
        accv_q8_heads_avx2(out + g, p + g, 1, 4, D, gs, v, vd, row_stride, scale_stride, t0, t1,
                           w, SA_QV_BLOCK);
        break;
    default: break;
    }
}

/* The last three heads of a group of 3 or 7 over a call's tokens, after
 * the group's other heads (accumulate_v_q8 below; each head's sums are the
 * same whichever pass adds them), with the call's prefetch walk:
 * a function of its own (beside the other blocks in one function, GCC
 * spilled inside these 12-accumulator loops), with copies for D = 64 and
 * 128 at the default group.  Blocks of SA_QV_TOKENS (32: a whole call,
 * each accumulator loaded and stored once) instead of V_TOKENS (16); the
 * other blocks keep 16, which streams better at G = 2 (docs/design.md, x86's measured choices). */
SA_INLINE void accv_q8_last3_body(float *const *out, const float *const *p, int D, int gs,
                                  const int8_t *v, const float *vd, ptrdiff_t row_stride,
                                  ptrdiff_t scale_stride, int n, sa_pf_walk *w)
{
    for (int t0 = 0; t0 < n; t0 += SA_QV_TOKENS) {
        const int t1 = n - t0 < SA_QV_TOKENS ? n : t0 + SA_QV_TOKENS;
        accv_q8_heads_avx2(out, p, 3, 4, D, gs, v, vd, row_stride, scale_stride, t0, t1, w,
                           SA_QV_TOKENS);
    }
}

__attribute__((noinline)) static void accv_q8_last3(float *const *out, const float *const *p,
                                                    int D, int gs, const int8_t *v,
                                                    const float *vd, ptrdiff_t row_stride,
                                                    ptrdiff_t scale_stride, int n, sa_pf_walk *w)
{
    if (gs == 32 && D == 64)
        accv_q8_last3_body(out, p, 64, 32, v, vd, row_stride, scale_stride, n, w);
    else if (gs == 32 && D == 128)
        accv_q8_last3_body(out, p, 128, 32, v, vd, row_stride, scale_stride, n, w);
    else
        accv_q8_last3_body(out, p, D, gs, v, vd, row_stride, scale_stride, n, w);
}
/* G = 4m + 3: accv_q8_block_avx2's blocks of 4 take the first 4m heads. */
#define SA_Q8_V_LAST3_TAKES(G) ((G) % 4 == 3)

/* The prefetch walk's steps in a call of n tokens: the tiles that start a
 * 32-column stretch step, those with 12 accumulators (accv_q8_last3's
 * three heads x four vectors, when gs is a multiple of 32) every token,
 * the others (accv_q8_block_avx2's last block, or accv_q8_last3's narrower
 * tiles) every SA_QV_STEP_TOKENS tokens of a block (V_TOKENS, or
 * SA_QV_TOKENS in the last three's pass: multiples of it). */
SA_INLINE long accv_q8_call_steps_avx2(int G, int D, int gs, int n)
{
    const long tiles = (D + 31) / 32;
    if (SA_Q8_V_LAST3_TAKES(G) && gs % 32 == 0)
        return (long)n * tiles;
    return (long)((n + SA_QV_STEP_TOKENS - 1) / SA_QV_STEP_TOKENS) * tiles;
}
_Static_assert(SA_QV_BLOCK == V_TOKENS, "accv_q8_block_avx2's weights hold a block of tokens");
_Static_assert(V_TOKENS % SA_QV_STEP_TOKENS == 0 && SA_QV_TOKENS % SA_QV_STEP_TOKENS == 0,
               "accv_q8_call_steps_avx2 counts a walk step per SA_QV_STEP_TOKENS of a block");

/* accumulate_v_q8 a block of V_TOKENS tokens at a time
 * (accv_q8_block_avx2). */
SA_INLINE void accv_q8_blocks_body(float *const *out, const float *const *p, int G, int D,
                                   int gs, const int8_t *v, const float *vd,
                                   ptrdiff_t row_stride, ptrdiff_t scale_stride, int n,
                                   sa_pf_walk *w)
{
    for (int t0 = 0; t0 < n; t0 += V_TOKENS) {
        const int t1 = n - t0 < V_TOKENS ? n : t0 + V_TOKENS;
        accv_q8_block_avx2(out, p, G, D, gs, v, vd, row_stride, scale_stride, t0, t1, w);
    }
}

/* Out of line: the caller takes the three-head case first, and the loop
 * keeps the code it had alone (inlined beside that case, or with it as a
 * branch inside, the pairs' loop was slower).  Copies for D = 64 and 128 at
 * the default group, so the tiles and weights loops have constant trip
 * counts (docs/design.md, x86's measured choices). */
__attribute__((noinline)) static void accv_q8_blocks(float *const *out, const float *const *p,
                                                     int G, int D, int gs, const int8_t *v,
                                                     const float *vd, ptrdiff_t row_stride,
                                                     ptrdiff_t scale_stride, int n,
                                                     sa_pf_walk *w)
{
    if (gs == 32 && D == 64)
        accv_q8_blocks_body(out, p, G, 64, 32, v, vd, row_stride, scale_stride, n, w);
    else if (gs == 32 && D == 128)
        accv_q8_blocks_body(out, p, G, 128, 32, v, vd, row_stride, scale_stride, n, w);
    else
        accv_q8_blocks_body(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, w);
}

/* Group sizes that are not a multiple of 8 take the scalar loop (fmaf, one
 * rounding: still bitwise accumulate_v_f32 of the weights, kernels.h).  A
 * group of 3 or 7 takes its last three heads after the others (which do not
 * walk): one prefetch walk, in the last pass. */
static void SA_FN(accumulate_v_q8)(float *const *out, const float *const *p, int G, int D,
                                   int gs, const int8_t *v, const float *vd,
                                   ptrdiff_t row_stride, ptrdiff_t scale_stride, int n,
                                   const sa_prefetch *pf)
{
    if (gs % 8 != 0) {
        accumulate_v_q8_scalar(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, pf);
        return;
    }
    sa_pf_walk w;
    sa_pf_walk_start(&w, pf, accv_q8_call_steps_avx2(G, D, gs, n));
    if (SA_Q8_V_LAST3_TAKES(G)) {
        if (G > 3)
            accv_q8_blocks(out, p, G - 3, D, gs, v, vd, row_stride, scale_stride, n, NULL);
        accv_q8_last3(out + G - 3, p + G - 3, D, gs, v, vd, row_stride, scale_stride, n, &w);
        return;
    }
    accv_q8_blocks(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, &w);
}

/* -------------------------------------------------------------------------
 * scores_q8_panels: GEMM form (kernels.h), panels of 8 keys
 * ---------------------------------------------------------------------- */

/* Query vectors per block: 5 float and 5 int32 accumulators, with a
 * chunk's keys, their magnitudes, the ones, a broadcast and a product 15
 * of the 16 registers. */
#define SA_Q8P_ROWS 5
#define SA_Q8_PANEL_KEYS 8

/* HB query vectors x one panel (x86_common.h stores them): per 4 channels
 * the 8 keys' bytes (one vector) and their magnitudes once, then per vector
 * its 4 bytes broadcast, given the keys' signs (maddubs takes |k| unsigned;
 * pairs stay below 2^15) and summed into 8 int32 lanes, one per key; per
 * group the term (qd * kd) * isum added in group order as scores_q8 adds
 * it. */
SA_INLINE void q8_panel_dot(const int8_t *qq, const float *qd, int HB, int D, int gs,
                            const int8_t *kp, const float *dp, __m256 *res)
{
    const int ng = D / gs, per = gs / 4;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < HB; h++)
        res[h] = _mm256_setzero_ps();
    for (int grp = 0; grp < ng; grp++) {
        __m256i isum[SA_Q8P_ROWS];
        for (int h = 0; h < HB; h++)
            isum[h] = _mm256_setzero_si256();
        for (int c4 = grp * per; c4 < (grp + 1) * per; c4++) {
            __m256i kv = _mm256_loadu_si256((const __m256i *)(kp + (ptrdiff_t)c4 * 32));
            __m256i ka = _mm256_abs_epi8(kv);
            SA_KEEP(kv);
            SA_KEEP(ka);
            for (int h = 0; h < HB; h++) {
                int32_t q4;
                memcpy(&q4, qq + (ptrdiff_t)h * D + 4 * c4, sizeof q4);
                const __m256i pr =
                    _mm256_maddubs_epi16(ka, _mm256_sign_epi8(_mm256_set1_epi32(q4), kv));
                isum[h] = _mm256_add_epi32(isum[h], _mm256_madd_epi16(pr, ones));
            }
        }
        const __m256 kd = _mm256_loadu_ps(dp + (ptrdiff_t)grp * 8);
        for (int h = 0; h < HB; h++) {
            const __m256 w = _mm256_mul_ps(_mm256_set1_ps(qd[(ptrdiff_t)h * ng + grp]), kd);
            res[h] = _mm256_add_ps(res[h], _mm256_mul_ps(w, _mm256_cvtepi32_ps(isum[h])));
        }
    }
}

/* No many-heads form: prefill's q8 tiles take the panels above. */
#define SA_Q8_MANY_HEADS 0

#include "x86_common.h"
