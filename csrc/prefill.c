/*
 * Prefill: exact causal attention (spec §3) and sparse prefill (§7), with
 * the importance of what ran.
 *
 * Query rows are taken in tiles.  A tile is up to `rows` consecutive query
 * positions [p0, p1) of one KV head's G query heads, rows x G query vectors
 * scored together, so every K and V row read serves all of them (a query
 * tile against a stream of keys: the shape of a flash-attention CPU kernel,
 * built from the decode kernels, which batch any number of query rows).  A
 * tile's keys are its "earlier" keys, then its causal keys [c0, p1), of
 * which the row at position p reads [c0, p]:
 *   exact   earlier = [0, c0) with c0 = p0;
 *   sparse  tiles lie in one KV block b (c0 = b * block_size); earlier =
 *           every block before b when b < k_blocks, else the k_blocks - 1
 *           blocks the decode rules choose among them from the mean query
 *           row of the block's rows (one choice per head, or per group).
 * A sparse call with an exact tail is two runs of tiles: the rows before
 * the tail's first block sparse, then the tail exact (sa_prefill).
 * Each query row keeps its full row of scores (at most max_tok of them), so
 * its softmax is taken once over the exact maximum and V is added in key
 * order.  On q8 K a row's arithmetic is dense decode's at seq_len =
 * position + 1, bit for bit up to one decode chunk (q8 V rows are
 * dequantised once per worker and KV head, and accumulate_v_q8 dequantises
 * the same way, kernels.h).  A call with PACK_VECTORS query vectors per KV
 * head or more scores in GEMM form (panels.c): each worker packs a KV
 * head's keys into the table's panels once per call and every tile reads
 * them, so no score needs a horizontal sum; q8 scores keep their bits, a
 * float32 row then agrees with decode within rounding (spec §3).  A score's
 * arithmetic never depends on the tile, and the form is the call's, so
 * sparse prefill's exact rows and the exact tail stay exact prefill's bit
 * for bit.
 * The tile's rows are capped so that one worker's scores stay within
 * SCORE_BYTES.
 *
 * Importance: per tile and head, the column sums of the final
 * probabilities (the rows' weights times 1/z, summed by accumulate_v_f32
 * over the tile's rows), added in double into the work item's array.
 *
 * Work items are (KV head, slice of tiles), slices of about equal cost (the
 * keys all their rows read) so that models with few KV heads (SmolLM2 has
 * 3) still keep every thread busy.  Tiles and slices depend on T, start and
 * the parameters only, and the items' importance is added in item order, so
 * nothing depends on the thread count.
 */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attend.h"
#include "bounds.h"
#include "channels.h"
#include "choose.h"
#include "panels.h"
#include "probe.h"
#include "probe_rows.h"
#include "rows.h"

/* A tile's score rows are written, exponentiated, read for V and read for
 * the importance, so they should stay near the core: with a 16 MiB cap a
 * Qwen2.5-0.5B layer (7 query heads per KV head, head_dim 64) at 16384
 * tokens kept 14.7 MB of rows per worker and ran 1.45x slower than with
 * 2 MiB (and 0.65x torch SDPA's speed); a smaller tile only reads K/V more
 * often (sparse-attn bench model; CHANGELOG.md, 0.2.0). */
#define TILE_ROWS 32                    /* query rows per tile, at most */
#define MIN_TILE_ROWS 4                 /* ... and at least, when the cap shrinks it */
#define SCORE_BYTES ((size_t)2 << 20)   /* one worker's score rows, at most */
#define DQ_ROWS 64                      /* q8 V rows dequantised at a time */
#define ITEMS_TARGET 32                 /* work items per call, about */
#define PACK_VECTORS 256                /* query vectors per KV head that repay a
                                         * worker's copy of the head's keys
                                         * (spec §3; panels.c) */

typedef struct {
    int p0, p1; /* query positions [p0, p1) */
    int c0;     /* first causal key */
    int block;  /* sparse: the KV block of the rows; exact: -1 */
} tile;

