/*
 * One decode step of one layer: probe, block selection and exact attention
 * over the chosen blocks, for every query head.  probe_scores,
 * select_blocks and dense decode are the same walk stopped earlier or with
 * every block chosen.
 *
 * The work is split over KV heads and, when a group attends to more than
 * CHUNK_ROWS rows, over chunks of those rows too (split-KV, or
 * "flash-decoding"): models with one or two KV heads would otherwise keep
 * one or two cores busy.  A group's attended rows (the union of its heads'
 * chosen blocks, ascending) are cut into equal chunks of at most CHUNK_ROWS
 * rows (a multiple of 32); each chunk gives per head its largest score, its
 * softmax sum and its unnormalised output, and the chunks are merged in
 * chunk order (attend.c, spec §2.6).  The cut depends on the union's length
 * alone, never on the thread count, so the bits do not either; sparse decode
 * with every block chosen has dense decode's union, so it stays dense
 * decode's bits.  A group of at most CHUNK_ROWS rows is one chunk and
 * computes exactly what it did before chunks existed.
 *
 * With chunks a call is one parallel job of two kinds of items: per KV
 * head a plan (quantise the query, choose the blocks), then per KV head as
 * many chunk items as its longest possible union could need, which wait
 * for their plan; the group's last chunk to finish merges its chunks.
 */
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
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

/* The longest chunk (sparse_attn.h; picked by measurement, docs/design.md,
 * Split-KV decode). */
#define CHUNK_ROWS SA_DECODE_CHUNK_ROWS

/* The length of a group's chunks when it attends to `rows` rows: the rows
 * cut into ceil(rows / CHUNK_ROWS) near-equal chunks, rounded up to a
 * multiple of 32 (so at most CHUNK_ROWS); all of them when that is one. */
static int64_t chunk_len(int64_t rows)
{
    if (rows <= CHUNK_ROWS)
        return rows > 0 ? rows : 1;
    const int64_t n = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    return ((rows + n - 1) / n + 31) / 32 * 32;
}

/* One KV head's choice, kept between the two steps of a chunked call. */
typedef struct {
    uint8_t *chosen;   /* G*NB */
    int32_t *uni;      /* NB */
    int8_t *qq;        /* G*D (q8 K) */
    float *qd;         /* G*D/gs */
    int n_uni;
    int64_t rows, len; /* union rows and chunk length */
    int n_chunks;
    atomic_int left;   /* chunks not yet attended */
    atomic_int ready;  /* 1 once the fields above are written */
} plan;

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
    plan *plans;                    /* chunked: [Hkv], else NULL */
    int Hkv, max_chunks;            /* chunked: chunk items per KV head */
    float *parts;                   /* chunked: sa_chunk_part_floats per chunk item */
    char *plan_mem;                 /* chunked: the plans' arrays */
    /* what prepare() found */
    sa_scratch_sizes sizes;
    sa_reserve reserve_mem;
    int64_t union_max;
    int n_items;                    /* the call's items: Hkv, or Hkv plans + chunks */
} decode_ctx;

/* Keep what s chose for KV head kh (and its quantised query, q8 K of group
 * size gs; 0 for float32) in p, with its chunks. */
static void save_plan(const sa_scratch *s, plan *p, int seq_len, int bs, int gs)
{
    const int G = s->G, D = s->D;
    memcpy(p->chosen, s->chosen, (size_t)G * s->NB);
    p->n_uni = s->n_uni;
    if (s->n_uni > 0)
        memcpy(p->uni, s->uni, (size_t)s->n_uni * sizeof(int32_t));
    if (gs) {
        memcpy(p->qq, s->qq, (size_t)G * D);
        memcpy(p->qd, s->qd, (size_t)G * (D / gs) * sizeof(float));
    }
    p->rows = sa_union_rows(s, seq_len, bs);
    p->len = chunk_len(p->rows);
    p->n_chunks = (int)((p->rows + p->len - 1) / p->len);
    atomic_store_explicit(&p->left, p->n_chunks, memory_order_relaxed);
    atomic_store_explicit(&p->ready, 1, memory_order_release);
}

