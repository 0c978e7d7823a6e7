/*
 * K packed in the kernels' panels (panels.h).
 *
 * Prefill scores a tile of many query vectors against every key it reads;
 * in GEMM form a register block of vectors meets one panel of keys laid out
 * channel by channel, so each lane accumulates one score and no score needs
 * a horizontal sum.  When the call has many tiles per KV head, a worker
 * packs the keys of the head its item works on once (a panel when a tile
 * first reads it), and every later tile of that head reads the packed copy:
 * one copy of a KV head's keys per worker, packing once what the tiles then
 * read tens to thousands of times.  A call with few query vectors per KV
 * head (a short chunk after a long context) reads each key for few of
 * them, so a copy would cost more than its scores (2.8x the time of one
 * row at 32K keys): it reads K in place with the decode kernels.  For q8 K
 * that is the same bits (kernels.h); for float32 K the call's form, and so
 * its bits, follow from its shape (spec §3).
 */
#include <string.h>

#include "panels.h"
#include "rows.h"

sa_panels sa_panels_layout(const sa_kernels *kern, const sa_kv *k, int keys, int amortized)
{
    int nt = 0;
    if (amortized && k->dtype == SA_DTYPE_F32)
        nt = kern->panel_keys;
    else if (amortized && kern->scores_q8_panels && k->group_size % 4 == 0)
        nt = kern->q8_panel_keys;
    return (sa_panels){.kern = kern, .k = k, .keys = keys, .nt = nt,
                       .count = nt ? sa_ceil_div(keys, nt) : 0};
}

size_t sa_panel_bytes(const sa_panels *pl)
{
    const sa_kv *k = pl->k;
    const size_t keys = (size_t)pl->nt, D = (size_t)k->head_dim;
    if (k->dtype == SA_DTYPE_F32)
        return keys * D * sizeof(float);
    return keys * D + keys * (D / (size_t)k->group_size) * sizeof(float);
}

/* Panel p of KV head kh's keys as the kernels read them (kernels.h:
 * float32 channel by channel; q8 four channels of each key together, the
 * scales after every panel's bytes), keys past pl->keys zero. */
static void pack_panel(const sa_panels *pl, sa_panel_buf *buf, int kh, int p)
{
    const sa_kv *k = pl->k;
    const int NT = pl->nt, D = k->head_dim;
    const int ng = k->dtype == SA_DTYPE_Q8 ? D / k->group_size : 0;
    float *dst = (float *)buf->data + (ptrdiff_t)p * D * NT;
    int8_t *k8 = (int8_t *)buf->data + (ptrdiff_t)p * D * NT;
    float *kd = (float *)(buf->data + (ptrdiff_t)pl->count * D * NT) + (ptrdiff_t)p * ng * NT;
    for (int j = 0; j < NT; j++) {
        const int64_t key = (int64_t)p * NT + j;
        const int in = key < pl->keys;
        if (k->dtype == SA_DTYPE_F32) {
            const float *row = in ? sa_kv_f32_row(k, kh, (int)key) : NULL;
            for (int d = 0; d < D; d++)
                dst[(ptrdiff_t)d * NT + j] = in ? row[d] : 0.0f;
            continue;
        }
        const int8_t *row = in ? sa_kv_q8_row(k, kh, (int)key) : NULL;
        const float *sr = in ? sa_kv_scale_row(k, kh, (int)key) : NULL;
        for (int c4 = 0; c4 < D / 4; c4++) {
            int8_t *to = k8 + ((ptrdiff_t)c4 * NT + j) * 4;
            if (in)
                memcpy(to, row + 4 * c4, 4);
            else
                memset(to, 0, 4);
        }
        for (int grp = 0; grp < ng; grp++)
            kd[(ptrdiff_t)grp * NT + j] = in ? sr[grp] : 0.0f;
    }
}

/* The kernel call on keys [row, row + n), from the buffer's panel `at`
 * (the one holding key `row`) on. */
static void panel_call(const sa_panels *pl, const sa_panel_buf *buf, sa_scratch *s,
                       const float *q, const int8_t *qq, const float *qd, int cnt, int row,
                       int n, int at)
{
    const sa_kv *k = pl->k;
    const int NT = pl->nt, D = k->head_dim, first = row % NT;
    if (k->dtype == SA_DTYPE_F32) {
        pl->kern->scores_f32_panels(q, cnt, D, (const float *)buf->data + (ptrdiff_t)at * D * NT,
                                    first, n, s->sp);
        return;
    }
    const int gs = k->group_size, ng = D / gs;
    const float *kd = (const float *)(buf->data + (ptrdiff_t)pl->count * D * NT);
    pl->kern->scores_q8_panels(qq, qd, cnt, D, gs,
                               (const int8_t *)buf->data + (ptrdiff_t)at * D * NT,
                               kd + (ptrdiff_t)at * ng * NT, first, n, s->sp);
}

void sa_panel_scores(const sa_panels *pl, sa_panel_buf *buf, sa_scratch *s, const float *qt,
                     int kh, int cnt, int row, int n)
{
    const sa_kv *k = pl->k;
    if (!pl->nt) {
        sa_score_rows(pl->kern, s, k, kh, qt, s->heads, cnt, row, 1, n, NULL);
        return;
    }
    const int NT = pl->nt, D = k->head_dim;
    int all = 1; /* the vectors are rows 0 .. cnt-1: read in place */
    for (int j = 0; j < cnt && all; j++)
        all = s->heads[j] == j;
    const float *q = qt;
    const int8_t *qq = s->qq;
    const float *qd = s->qd;
    if (!all && k->dtype == SA_DTYPE_F32) {
        for (int j = 0; j < cnt; j++)
            memcpy(s->qsub + (ptrdiff_t)j * D, qt + (ptrdiff_t)s->heads[j] * D,
                   (size_t)D * sizeof(float));
        q = s->qsub;
    } else if (!all) {
        const int ng = D / k->group_size;
        for (int j = 0; j < cnt; j++) {
            memcpy(s->qqsub + (ptrdiff_t)j * D, s->qq + (ptrdiff_t)s->heads[j] * D, (size_t)D);
            memcpy(s->qdsub + (ptrdiff_t)j * ng, s->qd + (ptrdiff_t)s->heads[j] * ng,
                   (size_t)ng * sizeof(float));
        }
        qq = s->qqsub;
        qd = s->qdsub;
    }
    const int p0 = row / NT, p1 = (int)(((int64_t)row + n - 1) / NT);
    for (int p = p0; p <= p1; p++)
        if (buf->head[p] != kh + 1) {
            pack_panel(pl, buf, kh, p);
            buf->head[p] = kh + 1;
        }
    panel_call(pl, buf, s, q, qq, qd, cnt, row, n, p0);
}