/* One worker's state. */
typedef struct {
    sa_scratch *att;     /* the tile's query vectors (G = rows * heads) */
    sa_scratch *sel;     /* the G heads' block choice (sparse) */
    float *qt;           /* [rows * G, D] query vectors, vector i = r * G + g */
    float *ot;           /* [rows * G, ot_stride] their outputs, before 1 / z */
    ptrdiff_t ot_stride; /* D rounded up to an odd number of cache lines */
    float *rep;          /* [G, D] mean query rows of a block (sparse) */
    float *colsum;       /* [max_tok] one head's importance in a tile */
    float *w;            /* [rows] 1 / z of one head's rows */
    float *vf;           /* q8 V dequantised: a KV head's rows [0, S) (v_whole), else DQ_ROWS */
    int *vf_head;        /* v_whole: [blocks of DQ_ROWS rows] the KV head + 1 each holds */
    int32_t *reserve;    /* [n_sel] the importance reserve of a block */
    int *all;            /* [G] 0 .. G-1 */
    int sel_kh, sel_block; /* whose choice sel->chosen holds (-1: none) */
    sa_panel_buf kt;     /* a KV head's keys [0, S) in the kernels' panels */
} worker;

typedef struct {
    const sa_kernels *kern;
    const float *q;
    int G;
    int qT, q0;  /* q and out: rows per head, and the position of row 0 */
    int start, S; /* this run's query positions [start, S) */
    const sa_kv *k, *v;
    const sa_select_params *sp; /* NULL: exact */
    const double *prior;        /* block sums of the prior importance, or NULL */
    float scale;
    float *out;
    const tile *tiles;
    int slices;
    const int *slice_tile;      /* [slices + 1] first tile of each slice */
    double *imp;                /* [items, S] */
    worker *w;
    sa_panels panels;           /* K's layout for the GEMM-form scores */
    int v_whole;                /* q8 V: a worker keeps a KV head's V dequantised */
} prefill_ctx;

enum { SCORES, VALUES };

static float *out_row(const prefill_ctx *c, int kh, const tile *tl, int i)
{
    const int r = i / c->G, g = i % c->G;
    return c->out + ((ptrdiff_t)(kh * c->G + g) * c->qT + (tl->p0 - c->q0) + r) *
                        c->k->head_dim;
}

/* s->op[j] += sum_t s->pp[j][t] * V[kh, row + t], t < n.  q8 V is read as
 * float rows (dequantize_rows: spec §4's other order than accumulate_v_q8's,
 * within rounding of it, kernels.h): from the
 * worker's copy of KV head kh's V, dequantised DQ_ROWS rows at a time when a
 * tile first reads them, when the call's tiles repay it (c->v_whole); else
 * DQ_ROWS rows at a time into a small buffer, for this run only. */
static void add_values(const prefill_ctx *c, worker *w, int kh, int cnt, int row, int n)
{
    sa_scratch *s = w->att;
    const sa_kv *v = c->v;
    if (v->dtype == SA_DTYPE_F32) {
        sa_accumulate_rows(c->kern, s, v, kh, cnt, row, n, NULL);
        return;
    }
    const int D = v->head_dim, gs = v->group_size, ng = D / gs;
    if (n <= 0)
        return;
    if (!c->v_whole) {
        for (int done = 0; done < n;) {
            const int m = sa_min(DQ_ROWS, n - done);
            c->kern->dequantize_rows(sa_kv_q8_row(v, kh, row + done),
                                     sa_kv_scale_row(v, kh, row + done), D, gs, m, D, ng, w->vf);
            const sa_kv view = {.dtype = SA_DTYPE_F32, .n_kv_heads = 1, .head_stride = m,
                                .n_rows = m, .head_dim = D, .group_size = 1, .f32 = w->vf};
            sa_accumulate_rows(c->kern, s, &view, 0, cnt, 0, m, NULL);
            for (int j = 0; j < cnt; j++)
                s->pp[j] += m;
            done += m;
        }
        for (int j = 0; j < cnt; j++)
            s->pp[j] -= n;
        return;
    }
    for (int b = row / DQ_ROWS; b <= (row + n - 1) / DQ_ROWS; b++) {
        if (w->vf_head[b] == kh + 1)
            continue;
        const int r0 = b * DQ_ROWS, m = sa_min(DQ_ROWS, c->S - r0);
        c->kern->dequantize_rows(sa_kv_q8_row(v, kh, r0), sa_kv_scale_row(v, kh, r0), D, gs, m,
                                 D, ng, w->vf + (ptrdiff_t)r0 * D);
        w->vf_head[b] = kh + 1;
    }
    const sa_kv view = {.dtype = SA_DTYPE_F32, .n_kv_heads = 1, .head_stride = c->S,
                        .n_rows = c->S, .head_dim = D, .group_size = 1, .f32 = w->vf};
    sa_accumulate_rows(c->kern, s, &view, 0, cnt, row, n, NULL);
}