/* Chunk `chunk` of KV head kh: attended with the group's plan, once the
 * item that makes it is done (it was claimed before this one, by a thread
 * that is running it, so the wait ends); the group's last chunk to finish
 * merges them (in chunk order, whoever runs it).  A chunk beyond the
 * group's count does nothing. */
static void chunk_item(decode_ctx *c, int kh, int chunk, sa_scratch *s)
{
    plan *p = &c->plans[kh];
    for (unsigned spins = 0; !atomic_load_explicit(&p->ready, memory_order_acquire); spins++)
        if (spins < 4096)
            sa_cpu_relax();
        else
            sched_yield();
    if (chunk >= p->n_chunks)
        return;
    const int G = c->G, D = s->D;
    uint8_t *chosen = s->chosen;
    int32_t *uni = s->uni;
    int8_t *qq = s->qq;
    float *qd = s->qd;
    const int n_uni = s->n_uni;
    s->chosen = p->chosen, s->uni = p->uni, s->n_uni = p->n_uni, s->qq = p->qq, s->qd = p->qd;
    const ptrdiff_t pf = sa_chunk_part_floats(G, D);
    float *parts = c->parts + (ptrdiff_t)kh * c->max_chunks * pf;
    const int64_t w0 = chunk * p->len;
    sa_attend_chunk(c->kern, s, c->k, c->v, kh, c->q + (ptrdiff_t)kh * G * D, c->seq_len,
                    c->block_size, c->scale, w0, w0 + p->len, parts + chunk * pf);
    s->chosen = chosen, s->uni = uni, s->n_uni = n_uni, s->qq = qq, s->qd = qd;
    if (atomic_fetch_sub(&p->left, 1) == 1)
        sa_merge_chunks(parts, p->n_chunks, G, D, c->scale, c->out + (ptrdiff_t)kh * G * D);
}

static int decode_item(void *arg, int kh, int worker)
{
    decode_ctx *c = arg;
    sa_scratch *s = c->scratch[worker];
    if (c->plans && kh >= c->Hkv) {
        const int i = kh - c->Hkv;
        chunk_item(c, i / c->max_chunks, i % c->max_chunks, s);
        return SA_OK;
    }
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
    if (c->plans) {
        save_plan(s, &c->plans[kh], c->seq_len, c->block_size,
                  c->k->dtype == SA_DTYPE_Q8 ? c->k->group_size : 0);
        return SA_OK;
    }
    sa_attend_group(c->kern, s, c->k, c->v, kh, qf, c->seq_len, c->block_size, c->scale,
                    c->out + (ptrdiff_t)kh * G * D, D);
    return SA_OK;
}

/* Bytes of one plan's arrays, 64-byte aligned pieces at offs; 0 if that
 * does not fit a size_t. */
static size_t plan_bytes(const sa_scratch_sizes *z, size_t offs[4])
{
    const size_t g = (size_t)z->G, d = (size_t)z->D, nb = (size_t)z->NB;
    const size_t ng = d / (size_t)z->group_size;
    size_t sizes[4];
    if (__builtin_mul_overflow(g, nb, &sizes[0]) ||
        __builtin_mul_overflow(nb, sizeof(int32_t), &sizes[1]) ||
        __builtin_mul_overflow(g, d, &sizes[2]) ||
        __builtin_mul_overflow(g * ng, sizeof(float), &sizes[3]))
        return 0;
    size_t at = 0;
    for (int i = 0; i < 4; i++) {
        offs[i] = at;
        if (sizes[i] > SIZE_MAX - 63 || __builtin_add_overflow(at, (sizes[i] + 63) & ~(size_t)63, &at))
            return 0;
    }
    return at;
}

