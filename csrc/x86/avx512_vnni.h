/*
 * The AVX-512 (F/BW/VL) + VNNI + FMA vectors and kernels that both AVX-512
 * tables are built from: kernels_avx512_vnni.c and kernels_avx512_amx.c
 * (which adds prefill's q8 scores on AMX tiles) each name their table
 * (SA_ISA_ID), include this and then add their own scores_q8_many.
 * Compiled with the same flags as the rest of the extension: the pragma
 * below, not the command line, lets these files use AVX-512, and
 * cpu_features.c only hands a table out when the CPU and OS support it.
 *
 * The kernel bodies are x86_common.h's, written once for the x86 files
 * (its header lists what a file defines and states the batching rule they
 * keep); this file supplies its 512-bit vectors, the steps that differ
 * from AVX2, its q8 V accumulation and the many-heads q8 scores in the
 * form of an int8 GEMM; the including file adds its scores_q8_many and then
 * x86_common.h.
 */
#ifndef SA_AVX512_VNNI_H
#define SA_AVX512_VNNI_H

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")
/* GCC implements _mm512_mul_ps/_mm512_add_ps as plain vector operators, so
 * by default (-ffp-contract=fast) it fuses them into FMAs wherever it likes.
 * Every FMA here is written out explicitly; a mul followed by an add stays
 * two roundings (the q8 scores then equal the portable ones bit for bit, and
 * scale*s - scale*max is exactly 0 at the max). */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>

#include <stdint.h>
#include <string.h>

#include "../kernels.h"
#include "x86_helpers.h"

/* The vectors and steps x86_common.h's bodies are written in (its header
 * lists them): 512-bit vectors, 16 floats. */
#define SA_VT 16
#define SA_MM(op) _mm512_##op
typedef __m512 sa_vf;
typedef __m512d sa_vd;
typedef __mmask16 sa_vmask;

/* The first r (0..16) lanes. */
SA_INLINE __mmask16 vf_tail(int r)
{
    return (__mmask16)((1u << r) - 1u);
}

/* Masked lanes never touch memory. */
#define vf_load_tail(p, m) _mm512_maskz_loadu_ps((m), (p))
#define vf_store_tail(p, m, x) _mm512_mask_storeu_ps((p), (m), (x))
#define vf_keep_tail(x, m) _mm512_maskz_mov_ps((m), (x))
#define vf_max_tail(mv, p, m) _mm512_mask_max_ps((mv), (m), (mv), _mm512_maskz_loadu_ps((m), (p)))

/* The first n (1 .. 16) lanes of x: a plain store for all 16. */
SA_INLINE void vf_store_first(float *p, int n, __m512 x)
{
    if (n == 16)
        _mm512_storeu_ps(p, x);
    else
        _mm512_mask_storeu_ps(p, vf_tail(n), x);
}

/* Which lanes have seen a NaN: an OR of unordered-compare masks. */
typedef __mmask16 sa_vnan;
#define vnan_none() ((__mmask16)0)
#define vnan_add(a, x) ((__mmask16)((a) | _mm512_cmp_ps_mask((x), (x), _CMP_UNORD_Q)))
#define vnan_any(a) ((a) != 0)

/* 16 halves -> 16 floats (AVX512F's vcvtph2ps). */
#define SA_HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))

/* 16 int8 -> 16 floats (exact). */
SA_INLINE __m512 vf_load_s8(const int8_t *x)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x)));
}

/* The high 256 bits (AVX512F has no _mm512_extractf32x8_ps). */
#define SA_HI256_PS(x) _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))

SA_INLINE float hmax_ps(__m512 x)
{
    return hmax8_ps(_mm256_max_ps(_mm512_castps512_ps256(x), SA_HI256_PS(x)));
}

SA_INLINE double hsum_pd(__m512d x)
{
    return hsum4_pd(_mm256_add_pd(_mm512_castpd512_pd256(x), _mm512_extractf64x4_pd(x, 1)));
}

SA_INLINE void vd_add_ps(__m512d *s0, __m512d *s1, __m512 x)
{
    *s0 = _mm512_add_pd(*s0, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
    *s1 = _mm512_add_pd(*s1, _mm512_cvtps_pd(SA_HI256_PS(x)));
}

/* The first r (0..64) bytes. */
SA_INLINE __mmask64 bytes64(int r)
{
    return r >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << r) - 1);
}

/* reduce4_ps (x86_common.h) for int32 (exact in any order): four
 * per-token vectors -> in each 128-bit lane c, lane i holds token i's sum
 * of that lane's four values. */
SA_INLINE __m512i reduce4_epi32(__m512i a0, __m512i a1, __m512i a2, __m512i a3)
{
    const __m512 s01 = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_unpacklo_epi64(a0, a1), _mm512_unpackhi_epi64(a0, a1)));
    const __m512 s23 = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_unpacklo_epi64(a2, a3), _mm512_unpackhi_epi64(a2, a3)));
    return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(s01, s23, 0x88)),
                            _mm512_castps_si512(_mm512_shuffle_ps(s01, s23, 0xDD)));
}