/* Keys [row, row + n) for the rows of the nh heads hs of a tile: their
 * scores (SCORES) or their weighted V rows (VALUES), at each head's offset
 * s->off[g], which then moves on by n. */
static void key_run(const prefill_ctx *c, worker *w, int kh, const tile *tl, const int *hs,
                    int nh, int row, int n, int pass)
{
    sa_scratch *s = w->att;
    const int G = c->G, R = tl->p1 - tl->p0;
    int j = 0;
    for (int r = 0; r < R; r++)
        for (int x = 0; x < nh; x++, j++) {
            const int i = r * G + hs[x];
            float *sc = s->scores + (ptrdiff_t)i * s->score_stride + s->off[hs[x]];
            s->heads[j] = i;
            if (pass == SCORES) {
                s->sp[j] = sc;
            } else {
                s->pp[j] = sc;
                s->op[j] = w->ot + i * w->ot_stride;
            }
        }
    if (pass == SCORES)
        sa_panel_scores(&c->panels, &w->kt, s, w->qt, kh, j, row, n);
    else
        add_values(c, w, kh, j, row, n);
    for (int x = 0; x < nh; x++)
        s->off[hs[x]] += n;
}

/* 1 if the tile's earlier keys are a choice of blocks (w->sel->chosen). */
static int chooses(const prefill_ctx *c, const tile *tl)
{
    return c->sp && tl->block >= c->sp->k_blocks;
}

/* The earlier keys of a tile, run by run, for one pass. */
static void earlier_keys(const prefill_ctx *c, worker *w, int kh, const tile *tl, int pass)
{
    if (!chooses(c, tl)) {
        if (tl->c0 > 0)
            key_run(c, w, kh, tl, w->all, c->G, 0, tl->c0, pass);
        return;
    }
    const sa_scratch *ss = w->sel;
    const int bs = c->sp->block_size;
    int b = 0, e = 0, cnt;
    while ((cnt = sa_next_run(ss, &b, &e, ss->heads)) > 0) {
        key_run(c, w, kh, tl, ss->heads, cnt, sa_block_start(b, bs), (e - b) * bs, pass);
        b = e;
    }
}

/* The choice of earlier blocks for the rows of block `block` (sparse
 * prefill, block >= k_blocks): the decode rules over blocks [0, block) with
 * k_blocks - 1 slots, scored by each head's mean query row over the block's
 * rows in this call.  Kept for the worker's next tile of the same block. */
static void choose_blocks(const prefill_ctx *c, worker *w, int kh, int block)
{
    if (w->sel_kh == kh && w->sel_block == block)
        return;
    sa_scratch *ss = w->sel;
    const sa_select_params *sp = c->sp;
    const int G = c->G, D = ss->D, bs = sp->block_size;
    const int r0 = sa_max(c->start, sa_block_start(block, bs));
    const int r1 = sa_block_end(block, bs, c->S);
    ss->NB = block;
    ss->n_sel = sp->k_blocks - 1;
    w->sel_kh = kh;
    w->sel_block = block;
    if (ss->n_sel == 0) {
        memset(ss->chosen, 0, (size_t)G * block);
        ss->n_uni = 0;
        return;
    }
    const float inv = 1.0f / (float)(r1 - r0);
    for (int g = 0; g < G; g++) {
        float *rep = w->rep + (ptrdiff_t)g * D;
        const float *qh = c->q + ((ptrdiff_t)(kh * G + g) * c->qT + (r0 - c->q0)) * D;
        memcpy(rep, qh, (size_t)D * sizeof(float));
        for (int r = 1; r < r1 - r0; r++)
            for (int i = 0; i < D; i++)
                rep[i] += qh[(ptrdiff_t)r * D + i];
        for (int i = 0; i < D; i++)
            rep[i] *= inv;
    }
    if (sp->scoring == SA_SCORING_MINMAX) {
        sa_minmax_group(c->kern, ss, sp->bounds, kh, w->rep, sp->share == SA_SHARE_GROUP);
    } else if (sp->scoring == SA_SCORING_CHANNELS) {
        /* blocks [0, block) are whole */
        sa_channels_group(c->kern, ss, sp->channels, sp->n_channels, kh, w->rep,
                          sa_block_start(block, bs));
    } else {
        if (c->k->dtype == SA_DTYPE_Q8)
            sa_quantize_group(ss, w->rep, c->k->group_size);
        sa_probe_group(c->kern, ss, c->k, kh, w->rep, sa_block_start(block, bs), bs,
                       sp->n_probe, sp->probe_rows);
    }
    sa_reserve reserve = {w->reserve, 0};
    if (c->prior)
        reserve.n = sa_reserve_rank(c->prior, block, sp, ss->n_sel, w->reserve);
    sa_choose_group(ss, sp, c->prior ? &reserve : NULL, NULL);
}

