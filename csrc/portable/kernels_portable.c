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

static float dot_q8(const int8_t *a, const float *da, const int8_t *b,
                    const float *db, int D, int gs)
{
    float acc = 0.0f;
    for (int g = 0, i0 = 0; i0 < D; g++, i0 += gs) {
        int32_t isum = 0;
        for (int i = i0; i < i0 + gs; i++)
            isum += (int32_t)a[i] * (int32_t)b[i];
        acc += (da[g] * db[g]) * (float)isum;
    }
    return acc;
}

static void scores_q8_portable(const int8_t *qq, const float *qd, int G, int D, int gs,
                               const int8_t *k, const float *kd, ptrdiff_t row_stride,
                               ptrdiff_t scale_stride, int n, float *const *s,
                               const sa_prefetch *pf)
{
    const int ng = D / gs;
    for (int t = 0; t < n; t++) {
        sa_prefetch_part(pf, t, n);
        const int8_t *row = k + (ptrdiff_t)t * row_stride;
        const float *rd = kd + (ptrdiff_t)t * scale_stride;
        for (int g = 0; g < G; g++)
            s[g][t] = dot_q8(qq + (ptrdiff_t)g * D, qd + (ptrdiff_t)g * ng, row, rd, D, gs);
    }
}

/* The maximum ignores NaN (a NaN score then gives a NaN weight, and the
 * sum is NaN: every ISA propagates it the same way). */
static float softmax_exp_portable(float *s, int n, float scale)
{
    float m = s[0];
    for (int t = 1; t < n; t++)
        m = s[t] > m ? s[t] : m;
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

static void accumulate_v_q8_portable(float *const *out, const float *const *p, int G, int D,
                                     int gs, const int8_t *v, const float *vd,
                                     ptrdiff_t row_stride, ptrdiff_t scale_stride, int n,
                                     const sa_prefetch *pf)
{
    for (int t = 0; t < n; t++) {
        sa_prefetch_part(pf, t, n);
        const int8_t *row = v + (ptrdiff_t)t * row_stride;
        const float *rd = vd + (ptrdiff_t)t * scale_stride;
        for (int g = 0; g < G; g++) {
            const float w = p[g][t];
            float *o = out[g];
            for (int d0 = 0, grp = 0; d0 < D; d0 += gs, grp++) {
                const float sc = rd[grp];
                for (int d = d0; d < d0 + gs; d++)
                    o[d] += w * (sc * (float)row[d]);
            }
        }
    }
}

static void minmax_scores_portable(const float *qp, const float *qn, int G, int D, int gs,
                          const int8_t *mn, const int8_t *mx, const float *sc,
                          ptrdiff_t block_stride, int n, float *const *s)
{
    const ptrdiff_t sc_stride = block_stride / gs;
    for (int b = 0; b < n; b++) {
        const int8_t *lo = mn + (ptrdiff_t)b * block_stride;
        const int8_t *hi = mx + (ptrdiff_t)b * block_stride;
        const float *scale = sc + (ptrdiff_t)b * sc_stride;
        for (int g = 0; g < G; g++) {
            const float *p = qp + (ptrdiff_t)g * D, *m = qn + (ptrdiff_t)g * D;
            float acc = 0.0f;
            for (int i0 = 0, grp = 0; i0 < D; i0 += gs, grp++) {
                float part = 0.0f;
                for (int i = i0; i < i0 + gs; i++)
                    part += m[i] * (float)lo[i] + p[i] * (float)hi[i];
                acc += scale[grp] * part;
            }
            s[g][b] = acc;
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
