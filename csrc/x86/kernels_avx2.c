/*
 * AVX2 + FMA kernels (x86-64 v3).  Compiled with the same flags as the rest
 * of the extension: the pragma below, not the command line, lets this one
 * file use AVX2/FMA, and cpu_features.c only hands the table out when the CPU
 * and OS support it.
 *
 * Batching rule (kernels.h): a kernel may share loads between heads and
 * tokens, but the operations that produce one (head, token) result never
 * depend on the batch.  Here every token of a block goes through the same
 * code: a short last block repeats its last row in the unused slots (no read
 * past row n-1) and stores only the valid results, so there is no separate
 * "tail token" path whose rounding could differ.  Heads are blocked the
 * same way: each head's accumulators see the same operations whatever the
 * block size.
 *
 * Tails along D use masked loads/stores (vmaskmov never touches the masked
 * lanes' memory), so nothing outside [0, D) of a row or [0, n) of the rows
 * is read or written.
 */
#pragma GCC target("avx2,fma")
/* GCC implements _mm256_mul_ps/_mm256_add_ps as plain vector operators, so
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
#define SA_ISA_ID avx2
#define SA_VT 8
typedef __m256 sa_vres;
#define SA_V_HEADS 2

/* -------------------------------------------------------------------------
 * Small helpers
 * ---------------------------------------------------------------------- */

/* The first r (0..8) lanes set. */
static const int32_t tail_tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

SA_INLINE __m256i tail_mask(int r)
{
    return _mm256_loadu_si256((const __m256i *)(tail_tab + 8 - r));
}

/* The first cnt of 8 results (vmaskmov stores are slow on AMD: only for a
 * short last block). */
SA_INLINE void store_scores(float *dst, int cnt, __m256 x)
{
    if (cnt == 8)
        _mm256_storeu_ps(dst, x);
    else
        _mm256_maskstore_ps(dst, tail_mask(cnt), x);
}

/* Four per-token vectors of partial sums -> in each 128-bit half, lane i is
 * token i's (x0 + x2) + (x1 + x3) of that half.  Float: the order is fixed. */
SA_INLINE __m256 reduce4_ps(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    const __m256 s01 = _mm256_add_ps(
        _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a0), _mm256_castps_pd(a1))),
        _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a0), _mm256_castps_pd(a1))));
    const __m256 s23 = _mm256_add_ps(
        _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a2), _mm256_castps_pd(a3))),
        _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a2), _mm256_castps_pd(a3))));
    return _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x88), _mm256_shuffle_ps(s01, s23, 0xDD));
}

/* Two reduce4_ps results (tokens 0-3 and 4-7) -> the 8 token sums, low half
 * + high half. */
SA_INLINE __m256 reduce_halves_ps(__m256 r0, __m256 r1)
{
    return _mm256_add_ps(_mm256_permute2f128_ps(r0, r1, 0x20),
                         _mm256_permute2f128_ps(r0, r1, 0x31));
}

/* -------------------------------------------------------------------------
 * scores_f32: 8 tokens per block, their dots reduced together.
 * ---------------------------------------------------------------------- */

/* HB (1 to SA_S_HEADS = 3) heads x 8 rows, in two groups of 4 rows.  Each
 * (head, token) keeps one 8-lane FMA accumulator over D (the D % 8 tail
 * through a masked load, zero lanes add nothing), then reduce4_ps /
 * reduce_halves_ps.  Per 8 channels the heads' query vectors are loaded
 * first and each row once: 3 heads x 4 rows are 12 independent FMA chains
 * on 7 loads, enough to keep both FMA pipes busy when many query rows share
 * the keys (prefill); the arithmetic of one (head, token) is the same for
 * any HB. */