/* Add the tile's importance for head g: the column sums of its rows'
 * probabilities, to the keys they belong to. */
static void tile_importance(const prefill_ctx *c, worker *w, const tile *tl, int g, double *imp)
{
    const sa_scratch *s = w->att;
    const int G = c->G, R = tl->p1 - tl->p0, causal = tl->p1 - tl->c0;
    const int n = s->off[g] + causal;
    for (int r = 0; r < R; r++)
        w->w[r] = 1.0f / s->z[r * G + g];
    memset(w->colsum, 0, (size_t)n * sizeof(float));
    float *cs = w->colsum;
    const float *wp = w->w;
    c->kern->accumulate_v_f32(&cs, &wp, 1, n, s->scores + (ptrdiff_t)g * s->score_stride,
                              (ptrdiff_t)G * s->score_stride, R, NULL);
    int o = 0;
    if (!chooses(c, tl)) {
        for (; o < tl->c0; o++)
            imp[o] += w->colsum[o];
    } else {
        const sa_scratch *ss = w->sel;
        const int bs = c->sp->block_size;
        for (int b = 0; b < ss->NB; b++) {
            if (!ss->chosen[(ptrdiff_t)g * ss->NB + b])
                continue;
            double *dst = imp + sa_block_start(b, bs);
            for (int t = 0; t < bs; t++)
                dst[t] += w->colsum[o + t];
            o += bs;
        }
    }
    for (int t = 0; t < causal; t++)
        imp[tl->c0 + t] += w->colsum[o + t];
}

