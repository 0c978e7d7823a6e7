/*
 * Exact causal prefill (SPEC §3).  Each query row is a dense decode over the
 * keys it may see, through the same attention code, so a prefill row equals
 * dense_decode at seq_len = position + 1 bit for bit.  Importance is summed
 * per KV head in double and the KV heads are added in order afterwards, so
 * it does not depend on the thread count.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attend.h"

typedef struct {
    const sa_kernels *kern;
    const float *q;
    int G, T, start;
    const sa_kv *k, *v;
    float scale;
    float *out;
    double *imp_kv;      /* [Hkv, start+T] */
    float *qrow;         /* [workers, G*D] gathered query rows */
    sa_scratch **scratch;
} prefill_ctx;

static int prefill_item(void *arg, int kh, int worker)
{
    prefill_ctx *c = arg;
    sa_scratch *s = c->scratch[worker];
    const int G = c->G, D = s->D, T = c->T, S = c->start + T;
    float *qrow = c->qrow + (ptrdiff_t)worker * G * D;
    double *imp = c->imp_kv + (ptrdiff_t)kh * S;
    memset(imp, 0, (size_t)S * sizeof(double));
    for (int t = 0; t < T; t++) {
        const int n = c->start + t + 1;
        for (int g = 0; g < G; g++) {
            const int h = kh * G + g;
            memcpy(qrow + (ptrdiff_t)g * D, c->q + ((ptrdiff_t)h * T + t) * D,
                   (size_t)D * sizeof(float));
        }
        if (c->k->dtype == SA_DTYPE_Q8)
            sa_quantize_group(s, qrow, c->k->group_size);
        /* A single block of n keys, chosen by every head. */
        memset(s->chosen, 1, (size_t)s->G);
        sa_attend_group(c->kern, s, c->k, c->v, kh, qrow, n, n, c->scale,
                        c->out + ((ptrdiff_t)kh * G * T + t) * D, (ptrdiff_t)T * D);
        for (int g = 0; g < G; g++) {
            const float *p = s->scores + (ptrdiff_t)g * s->max_tok;
            const double inv_z = 1.0 / (double)s->z[g];
            for (int j = 0; j < n; j++)
                imp[j] += (double)p[j] * inv_z;
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
    const int workers = sa_workers_for(Hkv, threads);
    prefill_ctx c = {.kern = sa_active_kernels(), .q = q, .G = G, .T = T, .start = start,
                     .k = k, .v = v, .scale = scale, .out = out};
    c.imp_kv = malloc((size_t)Hkv * S * sizeof(double));
    c.qrow = malloc((size_t)workers * G * D * sizeof(float));
    c.scratch = sa_scratch_array(workers, G, D, gs, 1, 1, 1, S);
    if (!c.imp_kv || !c.qrow || !c.scratch) {
        rc = SA_ERR_NOMEM;
    } else {
        rc = sa_parallel_for(Hkv, workers, prefill_item, &c);
        if (rc == SA_OK) {
            for (int j = 0; j < S; j++) {
                double acc = 0.0;
                for (int kh = 0; kh < Hkv; kh++)
                    acc += c.imp_kv[(ptrdiff_t)kh * S + j];
                importance[j] = (float)acc;
            }
        }
    }
    sa_scratch_array_free(c.scratch, workers);
    free(c.imp_kv);
    free(c.qrow);
    return rc;
}
