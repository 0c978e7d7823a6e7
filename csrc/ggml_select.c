/*
 * Spec §8's sparse decode over llama.cpp's cache: the blocks each decode row
 * of sa_ggml_flash_attn reads, chosen from K itself with nothing kept
 * between calls.
 *
 * A row's sequence is its valid cells (mask value not -Inf) in cell order,
 * found once per row by the calling thread (a scan of the row's mask: two
 * bytes a cell, beside the hundreds a cell's K and V hold).  Its blocks are
 * runs of block_size positions of that sequence.  The probe is split into
 * items of (row, KV head, PROBE_PART_BLOCKS blocks), so a model with few KV
 * heads still keeps every thread busy: an item converts its blocks' sampled
 * cells (the same conversion as the attention's) in batches, scores them
 * against the group's query rows with the kernel table and keeps each
 * block's largest dot.  The item that finishes a (row, KV head) last makes
 * its choice (sa_choose_group: the same sinks, fill, recency and share
 * rules as every other entry), whoever runs it: the choice reads the
 * finished scores only, so it is the same for every thread count.
 */
#include <limits.h>
#include <math.h>
#include <stdlib.h>

#include "choose.h"
#include "ggml_internal.h"

/* Blocks per probe item: 2048 cells at block_size 32, 512 sampled rows at
 * n_probe 8, a few microseconds' work (chosen, not tuned). */
#define PROBE_PART_BLOCKS 64

typedef struct {
    float *qf;        /* G x D query rows */
    int8_t *qq;       /* quantised (Q8_0 K) */
    float *qd;
    float *kf;        /* CHUNK x D float32 rows (F16 K) */
    int8_t *kq;       /* CHUNK x D int8 rows (Q8_0 K) ... */
    float *kd;        /* ... and their scales */
    uint16_t *halves; /* ng halves on the way to floats */
    int32_t *blk;     /* per sampled row of a batch: its block */
    float *dots;      /* G x SCORE_STRIDE */
    float **sp;       /* G pointers handed to the kernel */
    double *score;    /* the chooser's (sa_scratch): nb_max */
    int32_t *top, *uni, *sel, *tmp;
    uint8_t *used, *chosen;
} probe_worker;

typedef struct {
    const sa_ggml_attn *a;
    const sa_select_params *p;
    const sa_kernels *kern;
    sa_ggml_choice *ch;
    int D, ng, q8, n_q, k_blocks;
    int *item_rk;     /* per item: its (row, kh) */
    int *item_part;   /* per item: its part */
    probe_worker **w;
} probe_call;

static int n_blocks(const sa_ggml_choice *ch, int row)
{
    return sa_ceil_div(ch->n_valid[row], ch->bs);
}

/* Score the batch's cnt sampled rows and fold them into their blocks'
 * maxima (probe: G rows of nb apart). */
static void score_batch(const probe_call *c, probe_worker *w, int G, int cnt, float *probe,
                        int nb)
{
    if (c->q8)
        c->kern->scores_q8(w->qq, w->qd, G, c->D, SA_GGML_Q8_0_GROUP, w->kq, w->kd, c->D, c->ng,
                           cnt, w->sp, NULL);
    else
        c->kern->scores_f32(w->qf, G, c->D, w->kf, c->D, cnt, w->sp, NULL);
    for (int g = 0; g < G; g++) {
        const float *d = w->sp[g];
        float *best = probe + (ptrdiff_t)g * nb;
        for (int j = 0; j < cnt; j++)
            best[w->blk[j]] = d[j] > best[w->blk[j]] ? d[j] : best[w->blk[j]];
    }
}

/* The (row, kh)'s choice from its finished probe scores: per head the
 * blocks chosen (into a->blocks), the group's cells as positions of the
 * sequence (upos) and, with share head, each head's marks. */