static void tile_run(const prefill_ctx *c, worker *w, int kh, const tile *tl, double *imp)
{
    sa_scratch *s = w->att;
    const int G = c->G, D = c->k->head_dim, R = tl->p1 - tl->p0, m = R * G;
    const int causal = tl->p1 - tl->c0;
    s->G = m; /* the tile's vectors are "all" of them (rows.c reads them in place) */
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++)
            memcpy(w->qt + ((ptrdiff_t)r * G + g) * D,
                   c->q + ((ptrdiff_t)(kh * G + g) * c->qT + (tl->p0 - c->q0) + r) * D,
                   (size_t)D * sizeof(float));
    if (c->k->dtype == SA_DTYPE_Q8)
        sa_quantize_group(s, w->qt, c->k->group_size);
    if (chooses(c, tl))
        choose_blocks(c, w, kh, tl->block);

    /* Scores: the earlier keys, then the causal ones (all rows score up to
     * the last row's key; each row's softmax takes only its own). */
    for (int g = 0; g < G; g++)
        s->off[g] = 0;
    earlier_keys(c, w, kh, tl, SCORES);
    for (int i = 0; i < m; i++) {
        s->heads[i] = i;
        s->sp[i] = s->scores + (ptrdiff_t)i * s->score_stride + s->off[i % G];
    }
    sa_panel_scores(&c->panels, &w->kt, s, w->qt, kh, m, tl->c0, causal);

    for (int i = 0; i < m; i++) {
        const int r = i / G, g = i % G;
        const int n = s->off[g] + (tl->p0 + r - tl->c0 + 1);
        float *p = s->scores + (ptrdiff_t)i * s->score_stride;
        s->z[i] = c->kern->softmax_exp(p, n, c->scale, NULL);
        /* zero weight for the keys beyond the row (the importance sums
         * every row over the tile's keys) */
        memset(p + n, 0, (size_t)(s->off[g] + causal - n) * sizeof(float));
        memset(w->ot + i * w->ot_stride, 0, (size_t)D * sizeof(float));
    }

    /* V: the earlier keys; then the causal ones in key order: key c0 .. p0
     * for every row, key p0 + j for the rows from j on.  No zero weight
     * ever multiplies a key beyond its row (0 * NaN is NaN). */
    for (int g = 0; g < G; g++)
        s->off[g] = 0;
    earlier_keys(c, w, kh, tl, VALUES);
    for (int i = 0; i < m; i++) {
        s->pp[i] = s->scores + (ptrdiff_t)i * s->score_stride + s->off[i % G];
        s->op[i] = w->ot + i * w->ot_stride;
    }
    add_values(c, w, kh, m, tl->c0, tl->p0 + 1 - tl->c0);
    for (int j = 1; j < R; j++) {
        const int first = j * G, key = tl->p0 + j;
        for (int i = first; i < m; i++) {
            s->pp[i - first] = s->scores + (ptrdiff_t)i * s->score_stride + s->off[i % G] +
                               (key - tl->c0);
            s->op[i - first] = w->ot + i * w->ot_stride;
        }
        add_values(c, w, kh, m - first, key, 1);
    }

    for (int i = 0; i < m; i++) {
        float *o = out_row(c, kh, tl, i);
        const float *a = w->ot + i * w->ot_stride;
        for (int d = 0; d < D; d++)
            o[d] = a[d] / s->z[i];
    }
    for (int g = 0; g < G; g++)
        tile_importance(c, w, tl, g, imp);
}

static int prefill_item(void *arg, int item, int worker_id)
{
    const prefill_ctx *c = arg;
    worker *w = &c->w[worker_id];
    const int kh = item / c->slices, slice = item % c->slices;
    double *imp = c->imp + (ptrdiff_t)item * c->S;
    memset(imp, 0, (size_t)c->S * sizeof(double));
    for (int t = c->slice_tile[slice]; t < c->slice_tile[slice + 1]; t++)
        tile_run(c, w, kh, &c->tiles[t], imp);
    return SA_OK;
}

/* The tiles of a call (tiles NULL: only count them). */
static int make_tiles(int start, int S, int rows, const sa_select_params *sp, tile *tiles)
{
    int n = 0;
    if (!sp) {
        for (int64_t p0 = start; p0 < S; p0 += rows, n++)
            if (tiles)
                tiles[n] = (tile){(int)p0, (int)(p0 + rows < S ? p0 + rows : S), (int)p0, -1};
        return n;
    }
    const int bs = sp->block_size;
    for (int b = start / bs; (int64_t)b * bs < S; b++) {
        const int r1 = sa_block_end(b, bs, S);
        for (int64_t p0 = sa_max(start, sa_block_start(b, bs)); p0 < r1; p0 += rows, n++)
            if (tiles)
                tiles[n] = (tile){(int)p0, (int)(p0 + rows < r1 ? p0 + rows : r1),
                                  sa_block_start(b, bs), b};
    }
    return n;
}

/* What a tile costs: the keys its rows read. */
static double tile_cost(const tile *tl, const sa_select_params *sp)
{
    const double rows = tl->p1 - tl->p0;
    const double earlier = sp && tl->block >= sp->k_blocks
                               ? (double)(sp->k_blocks - 1) * sp->block_size
                               : (double)tl->c0;
    return rows * (earlier + (tl->p0 - tl->c0 + 1)) + rows * (rows - 1) / 2;
}

/* Slice bounds over the tiles: contiguous ranges of about equal cost. */
static void make_slices(const tile *tiles, int n_tiles, const sa_select_params *sp,
                        int slices, int *bounds)
{
    double total = 0.0, done = 0.0;
    for (int t = 0; t < n_tiles; t++)
        total += tile_cost(&tiles[t], sp);
    int t = 0;
    bounds[0] = 0;
    for (int sl = 1; sl < slices; sl++) {
        while (t < n_tiles && done < total * sl / slices)
            done += tile_cost(&tiles[t++], sp);
        bounds[sl] = t;
    }
    bounds[slices] = n_tiles;
}

