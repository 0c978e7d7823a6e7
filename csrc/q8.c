/* SPEC §4: symmetric int8 per group, the ggml q8_0 recipe with a float32 scale. */
#include <math.h>
#include <string.h>

#include "internal.h"

void sa_quantize_row(const float *x, int dim, int gs, int8_t *q, float *scales)
{
    for (int g = 0, i0 = 0; i0 < dim; g++, i0 += gs) {
        float amax = 0.0f;
        for (int i = i0; i < i0 + gs; i++) {
            const float a = fabsf(x[i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int i = i0; i < i0 + gs; i++) {
            float r = roundf(x[i] * id);
            /* x * id can land a hair above 127; NaN never reaches here from
             * the API (inputs are checked), but must not become UB either. */
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            q[i] = r == r ? (int8_t)r : 0;
        }
        scales[g] = d;
    }
}

int sa_quantize_q8(const float *x, int64_t n_rows, int dim, int group_size,
                   int8_t *q, float *scales)
{
    if (!x || !q || !scales)
        return SA_ERR_NULL;
    if (n_rows < 0 || dim < 1 || group_size < 1)
        return SA_ERR_SHAPE;
    if (dim % group_size)
        return SA_ERR_GROUP;
    const int ng = dim / group_size;
    for (int64_t r = 0; r < n_rows; r++)
        sa_quantize_row(x + r * dim, dim, group_size, q + r * dim, scales + r * ng);
    return SA_OK;
}

int sa_kv_write(const sa_kv *dst, int at, const float *src, int T)
{
    int rc = sa_check_kv(dst);
    if (rc)
        return rc;
    if (!src)
        return SA_ERR_NULL;
    if (T < 0 || at < 0 || (int64_t)at + T > dst->n_rows)
        return SA_ERR_SEQ_LEN;
    const int D = dst->head_dim;
    rc = sa_check_finite(src, (int64_t)dst->n_kv_heads * T * D);
    if (rc)
        return rc;
    for (int kh = 0; kh < dst->n_kv_heads; kh++) {
        const float *in = src + (ptrdiff_t)kh * T * D;
        if (dst->dtype == SA_DTYPE_F32) {
            /* The pointer is const in sa_kv because kernels only read; the
             * cache owns this memory and hands it over writable. */
            float *out = (float *)sa_kv_f32_row(dst, kh, at);
            memcpy(out, in, (size_t)T * D * sizeof(float));
        } else {
            int8_t *out = (int8_t *)sa_kv_q8_row(dst, kh, at);
            float *sc = (float *)sa_kv_scale_row(dst, kh, at);
            sa_quantize_q8(in, T, D, dst->group_size, out, sc);
        }
    }
    return SA_OK;
}

int sa_kernel_q8_dot(const int8_t *q, const float *q_scales, int dim, int group_size,
                     const int8_t *rows, const float *row_scales, int n, float *out)
{
    if (!q || !q_scales || !rows || !row_scales || !out)
        return SA_ERR_NULL;
    if (dim < 1 || group_size < 1 || n < 0)
        return SA_ERR_SHAPE;
    if (dim % group_size)
        return SA_ERR_GROUP;
    if (n == 0)
        return SA_OK;
    float *s[1] = {out};
    sa_active_kernels()->scores_q8(q, q_scales, 1, dim, group_size, rows, row_scales,
                                   dim, dim / group_size, n, s);
    return SA_OK;
}

int sa_kernel_accumulate_v(const float *p, const sa_kv *v, int n, float *out)
{
    int rc = sa_check_kv(v);
    if (rc)
        return rc;
    if (!p || !out)
        return SA_ERR_NULL;
    if (n < 0 || n > v->n_rows)
        return SA_ERR_SEQ_LEN;
    if (n == 0)
        return SA_OK;
    const sa_kernels *kern = sa_active_kernels();
    float *o[1] = {out};
    const float *pp[1] = {p};
    if (v->dtype == SA_DTYPE_F32)
        kern->accumulate_v_f32(o, pp, 1, v->head_dim, v->f32, v->head_dim, n);
    else
        kern->accumulate_v_q8(o, pp, 1, v->head_dim, v->group_size, v->q8, v->scales,
                              v->head_dim, v->head_dim / v->group_size, n);
    return SA_OK;
}