/* Four quads' reduce4 results r[j] = [lane c: tokens 4j..4j+3] -> c[k] =
 * [lane k of r0 | lane k of r1 | lane k of r2 | lane k of r3], i.e. lane k's
 * values for tokens 0..15 (a 4x4 transpose of 128-bit blocks). */
SA_INLINE void transpose_lanes(__m512i r0, __m512i r1, __m512i r2, __m512i r3, __m512i *c)
{
    const __m512i t0 = _mm512_shuffle_i64x2(r0, r1, 0x44), t1 = _mm512_shuffle_i64x2(r0, r1, 0xEE);
    const __m512i t2 = _mm512_shuffle_i64x2(r2, r3, 0x44), t3 = _mm512_shuffle_i64x2(r2, r3, 0xEE);
    c[0] = _mm512_shuffle_i64x2(t0, t2, 0x88);
    c[1] = _mm512_shuffle_i64x2(t0, t2, 0xDD);
    c[2] = _mm512_shuffle_i64x2(t1, t3, 0x88);
    c[3] = _mm512_shuffle_i64x2(t1, t3, 0xDD);
}

/* -------------------------------------------------------------------------
 * scores_f32: 16 tokens per block, their dots reduced together.
 * ---------------------------------------------------------------------- */

/* 4 heads x 4 rows are 16 independent FMA chains on 8 loads per 16
 * channels. */
#define SA_S_HEADS 4

/* Prefill's GEMM-form scores: 12 vectors x 2 key vectors, 24 of the 32
 * registers accumulating. */
#define SA_P_ROWS 12

/* The four quads' reduce4_ps results -> the 16 token sums: a transpose of
 * the quads' 128-bit lanes and (l0 + l1) + (l2 + l3). */
SA_INLINE __m512 sum_quads(const __m512 *quad)
{
    __m512i c[4];
    transpose_lanes(_mm512_castps_si512(quad[0]), _mm512_castps_si512(quad[1]),
                    _mm512_castps_si512(quad[2]), _mm512_castps_si512(quad[3]), c);
    return _mm512_add_ps(_mm512_add_ps(_mm512_castsi512_ps(c[0]), _mm512_castsi512_ps(c[1])),
                         _mm512_add_ps(_mm512_castsi512_ps(c[2]), _mm512_castsi512_ps(c[3])));
}

/* -------------------------------------------------------------------------
 * scores_q8
 *
 * vpdpbusd multiplies unsigned x signed bytes.  K gets its sign bit flipped
 * (k ^ 0x80 = k + 128 as u8) and q stays signed; each int32 lane starts at
 * -128 * (the sum of the q bytes it will see), which cancels the +128 exactly,
 * so the lane sums are the exact q . k.  Per group the 16 tokens' exact sums
 * end up side by side, and the group term (qd * kd) * isum is added in group
 * order with the portable kernel's operations: the scores are bitwise the
 * portable ones.
 * ---------------------------------------------------------------------- */

/* -128 * (sum of the 4 q bytes of each lane): the start value that cancels
 * the k + 128 offset of one vpdpbusd with q. */
SA_INLINE __m512i offset_bias(__m512i q)
{
    const __m512i u128 = _mm512_set1_epi8((char)0x80);
    const __m512i s128 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, q);
    return _mm512_sub_epi32(_mm512_setzero_si512(), s128);
}

/* The group term for 16 tokens: acc + (qd * kd) * (float)isum. */
SA_INLINE __m512 add_group_term(__m512 acc, float qdg, __m512 kdg, __m512i isum)
{
    return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(qdg), kdg),
                                            _mm512_cvtepi32_ps(isum)));
}

/* kd of group g for the 16 tokens of a block (unused slots repeat the last
 * row, like the row pointers). */
SA_INLINE __m512 gather_scales(const float *kd_t, __m512i idx, int g)
{
    return _mm512_i32gather_ps(idx, kd_t + g, 4);
}

/* The scales of groups g0 .. g0+3 for the 16 tokens of a block, as
 * kdg[g] = [token 0 .. 15]: 16 loads of 4 floats (inside each row's scales,
 * whatever the stride) and a 4x4 transpose.  Lane i of l[j] holds token
 * 4i + j, which makes the unpacks come out in token order. */
SA_INLINE void load_scales4(const float *const *srows, int g0, __m512 *kdg)
{
    __m512 l[4];
    for (int j = 0; j < 4; j++) {
        __m512 x = _mm512_castps128_ps512(_mm_loadu_ps(srows[j] + g0));
        x = _mm512_insertf32x4(x, _mm_loadu_ps(srows[4 + j] + g0), 1);
        x = _mm512_insertf32x4(x, _mm_loadu_ps(srows[8 + j] + g0), 2);
        l[j] = _mm512_insertf32x4(x, _mm_loadu_ps(srows[12 + j] + g0), 3);
    }
    /* per 128-bit lane i: t01 = [j0 g0, j1 g0, j0 g1, j1 g1], ... */
    const __m512 t01 = _mm512_unpacklo_ps(l[0], l[1]), t01h = _mm512_unpackhi_ps(l[0], l[1]);
    const __m512 t23 = _mm512_unpacklo_ps(l[2], l[3]), t23h = _mm512_unpackhi_ps(l[2], l[3]);
#define SA_AS_PD(x) _mm512_castps_pd(x)
    kdg[0] = _mm512_castpd_ps(_mm512_unpacklo_pd(SA_AS_PD(t01), SA_AS_PD(t23)));
    kdg[1] = _mm512_castpd_ps(_mm512_unpackhi_pd(SA_AS_PD(t01), SA_AS_PD(t23)));
    kdg[2] = _mm512_castpd_ps(_mm512_unpacklo_pd(SA_AS_PD(t01h), SA_AS_PD(t23h)));
    kdg[3] = _mm512_castpd_ps(_mm512_unpackhi_pd(SA_AS_PD(t01h), SA_AS_PD(t23h)));
#undef SA_AS_PD
}