/* Carve one worker's buffers out of one allocation (NULL on overflow or
 * no memory): `panels` of packed K of panel_bytes each (0: none), and
 * v_blocks blocks of DQ_ROWS dequantised q8 V rows (0 for float32 V), each
 * with a tag when tagged. */
static char *worker_buffers(worker *w, int m, int G, int D, int max_tok, int rows, int n_sel,
                            int panels, size_t panel_bytes, int v_blocks, int tagged)
{
    size_t lines = ((size_t)D + 15) / 16;
    lines += !(lines & 1);
    w->ot_stride = (ptrdiff_t)(lines * 16);
    enum { N = 11 };
    size_t off = 0, sizes[N];
    const size_t counts[N][2] = {
        {(size_t)m * D, sizeof(float)},   {(size_t)m * lines * 16, sizeof(float)},
        {(size_t)G * D, sizeof(float)},
        {(size_t)max_tok, sizeof(float)}, {(size_t)rows, sizeof(float)},
        {(size_t)v_blocks * DQ_ROWS, (size_t)D * sizeof(float)},
        {(size_t)(n_sel > 0 ? n_sel : 1), sizeof(int32_t)}, {(size_t)G, sizeof(int)},
        {(size_t)panels, panel_bytes}, {(size_t)(tagged ? panels : 0), sizeof(int)},
        {(size_t)(tagged ? v_blocks : 0), sizeof(int)}};
    for (int i = 0; i < N; i++) {
        if (__builtin_mul_overflow(counts[i][0], counts[i][1], &sizes[i]) ||
            __builtin_add_overflow(sizes[i], (size_t)63, &sizes[i]))
            return NULL;
        sizes[i] &= ~(size_t)63;
        if (__builtin_add_overflow(off, sizes[i], &off))
            return NULL;
    }
    char *base = aligned_alloc(64, off > 0 ? off : 64);
    if (!base)
        return NULL;
    char *p = base;
    w->qt = (float *)p, p += sizes[0];
    w->ot = (float *)p, p += sizes[1];
    w->rep = (float *)p, p += sizes[2];
    w->colsum = (float *)p, p += sizes[3];
    w->w = (float *)p, p += sizes[4];
    w->vf = (float *)p, p += sizes[5];
    w->reserve = (int32_t *)p, p += sizes[6];
    w->all = (int *)p, p += sizes[7];
    w->kt.data = p, p += sizes[8];
    w->kt.head = (int *)p, p += sizes[9];
    memset(w->kt.head, 0, sizes[9]);
    w->vf_head = (int *)p;
    memset(w->vf_head, 0, sizes[10]);
    for (int g = 0; g < G; g++)
        w->all[g] = g;
    w->sel_kh = w->sel_block = -1;
    return base;
}

static int check_prefill(const float *q, int n_heads, int T, const sa_kv *k, const sa_kv *v,
                         int start, const sa_select_params *sp, const float *prior,
                         int64_t n_prior, float scale, const float *out, const float *imp)
{
    int rc = sa_check_kv_pair(k, v);
    if (rc)
        return rc;
    if (!out || !imp)
        return SA_ERR_NULL;
    if (T < 1 || start < 0)
        return SA_ERR_SHAPE;
    const int64_t S = (int64_t)start + T;
    if (S > k->n_rows || S > v->n_rows)
        return SA_ERR_SEQ_LEN;
    if ((rc = sa_check_query(q, n_heads, k, (int64_t)n_heads * T)))
        return rc;
    if (!(isfinite(scale) && scale > 0.0f))
        return SA_ERR_SCALE;
    if (!sp)
        return SA_OK;
    if ((rc = sa_check_select_params(sp)))
        return rc;
    if (sp->scoring == SA_SCORING_MINMAX &&
        (rc = sa_check_bounds(sp->bounds, k, (int)S, sp->block_size)))
        return rc;
    if (sp->scoring == SA_SCORING_CHANNELS &&
        (rc = sa_check_channels(sp->channels, k, (int)S, sp->block_size)))
        return rc;
    if (sp->scoring == SA_SCORING_PROBE && sp->probe_rows &&
        (rc = sa_check_probe_rows(sp->probe_rows, k, (int)S, sp->block_size, sp->n_probe)))
        return rc;
    if (prior && n_prior < start)
        return SA_ERR_IMPORTANCE;
    if (prior && !sa_all_finite(prior, start))
        return SA_ERR_IMPORTANCE_VALUES;
    return SA_OK;
}

