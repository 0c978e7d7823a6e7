/*
 * One decode step of one layer: probe, block selection and exact attention
 * over the chosen blocks, for every query head, split over KV heads.
 * probe_scores, select_blocks and dense decode are the same walk stopped
 * earlier or with every block chosen.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attend.h"
#include "bounds.h"
#include "channels.h"
#include "choose.h"
#include "probe.h"
#include "probe_rows.h"
#include "rows.h"

enum mode { PROBE_ONLY, SELECT_ONLY, ATTEND };

typedef struct {
    enum mode mode;
    const sa_kernels *kern;
    const float *q;
    int G;
    const sa_kv *k, *v;
    int seq_len, block_size, n_probe;
    const sa_select_params *params; /* NULL: every block (dense) */
    const sa_reserve *reserve;      /* NULL: no importance */
    float scale;
    float *probe_out;               /* PROBE_ONLY: [H, NB] */
    int32_t *blocks;                /* [H, n_sel] or NULL */
    float *out;                     /* [H, D] */
    sa_scratch **scratch;
} decode_ctx;

static int decode_item(void *arg, int kh, int worker)
{
    decode_ctx *c = arg;
    sa_scratch *s = c->scratch[worker];
    const int G = c->G, D = s->D, NB = s->NB;
    const float *qf = c->q + (ptrdiff_t)kh * G * D; /* a group's heads are adjacent */

    if (c->k->dtype == SA_DTYPE_Q8)
        sa_quantize_group(s, qf, c->k->group_size);

    if (c->mode == PROBE_ONLY) {
        sa_probe_group(c->kern, s, c->k, kh, qf, c->seq_len, c->block_size, c->n_probe, NULL);
        memcpy(c->probe_out + (ptrdiff_t)kh * G * NB, s->probe, (size_t)G * NB * sizeof(float));
        return SA_OK;
    }
    int32_t *blocks = c->blocks ? c->blocks + (ptrdiff_t)kh * G * s->n_sel : NULL;
    if (!c->params || s->n_sel == NB) {
        /* Every block is chosen: the probe could not change anything. */
        memset(s->chosen, 1, (size_t)G * NB);
        s->n_uni = -1;      /* one run of every block */
        if (blocks)
            for (int g = 0; g < G; g++)
                for (int b = 0; b < NB; b++)
                    blocks[(ptrdiff_t)g * NB + b] = b;
    } else {
        if (c->params->scoring == SA_SCORING_MINMAX)
            sa_minmax_group(c->kern, s, c->params->bounds, kh, qf,
                            c->params->share == SA_SHARE_GROUP);
        else if (c->params->scoring == SA_SCORING_CHANNELS)
            sa_channels_group(c->kern, s, c->params->channels, c->params->n_channels, kh, qf,
                              c->seq_len);
        else
            sa_probe_group(c->kern, s, c->k, kh, qf, c->seq_len, c->block_size, c->n_probe,
                           c->params->probe_rows);
        sa_choose_group(s, c->params, c->reserve, blocks);
    }
    if (c->mode == SELECT_ONLY)
        return SA_OK;
    sa_attend_group(c->kern, s, c->k, c->v, kh, qf, c->seq_len, c->block_size, c->scale,
                    c->out + (ptrdiff_t)kh * G * D, D);
    return SA_OK;
}