/* One K row's 128 bytes from b, as scores_q8_block32 takes them: the sign
 * bits flipped, Z0 = [g0a g0b g1a g1b], Z1 = [g2a g2b g3a g3b] shuffled into
 * X = [g0a g1a g2a g3a] and Y = [g0b g1b g2b g3b]. */
SA_INLINE void k_xy(const int8_t *r, __m512i *x, __m512i *y)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i z0 = _mm512_xor_si512(_mm512_loadu_si512(r), flip);
    const __m512i z1 = _mm512_xor_si512(_mm512_loadu_si512(r + 64), flip);
    *x = _mm512_shuffle_i64x2(z0, z1, 0x88);
    *y = _mm512_shuffle_i64x2(z0, z1, 0xDD);
}

/* gs == 32, D % 128 == 0 (the common q8 shape).  Per 128 bytes of a row,
 * k_xy's X and Y; two vpdpbusd into one accumulator then leave each group
 * in its own 128-bit lane, so a quad of tokens needs only reduce4 and four
 * quads one lane transpose to give [group: 16 tokens]. */
SA_INLINE void scores_q8_block32(const int8_t *qq, const float *qd, int HB, int D,
                                 const int8_t *const *rows, const float *const *srows,
                                 __m512 *res, sa_pf_walk *w)
{
    const int ng = D / 32;
    sa_pf_walk wl = *w; /* in registers for the loop */
    for (int h = 0; h < HB; h++)
        res[h] = _mm512_setzero_ps();
    for (int b = 0; b < D; b += 128) {
        __m512i qx[SA_Q8_HEADS], qy[SA_Q8_HEADS], bias[SA_Q8_HEADS], quad[SA_Q8_HEADS][4];
        for (int h = 0; h < HB; h++) {
            const int8_t *qh = qq + (ptrdiff_t)h * D + b;
            const __m512i q0 = _mm512_loadu_si512(qh), q1 = _mm512_loadu_si512(qh + 64);
            qx[h] = _mm512_shuffle_i64x2(q0, q1, 0x88);
            qy[h] = _mm512_shuffle_i64x2(q0, q1, 0xDD);
            bias[h] = _mm512_add_epi32(offset_bias(qx[h]), offset_bias(qy[h]));
        }
        for (int j = 0; j < 4; j++) {
            sa_pf_walk_step(&wl);
            __m512i acc[SA_Q8_HEADS][4];
            for (int i = 0; i < 4; i++) {
                __m512i x, y;
                k_xy(rows[4 * j + i] + b, &x, &y);
                for (int h = 0; h < HB; h++)
                    acc[h][i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(bias[h], x, qx[h]), y,
                                                    qy[h]);
            }
            for (int h = 0; h < HB; h++)
                quad[h][j] = reduce4_epi32(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
        }
        const int g0 = b / 32;
        __m512 kdg[4];
        load_scales4(srows, g0, kdg);
        for (int h = 0; h < HB; h++) {
            __m512i isum[4];
            transpose_lanes(quad[h][0], quad[h][1], quad[h][2], quad[h][3], isum);
            const float *qdh = qd + (ptrdiff_t)h * ng + g0;
            res[h] = add_group_term(res[h], qdh[0], kdg[0], isum[0]);
            res[h] = add_group_term(res[h], qdh[1], kdg[1], isum[1]);
            res[h] = add_group_term(res[h], qdh[2], kdg[2], isum[2]);
            res[h] = add_group_term(res[h], qdh[3], kdg[3], isum[3]);
        }
    }
    *w = wl;
}

/* Any gs that is a multiple of 16 (so D is too).  Per 64-byte segment of a
 * row (the last one masked), one vpdpbusd per (head, token); reduce4 and the
 * lane transpose give the sums of the segment's four 16-byte chunks for the
 * 16 tokens; chunks are added into the current group's sum, and a group's
 * term is added once its last chunk is in.  (Many heads take
 * scores_q8_gemm_many instead.) */
SA_INLINE void scores_q8_block16(const int8_t *qq, const float *qd, int HB, int D, int gs,
                                 const int8_t *const *rows, const float *kd_t, __m512i idx,
                                 __m512 *res, sa_pf_walk *w)
{
    sa_pf_walk wl = *w; /* in registers for the loop */
    const int ng = D / gs, cpg = gs / 16, nchunk = D / 16;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i gsum[SA_Q8_HEADS];
    for (int h = 0; h < HB; h++) {
        res[h] = _mm512_setzero_ps();
        gsum[h] = _mm512_setzero_si512();
    }
    for (int b = 0; b < D; b += 64) {
        const __mmask64 m = bytes64(D - b);
        __m512i qv[SA_Q8_HEADS], bias[SA_Q8_HEADS], quad[SA_Q8_HEADS][4];
        for (int h = 0; h < HB; h++) {
            qv[h] = _mm512_maskz_loadu_epi8(m, qq + (ptrdiff_t)h * D + b);
            bias[h] = offset_bias(qv[h]); /* masked bytes: q = 0, nothing to cancel */
        }
        for (int j = 0; j < 4; j++) {
            sa_pf_walk_step(&wl);
            __m512i acc[SA_Q8_HEADS][4];
            for (int i = 0; i < 4; i++) {
                const __m512i z =
                    _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, rows[4 * j + i] + b), flip);
                for (int h = 0; h < HB; h++)
                    acc[h][i] = _mm512_dpbusd_epi32(bias[h], z, qv[h]);
            }
            for (int h = 0; h < HB; h++)
                quad[h][j] = reduce4_epi32(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
        }
        __m512i chunk[SA_Q8_HEADS][4];
        for (int h = 0; h < HB; h++)
            transpose_lanes(quad[h][0], quad[h][1], quad[h][2], quad[h][3], chunk[h]);
        for (int c = 0; c < 4; c++) {
            const int ci = b / 16 + c;
            if (ci >= nchunk)
                break;
            for (int h = 0; h < HB; h++)
                gsum[h] = _mm512_add_epi32(gsum[h], chunk[h][c]);
            if ((ci + 1) % cpg == 0) {
                const int g = ci / cpg;
                const __m512 kdg = gather_scales(kd_t, idx, g);
                for (int h = 0; h < HB; h++) {
                    res[h] = add_group_term(res[h], qd[(ptrdiff_t)h * ng + g], kdg, gsum[h]);
                    gsum[h] = _mm512_setzero_si512();
                }
            }
        }
    }
    *w = wl;
}

