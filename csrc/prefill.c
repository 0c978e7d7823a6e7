/*
 * Exact causal prefill (spec §3).
 *
 * Query rows are taken in tiles of PREFILL_TILE positions: the G heads of a
 * KV head times the tile's rows are scored against the keys the last row of
 * the tile sees in one kernel call, so every K and V row loaded serves them
 * all.  Each row keeps only its causal part: its softmax runs over its own
 * keys and V accumulation adds exactly those keys.  A row's arithmetic is
 * therefore that of dense decode at seq_len = position + 1, bit for bit.
 *
 * Work items are (KV head, slice of query rows), PREFILL_SLICES slices of
 * about equal causal cost per KV head, so that models with few KV heads
 * (SmolLM2 has 3) still keep every thread busy.  The slicing depends on T and
 * start only.  Importance is summed per item in double and the items are
 * added in a fixed order afterwards, so it does not depend on the thread
 * count.
 */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rows.h"

#define PREFILL_TILE 8
#define PREFILL_SLICES 4

typedef struct {
    const sa_kernels *kern;
    const float *q;
    int G, T, start;
    const sa_kv *k, *v;
    float scale;
    float *out;
    int slice_rows[PREFILL_SLICES + 1]; /* row bounds of the slices */
    double *imp;         /* [Hkv * PREFILL_SLICES, start+T] */
    float *qrows;        /* [workers, TILE*G*D] gathered query rows */
    sa_scratch **scratch;
} prefill_ctx;

/* Slice bounds: multiples of the tile with about equal sums of
 * (start + t + 1), the keys each row reads. */
static void slice_rows(int start, int T, int *bounds)
{
    const double total = (double)T * start + (double)T * (T + 1) / 2;
    int t = 0;
    double done = 0;
    bounds[0] = 0;
    for (int sl = 1; sl < PREFILL_SLICES; sl++) {
        while (t < T && done < total * sl / PREFILL_SLICES) {
            for (int r = t; r < sa_min(t + PREFILL_TILE, T); r++)
                done += start + r + 1;
            t = sa_min(t + PREFILL_TILE, T);
        }
        bounds[sl] = t;
    }
    bounds[PREFILL_SLICES] = T;
}

static int prefill_item(void *arg, int item, int worker)
{
    prefill_ctx *c = arg;
    sa_scratch *s = c->scratch[worker];
    const int kh = item / PREFILL_SLICES, slice = item % PREFILL_SLICES;
    const int G = c->G, D = s->D, T = c->T, S = c->start + T;
    float *qrows = c->qrows + (ptrdiff_t)worker * PREFILL_TILE * G * D;
    double *imp = c->imp + (ptrdiff_t)item * S;
    memset(imp, 0, (size_t)S * sizeof(double));

    const int t_end = c->slice_rows[slice + 1];
    for (int64_t t64 = c->slice_rows[slice]; t64 < t_end; t64 += PREFILL_TILE) {
        const int t0 = (int)t64;
        const int rows = sa_min(PREFILL_TILE, t_end - t0);
        const int m = rows * G;                     /* query vectors in this tile */
        const int n_tile = c->start + t0 + rows;    /* keys the last row sees */
        /* Vector i = r*G + g is head kh*G+g at row t0+r. */
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < G; g++) {
                const int h = kh * G + g;
                memcpy(qrows + ((ptrdiff_t)r * G + g) * D,
                       c->q + ((ptrdiff_t)h * T + t0 + r) * D, (size_t)D * sizeof(float));
            }
        if (c->k->dtype == SA_DTYPE_Q8) {
            const int ng = D / c->k->group_size;
            for (int i = 0; i < m; i++)
                sa_quantize_row(qrows + (ptrdiff_t)i * D, D, c->k->group_size,
                                s->qq + (ptrdiff_t)i * D, s->qd + (ptrdiff_t)i * ng);
        }
        for (int i = 0; i < m; i++) {
            s->heads[i] = i;
            s->sp[i] = s->scores + (ptrdiff_t)i * s->max_tok;
        }
        sa_score_rows(c->kern, s, c->k, kh, qrows, s->heads, m, 0, 1, n_tile, NULL);

        for (int i = 0; i < m; i++) {
            const int r = i / G, g = i % G, h = kh * G + g;
            const int n = c->start + t0 + r + 1;
            float *p = s->sp[i];
            s->z[i] = c->kern->softmax_exp(p, n, c->scale);
            s->pp[i] = p;
            s->op[i] = c->out + ((ptrdiff_t)h * T + t0 + r) * D;
            memset(s->op[i], 0, (size_t)D * sizeof(float));
        }
        /* Each row adds exactly its causal keys, in key order: all rows the
         * keys of the tile's first row, then key n0 + r - 1 for the rows from
         * r on (vectors r*G .. m-1).  Never a zero weight times a key beyond
         * the row: 0 * NaN is NaN. */
        const int n0 = c->start + t0 + 1;
        sa_accumulate_rows(c->kern, s, c->v, kh, m, 0, n0, NULL);
        for (int r = 1; r < rows; r++) {
            const int key = n0 + r - 1, first = r * G;
            s->op += first, s->pp += first;
            for (int j = 0; j < m - first; j++)
                s->pp[j] += key;
            sa_accumulate_rows(c->kern, s, c->v, kh, m - first, key, 1, NULL);
            for (int j = 0; j < m - first; j++)
                s->pp[j] -= key;
            s->op -= first, s->pp -= first;
        }

        for (int i = 0; i < m; i++) {
            const int n = c->start + t0 + i / G + 1;
            for (int d = 0; d < D; d++)
                s->op[i][d] /= s->z[i];
            const double inv_z = 1.0 / (double)s->z[i];
            for (int j = 0; j < n; j++)
                imp[j] += (double)s->pp[i][j] * inv_z;
        }
    }
    return SA_OK;
}

