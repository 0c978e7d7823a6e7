/*
 * Kernel calls over KV rows (rows.h).
 *
 * Contiguous rows are read as a stream of kernel calls of STRETCH rows; each
 * call is told to prefetch the STRETCH rows after it (more of the same run,
 * or, at its end, the first rows of the next span: after a jump to another
 * block the hardware prefetchers start cold).  The kernel spreads those
 * prefetches over its iterations.  On the development VM (2-core EPYC, KV
 * in DRAM) this is what made the difference: one burst of prefetches per
 * call, or none, was 10-40% slower for dense decode (docs/design.md).
 * Strided rows (the probe on K) are left to the hardware prefetchers, which
 * fetch the rows in between anyway.  A call covers at most MAX_ROWS rows, so
 * the kernels' `t += 8`-style loops never get near INT_MAX.  Splitting a
 * call changes no result (kernels.h: a row's score does not depend on its
 * batch, and V is added in row order either way).
 */
#include <string.h>

#include "rows.h"

#define STRETCH 32
#define MAX_ROWS (1 << 24)

void sa_quantize_group(sa_scratch *s, const float *q, int group_size)
{
    const int ng = s->D / group_size;
    for (int g = 0; g < s->G; g++)
        sa_quantize_row(q + (ptrdiff_t)g * s->D, s->D, group_size,
                        s->qq + (ptrdiff_t)g * s->D, s->qd + (ptrdiff_t)g * ng);
}

/* The byte ranges of rows [row, row + n) of KV head kh. */
static void add_rows(sa_prefetch *pf, int *slot, const sa_kv *kv, int kh, int row, int n)
{
    if (n <= 0)
        return;
    const int D = kv->head_dim;
    if (kv->dtype == SA_DTYPE_F32) {
        pf->at[*slot] = (const char *)sa_kv_f32_row(kv, kh, row);
        pf->len[(*slot)++] = (size_t)n * D * sizeof(float);
    } else {
        pf->at[*slot] = (const char *)sa_kv_q8_row(kv, kh, row);
        pf->len[(*slot)++] = (size_t)n * D;
        pf->at[*slot] = (const char *)sa_kv_scale_row(kv, kh, row);
        pf->len[(*slot)++] = (size_t)n * (D / kv->group_size) * sizeof(float);
    }
}

/* What a call ending at row t1 of a span ending at r1 prefetches: rows
 * [t1, t1 + STRETCH) of the stream, from this span first, then from `next`. */
static const sa_prefetch *hint(sa_prefetch *pf, const sa_kv *kv, int kh, int t1, int r1,
                               const sa_span *next)
{
    memset(pf, 0, sizeof *pf);
    int slot = 0;
    const int here = sa_min(STRETCH, r1 - t1);
    add_rows(pf, &slot, kv, kh, t1, here);
    if (here < STRETCH && next)
        add_rows(pf, &slot, next->kv, next->kh, next->row, sa_min(STRETCH - here, next->n));
    return pf;
}

static void advance(float **p, int cnt, ptrdiff_t by)
{
    for (int j = 0; j < cnt; j++)
        p[j] += by;
}

static void score_call(const sa_kernels *kern, const sa_scratch *s, const sa_kv *k, int kh,
                       const float *q, const int8_t *qq, const float *qd, int cnt, int row,
                       int step, int m, const sa_prefetch *pf)
{
    const int D = s->D;
    if (k->dtype == SA_DTYPE_F32) {
        kern->scores_f32(q, cnt, D, sa_kv_f32_row(k, kh, row), (ptrdiff_t)step * D, m, s->sp, pf);
    } else {
        const int ng = D / k->group_size;
        kern->scores_q8(qq, qd, cnt, D, k->group_size, sa_kv_q8_row(k, kh, row),
                        sa_kv_scale_row(k, kh, row), (ptrdiff_t)step * D, (ptrdiff_t)step * ng,
                        m, s->sp, pf);
    }
}

void sa_score_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, int kh,
                   const float *qf, const int *heads, int cnt, int row, int step, int n,
                   const sa_span *next)
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
    const int chunk = step == 1 ? STRETCH : MAX_ROWS;
    sa_prefetch pf;
    int done = 0;
    for (;;) {
        const int m = sa_min(chunk, n - done);
        const int r = (int)(row + (int64_t)done * step);
        score_call(kern, s, k, kh, q, qq, qd, cnt, r, step, m,
                   step == 1 ? hint(&pf, k, kh, r + m, row + n, next) : NULL);
        if (m >= n - done)
            break;
        advance(s->sp, cnt, m);
        done += m;
    }
    advance(s->sp, cnt, -done);
}

void sa_accumulate_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *v, int kh,
                        int cnt, int r0, int n, const sa_span *next)
{
    const int D = s->D;
    sa_prefetch pf;
    int done = 0;
    for (;;) {
        const int m = sa_min(STRETCH, n - done), r = r0 + done;
        const sa_prefetch *h = hint(&pf, v, kh, r + m, r0 + n, next);
        if (v->dtype == SA_DTYPE_F32)
            kern->accumulate_v_f32(s->op, s->pp, cnt, D, sa_kv_f32_row(v, kh, r), D, m, h);
        else
            kern->accumulate_v_q8(s->op, s->pp, cnt, D, v->group_size, sa_kv_q8_row(v, kh, r),
                                  sa_kv_scale_row(v, kh, r), D, D / v->group_size, m, h);
        if (m >= n - done)
            break;
        for (int j = 0; j < cnt; j++)
            s->pp[j] += m;
        done += m;
    }
    for (int j = 0; j < cnt; j++)
        s->pp[j] -= done;
}