static void choose(const probe_call *c, probe_worker *w, int row, int kh)
{
    sa_ggml_choice *ch = c->ch;
    const int G = ch->G, NB = n_blocks(ch, row), n = ch->n_valid[row];
    const int n_sel = sa_min(c->k_blocks, NB);
    const int rk = row * ch->Hkv + kh;
    sa_scratch s = {.G = G, .NB = NB, .n_sel = n_sel};
    s.probe = ch->probe + (ptrdiff_t)rk * G * ch->nb_max;
    s.score = w->score;
    s.top = w->top;
    s.used = w->used;
    s.sel = w->sel;
    s.chosen = w->chosen;
    s.uni = w->uni;
    sa_choose_group(&s, c->p, NULL, w->tmp);

    int32_t *up = ch->upos + (ptrdiff_t)rk * ch->cap;
    int m = 0;
    for (int i = 0; i < s.n_uni; i++)
        for (int pos = sa_block_start(s.uni[i], ch->bs), e = sa_block_end(s.uni[i], ch->bs, n);
             pos < e; pos++)
            up[m++] = pos;
    ch->n_upos[rk] = m;
    if (ch->marks)
        for (int g = 0; g < G; g++)
            memcpy(ch->marks + ((ptrdiff_t)row * ch->H + (ptrdiff_t)kh * G + g) * ch->nb_max,
                   s.chosen + (ptrdiff_t)g * NB, (size_t)NB);
    if (c->a->blocks)
        for (int g = 0; g < G; g++) {
            int32_t *dst = c->a->blocks +
                           ((int64_t)row * ch->H + (int64_t)kh * G + g) * c->k_blocks;
            memcpy(dst, w->tmp + (ptrdiff_t)g * n_sel, (size_t)n_sel * sizeof(int32_t));
        }
}

static int probe_item(void *arg, int item, int wi)
{
    const probe_call *c = arg;
    probe_worker *w = c->w[wi];
    sa_ggml_choice *ch = c->ch;
    const int rk = c->item_rk[item], part = c->item_part[item];
    const int row = rk / ch->Hkv, kh = rk % ch->Hkv;
    const int s = row / c->n_q, i = row % c->n_q;
    const int G = ch->G, bs = ch->bs, n = ch->n_valid[row], NB = n_blocks(ch, row);
    const int b0 = part * PROBE_PART_BLOCKS, b1 = sa_min(NB, b0 + PROBE_PART_BLOCKS);
    const int32_t *cells = ch->cells + (ptrdiff_t)row * ch->n_kv;
    float *probe = ch->probe + (ptrdiff_t)rk * G * ch->nb_max;

    sa_ggml_load_group(c->a, c->q8, c->D, G, i, kh, s, w->qf, w->qq, w->qd);
    for (int g = 0; g < G; g++) {
        w->sp[g] = w->dots + (ptrdiff_t)g * SA_GGML_SCORE_STRIDE;
        for (int b = b0; b < b1; b++)
            probe[(ptrdiff_t)g * NB + b] = -INFINITY;
    }
    /* spec §2.2 over the sequence: block b's samples p0, p0 + step, ... */
    int cnt = 0;
    for (int b = b0; b < b1; b++) {
        const int p0 = sa_block_start(b, bs), pe = sa_block_end(b, bs, n);
        const int step = sa_max(1, (pe - p0) / c->p->n_probe);
        for (int pos = p0; pos < pe; pos += step) {
            sa_ggml_convert_row(c->kern, &c->a->k, c->q8, c->D, cells[pos], kh, s, w->halves,
                                w->kf, w->kq, w->kd, cnt);
            w->blk[cnt++] = b;
            if (cnt == SA_GGML_CHUNK_CELLS) {
                score_batch(c, w, G, cnt, probe, NB);
                cnt = 0;
            }
            if (pe - pos <= step) /* pos + step may pass INT_MAX */
                break;
        }
    }
    if (cnt)
        score_batch(c, w, G, cnt, probe, NB);
    if (atomic_fetch_sub(&ch->left[rk], 1) == 1)
        choose(c, w, row, kh);
    return SA_OK;
}

/* ------------------------------------------------------------- the call */

