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

SA_DEFINE_KERNELS(portable);