/* One run of tiles over the query positions [start, S) of a call whose q
 * and out hold qT rows per head from position q0: exact (params NULL) or
 * sparse.  Adds the run's importance to acc[0, S), work item by work item.
 * `amortized`: the call packs K in panels (panels.h). */
static int prefill_run(const float *q, int n_heads, int qT, int q0, const sa_kv *k,
                       const sa_kv *v, int start, int S, const sa_select_params *params,
                       const float *prior, float scale, float *out, double *acc, int amortized,
                       int threads)
{
    int rc;
    const int Hkv = k->n_kv_heads, G = n_heads / Hkv, D = k->head_dim;
    const int gs = k->dtype == SA_DTYPE_Q8 ? k->group_size : 1;
    const int bs = params ? params->block_size : 1;
    const int NB = params ? sa_ceil_div(S, bs) : 1;
    const int64_t reach = params ? (int64_t)params->k_blocks * bs : S;
    const int max_tok = (int)(reach < S ? reach : S);
    int rows = params ? sa_min(TILE_ROWS, bs) : TILE_ROWS;
    while (rows > MIN_TILE_ROWS && (double)rows * G * max_tok * sizeof(float) > SCORE_BYTES)
        rows /= 2;
    if (G > INT_MAX / rows)
        return SA_ERR_SIZE;
    const int m = rows * G, n_sel = params ? params->k_blocks - 1 : 0;
    /* the table once: the panels are laid out for its kernels */
    const sa_kernels *kern = sa_active_kernels();
    const sa_panels panels = sa_panels_layout(kern, k, S, amortized);
    const int v_whole = v->dtype == SA_DTYPE_Q8 && amortized;
    const int v_blocks = v->dtype != SA_DTYPE_Q8 ? 0 : v_whole ? sa_ceil_div(S, DQ_ROWS) : 1;

    const int n_tiles = make_tiles(start, S, rows, params, NULL);
    const int slices = sa_max(1, sa_min(sa_ceil_div(ITEMS_TARGET, Hkv), n_tiles));
    if (Hkv > INT_MAX / slices)
        return SA_ERR_SIZE;
    const int items = Hkv * slices;
    const int workers = sa_workers_for(items, threads);
    size_t imp_bytes;
    if (__builtin_mul_overflow((size_t)items * sizeof(double), (size_t)S, &imp_bytes))
        return SA_ERR_SIZE;

    prefill_ctx c = {.kern = kern, .q = q, .G = G, .qT = qT, .q0 = q0,
                     .start = start, .S = S, .k = k, .v = v, .sp = params, .scale = scale,
                     .out = out, .slices = slices, .panels = panels, .v_whole = v_whole};
    tile *tiles = malloc((size_t)n_tiles * sizeof(tile));
    int *slice_tile = malloc((size_t)(slices + 1) * sizeof(int));
    double *prior_sums = params && prior ? malloc((size_t)NB * sizeof(double)) : NULL;
    c.imp = malloc(imp_bytes);
    c.w = calloc((size_t)workers, sizeof(worker));
    char **bufs = calloc((size_t)workers, sizeof(char *));
    sa_scratch **att = NULL, **sel = NULL;
    rc = SA_ERR_NOMEM;
    if (!tiles || !slice_tile || (params && prior && !prior_sums) || !c.imp || !c.w || !bufs)
        goto done;
    make_tiles(start, S, rows, params, tiles);
    make_slices(tiles, n_tiles, params, slices, slice_tile);
    c.tiles = tiles;
    c.slice_tile = slice_tile;
    if (prior_sums) {
        sa_block_sums(prior, start, bs, NB, prior_sums);
        c.prior = prior_sums;
    }
    const sa_scratch_sizes za = {.G = m, .D = D, .group_size = gs, .NB = 1, .n_sel = 1,
                                 .max_tok = max_tok, .probe_tmp_per_head = 0};
    if ((rc = sa_scratch_array(workers, &za, &att)))
        goto done;
    if (params) {
        const int probes = params->scoring == SA_SCORING_PROBE && n_sel > 0;
        const sa_scratch_sizes zs = {
            .G = G, .D = D, .group_size = gs, .NB = NB, .n_sel = sa_max(n_sel, 1),
            .max_tok = 1,
            .probe_tmp_per_head = probes ? sa_probe_tmp_floats(S, bs, params->n_probe) : 0,
            .channel_rows = params->scoring == SA_SCORING_CHANNELS && n_sel > 0
                                ? sa_min(bs, S) : 0};
        if ((rc = sa_scratch_array(workers, &zs, &sel)))
            goto done;
    }
    rc = SA_ERR_NOMEM;
    for (int i = 0; i < workers; i++) {
        c.w[i].att = att[i];
        c.w[i].sel = sel ? sel[i] : NULL;
        if (!(bufs[i] = worker_buffers(&c.w[i], m, G, D, max_tok, rows, n_sel, panels.count,
                                       sa_panel_bytes(&panels), v_blocks, amortized)))
            goto done;
    }
    rc = sa_parallel_for(items, workers, prefill_item, &c);
    if (rc == SA_OK)
        for (int j = 0; j < S; j++) {
            double a = acc[j];
            for (int it = 0; it < items; it++)
                a += c.imp[(ptrdiff_t)it * S + j];
            acc[j] = a;
        }
done:
    for (int i = 0; bufs && i < workers; i++)
        free(bufs[i]);
    free(bufs);
    sa_scratch_array_free(att, workers);
    sa_scratch_array_free(sel, workers);
    free(c.w);
    free(c.imp);
    free(prior_sums);
    free(slice_tile);
    free(tiles);
    return rc;
}