static int probe_worker_new(const probe_call *c, probe_worker **out)
{
    const size_t G = (size_t)c->ch->G, D = (size_t)c->D, ng = (size_t)c->ng;
    const size_t cells = SA_GGML_CHUNK_CELLS, q8 = (size_t)c->q8, nb = (size_t)c->ch->nb_max;
    const size_t n_sel = (size_t)sa_min(c->k_blocks, c->ch->nb_max);
    sa_carve l = {sizeof(probe_worker), 0};
    const size_t o_qf = sa_carve_take(&l, G, D, sizeof(float));
    const size_t o_qq = sa_carve_take(&l, G, D * q8, 1);
    const size_t o_qd = sa_carve_take(&l, G, ng * q8, sizeof(float));
    const size_t o_kf = sa_carve_take(&l, cells, D * !q8, sizeof(float));
    const size_t o_kq = sa_carve_take(&l, cells, D * q8, 1);
    const size_t o_kd = sa_carve_take(&l, cells, ng * q8, sizeof(float));
    const size_t o_half = sa_carve_take(&l, ng + 1, 1, sizeof(uint16_t));
    const size_t o_blk = sa_carve_take(&l, cells, 1, sizeof(int32_t));
    const size_t o_dots = sa_carve_take(&l, G, SA_GGML_SCORE_STRIDE, sizeof(float));
    const size_t o_sp = sa_carve_take(&l, G, 1, sizeof(float *));
    const size_t o_score = sa_carve_take(&l, nb, 1, sizeof(double));
    const size_t o_top = sa_carve_take(&l, nb, 1, sizeof(int32_t));
    const size_t o_uni = sa_carve_take(&l, nb, 1, sizeof(int32_t));
    const size_t o_sel = sa_carve_take(&l, n_sel, 1, sizeof(int32_t));
    const size_t o_tmp = sa_carve_take(&l, G, n_sel, sizeof(int32_t));
    const size_t o_used = sa_carve_take(&l, nb, 1, 1), o_chosen = sa_carve_take(&l, G, nb, 1);
    if (l.overflow)
        return SA_ERR_SIZE;
    char *mem = aligned_alloc(64, (l.off + 63) & ~(size_t)63);
    if (!mem)
        return SA_ERR_NOMEM;
    probe_worker *w = (probe_worker *)mem;
    *w = (probe_worker){
        .qf = (float *)(mem + o_qf), .qq = (int8_t *)(mem + o_qq), .qd = (float *)(mem + o_qd),
        .kf = (float *)(mem + o_kf), .kq = (int8_t *)(mem + o_kq), .kd = (float *)(mem + o_kd),
        .halves = (uint16_t *)(mem + o_half), .blk = (int32_t *)(mem + o_blk),
        .dots = (float *)(mem + o_dots), .sp = (float **)(mem + o_sp),
        .score = (double *)(mem + o_score), .top = (int32_t *)(mem + o_top),
        .uni = (int32_t *)(mem + o_uni), .sel = (int32_t *)(mem + o_sel),
        .tmp = (int32_t *)(mem + o_tmp), .used = (uint8_t *)(mem + o_used),
        .chosen = (uint8_t *)(mem + o_chosen)};
    *out = w;
    return SA_OK;
}

void sa_ggml_choice_free(sa_ggml_choice *c)
{
    free(c->n_valid);
    free(c->cells);
    free(c->sparse);
    free(c->n_upos);
    free(c->upos);
    free(c->marks);
    free(c->probe);
    free(c->left);
    memset(c, 0, sizeof *c);
}

/* A row's valid cells, ascending, into cells; their count. */
static int valid_cells(const sa_ggml_attn *a, int n_kv, int i, int s, int32_t *cells)
{
    if (!a->mask) {
        for (int c = 0; c < n_kv; c++)
            cells[c] = c;
        return n_kv;
    }
    const uint16_t *m = sa_ggml_mask_row(a, i, 0, s);
    int n = 0;
    for (int c = 0; c < n_kv; c++) {
        cells[n] = c;
        n += m[c] != SA_GGML_HALF_NEG_INF;
    }
    return n;
}

/* Per (row, head): blocks 0 .. NB-1 (every block, the row read exactly). */
static void write_every_block(const sa_ggml_attn *a, const sa_ggml_choice *ch, int row)
{
    const int NB = n_blocks(ch, row), k = a->select->k_blocks;
    for (int h = 0; h < ch->H; h++) {
        int32_t *dst = a->blocks + ((int64_t)row * ch->H + h) * k;
        for (int b = 0; b < NB; b++)
            dst[b] = b;
    }
}