/* gs a multiple of 16; the gathers of the general path index 15 rows of
 * scales with 32-bit offsets. */
SA_INLINE int q8_takes(int gs, int D, ptrdiff_t scale_stride)
{
    (void)D;
    return gs % 16 == 0 && scale_stride >= 0 && scale_stride <= INT32_MAX / 16;
}

SA_INLINE void scores_q8_tokens(const int8_t *qq, const float *qd, int HB, int D, int gs,
                                const int8_t *const *rows, const float *const *srows,
                                const float *kd_t, ptrdiff_t scale_stride, int cnt,
                                const __m512 *ks, __m512 *res, sa_pf_walk *w)
{
    (void)ks; /* no block scales (SA_Q8_BLOCK_SCALES 0): the blocks gather theirs */
    if (gs == 32 && D % 128 == 0) {
        scores_q8_block32(qq, qd, HB, D, rows, srows, res, w);
        return;
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i idx = _mm512_mullo_epi32(_mm512_min_epi32(lane, _mm512_set1_epi32(cnt - 1)),
                                           _mm512_set1_epi32((int)scale_stride));
    scores_q8_block16(qq, qd, HB, D, gs, rows, kd_t, idx, res, w);
}

/* Prefetch steps per block of heads and tokens: one per quad of rows and
 * 128 (gs 32) or 64 bytes of the row. */
#define SA_Q8_S_STEPS(D, gs) ((gs) == 32 && (D) % 128 == 0 ? (D) / 32 : ((D) + 63) / 64 * 4)

/* The blocks gather their own scales (gather_scales, load_scales4). */
#define SA_Q8_BLOCK_SCALES 0

/* -------------------------------------------------------------------------
 * softmax_exp: the exponent's steps
 * ---------------------------------------------------------------------- */

/* As the AVX2 file's: 2^n + poly * 2^n with 2^n's bits shifted out of z,
 * 0 where x is below ln(FLT_MIN) (the compare is true for NaN, which the
 * FMA keeps). */
SA_INLINE __m512 vf_exp_finish(__m512 poly, __m512 z, __m512 x)
{
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(z),
                                                         _mm512_set1_epi32(127)), 23);
    const __m512 two_n = _mm512_castsi512_ps(e);
    const __m512 y = _mm512_fmadd_ps(poly, two_n, two_n);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(SA_LN_FLT_MIN), _CMP_NLT_UQ),
                               y);
}

/* Heads per V accumulation block: 4 heads x 4 vectors of a q8 tile are 16
 * accumulators. */
#define SA_V_HEADS 4

/* Many heads (prefill): 6 heads x 4 vectors (64 columns), 24 accumulators;
 * each token's 64 values loaded once for the 6 heads: 10 loads per 24 FMAs
 * instead of 8 per 16 (x86_common.h, accv_f32_wide; docs/design.md, x86's measured choices). */