/* A chunked call's plans and chunk outputs: Hkv plan items (choose,
 * quantise), then max_chunks chunk items per KV head, in KV head order.
 * Claims go in item order, so every plan is taken before any chunk that
 * waits for it. */
static int chunks_setup(decode_ctx *c)
{
    sa_scratch_sizes *sizes = &c->sizes;
    const int Hkv = c->k->n_kv_heads;
    size_t offs[4];
    const size_t each = plan_bytes(sizes, offs);
    const int64_t max_chunks = (c->union_max + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const ptrdiff_t pf = sa_chunk_part_floats(sizes->G, sizes->D);
    if (!each || each > SIZE_MAX / (size_t)Hkv || max_chunks > (INT32_MAX - Hkv) / Hkv ||
        (size_t)(Hkv * max_chunks) > SIZE_MAX / sizeof(float) / (size_t)pf)
        return SA_ERR_SIZE;
    c->plans = calloc((size_t)Hkv, sizeof *c->plans);
    c->plan_mem = aligned_alloc(64, each * (size_t)Hkv);
    c->parts = malloc((size_t)(Hkv * max_chunks) * (size_t)pf * sizeof(float));
    if (!c->plans || !c->plan_mem || !c->parts)
        return SA_ERR_NOMEM;
    for (int kh = 0; kh < Hkv; kh++) {
        char *at = c->plan_mem + each * (size_t)kh;
        plan *p = &c->plans[kh];
        p->chosen = (uint8_t *)(at + offs[0]);
        p->uni = (int32_t *)(at + offs[1]);
        p->qq = (int8_t *)(at + offs[2]);
        p->qd = (float *)(at + offs[3]);
        atomic_init(&p->left, 0);
        atomic_init(&p->ready, 0);
    }
    c->Hkv = Hkv;
    c->max_chunks = (int)max_chunks;
    c->n_items = (int)(Hkv + Hkv * max_chunks);
    if (sizes->max_tok > CHUNK_ROWS)
        sizes->max_tok = CHUNK_ROWS;
    return SA_OK;
}

/* What prepare() and chunks_setup() allocated, and the scratch. */
static void ctx_free(decode_ctx *c, int workers)
{
    sa_scratch_array_free(c->scratch, workers);
    c->scratch = NULL;
    free(c->parts);
    free(c->plan_mem);
    free(c->plans);
    c->parts = NULL, c->plan_mem = NULL, c->plans = NULL;
    free(c->reserve_mem.blocks);
    c->reserve_mem.blocks = NULL;
}

/* Check a call and size its work: its scratch, its importance reserve,
 * whether it is chunked (then its plans) and its items: per KV head one
 * (chosen and attended by one thread), or a plan and its chunks. */
static int prepare(decode_ctx *c, int n_heads, const float *importance, int64_t n_importance)
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

    if (importance && c->params && c->mode != PROBE_ONLY && n_sel < NB) {
        if ((rc = sa_importance_reserve(importance, c->seq_len, c->params, n_sel,
                                        &c->reserve_mem)))
            return rc;
        c->reserve = &c->reserve_mem;
    }
    const int probes = c->mode == PROBE_ONLY ||
                       (c->params && n_sel < NB && c->params->scoring == SA_SCORING_PROBE);
    c->sizes = (sa_scratch_sizes){
        .G = G, .D = D, .group_size = gs, .NB = NB, .n_sel = n_sel,
        .max_tok = c->mode == ATTEND ? max_tok : 1,
        .probe_tmp_per_head =
            probes ? sa_probe_tmp_floats(c->seq_len, c->block_size, c->n_probe) : 0,
        .channel_rows = c->mode != PROBE_ONLY && c->params && n_sel < NB &&
                                c->params->scoring == SA_SCORING_CHANNELS
                            ? sa_min(c->block_size, c->seq_len)
                            : 0};
    /* The most rows a group can attend to: beyond one chunk the call is
     * chunked (the chunks then follow from the rows it does attend to). */
    c->union_max = c->seq_len;
    if (c->params && n_sel < NB) {
        const int64_t heads = c->params->share == SA_SHARE_GROUP ? 1 : G;
        const int64_t most = (int64_t)n_sel * c->block_size * heads;
        c->union_max = most < c->union_max ? most : c->union_max;
    }
    c->n_items = Hkv;
    if (c->mode == ATTEND && c->union_max > CHUNK_ROWS)
        return chunks_setup(c);
    return SA_OK;
}

