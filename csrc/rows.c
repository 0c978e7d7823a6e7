/* Kernel calls over KV rows (rows.h).  One kernel call covers at most
 * MAX_ROWS rows, so the kernels' `t += 8`-style loops never get near
 * INT_MAX; splitting a call changes no result (kernels.h: a row's score does
 * not depend on its batch, and V is added in row order either way). */
#include <string.h>

#include "rows.h"

#define MAX_ROWS (1 << 24)

void sa_quantize_group(sa_scratch *s, const float *q, int group_size)
{
    const int ng = s->D / group_size;
    for (int g = 0; g < s->G; g++)
        sa_quantize_row(q + (ptrdiff_t)g * s->D, s->D, group_size,
                        s->qq + (ptrdiff_t)g * s->D, s->qd + (ptrdiff_t)g * ng);
}

static void advance(float **p, int cnt, ptrdiff_t by)
{
    for (int j = 0; j < cnt; j++)
        p[j] += by;
}

/* One kernel call for rows [row + done*step, ...) of m rows. */
static void score_call(const sa_kernels *kern, const sa_scratch *s, const sa_kv *k, int kh,
                       const float *q, const int8_t *qq, const float *qd, int cnt, int row,
                       int step, int m)
{
    const int D = s->D;
    if (k->dtype == SA_DTYPE_F32) {
        kern->scores_f32(q, cnt, D, sa_kv_f32_row(k, kh, row), (ptrdiff_t)step * D, m, s->sp);
    } else {
        const int ng = D / k->group_size;
        kern->scores_q8(qq, qd, cnt, D, k->group_size, sa_kv_q8_row(k, kh, row),
                        sa_kv_scale_row(k, kh, row), (ptrdiff_t)step * D, (ptrdiff_t)step * ng,
                        m, s->sp);
    }
}

void sa_score_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, int kh,
                   const float *qf, const int *heads, int cnt, int row, int step, int n)
{
    const int D = s->D;
    const int all = cnt == s->G;
    const float *q = qf;
    const int8_t *qq = s->qq;
    const float *qd = s->qd;
    if (!all && k->dtype == SA_DTYPE_F32) {
        for (int j = 0; j < cnt; j++)
            memcpy(s->qsub + (ptrdiff_t)j * D, qf + (ptrdiff_t)heads[j] * D,
                   (size_t)D * sizeof(float));
        q = s->qsub;
    } else if (!all) {
        const int ng = D / k->group_size;
        for (int j = 0; j < cnt; j++) {
            memcpy(s->qqsub + (ptrdiff_t)j * D, s->qq + (ptrdiff_t)heads[j] * D, (size_t)D);
            memcpy(s->qdsub + (ptrdiff_t)j * ng, s->qd + (ptrdiff_t)heads[j] * ng,
                   (size_t)ng * sizeof(float));
        }
        qq = s->qqsub;
        qd = s->qdsub;
    }
    int done = 0;
    for (;;) {
        const int m = sa_min(MAX_ROWS, n - done);
        score_call(kern, s, k, kh, q, qq, qd, cnt, (int)(row + (int64_t)done * step), step, m);
        if (m >= n - done)
            break;
        advance(s->sp, cnt, m);
        done += m;
    }
    advance(s->sp, cnt, -done);
}

void sa_accumulate_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *v, int kh,
                        int cnt, int r0, int n)
{
    const int D = s->D;
    int done = 0;
    for (;;) {
        const int m = sa_min(MAX_ROWS, n - done), r = r0 + done;
        if (v->dtype == SA_DTYPE_F32)
            kern->accumulate_v_f32(s->op, s->pp, cnt, D, sa_kv_f32_row(v, kh, r), D, m);
        else
            kern->accumulate_v_q8(s->op, s->pp, cnt, D, v->group_size, sa_kv_q8_row(v, kh, r),
                                  sa_kv_scale_row(v, kh, r), D, D / v->group_size, m);
        if (m >= n - done)
            break;
        for (int j = 0; j < cnt; j++)
            s->pp[j] += m;
        done += m;
    }
    for (int j = 0; j < cnt; j++)
        s->pp[j] -= done;
}
