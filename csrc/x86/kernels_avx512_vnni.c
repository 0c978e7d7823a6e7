/*
 * AVX-512 (F/BW/VL) + VNNI + FMA kernels.  Compiled with the same flags as
 * the rest of the extension: the pragma below, not the command line, lets
 * this one file use AVX-512, and cpu_features.c only hands the table out when
 * the CPU and OS support it.
 *
 * Batching rule (kernels.h): a kernel may share loads between heads and
 * tokens, but the operations that produce one (head, token) result never
 * depend on the batch.  Every token of a block goes through the same code: a
 * short last block repeats its last row in the unused slots (no read past
 * row n-1) and stores only the valid results, so there is no separate "tail
 * token" path whose rounding could differ.  Heads are blocked the same way:
 * each head's accumulators see the same operations whatever the block size.
 *
 * Tails along D use masked loads/stores (masked lanes never touch memory),
 * so nothing outside [0, D) of a row or [0, n) of the rows is read or
 * written.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")
/* GCC implements _mm512_mul_ps/_mm512_add_ps as plain vector operators, so
 * by default (-ffp-contract=fast) it fuses them into FMAs wherever it likes.
 * Every FMA here is written out explicitly; a mul followed by an add stays
 * two roundings (the q8 scores then equal the portable ones bit for bit, and
 * scale*s - scale*max is exactly 0 at the max). */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>

#include <stdint.h>

#include "../kernels.h"
#include "x86_helpers.h"

/* The steps x86_common.h's loops call (its header lists them). */
#define SA_ISA_ID avx512_vnni
#define SA_VT 16
typedef __m512 sa_vres;
#define SA_V_HEADS 4

/* -------------------------------------------------------------------------
 * Small helpers
 * ---------------------------------------------------------------------- */

/* The first r (0..16) lanes. */
SA_INLINE __mmask16 lanes16(int r)
{
    return (__mmask16)((1u << r) - 1u);
}

/* The first r (0..64) bytes. */
SA_INLINE __mmask64 bytes64(int r)
{
    return r >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << r) - 1);
}

/* Four per-token vectors -> in each 128-bit lane c, lane i holds token i's
 * (x0 + x2) + (x1 + x3) of that lane's four values.  Float: fixed order. */
SA_INLINE __m512 reduce4_ps(__m512 a0, __m512 a1, __m512 a2, __m512 a3)
{
    const __m512 s01 = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a0), _mm512_castps_pd(a1))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a0), _mm512_castps_pd(a1))));
    const __m512 s23 = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a2), _mm512_castps_pd(a3))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a2), _mm512_castps_pd(a3))));
    return _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x88), _mm512_shuffle_ps(s01, s23, 0xDD));
}

/* The same for int32 (exact in any order). */
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

/* The first cnt of 16 results. */
SA_INLINE void store_scores(float *dst, int cnt, __m512 x)
{
    if (cnt == 16)
        _mm512_storeu_ps(dst, x);
    else
        _mm512_mask_storeu_ps(dst, lanes16(cnt), x);
}

/* -------------------------------------------------------------------------
 * scores_f32: 16 tokens per block, their dots reduced together.
 * ---------------------------------------------------------------------- */

/* HB (1 to SA_S_HEADS = 4) heads x 16 rows, in quads of 4 rows.  Each
 * (head, token) keeps one 16-lane FMA accumulator over D (the D % 16 tail
 * through masked loads: zero lanes add nothing), then reduce4_ps per quad
 * of tokens, a transpose of the quads' 128-bit lanes and (l0 + l1) +
 * (l2 + l3).  Per 16 channels the heads' query vectors are loaded first and
 * each row once: 4 heads x 4 rows are 16 independent FMA chains on 8 loads
 * (prefill, where many query rows share the keys); the arithmetic of one
 * (head, token) is the same for any HB. */
