/* The design card's kernels on their own, for microbenchmarks and tests:
 * calls of the active table's kernel (at most 2^24 rows each, as rows.c
 * makes them), no threads, no scratch, no prefetch hints. */
#include "internal.h"

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
    /* in calls of at most 2^24 rows, as rows.c makes them */
    const sa_kernels *kern = sa_active_kernels();
    const int ng = dim / group_size;
    for (int done = 0; done < n;) {
        const int m = n - done < (1 << 24) ? n - done : (1 << 24);
        float *s[1] = {out + done};
        kern->scores_q8(q, q_scales, 1, dim, group_size, rows + (ptrdiff_t)done * dim,
                        row_scales + (ptrdiff_t)done * ng, dim, ng, m, s, NULL);
        done += m;
    }
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
    for (int done = 0; done < n;) {
        const int m = n - done < (1 << 24) ? n - done : (1 << 24);
        const float *pp[1] = {p + done};
        if (v->dtype == SA_DTYPE_F32)
            kern->accumulate_v_f32(o, pp, 1, v->head_dim, sa_kv_f32_row(v, 0, done),
                                   v->head_dim, m, NULL);
        else
            kern->accumulate_v_q8(o, pp, 1, v->head_dim, v->group_size, sa_kv_q8_row(v, 0, done),
                                  sa_kv_scale_row(v, 0, done), v->head_dim,
                                  v->head_dim / v->group_size, m, NULL);
        done += m;
    }
    return SA_OK;
}