int sa_prefill(const float *q, int n_heads, int T, const sa_kv *k, const sa_kv *v,
               int start, float scale, float *out, float *importance, int threads)
{
    int rc = sa_check_kv_pair(k, v);
    if (rc)
        return rc;
    if (!out || !importance)
        return SA_ERR_NULL;
    if (T < 1 || start < 0)
        return SA_ERR_SHAPE;
    if ((int64_t)start + T > k->n_rows || (int64_t)start + T > v->n_rows)
        return SA_ERR_SEQ_LEN;
    if ((rc = sa_check_query(q, n_heads, k, (int64_t)n_heads * T)))
        return rc;
    if (!(isfinite(scale) && scale > 0.0f))
        return SA_ERR_SCALE;

    const int Hkv = k->n_kv_heads, G = n_heads / Hkv, D = k->head_dim, S = start + T;
    const int gs = k->dtype == SA_DTYPE_Q8 ? k->group_size : 1;
    const int items = Hkv * PREFILL_SLICES;
    const int workers = sa_workers_for(items, threads);
    prefill_ctx c = {.kern = sa_active_kernels(), .q = q, .G = G, .T = T, .start = start,
                     .k = k, .v = v, .scale = scale, .out = out};
    slice_rows(start, T, c.slice_rows);
    c.imp = malloc((size_t)items * S * sizeof(double));
    c.qrows = malloc((size_t)workers * PREFILL_TILE * G * D * sizeof(float));
    const sa_scratch_sizes sizes = {.G = PREFILL_TILE * G, .D = D, .group_size = gs, .NB = 1,
                                     .n_sel = 1, .max_tok = S, .probe_tmp_per_head = 0};
    if (G > INT_MAX / PREFILL_TILE)
        rc = SA_ERR_SIZE;
    else if (!c.imp || !c.qrows)
        rc = SA_ERR_NOMEM;
    else
        rc = sa_scratch_array(workers, &sizes, &c.scratch);
    if (rc == SA_OK) {
        rc = sa_parallel_for(items, workers, prefill_item, &c);
        if (rc == SA_OK) {
            for (int j = 0; j < S; j++) {
                double acc = 0.0;
                for (int it = 0; it < items; it++)
                    acc += c.imp[(ptrdiff_t)it * S + j];
                importance[j] = (float)acc;
            }
        }
    }
    sa_scratch_array_free(c.scratch, workers);
    free(c.imp);
    free(c.qrows);
    return rc;
}