static int run(decode_ctx *c, int n_heads, int threads, const float *importance,
               int64_t n_importance)
{
    int rc = prepare(c, n_heads, importance, n_importance);
    int workers = 0;
    if (!rc) {
        workers = sa_workers_for(c->n_items, threads);
        rc = sa_scratch_array(workers, &c->sizes, &c->scratch);
    }
    if (!rc)
        rc = sa_parallel_for(c->n_items, workers, decode_item, c);
    ctx_free(c, workers);
    return rc;
}

/* A batch of decode calls as one parallel job: the calls' items one after
 * another, each run with its own call's context and scratch. */
typedef struct {
    decode_ctx *ctx;
    int n;
    int *first;     /* [n + 1]: the first item of each call */
} batch_job;

static int batch_item(void *arg, int item, int worker)
{
    const batch_job *b = arg;
    int lo = 0, hi = b->n - 1;      /* the call whose items hold `item` */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (b->first[mid] <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    return decode_item(&b->ctx[lo], item - b->first[lo], worker);
}

int sa_decode_batch(const sa_decode_call *calls, int n_calls, int threads, int *failed)
{
    if (failed)
        *failed = -1;
    if (n_calls < 0)
        return SA_ERR_SHAPE;
    if (n_calls == 0)
        return SA_OK;
    if (!calls)
        return SA_ERR_NULL;
    decode_ctx *ctx = calloc((size_t)n_calls, sizeof *ctx);
    int *first = malloc(((size_t)n_calls + 1) * sizeof *first);
    int rc = ctx && first ? SA_OK : SA_ERR_NOMEM;
    int workers = 0;
    int64_t items = 0;
    for (int i = 0; i < n_calls && !rc; i++) {
        const sa_decode_call *a = &calls[i];
        decode_ctx *c = &ctx[i];
        /* params NULL: dense decode, one block spanning the context (as
         * sa_dense_decode) */
        *c = (decode_ctx){.mode = ATTEND, .q = a->q, .k = a->k, .v = a->v,
                          .seq_len = a->seq_len, .params = a->params, .scale = a->scale,
                          .out = a->out, .blocks = a->params ? a->blocks : NULL,
                          .block_size = a->params ? a->params->block_size
                                                  : (a->seq_len > 0 ? a->seq_len : 1),
                          .n_probe = a->params ? a->params->n_probe : 1};
        rc = a->v ? prepare(c, a->n_heads, a->params ? a->importance : NULL, a->n_importance)
                  : SA_ERR_NULL;
        first[i] = (int)items;
        items += c->n_items;
        if (!rc && items > INT32_MAX)
            rc = SA_ERR_SIZE;
        if (rc && failed)
            *failed = i;
    }
    if (!rc) {
        first[n_calls] = (int)items;
        workers = sa_workers_for((int)items, threads);
        for (int i = 0; i < n_calls && !rc; i++)
            rc = sa_scratch_array(workers, &ctx[i].sizes, &ctx[i].scratch);
    }
    if (!rc) {
        batch_job job = {ctx, n_calls, first};
        rc = sa_parallel_for((int)items, workers, batch_item, &job);
    }
    /* (a context never prepared, or without scratch, frees nothing) */
    for (int i = 0; ctx && i < n_calls; i++)
        ctx_free(&ctx[i], workers);
    free(first);
    free(ctx);
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