#define SA_V_WIDE 6
#define SA_V_WIDE_VECS 4

/* Many heads against one block (prefill scores a tile's rows x heads, 64
 * query vectors for a Qwen3-VL-2B layer, 96 for SmolLM2), in the form of
 * an int8 GEMM (scores_q8_gemm_many): each block of 16 K rows is
 * transposed once (k_block_t) so that vector c holds the bytes 4c .. 4c+3
 * of the 16 rows (lane i: row i), and a vector's group sum is then gs/4
 * vpdpbusd of those vectors with its own 4 bytes broadcast: the 16
 * tokens' exact sums come out side by side, with no per-token reduction
 * (the dot form's reductions, not its vpdpbusd, bound it with many heads).
 * vpdpbusd takes one operand unsigned: the query's bytes, +128 (flipped
 * once per call for all the tokens), and each group's sum starts at -128
 * times the sum of the token's K bytes in the group (k_group_bias, once per
 * block for all the heads).  The sums are exact integers and the group
 * terms are added with scores_q8_block32/16's operations in group order,
 * so the scores are bitwise those of scores_q8_tokens (and of the portable
 * kernel).  Decode's few heads per KV head (4 and 8, K streamed from
 * memory) do not gain from preparing K once (docs/design.md, x86's measured choices), so this starts at
 * 16 vectors, which a full prefill tile (8 rows or more) has from 2 heads
 * per KV head on. */
#define SA_Q8_MANY_HEADS 16
#define SA_Q8_MANY_MAX_D 512
#define SA_Q8_MANY_HB 8    /* heads per pass over a block's vectors: 8 dpbusd chains */
#define SA_Q8_MANY_CHUNK 64 /* heads whose flipped bytes are kept at once */

SA_INLINE int q8_many_takes(int gs, int D)
{
    return gs % 16 == 0 && D <= SA_Q8_MANY_MAX_D;
}

/* -------------------------------------------------------------------------
 * accumulate_v_q8
 * ---------------------------------------------------------------------- */

/* q8 V's weights are taken a block of V_TOKENS tokens at a time. */
#define SA_QV_TOKENS V_TOKENS

/* out[h][d .. d + 4*SA_VT) for HB (1 to SA_V_HEADS) heads over tokens
 * [t0, t1), with the weights of q8_v_weights from group g0 on (wq's row for
 * token t0).  gs is a multiple of SA_VT, so each vector lies in one group
 * (its weight at the vector's group); each token's 4*SA_VT values are
 * converted once for the heads (exact), then added as accv_f32_tile adds a
 * float row with those weights.  Called with constant HB, so the
 * accumulators stay in registers; SHARE (a constant, 4, 2 or 1): how many
 * neighbouring vectors lie in one group, so a head's weight is broadcast
 * once per group met, not once per vector. */
SA_INLINE void accv_q8_tile4(float *const *out, const float *wq, int HB, int gs, int g0,
                             const int8_t *v, ptrdiff_t row_stride, int t0, int t1, int d,
                             sa_pf_walk *walk, const int SHARE)
{
    const int j0 = d / gs - g0, j1 = (d + SA_VT) / gs - g0, j2 = (d + 2 * SA_VT) / gs - g0;
    const int j3 = (d + 3 * SA_VT) / gs - g0;
    sa_vf a0[SA_V_HEADS], a1[SA_V_HEADS], a2[SA_V_HEADS], a3[SA_V_HEADS];
    for (int h = 0; h < HB; h++) {
        const float *o = out[h] + d;
        a0[h] = SA_MM(loadu_ps)(o), a1[h] = SA_MM(loadu_ps)(o + SA_VT);
        a2[h] = SA_MM(loadu_ps)(o + 2 * SA_VT), a3[h] = SA_MM(loadu_ps)(o + 3 * SA_VT);
    }
    sa_pf_walk wl = *walk; /* in registers for the loop */
    const int8_t *row = v + (ptrdiff_t)t0 * row_stride + d;
    for (int t = t0; t < t1; t++, row += row_stride, wq += HB * SA_QV_GROUPS) {
        sa_pf_walk_step(&wl);
        const sa_vf v0 = vf_load_s8(row), v1 = vf_load_s8(row + SA_VT);
        const sa_vf v2 = vf_load_s8(row + 2 * SA_VT), v3 = vf_load_s8(row + 3 * SA_VT);
        for (int h = 0; h < HB; h++) {
            const float *wh = wq + h * SA_QV_GROUPS;
            const sa_vf w0 = SA_MM(set1_ps)(wh[j0]);
            const sa_vf w1 = SHARE >= 2 ? w0 : SA_MM(set1_ps)(wh[j1]);
            const sa_vf w2 = SHARE == 4 ? w0 : SA_MM(set1_ps)(wh[j2]);
            const sa_vf w3 = SHARE == 4 ? w0 : SHARE == 2 ? w2 : SA_MM(set1_ps)(wh[j3]);
            a0[h] = SA_MM(fmadd_ps)(w0, v0, a0[h]);
            a1[h] = SA_MM(fmadd_ps)(w1, v1, a1[h]);
            a2[h] = SA_MM(fmadd_ps)(w2, v2, a2[h]);
            a3[h] = SA_MM(fmadd_ps)(w3, v3, a3[h]);
        }
    }
    *walk = wl;
    for (int h = 0; h < HB; h++) {
        float *o = out[h] + d;
        SA_MM(storeu_ps)(o, a0[h]), SA_MM(storeu_ps)(o + SA_VT, a1[h]);
        SA_MM(storeu_ps)(o + 2 * SA_VT, a2[h]), SA_MM(storeu_ps)(o + 3 * SA_VT, a3[h]);
    }
}