int sa_ggml_choose(const sa_ggml_attn *a, const sa_kernels *kern, int threads,
                   sa_ggml_choice *ch, int *any)
{
    const sa_select_params *p = a->select;
    const int n_q = (int)a->q.ne[1], ns = (int)a->q.ne[3], n_kv = (int)a->k.ne[1];
    memset(ch, 0, sizeof *ch);
    *any = 0;
    ch->n_rows = n_q * ns; /* at most SA_GGML_DECODE_ROWS * INT_MAX streams: checked below */
    if ((int64_t)n_q * ns > INT_MAX)
        return SA_ERR_SIZE;
    ch->n_kv = n_kv;
    ch->H = (int)a->q.ne[2];
    ch->Hkv = (int)a->k.ne[2];
    ch->G = ch->H / ch->Hkv;
    ch->bs = p->block_size;
    ch->nb_max = sa_ceil_div(n_kv, p->block_size);
    ch->share_group = p->share == SA_SHARE_GROUP;
    const size_t rows = (size_t)ch->n_rows;
    ch->n_valid = malloc(rows * sizeof(int));
    ch->sparse = malloc(rows);
    size_t cell_bytes;
    if (__builtin_mul_overflow(rows * (size_t)n_kv, sizeof(int32_t), &cell_bytes)) {
        sa_ggml_choice_free(ch);
        return SA_ERR_SIZE;
    }
    ch->cells = malloc(cell_bytes);
    if (!ch->n_valid || !ch->sparse || !ch->cells) {
        sa_ggml_choice_free(ch);
        return SA_ERR_NOMEM;
    }
    int n_items = 0, n_sparse = 0;
    for (int row = 0; row < ch->n_rows; row++) {
        ch->n_valid[row] = valid_cells(a, n_kv, row % n_q, row / n_q,
                                       ch->cells + (ptrdiff_t)row * n_kv);
        const int NB = n_blocks(ch, row);
        ch->sparse[row] = NB > p->k_blocks;
        n_sparse += ch->sparse[row];
        if (ch->sparse[row])
            n_items += sa_ceil_div(NB, PROBE_PART_BLOCKS) * ch->Hkv; /* <= n_kv * Hkv / 2 */
        else if (a->blocks)
            write_every_block(a, ch, row);
    }
    if (!n_sparse) {
        sa_ggml_choice_free(ch);
        return SA_OK;
    }
    /* What a group may read: all its row's cells, or G heads' k blocks. */
    const int64_t cap = (int64_t)ch->G * p->k_blocks * p->block_size;
    ch->cap = cap < n_kv ? (int)cap : n_kv;
    const size_t rk = rows * (size_t)ch->Hkv, nb = (size_t)ch->nb_max;
    size_t up_bytes, probe_bytes, mark_bytes;
    if (__builtin_mul_overflow(rk * (size_t)ch->cap, sizeof(int32_t), &up_bytes) ||
        __builtin_mul_overflow(rows * (size_t)ch->H * nb, sizeof(float), &probe_bytes) ||
        __builtin_mul_overflow(rows * (size_t)ch->H, nb, &mark_bytes)) {
        sa_ggml_choice_free(ch);
        return SA_ERR_SIZE;
    }
    ch->n_upos = calloc(rk, sizeof(int));
    ch->upos = malloc(up_bytes);
    ch->probe = malloc(probe_bytes);
    ch->left = malloc(rk * sizeof *ch->left);
    ch->marks = ch->share_group ? NULL : malloc(mark_bytes);
    probe_call c = {.a = a, .p = p, .kern = kern, .ch = ch, .D = (int)a->q.ne[0],
                    .q8 = a->k.type == SA_GGML_Q8_0, .n_q = n_q, .k_blocks = p->k_blocks};
    c.ng = c.q8 ? c.D / SA_GGML_Q8_0_GROUP : 0;
    c.item_rk = malloc((size_t)n_items * sizeof(int));
    c.item_part = malloc((size_t)n_items * sizeof(int));
    int rc = SA_OK;
    if (!ch->n_upos || !ch->upos || !ch->probe || !ch->left || (!ch->share_group && !ch->marks) ||
        !c.item_rk || !c.item_part)
        rc = SA_ERR_NOMEM;
    for (int row = 0, it = 0; !rc && row < ch->n_rows; row++) {
        const int parts = ch->sparse[row] ? sa_ceil_div(n_blocks(ch, row), PROBE_PART_BLOCKS) : 0;
        for (int kh = 0; kh < ch->Hkv; kh++) {
            atomic_init(&ch->left[row * ch->Hkv + kh], parts);
            for (int part = 0; part < parts; part++, it++) {
                c.item_rk[it] = row * ch->Hkv + kh;
                c.item_part[it] = part;
            }
        }
    }
    const int workers = sa_workers_for(n_items, threads);
    if (!rc) {
        c.w = calloc((size_t)workers, sizeof *c.w);
        rc = c.w ? SA_OK : SA_ERR_NOMEM;
    }
    for (int i = 0; !rc && i < workers; i++)
        rc = probe_worker_new(&c, &c.w[i]);
    if (!rc)
        rc = sa_parallel_for(n_items, workers, probe_item, &c);
    for (int i = 0; c.w && i < workers; i++)
        free(c.w[i]);
    free(c.w);
    free(c.item_rk);
    free(c.item_part);
    if (rc) {
        sa_ggml_choice_free(ch);
        return rc;
    }
    *any = 1;
    return SA_OK;
}
