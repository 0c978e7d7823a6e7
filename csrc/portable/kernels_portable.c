/*
 * Portable kernels: plain C the compiler can vectorise, always built, always
 * the path the SIMD variants are tested against.
 *
 * Float dots keep SA_LANES independent partial sums reduced by a fixed tree,
 * which lets the compiler use vector registers without reassociating (no
 * -ffast-math) and keeps the result independent of the caller's batching.
 */
#include <math.h>

#include "../kernels.h"

/* The q8 kernels and Quest's bound: their loops are shared with the SIMD
 * files' fallbacks, here with a plain multiply-add (two roundings). */
#define SA_MULADD(a, b, c) ((c) + (a) * (b))
#define SA_SCALAR_FN(kernel) kernel##_portable
#define SA_Q8_V_SCALED 0 /* q8 V: the scale in the weight (kernels.h) */
#include "../scalar_kernels.h"

#define SA_LANES 8

static float dot_f32(const float *a, const float *b, int n)
{
    float acc[SA_LANES] = {0};
    int i = 0;
    for (; i + SA_LANES <= n; i += SA_LANES)
        for (int j = 0; j < SA_LANES; j++)
            acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++)
        acc[0] += a[i] * b[i];
    float s01 = acc[0] + acc[1], s23 = acc[2] + acc[3];
    float s45 = acc[4] + acc[5], s67 = acc[6] + acc[7];
    return (s01 + s23) + (s45 + s67);
}

static void scores_f32_portable(const float *q, int G, int D, const float *k,
                                ptrdiff_t row_stride, int n, float *const *s,
                                const sa_prefetch *pf)
{
    for (int t = 0; t < n; t++) {
        sa_prefetch_part(pf, t, n);
        const float *row = k + (ptrdiff_t)t * row_stride;
        for (int g = 0; g < G; g++)
            s[g][t] = dot_f32(q + (ptrdiff_t)g * D, row, D);
    }
}

/* GEMM form (kernels.h): per query vector and panel, SA_LANES keys' chains
 * side by side over the channels, a plain multiply-add each. */
enum { panel_keys_portable = SA_LANES };

static void scores_f32_panels_portable(const float *q, int G, int D, const float *kt,
                                       int first, int n, float *const *s)
{
    const int64_t end = (int64_t)first + n;
    for (int64_t p = 0; p * SA_LANES < end; p++) {
        const float *kp = kt + (ptrdiff_t)p * D * SA_LANES;
        const int64_t at = p * SA_LANES - first; /* the panel's key 0 in s[g] */
        for (int g = 0; g < G; g++) {
            const float *qg = q + (ptrdiff_t)g * D;
            float acc[SA_LANES] = {0};
            for (int d = 0; d < D; d++)
                for (int j = 0; j < SA_LANES; j++)
                    acc[j] += qg[d] * kp[(ptrdiff_t)d * SA_LANES + j];
            for (int j = 0; j < SA_LANES; j++)
                if (at + j >= 0 && at + j < n)
                    s[g][at + j] = acc[j];
        }
    }
}

/* scores_q8 in GEMM form (kernels.h): per query vector, panel and group,
 * the SA_LANES keys' exact int32 sums side by side, then each key's group
 * term added as scores_q8 adds it. */
enum { q8_panel_keys_portable = SA_LANES };

static void scores_q8_panels_portable(const int8_t *qq, const float *qd, int G, int D, int gs,
                                      const int8_t *k8, const float *kd, int first, int n,
                                      float *const *s)
{
    const int ng = D / gs;
    const int64_t end = (int64_t)first + n;
    for (int64_t p = 0; p * SA_LANES < end; p++) {
        const int8_t *kp = k8 + (ptrdiff_t)p * D * SA_LANES;
        const float *dp = kd + (ptrdiff_t)p * ng * SA_LANES;
        const int64_t at = p * SA_LANES - first;
        for (int g = 0; g < G; g++) {
            const int8_t *a = qq + (ptrdiff_t)g * D;
            float acc[SA_LANES] = {0};
            for (int grp = 0; grp < ng; grp++) {
                int32_t isum[SA_LANES] = {0};
                for (int i = grp * gs; i < (grp + 1) * gs; i++) {
                    const int8_t *col = kp + (ptrdiff_t)(i & ~3) * SA_LANES + (i & 3);
                    for (int j = 0; j < SA_LANES; j++)
                        isum[j] += (int32_t)a[i] * (int32_t)col[4 * j];
                }
                const float w = qd[(ptrdiff_t)g * ng + grp];
                for (int j = 0; j < SA_LANES; j++)
                    acc[j] = SA_MULADD(w * dp[grp * SA_LANES + j], (float)isum[j], acc[j]);
            }
            for (int j = 0; j < SA_LANES; j++)
                if (at + j >= 0 && at + j < n)
                    s[g][at + j] = acc[j];
        }
    }
}

/* The maximum ignores NaN (a NaN score then gives a NaN weight, and the
 * sum is NaN: every ISA propagates it the same way); max_out does not. */
static float softmax_exp_portable(float *s, int n, float scale, float *max_out)
{
    float m = s[0];
    int nan = s[0] != s[0];
    for (int t = 1; t < n; t++) {
        m = s[t] > m ? s[t] : m;
        nan |= s[t] != s[t];
    }
    if (max_out)
        *max_out = nan ? NAN : m;
    double sum = 0.0;
    for (int t = 0; t < n; t++) {
        s[t] = expf(scale * (s[t] - m));
        sum += s[t];
    }
    return (float)sum;
}

static void accumulate_v_f32_portable(float *const *out, const float *const *p, int G, int D,
                                      const float *v, ptrdiff_t row_stride, int n,
                                      const sa_prefetch *pf)
{
    for (int t = 0; t < n; t++) {
        sa_prefetch_part(pf, t, n);
        const float *row = v + (ptrdiff_t)t * row_stride;
        for (int g = 0; g < G; g++) {
            const float w = p[g][t];
            float *o = out[g];
            for (int d = 0; d < D; d++)
                o[d] += w * row[d];
        }
    }
}

/* A wrapping sum of 64-bit words; eight independent sums let the compiler
 * vectorise with the baseline ISA. */
static uint64_t stream_sum_portable(const uint64_t *buf, size_t n_words)
{
    uint64_t acc[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n_words; i += 8)
        for (int j = 0; j < 8; j++)
            acc[j] += buf[i + j];
    for (; i < n_words; i++)
        acc[0] += buf[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

enum { q8_v_scaled_portable = SA_Q8_V_SCALED };

SA_DEFINE_KERNELS(portable);