#define SA_S_HEADS 4
SA_INLINE void scores_f32_block(const float *q, int HB, int D, const float *const *rows,
                                __m512 *res)
{
    const int dv = D & ~15;
    const __mmask16 tm = lanes16(D & 15);
    __m512 quad[SA_S_HEADS][4];
    for (int j = 0; j < 4; j++) {
        const float *const *r = rows + 4 * j;
        __m512 acc[SA_S_HEADS][4];
        for (int h = 0; h < HB; h++)
            for (int i = 0; i < 4; i++)
                acc[h][i] = _mm512_setzero_ps();
        for (int d = 0; d < dv; d += 16) {
            __m512 qv[SA_S_HEADS];
            for (int h = 0; h < HB; h++) {
                qv[h] = _mm512_loadu_ps(q + (ptrdiff_t)h * D + d);
                SA_KEEP(qv[h]);
            }
            for (int i = 0; i < 4; i++) {
                __m512 kv = _mm512_loadu_ps(r[i] + d);
                SA_KEEP(kv);
                for (int h = 0; h < HB; h++)
                    acc[h][i] = _mm512_fmadd_ps(qv[h], kv, acc[h][i]);
            }
        }
        if (tm) {
            __m512 qv[SA_S_HEADS];
            for (int h = 0; h < HB; h++)
                qv[h] = _mm512_maskz_loadu_ps(tm, q + (ptrdiff_t)h * D + dv);
            for (int i = 0; i < 4; i++) {
                const __m512 kv = _mm512_maskz_loadu_ps(tm, r[i] + dv);
                for (int h = 0; h < HB; h++)
                    acc[h][i] = _mm512_fmadd_ps(qv[h], kv, acc[h][i]);
            }
        }
        for (int h = 0; h < HB; h++)
            quad[h][j] = reduce4_ps(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    }
    for (int h = 0; h < HB; h++) {
        __m512i c[4];
        transpose_lanes(_mm512_castps_si512(quad[h][0]), _mm512_castps_si512(quad[h][1]),
                        _mm512_castps_si512(quad[h][2]), _mm512_castps_si512(quad[h][3]), c);
        res[h] = _mm512_add_ps(_mm512_add_ps(_mm512_castsi512_ps(c[0]), _mm512_castsi512_ps(c[1])),
                               _mm512_add_ps(_mm512_castsi512_ps(c[2]), _mm512_castsi512_ps(c[3])));
    }
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
#define SA_PD(x) _mm512_castps_pd(x)
    kdg[0] = _mm512_castpd_ps(_mm512_unpacklo_pd(SA_PD(t01), SA_PD(t23)));
    kdg[1] = _mm512_castpd_ps(_mm512_unpackhi_pd(SA_PD(t01), SA_PD(t23)));
    kdg[2] = _mm512_castpd_ps(_mm512_unpacklo_pd(SA_PD(t01h), SA_PD(t23h)));
    kdg[3] = _mm512_castpd_ps(_mm512_unpackhi_pd(SA_PD(t01h), SA_PD(t23h)));
#undef SA_PD
}

/* gs == 32, D % 128 == 0 (the common q8 shape).  Per 128 bytes of a row, the
 * two 64-byte halves Z0 = [g0a g0b g1a g1b], Z1 = [g2a g2b g3a g3b] (16-byte
 * quarters of the four groups) are shuffled into X = [g0a g1a g2a g3a] and
 * Y = [g0b g1b g2b g3b]; two vpdpbusd into one accumulator then leave each
 * group in its own 128-bit lane, so a quad of tokens needs only reduce4 and
 * four quads one lane transpose to give [group: 16 tokens]. */
SA_INLINE void scores_q8_block32(const int8_t *qq, const float *qd, int HB, int D,
                                 const int8_t *const *rows, const float *const *srows,
                                 __m512 *res)
{
    const int ng = D / 32;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int h = 0; h < HB; h++)
        res[h] = _mm512_setzero_ps();
    for (int b = 0; b < D; b += 128) {
        __m512i qx[2], qy[2], bias[2], quad[2][4];
        for (int h = 0; h < HB; h++) {
            const int8_t *qh = qq + (ptrdiff_t)h * D + b;
            const __m512i q0 = _mm512_loadu_si512(qh), q1 = _mm512_loadu_si512(qh + 64);
            qx[h] = _mm512_shuffle_i64x2(q0, q1, 0x88);
            qy[h] = _mm512_shuffle_i64x2(q0, q1, 0xDD);
            bias[h] = _mm512_add_epi32(offset_bias(qx[h]), offset_bias(qy[h]));
        }
        for (int j = 0; j < 4; j++) {
            __m512i acc[2][4];
            for (int i = 0; i < 4; i++) {
                const int8_t *r = rows[4 * j + i] + b;
                const __m512i z0 = _mm512_xor_si512(_mm512_loadu_si512(r), flip);
                const __m512i z1 = _mm512_xor_si512(_mm512_loadu_si512(r + 64), flip);
                const __m512i x = _mm512_shuffle_i64x2(z0, z1, 0x88);
                const __m512i y = _mm512_shuffle_i64x2(z0, z1, 0xDD);
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
}

/* Any gs that is a multiple of 16 (so D is too).  Per 64-byte segment of a
 * row (the last one masked), one vpdpbusd per (head, token); reduce4 and the
 * lane transpose give the sums of the segment's four 16-byte chunks for the
 * 16 tokens; chunks are added into the current group's sum, and a group's
 * term is added once its last chunk is in. */
SA_INLINE void scores_q8_block16(const int8_t *qq, const float *qd, int HB, int D, int gs,
                                 const int8_t *const *rows, const float *kd_t, __m512i idx,
                                 __m512 *res)
{
    const int ng = D / gs, cpg = gs / 16, nchunk = D / 16;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i gsum[2];
    for (int h = 0; h < HB; h++) {
        res[h] = _mm512_setzero_ps();
        gsum[h] = _mm512_setzero_si512();
    }
    for (int b = 0; b < D; b += 64) {
        const __mmask64 m = bytes64(D - b);
        __m512i qv[2], bias[2], quad[2][4];
        for (int h = 0; h < HB; h++) {
            qv[h] = _mm512_maskz_loadu_epi8(m, qq + (ptrdiff_t)h * D + b);
            bias[h] = offset_bias(qv[h]); /* masked bytes: q = 0, nothing to cancel */
        }
        for (int j = 0; j < 4; j++) {
            __m512i acc[2][4];
            for (int i = 0; i < 4; i++) {
                const __m512i z =
                    _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, rows[4 * j + i] + b), flip);
                for (int h = 0; h < HB; h++)
                    acc[h][i] = _mm512_dpbusd_epi32(bias[h], z, qv[h]);
            }
            for (int h = 0; h < HB; h++)
                quad[h][j] = reduce4_epi32(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
        }
        __m512i chunk[2][4];
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
                                __m512 *res)
{
    if (gs == 32 && D % 128 == 0) {
        scores_q8_block32(qq, qd, HB, D, rows, srows, res);
        return;
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i idx = _mm512_mullo_epi32(_mm512_min_epi32(lane, _mm512_set1_epi32(cnt - 1)),
                                           _mm512_set1_epi32((int)scale_stride));
    scores_q8_block16(qq, qd, HB, D, gs, rows, kd_t, idx, res);
}

/* -------------------------------------------------------------------------
 * softmax_exp
 * ---------------------------------------------------------------------- */

/* exp(x) for a vector: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite, two
 * constants), e^r by the Cephes expf polynomial (< 1 ulp on that range),
 * then vscalefps multiplies by 2^n with a single rounding (subnormals, 0 and
 * inf come out right).  x is clamped to [-104, 89] first so r stays small:
 * e^-104 rounds to 0 and e^89 overflows to inf; never NaN for finite x,
 * NaN for NaN. */
SA_INLINE __m512 exp_ps(__m512 x)
{
    /* constant first: a NaN x stays NaN (the second operand wins) */
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* 16 floats added into two 8-double accumulators. */
SA_INLINE void add_pd16(__m512d *s0, __m512d *s1, __m512 e)
{
    *s0 = _mm512_add_pd(*s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    *s1 = _mm512_add_pd(
        *s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
}

/* Two passes: the max, then exp(scale * (s - max)) written back while the
 * sum runs in double lanes (as accurate as the portable double sum), reduced
 * in a fixed order. */
static float softmax_exp_avx512_vnni(float *s, int n, float scale)
{
    if (n <= 0)
        return 0.0f;
    const int nv = n & ~15;
    const __mmask16 tm = lanes16(n & 15);
    __m512 mv = _mm512_set1_ps(-__builtin_inff());
    for (int t = 0; t < nv; t += 16)
        mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
    if (tm)
        mv = _mm512_mask_max_ps(mv, tm, mv, _mm512_maskz_loadu_ps(tm, s + nv));
    __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(mv),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(mv), 1)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float m = _mm_cvtss_f32(m4);

    const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(m);
    __m512d sum0 = _mm512_setzero_pd(), sum1 = _mm512_setzero_pd();
    for (int t = 0; t < nv; t += 16) {
        const __m512 e = exp_ps(_mm512_mul_ps(vs, _mm512_sub_ps(_mm512_loadu_ps(s + t), vm)));
        _mm512_storeu_ps(s + t, e);
        add_pd16(&sum0, &sum1, e);
    }
    if (tm) {
        const __m512 x = _mm512_maskz_loadu_ps(tm, s + nv);
        const __m512 e =
            _mm512_maskz_mov_ps(tm, exp_ps(_mm512_mul_ps(vs, _mm512_sub_ps(x, vm))));
        _mm512_mask_storeu_ps(s + nv, tm, e);
        add_pd16(&sum0, &sum1, e); /* unused lanes add 0 */
    }
    const __m512d s8 = _mm512_add_pd(sum0, sum1);
    const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
    const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return (float)_mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}

/* -------------------------------------------------------------------------
 * accumulate_v_f32
 * ---------------------------------------------------------------------- */

/* out[h][d .. d + 16*NC) for HB heads over tokens [t0, t1): accumulators
 * stay in registers, one FMA per (head, 16 lanes, token) in token order.
 * The last vector is masked by m (all ones when D allows). */
SA_INLINE void accv_f32_tile(float *const *out, const float *const *p, int HB, int NC,
                             __mmask16 m, const float *v, ptrdiff_t row_stride, int t0, int t1,
                             int d)
{
    __m512 acc[4][4];
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NC; c++)
            acc[h][c] = c == NC - 1 ? _mm512_maskz_loadu_ps(m, out[h] + d + 16 * c)
                                    : _mm512_loadu_ps(out[h] + d + 16 * c);
    for (int t = t0; t < t1; t++) {
        const float *row = v + (ptrdiff_t)t * row_stride + d;
        __m512 vv[4];
        for (int c = 0; c < NC; c++)
            vv[c] = c == NC - 1 ? _mm512_maskz_loadu_ps(m, row + 16 * c)
                                : _mm512_loadu_ps(row + 16 * c);
        for (int h = 0; h < HB; h++) {
            const __m512 w = _mm512_set1_ps(p[h][t]);
            for (int c = 0; c < NC; c++)
                acc[h][c] = _mm512_fmadd_ps(w, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NC; c++) {
            if (c == NC - 1)
                _mm512_mask_storeu_ps(out[h] + d + 16 * c, m, acc[h][c]);
            else
                _mm512_storeu_ps(out[h] + d + 16 * c, acc[h][c]);
        }
}

/* All of D for HB heads: 64-float tiles, then 16-float ones, then the
 * masked remainder. */
SA_INLINE void accv_f32_heads(float *const *out, const float *const *p, int HB, int D,
                              const float *v, ptrdiff_t row_stride, int t0, int t1)
{
    int d = 0;
    for (; d + 64 <= D; d += 64)
        accv_f32_tile(out, p, HB, 4, 0xFFFF, v, row_stride, t0, t1, d);
    for (; d + 16 <= D; d += 16)
        accv_f32_tile(out, p, HB, 1, 0xFFFF, v, row_stride, t0, t1, d);
    if (d < D)
        accv_f32_tile(out, p, HB, 1, lanes16(D - d), v, row_stride, t0, t1, d);
}

/* -------------------------------------------------------------------------
 * accumulate_v_q8
 * ---------------------------------------------------------------------- */

#define V_HEADS 4

/* 16 int8 -> 16 floats (exact). */
SA_INLINE __m512 load16_s8_ps(const int8_t *x)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x)));
}

/* 16 int8 of a V row times their group's scale: the dequantised floats
 * (one rounding, as sa_dequantize_rows). */
#define SA_DQ16(row, rd, g) _mm512_mul_ps(_mm512_set1_ps((rd)[g]), load16_s8_ps(row))

/* out[h][d .. d + 64) for HB (1, 2 or 4) heads over tokens [t0, t1).  gs is
 * a multiple of 16, so each 16-lane slice lies in one group; each token's 64
 * values are dequantised once for the heads, then added as accv_f32_tile
 * adds a float row. */
SA_INLINE void accv_q8_tile64(float *const *out, const float *const *p, int HB, int gs,
                              const int8_t *v, const float *vd, ptrdiff_t row_stride,
                              ptrdiff_t scale_stride, int t0, int t1, int d)
{
    const int g0 = d / gs, g1 = (d + 16) / gs, g2 = (d + 32) / gs, g3 = (d + 48) / gs;
    __m512 a0[V_HEADS], a1[V_HEADS], a2[V_HEADS], a3[V_HEADS];
    for (int h = 0; h < HB; h++) {
        a0[h] = _mm512_loadu_ps(out[h] + d), a1[h] = _mm512_loadu_ps(out[h] + d + 16);
        a2[h] = _mm512_loadu_ps(out[h] + d + 32), a3[h] = _mm512_loadu_ps(out[h] + d + 48);
    }
    for (int t = t0; t < t1; t++) {
        const int8_t *row = v + (ptrdiff_t)t * row_stride + d;
        const float *rd = vd + (ptrdiff_t)t * scale_stride;
        const __m512 v0 = SA_DQ16(row, rd, g0), v1 = SA_DQ16(row + 16, rd, g1);
        const __m512 v2 = SA_DQ16(row + 32, rd, g2), v3 = SA_DQ16(row + 48, rd, g3);
        for (int h = 0; h < HB; h++) {
            const __m512 w = _mm512_set1_ps(p[h][t]);
            a0[h] = _mm512_fmadd_ps(w, v0, a0[h]);
            a1[h] = _mm512_fmadd_ps(w, v1, a1[h]);
            a2[h] = _mm512_fmadd_ps(w, v2, a2[h]);
            a3[h] = _mm512_fmadd_ps(w, v3, a3[h]);
        }
    }
    for (int h = 0; h < HB; h++) {
        _mm512_storeu_ps(out[h] + d, a0[h]), _mm512_storeu_ps(out[h] + d + 16, a1[h]);
        _mm512_storeu_ps(out[h] + d + 32, a2[h]), _mm512_storeu_ps(out[h] + d + 48, a3[h]);
    }
}

/* The same for one 16-lane slice (D % 64 leftovers). */
SA_INLINE void accv_q8_tile16(float *const *out, const float *const *p, int HB, int gs,
                              const int8_t *v, const float *vd, ptrdiff_t row_stride,
                              ptrdiff_t scale_stride, int t0, int t1, int d)
{
    const int g0 = d / gs;
    for (int h = 0; h < HB; h++) {
        __m512 a = _mm512_loadu_ps(out[h] + d);
        for (int t = t0; t < t1; t++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(p[h][t]),
                                SA_DQ16(v + (ptrdiff_t)t * row_stride + d,
                                        vd + (ptrdiff_t)t * scale_stride, g0), a);
        _mm512_storeu_ps(out[h] + d, a);
    }
}

SA_INLINE void accv_q8_heads(float *const *out, const float *const *p, int HB, int D, int gs,
                             const int8_t *v, const float *vd, ptrdiff_t row_stride,
                             ptrdiff_t scale_stride, int t0, int t1)
{
    int d = 0;
    for (; d + 64 <= D; d += 64)
        accv_q8_tile64(out, p, HB, gs, v, vd, row_stride, scale_stride, t0, t1, d);
    for (; d < D; d += 16)
        accv_q8_tile16(out, p, HB, gs, v, vd, row_stride, scale_stride, t0, t1, d);
}

/* gs a multiple of 16: each 16-lane slice lies in one group. */
SA_INLINE int accv_q8_takes(int gs) { return gs % 16 == 0; }

/* -------------------------------------------------------------------------
 * stream_sum: the bandwidth probe, 64-byte loads into four accumulators.
 * ---------------------------------------------------------------------- */

static uint64_t stream_sum_avx512_vnni(const uint64_t *buf, size_t n_words)
{
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 32 <= n_words; i += 32) {
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(buf + i));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(buf + i + 8));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(buf + i + 16));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(buf + i + 24));
    }
    uint64_t lanes[8];
    _mm512_storeu_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(a0, a1),
                                                _mm512_add_epi64(a2, a3)));
    uint64_t sum = 0;
    for (int j = 0; j < 8; j++)
        sum += lanes[j];
    for (; i < n_words; i++)
        sum += buf[i];
    return sum;
}

#include "x86_common.h"