/* The same for one vector (D % (4*SA_VT) leftovers). */
SA_INLINE void accv_q8_tile1(float *const *out, const float *wq, int HB, int gs, int g0,
                             const int8_t *v, ptrdiff_t row_stride, int t0, int t1, int d)
{
    const int j0 = d / gs - g0;
    for (int h = 0; h < HB; h++) {
        sa_vf a = SA_MM(loadu_ps)(out[h] + d);
        const float *wh = wq + h * SA_QV_GROUPS + j0;
        for (int t = t0; t < t1; t++, wh += HB * SA_QV_GROUPS)
            a = SA_MM(fmadd_ps)(SA_MM(set1_ps)(*wh),
                                vf_load_s8(v + (ptrdiff_t)t * row_stride + d), a);
        SA_MM(storeu_ps)(out[h] + d, a);
    }
}

/* HB heads over all of D, SA_QV_GROUPS groups at a time: their weights
 * (q8_v_weights), then their columns in tiles of 4 vectors and single
 * vectors. */
SA_INLINE void accv_q8_heads(float *const *out, const float *const *p, int HB, int D, int gs,
                             const int8_t *v, const float *vd, ptrdiff_t row_stride,
                             ptrdiff_t scale_stride, int t0, int t1, sa_pf_walk *w)
{
    float wq[SA_QV_TOKENS * SA_V_HEADS * SA_QV_GROUPS] __attribute__((aligned(64)));
    const int ng = D / gs;
    for (int g0 = 0; g0 < ng; g0 += SA_QV_GROUPS) {
        const int gn = ng - g0 < SA_QV_GROUPS ? ng - g0 : SA_QV_GROUPS;
        const int d1 = (g0 + gn) * gs;
        int d = g0 * gs;
        q8_v_weights(p, HB, vd, scale_stride, t0, t1, g0, gn, wq);
        for (; d + 4 * SA_VT <= d1; d += 4 * SA_VT) {
            if (d / gs == (d + 4 * SA_VT - 1) / gs)
                accv_q8_tile4(out, wq, HB, gs, g0, v, row_stride, t0, t1, d, w, 4);
            else if (gs % (2 * SA_VT) == 0)
                accv_q8_tile4(out, wq, HB, gs, g0, v, row_stride, t0, t1, d, w, 2);
            else
                accv_q8_tile4(out, wq, HB, gs, g0, v, row_stride, t0, t1, d, w, 1);
        }
        for (; d < d1; d += SA_VT)
            accv_q8_tile1(out, wq, HB, gs, g0, v, row_stride, t0, t1, d);
    }
}

/* Steps (tile passes over one token, each a step of the prefetch walk) of
 * accv_q8_heads' blocks in a call of n tokens: tiles of 4 vectors, per
 * block of heads and token. */
static long accv_q8_steps(int G, int D, int gs, int n)
{
    (void)gs;
    int blocks = G / SA_V_HEADS + G % SA_V_HEADS / 2 + G % 2;
    if (G % SA_V_HEADS == 3)
        blocks = G / SA_V_HEADS + 1; /* accv_q8_split3 */
    return (long)n * blocks * (D / (4 * SA_VT));
}

/* accumulate_v_q8 with SA_V_HEADS heads at a time, then pairs, then one, a
 * block of tokens at a time. */
SA_INLINE void accv_q8_blocks_body(float *const *out, const float *const *p, int G, int D,
                                   int gs, const int8_t *v, const float *vd,
                                   ptrdiff_t row_stride, ptrdiff_t scale_stride, int n,
                                   sa_pf_walk *w)
{
    for (int t0 = 0; t0 < n; t0 += V_TOKENS) {
        const int t1 = n - t0 < V_TOKENS ? n : t0 + V_TOKENS;
        int g = 0;
        for (; g + SA_V_HEADS <= G; g += SA_V_HEADS)
            accv_q8_heads(out + g, p + g, SA_V_HEADS, D, gs, v, vd, row_stride, scale_stride,
                          t0, t1, w);
        for (; g + 2 <= G; g += 2)
            accv_q8_heads(out + g, p + g, 2, D, gs, v, vd, row_stride, scale_stride, t0, t1, w);
        if (g < G)
            accv_q8_heads(out + g, p + g, 1, D, gs, v, vd, row_stride, scale_stride, t0, t1, w);
    }
}

/* Out of line: a caller below takes the three-head case first, and the
 * loop keeps the code it had alone (inlined beside that case, or with it as
 * a branch inside, the pairs' loop was slower). */