#define SA_S_HEADS 3
SA_INLINE void scores_f32_block(const float *q, int HB, int D, const float *const *rows,
                                __m256 *res)
{
    const int dv = D & ~7, rem = D & 7;
    const __m256i tm = tail_mask(rem);
    __m256 half[SA_S_HEADS][2];
    for (int j = 0; j < 2; j++) {
        const float *const *r = rows + 4 * j;
        __m256 acc[SA_S_HEADS][4];
        for (int h = 0; h < HB; h++)
            for (int i = 0; i < 4; i++)
                acc[h][i] = _mm256_setzero_ps();
        for (int d = 0; d < dv; d += 8) {
            __m256 qv[SA_S_HEADS];
            for (int h = 0; h < HB; h++) {
                qv[h] = _mm256_loadu_ps(q + (ptrdiff_t)h * D + d);
                SA_KEEP(qv[h]);
            }
            for (int i = 0; i < 4; i++) {
                __m256 kv = _mm256_loadu_ps(r[i] + d);
                SA_KEEP(kv);
                for (int h = 0; h < HB; h++)
                    acc[h][i] = _mm256_fmadd_ps(qv[h], kv, acc[h][i]);
            }
        }
        if (rem) {
            __m256 qv[SA_S_HEADS];
            for (int h = 0; h < HB; h++)
                qv[h] = _mm256_maskload_ps(q + (ptrdiff_t)h * D + dv, tm);
            for (int i = 0; i < 4; i++) {
                const __m256 kv = _mm256_maskload_ps(r[i] + dv, tm);
                for (int h = 0; h < HB; h++)
                    acc[h][i] = _mm256_fmadd_ps(qv[h], kv, acc[h][i]);
            }
        }
        for (int h = 0; h < HB; h++)
            half[h][j] = reduce4_ps(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    }
    for (int h = 0; h < HB; h++)
        res[h] = reduce_halves_ps(half[h][0], half[h][1]);
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

/* Group g of HB (1 or 2) heads against 4 rows: each (head, row) gets 8 int32
 * lanes, and the 4 rows' lanes are reduced together (the unpack/shuffle
 * tree of reduce4_ps, integer so exact). */
SA_INLINE void dot_group4_s8(const int8_t *const *qh, int HB, const int8_t *const *rows, int off,
                             int nc, __m256i *half)
{
    __m256i acc[2][4];
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

/* HB heads x one block of 8 rows: per group, the 8 tokens' exact int32 sums
 * side by side, then the group term (qd * kd) * isum added in group order,
 * the portable kernel's operations (so the scores are bitwise the portable
 * ones).  srow[i] are the tokens' scale rows (slots past n repeat the last
 * row, like rows). */
SA_INLINE void scores_q8_block(const int8_t *qq, const float *qd, int HB, int D, int gs,
                               const int8_t *const *rows, const float *const *srow, __m256 *res)
{
    const int ng = D / gs, nc = gs / 32;
    const int8_t *qh[2] = {qq, qq + (HB > 1 ? D : 0)};
    for (int h = 0; h < HB; h++)
        res[h] = _mm256_setzero_ps();
    __m256 kd4[4];
    for (int g = 0; g < ng; g++) {
        __m256i lo[2], hi[2];
        dot_group4_s8(qh, HB, rows, g * gs, nc, lo);
        dot_group4_s8(qh, HB, rows + 4, g * gs, nc, hi);
        if (g % 4 == 0 && g + 4 <= ng)
            scales_8x4(srow, g, kd4);
        const __m256 kdg = g < (ng & ~3) ? kd4[g % 4]
                                         : _mm256_setr_ps(srow[0][g], srow[1][g], srow[2][g],
                                                          srow[3][g], srow[4][g], srow[5][g],
                                                          srow[6][g], srow[7][g]);
        for (int h = 0; h < HB; h++) {
            const __m256i isum = _mm256_add_epi32(_mm256_permute2x128_si256(lo[h], hi[h], 0x20),
                                                  _mm256_permute2x128_si256(lo[h], hi[h], 0x31));
            const __m256 w = _mm256_mul_ps(_mm256_set1_ps(qd[h * ng + g]), kdg);
            res[h] = _mm256_add_ps(res[h], _mm256_mul_ps(w, _mm256_cvtepi32_ps(isum)));
        }
    }
}

/* gs a multiple of 32 (the dot works on 32-byte chunks of one group). */
SA_INLINE int q8_takes(int gs, int D, ptrdiff_t scale_stride)
{
    (void)D, (void)scale_stride;
    return gs % 32 == 0;
}

SA_INLINE void scores_q8_tokens(const int8_t *qq, const float *qd, int HB, int D, int gs,
                                const int8_t *const *rows, const float *const *srows,
                                const float *kd_t, ptrdiff_t scale_stride, int cnt,
                                __m256 *res)
{
    (void)kd_t, (void)scale_stride, (void)cnt;
    scores_q8_block(qq, qd, HB, D, gs, rows, srows, res);
}

/* -------------------------------------------------------------------------
 * softmax_exp
 * ---------------------------------------------------------------------- */

/* exp(x) for a vector: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite, two
 * constants), e^r by the Cephes expf polynomial (< 1 ulp on that range),
 * times 2^n built in two halves so results down to the subnormals (and 0
 * below them) come out with a single rounding.  x is clamped to
 * [-104, 89]: e^-104 rounds to 0, e^89 overflows to inf; never NaN for
 * finite input, and NaN for NaN. */
SA_INLINE __m256 exp_ps(__m256 x)
{
    /* constant first: maxps/minps return their second operand when one is
     * NaN, so a NaN x stays NaN (and its softmax sum NaN, as in portable). */
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    /* n in [-150, 128]: 2^n = 2^n1 * 2^n2 with both halves normal. */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

/* Two passes: the max, then exp(scale * (s - max)) written back while the
 * sum runs in double lanes (as accurate as the portable double sum), reduced
 * in a fixed order. */
static float softmax_exp_avx2(float *s, int n, float scale)
{
    if (n <= 0)
        return 0.0f;
    const int nv = n & ~7, rem = n & 7;
    const __m256i tm = tail_mask(rem);
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    __m256 mv = ninf;
    for (int t = 0; t < nv; t += 8)
        mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    if (rem)
        mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_maskload_ps(s + nv, tm),
                                                 _mm256_castsi256_ps(tm)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float m = _mm_cvtss_f32(m4);

    const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(m);
    __m256d sum0 = _mm256_setzero_pd(), sum1 = _mm256_setzero_pd();
    for (int t = 0; t < nv; t += 8) {
        const __m256 e = exp_ps(_mm256_mul_ps(vs, _mm256_sub_ps(_mm256_loadu_ps(s + t), vm)));
        _mm256_storeu_ps(s + t, e);
        sum0 = _mm256_add_pd(sum0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        sum1 = _mm256_add_pd(sum1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    if (rem) {
        __m256 e = exp_ps(_mm256_mul_ps(vs, _mm256_sub_ps(_mm256_maskload_ps(s + nv, tm), vm)));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(tm)); /* unused lanes add 0 */
        _mm256_maskstore_ps(s + nv, tm, e);
        sum0 = _mm256_add_pd(sum0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        sum1 = _mm256_add_pd(sum1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    const __m256d s4 = _mm256_add_pd(sum0, sum1);
    const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return (float)_mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}

/* -------------------------------------------------------------------------
 * accumulate_v_f32
 * ---------------------------------------------------------------------- */

/* out[h][d .. d + 8*NC) for HB heads over tokens [t0, t1): accumulators
 * stay in registers, one FMA per (head, 8 lanes, token) in token order.  The
 * last vector is masked when `masked`. */
SA_INLINE void accv_f32_tile(float *const *out, const float *const *p, int HB, int NC,
                             int masked, __m256i tm, const float *v, ptrdiff_t row_stride,
                             int t0, int t1, int d)
{
    __m256 acc[2][4];
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NC; c++)
            acc[h][c] = masked && c == NC - 1 ? _mm256_maskload_ps(out[h] + d + 8 * c, tm)
                                              : _mm256_loadu_ps(out[h] + d + 8 * c);
    for (int t = t0; t < t1; t++) {
        const float *row = v + (ptrdiff_t)t * row_stride + d;
        __m256 vv[4];
        for (int c = 0; c < NC; c++)
            vv[c] = masked && c == NC - 1 ? _mm256_maskload_ps(row + 8 * c, tm)
                                          : _mm256_loadu_ps(row + 8 * c);
        for (int h = 0; h < HB; h++) {
            const __m256 w = _mm256_broadcast_ss(p[h] + t);
            for (int c = 0; c < NC; c++)
                acc[h][c] = _mm256_fmadd_ps(w, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < NC; c++) {
            if (masked && c == NC - 1)
                _mm256_maskstore_ps(out[h] + d + 8 * c, tm, acc[h][c]);
            else
                _mm256_storeu_ps(out[h] + d + 8 * c, acc[h][c]);
        }
}

/* Columns [d, D) for HB heads: 32-float tiles, then 8-float ones, then the
 * masked remainder. */
SA_INLINE void accv_f32_cols(float *const *out, const float *const *p, int HB, int d, int D,
                             const float *v, ptrdiff_t row_stride, int t0, int t1)
{
    for (; d + 32 <= D; d += 32)
        accv_f32_tile(out, p, HB, 4, 0, _mm256_setzero_si256(), v, row_stride, t0, t1, d);
    for (; d + 8 <= D; d += 8)
        accv_f32_tile(out, p, HB, 1, 0, _mm256_setzero_si256(), v, row_stride, t0, t1, d);
    if (d < D)
        accv_f32_tile(out, p, HB, 1, 1, tail_mask(D - d), v, row_stride, t0, t1, d);
}

SA_INLINE void accv_f32_heads(float *const *out, const float *const *p, int HB, int D,
                              const float *v, ptrdiff_t row_stride, int t0, int t1)
{
    accv_f32_cols(out, p, HB, 0, D, v, row_stride, t0, t1);
}

/* Many heads (prefill): SA_V_WIDE = 6 heads x 16 columns, 12 accumulators,
 * each token's 16 values loaded once (SA_KEEP) for the 6 heads: 8 loads
 * per 12 FMAs instead of 10 per 8.  The same per-element FMA in token order
 * as accv_f32_tile; the D % 16 columns go through it. */
#define SA_V_WIDE 6
SA_INLINE void accv_f32_wide(float *const *out, const float *const *p, int D, const float *v,
                             ptrdiff_t row_stride, int t0, int t1)
{
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 a[SA_V_WIDE][2];
        for (int h = 0; h < SA_V_WIDE; h++) {
            a[h][0] = _mm256_loadu_ps(out[h] + d);
            a[h][1] = _mm256_loadu_ps(out[h] + d + 8);
        }
        for (int t = t0; t < t1; t++) {
            const float *row = v + (ptrdiff_t)t * row_stride + d;
            __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
            SA_KEEP(v0);
            SA_KEEP(v1);
            for (int h = 0; h < SA_V_WIDE; h++) {
                const __m256 w = _mm256_broadcast_ss(p[h] + t);
                a[h][0] = _mm256_fmadd_ps(w, v0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(w, v1, a[h][1]);
            }
        }
        for (int h = 0; h < SA_V_WIDE; h++) {
            _mm256_storeu_ps(out[h] + d, a[h][0]);
            _mm256_storeu_ps(out[h] + d + 8, a[h][1]);
        }
    }
    if (d < D)
        for (int h = 0; h < SA_V_WIDE; h += 2)
            accv_f32_cols(out + h, p + h, 2, d, D, v, row_stride, t0, t1);
}

/* -------------------------------------------------------------------------
 * accumulate_v_q8
 * ---------------------------------------------------------------------- */

/* 8 int8 of a V row times their group's scale: the dequantised floats
 * (one rounding, as sa_dequantize_rows). */
#define SA_DQ8(row, rd, g) _mm256_mul_ps(_mm256_broadcast_ss((rd) + (g)), load8_s8_ps(row))

/* out[h][d .. d + 32) for HB (1 or 2) heads over tokens [t0, t1).  gs is a
 * multiple of 8, so each 8-lane slice lies in one group; each token's 32
 * values are dequantised once for the heads, then added as accv_f32_tile
 * adds a float row.  Accumulators are named variables: GCC keeps them in
 * registers. */
SA_INLINE void accv_q8_tile32(float *const *out, const float *const *p, int HB, int gs,
                              const int8_t *v, const float *vd, ptrdiff_t row_stride,
                              ptrdiff_t scale_stride, int t0, int t1, int d)
{
    const int g0 = d / gs, g1 = (d + 8) / gs, g2 = (d + 16) / gs, g3 = (d + 24) / gs;
    float *o0 = out[0] + d, *o1 = out[HB > 1 ? 1 : 0] + d;
    const float *p0 = p[0], *p1 = p[HB > 1 ? 1 : 0];
    __m256 a00 = _mm256_loadu_ps(o0), a01 = _mm256_loadu_ps(o0 + 8);
    __m256 a02 = _mm256_loadu_ps(o0 + 16), a03 = _mm256_loadu_ps(o0 + 24);
    __m256 a10 = a00, a11 = a01, a12 = a02, a13 = a03;
    if (HB > 1) {
        a10 = _mm256_loadu_ps(o1), a11 = _mm256_loadu_ps(o1 + 8);
        a12 = _mm256_loadu_ps(o1 + 16), a13 = _mm256_loadu_ps(o1 + 24);
    }
    for (int t = t0; t < t1; t++) {
        const int8_t *row = v + (ptrdiff_t)t * row_stride + d;
        const float *rd = vd + (ptrdiff_t)t * scale_stride;
        const __m256 v0 = SA_DQ8(row, rd, g0), v1 = SA_DQ8(row + 8, rd, g1);
        const __m256 v2 = SA_DQ8(row + 16, rd, g2), v3 = SA_DQ8(row + 24, rd, g3);
        const __m256 w0 = _mm256_broadcast_ss(p0 + t);
        a00 = _mm256_fmadd_ps(w0, v0, a00), a01 = _mm256_fmadd_ps(w0, v1, a01);
        a02 = _mm256_fmadd_ps(w0, v2, a02), a03 = _mm256_fmadd_ps(w0, v3, a03);
        if (HB > 1) {
            const __m256 w1 = _mm256_broadcast_ss(p1 + t);
            a10 = _mm256_fmadd_ps(w1, v0, a10), a11 = _mm256_fmadd_ps(w1, v1, a11);
            a12 = _mm256_fmadd_ps(w1, v2, a12), a13 = _mm256_fmadd_ps(w1, v3, a13);
        }
    }
    _mm256_storeu_ps(o0, a00), _mm256_storeu_ps(o0 + 8, a01);
    _mm256_storeu_ps(o0 + 16, a02), _mm256_storeu_ps(o0 + 24, a03);
    if (HB > 1) {
        _mm256_storeu_ps(o1, a10), _mm256_storeu_ps(o1 + 8, a11);
        _mm256_storeu_ps(o1 + 16, a12), _mm256_storeu_ps(o1 + 24, a13);
    }
}

/* The same for one 8-lane slice (D % 32 leftovers). */
SA_INLINE void accv_q8_tile8(float *const *out, const float *const *p, int HB, int gs,
                             const int8_t *v, const float *vd, ptrdiff_t row_stride,
                             ptrdiff_t scale_stride, int t0, int t1, int d)
{
    const int g0 = d / gs;
    for (int h = 0; h < HB; h++) {
        __m256 a = _mm256_loadu_ps(out[h] + d);
        for (int t = t0; t < t1; t++)
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(p[h] + t),
                                SA_DQ8(v + (ptrdiff_t)t * row_stride + d,
                                       vd + (ptrdiff_t)t * scale_stride, g0), a);
        _mm256_storeu_ps(out[h] + d, a);
    }
}

SA_INLINE void accv_q8_heads(float *const *out, const float *const *p, int HB, int D, int gs,
                             const int8_t *v, const float *vd, ptrdiff_t row_stride,
                             ptrdiff_t scale_stride, int t0, int t1)
{
    int d = 0;
    for (; d + 32 <= D; d += 32)
        accv_q8_tile32(out, p, HB, gs, v, vd, row_stride, scale_stride, t0, t1, d);
    for (; d < D; d += 8)
        accv_q8_tile8(out, p, HB, gs, v, vd, row_stride, scale_stride, t0, t1, d);
}

/* gs a multiple of 8: each 8-lane slice lies in one group. */
SA_INLINE int accv_q8_takes(int gs) { return gs % 8 == 0; }

/* -------------------------------------------------------------------------
 * stream_sum: the bandwidth probe, 32-byte loads into four accumulators.
 * ---------------------------------------------------------------------- */

static uint64_t stream_sum_avx2(const uint64_t *buf, size_t n_words)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 16 <= n_words; i += 16) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(buf + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(buf + i + 4)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(buf + i + 8)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(buf + i + 12)));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes,
                        _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
    uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n_words; i++)
        sum += buf[i];
    return sum;
}

#include "x86_common.h"