static int run(decode_ctx *c, int n_heads, int threads, const float *importance,
               int64_t n_importance)
{
    const sa_kv *k = c->k;
    int rc = sa_check_kv(k);
    if (rc)
        return rc;
    if (c->v && (rc = sa_check_kv_pair(k, c->v)))
        return rc;
    if ((rc = sa_check_query(c->q, n_heads, k, n_heads)))
        return rc;
    if (c->seq_len < 1 || c->seq_len > k->n_rows || (c->v && c->seq_len > c->v->n_rows))
        return SA_ERR_SEQ_LEN;
    if (c->block_size < 1 || c->n_probe < 1)
        return SA_ERR_PARAM;
    if (c->mode != PROBE_ONLY && c->params && (rc = sa_check_select_params(c->params)))
        return rc;
    if (c->mode != PROBE_ONLY && c->params && c->params->scoring == SA_SCORING_MINMAX &&
        (rc = sa_check_bounds(c->params->bounds, k, c->seq_len, c->block_size)))
        return rc;
    if (c->mode != PROBE_ONLY && c->params && c->params->scoring == SA_SCORING_CHANNELS &&
        (rc = sa_check_channels(c->params->channels, k, c->seq_len, c->block_size)))
        return rc;
    if (c->mode != PROBE_ONLY && c->params && c->params->scoring == SA_SCORING_PROBE &&
        c->params->probe_rows &&
        (rc = sa_check_probe_rows(c->params->probe_rows, k, c->seq_len, c->block_size,
                                  c->n_probe)))
        return rc;
    if (c->mode == ATTEND && !(isfinite(c->scale) && c->scale > 0.0f))
        return SA_ERR_SCALE;
    if (c->mode == ATTEND && !c->out)
        return SA_ERR_NULL;
    if (importance && n_importance < c->seq_len)
        return SA_ERR_IMPORTANCE;
    if (importance && !sa_all_finite(importance, c->seq_len))
        return SA_ERR_IMPORTANCE_VALUES;

    const int Hkv = k->n_kv_heads, G = n_heads / Hkv, D = k->head_dim;
    const int gs = k->dtype == SA_DTYPE_Q8 ? k->group_size : 1;
    const int NB = sa_ceil_div(c->seq_len, c->block_size);
    const int n_sel = c->params ? sa_min(c->params->k_blocks, NB) : NB;
    const int max_tok = (int)((int64_t)n_sel * c->block_size < c->seq_len
                                  ? (int64_t)n_sel * c->block_size : c->seq_len);
    c->G = G;
    c->kern = sa_active_kernels();

    sa_reserve reserve = {NULL, 0};
    if (importance && c->params && c->mode != PROBE_ONLY && n_sel < NB) {
        if ((rc = sa_importance_reserve(importance, c->seq_len, c->params, n_sel, &reserve)))
            return rc;
        c->reserve = &reserve;
    }
    const int workers = sa_workers_for(Hkv, threads);
    const int probes = c->mode == PROBE_ONLY ||
                       (c->params && n_sel < NB && c->params->scoring == SA_SCORING_PROBE);
    const sa_scratch_sizes sizes = {
        .G = G, .D = D, .group_size = gs, .NB = NB, .n_sel = n_sel,
        .max_tok = c->mode == ATTEND ? max_tok : 1,
        .probe_tmp_per_head =
            probes ? sa_probe_tmp_floats(c->seq_len, c->block_size, c->n_probe) : 0,
        .channel_rows = c->mode != PROBE_ONLY && c->params && n_sel < NB &&
                                c->params->scoring == SA_SCORING_CHANNELS
                            ? sa_min(c->block_size, c->seq_len)
                            : 0};
    if ((rc = sa_scratch_array(workers, &sizes, &c->scratch))) {
        free(reserve.blocks);
        return rc;
    }
    rc = sa_parallel_for(Hkv, workers, decode_item, c);
    sa_scratch_array_free(c->scratch, workers);
    free(reserve.blocks);
    return rc;
}

int sa_probe_scores(const float *q, int n_heads, const sa_kv *k, int seq_len,
                    int block_size, int n_probe, float *probe, int threads)
{
    if (!probe)
        return SA_ERR_NULL;
    decode_ctx c = {.mode = PROBE_ONLY, .q = q, .k = k, .seq_len = seq_len,
                    .block_size = block_size, .n_probe = n_probe, .probe_out = probe};
    return run(&c, n_heads, threads, NULL, 0);
}

int sa_select_blocks(const float *q, int n_heads, const sa_kv *k, int seq_len,
                     const sa_select_params *params, const float *importance,
                     int64_t n_importance, int32_t *blocks, int threads)
{
    if (!params || !blocks)
        return SA_ERR_NULL;
    decode_ctx c = {.mode = SELECT_ONLY, .q = q, .k = k, .seq_len = seq_len,
                    .block_size = params->block_size, .n_probe = params->n_probe,
                    .params = params, .blocks = blocks};
    return run(&c, n_heads, threads, importance, n_importance);
}

int sa_sparse_decode(const float *q, int n_heads, const sa_kv *k, const sa_kv *v,
                     int seq_len, const sa_select_params *params,
                     const float *importance, int64_t n_importance, float scale,
                     float *out, int32_t *blocks, int threads)
{
    if (!params || !v)
        return SA_ERR_NULL;
    decode_ctx c = {.mode = ATTEND, .q = q, .k = k, .v = v, .seq_len = seq_len,
                    .block_size = params->block_size, .n_probe = params->n_probe,
                    .params = params, .scale = scale, .out = out, .blocks = blocks};
    return run(&c, n_heads, threads, importance, n_importance);
}

int sa_dense_decode(const float *q, int n_heads, const sa_kv *k, const sa_kv *v,
                    int seq_len, float scale, float *out, int threads)
{
    if (!v)
        return SA_ERR_NULL;
    /* One block spanning the context: a single run, the same kernel calls
     * as sparse decode with every block chosen. */
    decode_ctx c = {.mode = ATTEND, .q = q, .k = k, .v = v, .seq_len = seq_len,
                    .block_size = seq_len > 0 ? seq_len : 1, .n_probe = 1,
                    .scale = scale, .out = out};
    return run(&c, n_heads, threads, NULL, 0);
}