__attribute__((noinline)) static void accv_q8_blocks(float *const *out, const float *const *p,
                                                     int G, int D, int gs, const int8_t *v,
                                                     const float *vd, ptrdiff_t row_stride,
                                                     ptrdiff_t scale_stride, int n,
                                                     sa_pf_walk *w)
{
    accv_q8_blocks_body(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, w);
}

/* G = 4m + 3 heads (a GQA group of 3, or 7: SmolLM2, Qwen2.5): the first 4m
 * as above, then the last three as one block, each token converted once
 * for the three instead of for a pair and again for one; the rows are back
 * in L1 or L2 for them.  Each head's sums are the same operations in the
 * same order whichever pass adds them.  One prefetch walk spans both
 * passes. */
__attribute__((noinline)) static void accv_q8_split3(float *const *out, const float *const *p,
                                                     int G, int D, int gs, const int8_t *v,
                                                     const float *vd, ptrdiff_t row_stride,
                                                     ptrdiff_t scale_stride, int n,
                                                     sa_pf_walk *w)
{
    if (G > 3)
        accv_q8_blocks(out, p, G - 3, D, gs, v, vd, row_stride, scale_stride, n, w);
    for (int t0 = 0; t0 < n; t0 += V_TOKENS) {
        const int t1 = n - t0 < V_TOKENS ? n : t0 + V_TOKENS;
        accv_q8_heads(out + G - 3, p + G - 3, 3, D, gs, v, vd, row_stride, scale_stride, t0,
                      t1, w);
    }
}

static void SA_FN(accumulate_v_q8)(float *const *out, const float *const *p, int G, int D,
                                   int gs, const int8_t *v, const float *vd,
                                   ptrdiff_t row_stride, ptrdiff_t scale_stride, int n,
                                   const sa_prefetch *pf)
{
    if (gs % SA_VT != 0) {
        accumulate_v_q8_scalar(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, pf);
        return;
    }
    if (D < 4 * SA_VT) { /* no tile of 4 vectors to walk in: the lines now */
        sa_prefetch_part(pf, 0, 1);
        pf = NULL;
    }
    sa_pf_walk w;
    sa_pf_walk_start(&w, pf, accv_q8_steps(G, D, gs, n));
    if (G % SA_V_HEADS == 3) {
        accv_q8_split3(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, &w);
        return;
    }
    accv_q8_blocks(out, p, G, D, gs, v, vd, row_stride, scale_stride, n, &w);
}

/* No GEMM-form q8 scores: prefill's q8 tiles take scores_q8_many (the
 * including file's), which prepares each K block once for all their query
 * vectors. */
#define SA_Q8_PANEL_KEYS 0

/* 16 rows of 16 int32 -> their transpose (in place). */
SA_INLINE void transpose16_epi32(__m512i *r)
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* Lane L (128 bits) of r[4a + j] is now column 4L + j of rows
     * 4a .. 4a+3; two rounds of 128-bit lane shuffles put column c's four
     * lanes side by side in r[c]. */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xDD);
        t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xDD);
        r[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xDD);
    }
}

/* A block of 16 K rows (row pointers as SA_BLOCK_ROWS gives them, the
 * first cnt real) for the GEMM forms (vpdpbusd and tdpbssd): kt[c] =
 * bytes 4c .. 4c+3 of the 16 rows (lane i: row i), signed as stored, and
 * kds[g] = the rows' scales of group g. */
SA_INLINE void k_block_t(const int8_t *const *rows, const float *kd_t, ptrdiff_t scale_stride,
                         int cnt, int D, int gs, __m512i *kt, __m512 *kds)
{
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int b = 0; b < (D + 63) / 64; b++) {
        const __mmask64 m = bytes64(D - 64 * b);
        for (int i = 0; i < 16; i++)
            kt[16 * b + i] = _mm512_maskz_loadu_epi8(m, rows[i] + 64 * b);
        transpose16_epi32(kt + 16 * b);
    }
    const __m512i idx = _mm512_mullo_epi32(_mm512_min_epi32(lane, _mm512_set1_epi32(cnt - 1)),
                                           _mm512_set1_epi32((int)scale_stride));
    for (int g = 0; g < D / gs; g++)
        kds[g] = gather_scales(kd_t, idx, g);
}

/* acc += the 4-byte dot products of u's unsigned bytes with s's signed
 * bytes.  GCC 12 kept a copy of the accumulator around each
 * _mm512_dpbusd_epi32 of a loop (two register moves per instruction, and
 * spills); the asm pins it in its register.  Under the SIMDe test build (no
 * __AVX512VNNI__) the intrinsic stands in. */
#if defined(__AVX512VNNI__) && defined(__GNUC__)
#define sa_dpbusd(acc, u, s) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))
#else
#define sa_dpbusd(acc, u, s) ((acc) = _mm512_dpbusd_epi32((acc), (u), (s)))
#endif

/* The 4 bytes of a flipped query vector at q, in every lane. */
SA_INLINE __m512i q4_bcast(const uint8_t *q)
{
    int32_t q4;
    memcpy(&q4, q, 4);
    return _mm512_set1_epi32(q4);
}