int sa_prefill(const float *q, int n_heads, int T, const sa_kv *k, const sa_kv *v, int start,
               const sa_select_params *params, const float *prior, int64_t n_prior,
               float scale, float *out, float *importance, int threads)
{
    int rc = check_prefill(q, n_heads, T, k, v, start, params, prior, n_prior, scale, out,
                           importance);
    if (rc)
        return rc;
    const int S = start + T;
    /* The exact tail (spec §7.6): from the start of the block holding
     * position S - exact_tail on, one exact run; before it, the sparse one.
     * The split lies on a block boundary, so the sparse run's blocks and
     * choices are those of the call without a tail. */
    int split = S;
    if (params && params->exact_tail > 0) {
        const int64_t from = (int64_t)S - params->exact_tail, bs = params->block_size;
        const int64_t aligned = from <= start ? start : from / bs * bs;
        split = (int)(aligned > start ? aligned : start);
    }
    double *acc = calloc((size_t)S, sizeof(double));
    if (!acc)
        return SA_ERR_NOMEM;
    rc = SA_OK;
    /* GEMM-form scores from panels when the call's query vectors per KV head
     * repay a worker's copy of a head's keys (spec §3): decided for the whole
     * call, so the exact tail's rows are the call's exact prefill rows bit
     * for bit.  Float32 K also needs the call's rows to be a quarter of its
     * keys or more: a short chunk after a long context (512 rows after 32K
     * keys) ran 8-14% slower from panels, prompts 0.8-1.0x the time. */
    const int amortized = (int64_t)T * (n_heads / k->n_kv_heads) >= PACK_VECTORS &&
                          (k->dtype == SA_DTYPE_Q8 || 4 * (int64_t)T >= S);
    if (split > start)
        rc = prefill_run(q, n_heads, T, start, k, v, start, split, params, prior, scale, out,
                         acc, amortized, threads);
    if (rc == SA_OK && split < S)
        rc = prefill_run(q, n_heads, T, start, k, v, split, S, NULL, NULL, scale, out, acc,
                         amortized, threads);
    if (rc == SA_OK)
        for (int j = 0; j < S; j++)
            importance[j] = (float)acc[j];
    free(acc);
    return rc;
}