/* kb[g] = -128 * (the sum of each token's K bytes in group g), lane i for
 * row i of the transposed block kt: what cancels the query's +128. */
SA_INLINE void k_group_bias(const __m512i *kt, int D, int gs, __m512i *kb)
{
    const __m512i ones = _mm512_set1_epi8(1);
    for (int g = 0, c = 0; g < D / gs; g++) {
        __m512i sum = _mm512_setzero_si512();
        for (const int end = c + gs / 4; c < end; c++)
            sum = _mm512_dpbusd_epi32(sum, ones, kt[c]);
        kb[g] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
    }
}

/* The scores of vectors 0 .. HB-1 (HB <= 8) of qu (their bytes + 128, row
 * stride D, 8 rows readable) against one prepared block: kt[c] = bytes
 * 4c..4c+3 of the 16 rows, kds[g] and kb[g] the rows' scales and bias of
 * group g; stored at s[x] + t.  Always 8 named accumulators in a function
 * of its own, so all 16 stay in registers (with an array inlined into
 * scores_q8_gemm_many, GCC 12 spilled some); rows from HB on are computed
 * and dropped. */
#define SA_H8(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
__attribute__((noinline)) static void scores_q8_gemm8(const uint8_t *qu, const float *qd, int HB,
                                                      int D, int gs, const __m512i *kt,
                                                      const __m512 *kds, const __m512i *kb,
                                                      float *const *s, int t, int cnt)
{
    const int ng = D / gs, cpg = gs / 4;
#define SA_R(x) __m512 r##x = _mm512_setzero_ps();
    SA_H8(SA_R)
#undef SA_R
    for (int g = 0; g < ng; g++) {
        const __m512i bias = kb[g];
#define SA_A(x) __m512i a##x = bias;
        SA_H8(SA_A)
#undef SA_A
        for (int c = g * cpg; c < (g + 1) * cpg; c++) {
            const __m512i kc = kt[c];
#define SA_DOT(x) sa_dpbusd(a##x, q4_bcast(qu + (ptrdiff_t)(x) * D + 4 * c), kc);
            SA_H8(SA_DOT)
#undef SA_DOT
        }
        const __m512 kdg = kds[g];
#define SA_T(x) r##x = add_group_term(r##x, (x) < HB ? qd[(ptrdiff_t)(x) * ng + g] : 0.0f, \
                                         kdg, a##x);
        SA_H8(SA_T)
#undef SA_T
    }
#define SA_S(x)                                                                  \
    if ((x) < HB)                                                                \
        vf_store_first(s[x] + t, cnt, r##x);
    SA_H8(SA_S)
#undef SA_S
}
#undef SA_H8

static void scores_q8_gemm_many(const int8_t *qq, const float *qd, int G, int D, int gs,
                                const int8_t *k, const float *kd, ptrdiff_t row_stride,
                                ptrdiff_t scale_stride, int n, float *const *s,
                                const sa_prefetch *pf)
{
    __m512i kt[SA_Q8_MANY_MAX_D / 4], kb[SA_Q8_MANY_MAX_D / 16];
    __m512 kds[SA_Q8_MANY_MAX_D / 16];
    /* the chunk's vectors flipped, rounded up to whole 8s (the rows past nh
     * hold flipped zeros), + 64: the last store may run past them */
    uint8_t qu[SA_Q8_MANY_CHUNK * SA_Q8_MANY_MAX_D + 64] __attribute__((aligned(64)));
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int ng = D / gs, iters = (n + 15) / 16;
    for (int h0 = 0; h0 < G; h0 += SA_Q8_MANY_CHUNK) {
        const int nh = G - h0 < SA_Q8_MANY_CHUNK ? G - h0 : SA_Q8_MANY_CHUNK;
        const int8_t *qh0 = qq + (ptrdiff_t)h0 * D;
        for (int i = 0; i < (nh + 7) / 8 * 8 * D; i += 64) {
            const __mmask64 m = i < nh * D ? bytes64(nh * D - i) : 0;
            const __m512i q = _mm512_maskz_loadu_epi8(m, qh0 + i);
            _mm512_store_si512(qu + i, _mm512_xor_si512(q, flip));
        }
        for (int t = 0, it = 0; t < n; t += 16, it++) {
            const int cnt = n - t < 16 ? n - t : 16;
            const int8_t *rows[16];
            SA_BLOCK_ROWS(rows, k, t, cnt, row_stride);
            if (h0 == 0)
                sa_prefetch_part(pf, it, iters);
            k_block_t(rows, kd + (ptrdiff_t)t * scale_stride, scale_stride, cnt, D, gs, kt, kds);
            k_group_bias(kt, D, gs, kb);
            for (int x = 0; x < nh; x += SA_Q8_MANY_HB) {
                const int h = h0 + x;
                scores_q8_gemm8(qu + (ptrdiff_t)x * D, qd + (ptrdiff_t)h * ng,
                                nh - x < SA_Q8_MANY_HB ? nh - x : SA_Q8_MANY_HB, D, gs, kt, kds,
                                kb, s + h, t, cnt);
            }
        }
    }
}

#endif
