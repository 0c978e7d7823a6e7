/*
 * llama.cpp's attention op over its own tensors (sa_ggml_flash_attn in
 * sparse_attn.h): exact attention of one GGML_OP_FLASH_ATTN_EXT node, what
 * the ggml backend built from this core (csrc/ggml/backend.c) runs for
 * llama.cpp.  No ggml type reaches this file: a tensor is a pointer, ggml's
 * type id, and ggml's ne/nb.
 *
 * The work is split into items by (stream, KV head, block of QUERY_BLOCK
 * query rows): an item's query heads share their KV head's cells, and its
 * rows share the cells it converts.  A call of at most SPLIT_ROWS query
 * rows (decode) would leave a model with few KV heads one or two items, so
 * its items are cut over the cells too, in spans of SPAN_CELLS, and each
 * group's spans are merged in span order by whichever item finishes the
 * group last.  The cut depends on the shapes alone, never on the thread
 * count, so the bits do not either.
 *
 * An item walks its cells a chunk of CHUNK_CELLS at a time.  The cells any
 * of its rows may read (mask value not -Inf) are converted into the
 * worker's scratch, compacted: F16 to float32 rows (the table's exact
 * halves_to_floats), Q8_0 to q8 rows with float32 scales.  Then for each query row, the cells its own mask row
 * allows are runs of that scratch: scored by the kernel table, scaled,
 * biased by the mask, turned into softmax weights relative to the chunk's
 * largest score, and added into V; the chunk's (maximum, sum, weighted V)
 * is folded into the row's running state (the online softmax of flash
 * attention).  A cell no row of the item may read is never read, so the
 * unused cells of llama.cpp's cache (masked, holding anything) cannot reach
 * a result.
 *
 * Sparse decode (spec §8) slots in where a row's cells are listed: the
 * blocks chosen for a decode row (ggml_select.c) are listed as the cells
 * its group reads, and a chunk's cells are those of the list that fall in
 * it (sparse_row_cells) instead of its mask row's (row_cells); the walk,
 * the chunks and the arithmetic are the same, so a row whose every block
 * is chosen is the exact path's bit for bit.
 */
#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_internal.h"

/* The split below is chosen, not yet tuned by measurement. */
#define CHUNK_CELLS SA_GGML_CHUNK_CELLS
/* Query rows per item: the cells an item converts serve this many rows. */
#define QUERY_BLOCK 32
/* A call of at most this many query rows (decode) is split over its cells
 * too ... */
#define SPLIT_ROWS SA_GGML_DECODE_ROWS
/* ... in spans of this many (four chunks). */
#define SPAN_CELLS 512
#define Q8_0_GROUP SA_GGML_Q8_0_GROUP
#define Q8_0_BYTES SA_GGML_Q8_0_BYTES
#define HALF_NEG_INF SA_GGML_HALF_NEG_INF
#define SCORE_STRIDE SA_GGML_SCORE_STRIDE

/* ------------------------------------------------------------------ checks */

/* Bytes of ne[0]'s unit: an element, or a Q8_0 block. */
static int64_t unit_bytes(int type)
{
    return type == SA_GGML_F32 ? 4 : type == SA_GGML_F16 ? 2 : Q8_0_BYTES;
}

static int dims_ok(const sa_ggml_tensor *t)
{
    for (int i = 0; i < 4; i++)
        if (t->ne[i] < 1 || t->ne[i] > INT_MAX)
            return 0;
    return 1;
}

/* Rows contiguous (nb[0] the unit's size), strides not negative and
 * multiples of `align`. */
static int strides_ok(const sa_ggml_tensor *t, int64_t align)
{
    if (t->nb[0] != unit_bytes(t->type))
        return 0;
    for (int i = 1; i < 4; i++)
        if (t->nb[i] < 0 || t->nb[i] % align)
            return 0;
    return 1;
}

int sa_ggml_flash_attn_check(const sa_ggml_attn *a)
{
    if (!a)
        return SA_ERR_NULL;
    const sa_ggml_tensor *q = &a->q, *k = &a->k, *v = &a->v, *o = &a->out, *m = a->mask;
    if (a->max_bias != 0.0f || a->logit_softcap != 0.0f || a->n_kv_max != 0 || a->has_sinks)
        return SA_ERR_UNSUPPORTED;
    if (q->type != SA_GGML_F32 || o->type != SA_GGML_F32 ||
        (k->type != SA_GGML_F16 && k->type != SA_GGML_Q8_0) || v->type != k->type ||
        (m && m->type != SA_GGML_F16))
        return SA_ERR_DTYPE;
    if (!dims_ok(q) || !dims_ok(k) || !dims_ok(v) || !dims_ok(o) || (m && !dims_ok(m)))
        return SA_ERR_SHAPE;
    const int64_t D = q->ne[0], n_q = q->ne[1], H = q->ne[2], ns = q->ne[3];
    const int64_t n_kv = k->ne[1], Hkv = k->ne[2];
    /* ggml's q8_0 tensors hold whole blocks: ne[0] counts values */
    if (k->ne[0] != D)
        return SA_ERR_SHAPE;
    if (v->ne[0] != D)
        return SA_ERR_UNSUPPORTED;
    if (v->ne[1] != n_kv || v->ne[2] != Hkv || k->ne[3] != ns || v->ne[3] != ns)
        return SA_ERR_SHAPE;
    if (o->ne[0] != D || o->ne[1] != H || o->ne[2] != n_q || o->ne[3] != ns)
        return SA_ERR_SHAPE;
    if (m && (m->ne[0] < n_kv || m->ne[1] < n_q || H % m->ne[2] || ns % m->ne[3]))
        return SA_ERR_SHAPE;
    if (H % Hkv)
        return SA_ERR_GQA;
    if (k->type == SA_GGML_Q8_0 && D % Q8_0_GROUP)
        return SA_ERR_GROUP;
    const int64_t kv_align = k->type == SA_GGML_F16 ? 2 : 1;
    if (!strides_ok(q, 4) || !strides_ok(k, kv_align) || !strides_ok(v, kv_align) ||
        (m && !strides_ok(m, 2)))
        return SA_ERR_LAYOUT;
    /* the output is written by many threads: rows that cannot overlap */
    if (o->nb[0] != 4 || o->nb[1] != 4 * D || o->nb[2] != o->nb[1] * H ||
        o->nb[3] != o->nb[2] * n_q)
        return SA_ERR_LAYOUT;
    if (!(isfinite(a->scale) && a->scale > 0.0f))
        return SA_ERR_SCALE;
    if (a->select) {
        const int rc = sa_check_select_params(a->select);
        if (rc)
            return rc;
        /* spec §8: nothing is kept beside llama.cpp's cache, so no
         * importance reserve and no scoring from metadata */
        if (a->select->scoring != SA_SCORING_PROBE || a->select->importance_blocks != 0 ||
            a->select->probe_rows)
            return SA_ERR_UNSUPPORTED;
    }
    return SA_OK;
}

/* Spec §8 step 1: a selection, at most SA_GGML_DECODE_ROWS rows, one mask
 * plane for every head. */
int sa_ggml_sparse_call(const sa_ggml_attn *a)
{
    return a->select && a->q.ne[1] <= SA_GGML_DECODE_ROWS && (!a->mask || a->mask->ne[2] == 1);
}

/* ------------------------------------------------------------------- a call */

/* A worker's scratch (one allocation, carved in 64-byte pieces). */
typedef struct {
    float *qf;            /* qb x G x D: the item's query rows, row-major by (row, head) */
    int8_t *qq;           /* the same quantised (Q8_0 K) */
    float *qd;            /* their scales, qb x G x D/32 */
    float *kf, *vf;       /* CHUNK_CELLS x D float32 rows (F16 K and V) */
    int8_t *kq, *vq;      /* CHUNK_CELLS x D int8 rows (Q8_0) ... */
    float *kd, *vd;       /* ... and their scales, CHUNK_CELLS x D/32 */
    int32_t *slot;        /* per cell of the chunk: its scratch row, or -1 */
    uint16_t *halves;     /* halves on their way to floats (mask values, scales) */
    float *bias;          /* the mask values of the cells one row reads */
    int32_t *run;         /* (first scratch row, count) of the runs one row reads */
    int32_t *lo, *hi;     /* qb: a sparse row's chosen cells in the chunk */
    float *scores;        /* G x SCORE_STRIDE: scores, then softmax weights */
    float *acc;           /* G x D: one chunk's weighted V */
    float *mx, *z;        /* G: one chunk's maxima and sums */
    float *state;         /* qb x state_floats: each row's running result */
    float **sp, **op;     /* G pointers handed to the kernels */
    const float **pp;
} worker;

typedef struct {
    const sa_ggml_attn *a;
    const sa_kernels *kern;
    int D, ng, n_q, H, ns, n_kv, Hkv, G;
    int q8;               /* K and V are Q8_0 */
    int shared_mask;      /* a group's heads read one mask row */
    int qb, n_qb;         /* query rows per item, blocks of them */
    int spans;            /* items per group (> 1: split over cells) */
    const sa_ggml_choice *choice; /* sparse decode: the rows' chosen cells, or NULL */
    worker **w;
    float *parts;         /* spans > 1: per item, its rows' states */
    atomic_int *left;     /* spans > 1: per group, its items not yet done */
} call;

/* A row's running result: G maxima, G sums, then G x D unnormalised rows. */
static ptrdiff_t state_floats(int G, int D) { return (ptrdiff_t)G * (2 + (ptrdiff_t)D); }

static void state_reset(float *st, int G, int D)
{
    for (int g = 0; g < G; g++) {
        st[g] = -INFINITY;
        st[G + g] = 0.0f;
    }
    memset(st + 2 * G, 0, (size_t)G * D * sizeof(float));
}

/* Fold a part (its largest score m, its sum z of exp(s - m), its rows
 * weighted by them) into head g of a running state: both rescaled to the
 * larger maximum.  A NaN in the part or the state makes the sum NaN. */
static void fold(float *st, int G, int D, int g, float m, float z, const float *add)
{
    float *M = st + g, *S = st + G + g, *acc = st + 2 * G + (ptrdiff_t)g * D;
    const float nm = m > *M ? m : *M;
    const float a = expf(*M - nm), b = expf(m - nm);
    for (int d = 0; d < D; d++)
        acc[d] = acc[d] * a + add[d] * b;
    *S = *S * a + z * b;
    *M = nm;
}

static const uint16_t *mask_row(const call *c, int row, int head, int s)
{
    return sa_ggml_mask_row(c->a, row, head, s);
}

/* The item's query rows into the worker's scratch (quantised for Q8_0 K). */
static void load_queries(const call *c, worker *w, int s, int kh, int r0, int nr)
{
    const ptrdiff_t per_row = (ptrdiff_t)c->G * c->D;
    for (int r = 0; r < nr; r++)
        sa_ggml_load_group(c->a, c->q8, c->D, c->G, r0 + r, kh, s, w->qf + r * per_row,
                           w->qq + r * per_row, w->qd + r * (ptrdiff_t)c->G * c->ng);
}

static void convert_row(const call *c, worker *w, const sa_ggml_tensor *t, int cell, int kh,
                        int s, float *f, int8_t *q, float *d, int j)
{
    sa_ggml_convert_row(c->kern, t, c->q8, c->D, cell, kh, s, w->halves, f, q, d, j);
}

/* The cells [0, n) of the chunk that a query row reads with the mask row
 * mr (NULL: all): their mask values into w->bias, their scratch rows as
 * runs into w->run; the number of cells, *n_runs the runs. */
/* Slot j appended to the runs (start, length pairs) of consecutive slots:
 * it extends the last run when it follows it.  Returns the runs' count. */
static inline int add_to_runs(int32_t *run, int runs, int j)
{
    if (runs && run[2 * runs - 2] + run[2 * runs - 1] == j) {
        run[2 * runs - 1]++;
        return runs;
    }
    run[2 * runs] = j;
    run[2 * runs + 1] = 1;
    return runs + 1;
}

static int row_cells(const call *c, worker *w, const uint16_t *mr, int n, int *n_runs)
{
    int cnt = 0, runs = 0;
    for (int t = 0; t < n; t++) {
        if (mr && mr[t] == HALF_NEG_INF)
            continue;
        const int j = w->slot[t];
        w->halves[cnt++] = mr ? mr[t] : 0; /* 0: the half +0 */
        runs = add_to_runs(w->run, runs, j);
    }
    c->kern->halves_to_floats(w->halves, w->bias, cnt);
    *n_runs = runs;
    return cnt;
}

/* Heads g0 .. g0+nh-1 of query row r (of the item) over the chunk's cells
 * listed in w->run / w->bias (cnt of them), folded into the row's state. */
static void attend_cells(const call *c, worker *w, int r, int g0, int nh, int cnt, int runs)
{
    const sa_kernels *kern = c->kern;
    const int G = c->G, D = c->D, ng = c->ng;
    const ptrdiff_t qrow = (ptrdiff_t)r * G + g0;
    int off = 0;
    for (int i = 0; i < runs; i++) {
        const int j0 = w->run[2 * i], len = w->run[2 * i + 1];
        for (int h = 0; h < nh; h++)
            w->sp[h] = w->scores + (ptrdiff_t)h * SCORE_STRIDE + off;
        if (c->q8)
            kern->scores_q8(w->qq + qrow * D, w->qd + qrow * ng, nh, D, Q8_0_GROUP,
                            w->kq + (ptrdiff_t)j0 * D, w->kd + (ptrdiff_t)j0 * ng, D, ng,
                            len, w->sp, NULL);
        else
            kern->scores_f32(w->qf + qrow * D, nh, D, w->kf + (ptrdiff_t)j0 * D, D, len,
                             w->sp, NULL);
        off += len;
    }
    const float scale = c->a->scale;
    for (int h = 0; h < nh; h++) {
        float *sc = w->scores + (ptrdiff_t)h * SCORE_STRIDE;
        /* llama.cpp's order: the score scaled, then the mask value added */
        for (int t = 0; t < cnt; t++)
            sc[t] = sc[t] * scale + w->bias[t];
        w->z[h] = kern->softmax_exp(sc, cnt, 1.0f, &w->mx[h]);
        memset(w->acc + (ptrdiff_t)h * D, 0, (size_t)D * sizeof(float));
        w->op[h] = w->acc + (ptrdiff_t)h * D;
    }
    off = 0;
    for (int i = 0; i < runs; i++) {
        const int j0 = w->run[2 * i], len = w->run[2 * i + 1];
        for (int h = 0; h < nh; h++)
            w->pp[h] = w->scores + (ptrdiff_t)h * SCORE_STRIDE + off;
        if (c->q8)
            kern->accumulate_v_q8(w->op, w->pp, nh, D, Q8_0_GROUP, w->vq + (ptrdiff_t)j0 * D,
                                  w->vd + (ptrdiff_t)j0 * ng, D, ng, len, NULL);
        else
            kern->accumulate_v_f32(w->op, w->pp, nh, D, w->vf + (ptrdiff_t)j0 * D, D, len,
                                   NULL);
        off += len;
    }
    float *st = w->state + (ptrdiff_t)r * state_floats(G, D);
    for (int h = 0; h < nh; h++)
        fold(st, G, D, g0 + h, w->mx[h], w->z[h], w->acc + (ptrdiff_t)h * D);
}

/* A sparse row's chosen cells in [c0, c0 + n): entries [*lo, return) of
 * its group's list (upos, positions of the row's sequence; cells maps a
 * position to its cell), found by bisection. */
static int chosen_range(const int32_t *upos, int n_upos, const int32_t *cells, int c0, int n,
                        int *lo)
{
    int a = 0, b = n_upos;
    while (a < b) {
        const int m = a + (b - a) / 2;
        if (cells[upos[m]] < c0)
            a = m + 1;
        else
            b = m;
    }
    *lo = a;
    while (b < n_upos && cells[upos[b]] - c0 < n)
        b++;
    return b;
}

/* sparse_row_cells: row_cells for a sparse row: the chosen cells
 * [lo, hi) of its group's list that head set `marks` chose (NULL: all,
 * the group's one choice), with the mask values of mr (NULL: none). */
static int sparse_row_cells(const call *c, worker *w, const uint16_t *mr, int c0,
                            const int32_t *upos, const int32_t *cells, int lo, int hi,
                            const uint8_t *marks, int *n_runs)
{
    const int bs = c->choice->bs;
    int cnt = 0, runs = 0;
    for (int x = lo; x < hi; x++) {
        if (marks && !marks[upos[x] / bs])
            continue;
        const int t = cells[upos[x]] - c0, j = w->slot[t];
        w->halves[cnt++] = mr ? mr[t] : 0;
        runs = add_to_runs(w->run, runs, j);
    }
    c->kern->halves_to_floats(w->halves, w->bias, cnt);
    *n_runs = runs;
    return cnt;
}

/* Cells [c0, c0 + n) for the item's rows r0 .. r0+nr-1. */
static void attend_chunk(const call *c, worker *w, int s, int kh, int r0, int nr, int c0, int n)
{
    const int G = c->G;
    const int sets = c->shared_mask ? 1 : G; /* head sets reading one mask row */
    const sa_ggml_choice *ch = c->choice;
    int used = 0, any_exact = 0;
    memset(w->slot, 0, (size_t)n * sizeof *w->slot);
    for (int r = 0; r < nr; r++) {
        const int row = s * c->n_q + r0 + r;
        if (ch && ch->sparse[row]) {
            /* the cells of the blocks the row's group chose */
            const int rk = row * c->Hkv + kh;
            const int32_t *upos = ch->upos + (ptrdiff_t)rk * ch->cap;
            const int32_t *cells = ch->cells + (ptrdiff_t)row * c->n_kv;
            int lo;
            const int hi = chosen_range(upos, ch->n_upos[rk], cells, c0, n, &lo);
            w->lo[r] = lo;
            w->hi[r] = hi;
            for (int x = lo; x < hi; x++)
                w->slot[cells[upos[x]] - c0] = 1;
            continue;
        }
        any_exact = 1;
        if (!c->a->mask)
            continue;
        for (int set = 0; set < sets; set++) {
            const uint16_t *mr = mask_row(c, r0 + r, kh * G + set, s) + c0;
            for (int t = 0; t < n; t++)
                w->slot[t] |= mr[t] != HALF_NEG_INF;
        }
    }
    if (any_exact && !c->a->mask)
        for (int t = 0; t < n; t++)
            w->slot[t] = 1;
    for (int t = 0; t < n; t++)
        w->slot[t] = w->slot[t] ? used++ : -1;
    if (!used)
        return;
    for (int t = 0; t < n; t++)
        if (w->slot[t] >= 0) {
            convert_row(c, w, &c->a->k, c0 + t, kh, s, w->kf, w->kq, w->kd, w->slot[t]);
            convert_row(c, w, &c->a->v, c0 + t, kh, s, w->vf, w->vq, w->vd, w->slot[t]);
        }
    for (int r = 0; r < nr; r++) {
        const int row = s * c->n_q + r0 + r;
        const int sparse = ch && ch->sparse[row];
        /* share="head": each head its own choice (one set per head) */
        const int row_sets = sparse && !ch->share_group ? G : sets;
        for (int set = 0; set < row_sets; set++) {
            const int one = row_sets == 1;
            const int g0 = one ? 0 : set, nh = one ? G : 1;
            const uint16_t *mr = c->a->mask ? mask_row(c, r0 + r, kh * G + g0, s) + c0 : NULL;
            int runs, cnt;
            if (sparse) {
                const int rk = row * c->Hkv + kh;
                const uint8_t *marks =
                    ch->share_group ? NULL
                                    : ch->marks + ((ptrdiff_t)row * c->H + kh * G + g0) * ch->nb_max;
                cnt = sparse_row_cells(c, w, mr, c0, ch->upos + (ptrdiff_t)rk * ch->cap,
                                       ch->cells + (ptrdiff_t)row * c->n_kv, w->lo[r], w->hi[r],
                                       marks, &runs);
            } else {
                cnt = row_cells(c, w, mr, n, &runs);
            }
            if (cnt)
                attend_cells(c, w, r, g0, nh, cnt, runs);
        }
    }
}

/* The output rows of the item's heads and rows from their states: each
 * row's weighted V over its sum, zeros where no cell was read. */
static void write_rows(const call *c, const float *states, int s, int kh, int r0, int nr)
{
    const int G = c->G, D = c->D;
    float *out = c->a->out.data;
    for (int r = 0; r < nr; r++) {
        const float *st = states + (ptrdiff_t)r * state_floats(G, D);
        for (int g = 0; g < G; g++) {
            const float S = st[G + g];
            const float *acc = st + 2 * G + (ptrdiff_t)g * D;
            float *o = out + (((ptrdiff_t)s * c->n_q + r0 + r) * c->H + (ptrdiff_t)kh * G + g) * D;
            for (int d = 0; d < D; d++)
                o[d] = S == 0.0f ? 0.0f : acc[d] / S;
        }
    }
}

static int item_fn(void *arg, int item, int wi)
{
    call *c = arg;
    worker *w = c->w[wi];
    const int G = c->G, D = c->D;
    const int group = item / c->spans, span = item % c->spans;
    const int qblk = group % c->n_qb, kh = (group / c->n_qb) % c->Hkv;
    const int s = group / (c->n_qb * c->Hkv);
    const int r0 = qblk * c->qb, nr = sa_min(c->qb, c->n_q - r0);
    const int span_cells = c->spans > 1 ? SPAN_CELLS : c->n_kv;
    const int c_begin = span * span_cells; /* below n_kv */
    const int c_end = c->n_kv - c_begin > span_cells ? c_begin + span_cells : c->n_kv;
    const ptrdiff_t sf = state_floats(G, D);

    load_queries(c, w, s, kh, r0, nr);
    for (int r = 0; r < nr; r++)
        state_reset(w->state + r * sf, G, D);
    for (int c0 = c_begin; c0 < c_end; c0 += CHUNK_CELLS)
        attend_chunk(c, w, s, kh, r0, nr, c0, sa_min(CHUNK_CELLS, c_end - c0));
    if (c->spans == 1) {
        write_rows(c, w->state, s, kh, r0, nr);
        return SA_OK;
    }
    const ptrdiff_t part = (ptrdiff_t)c->qb * sf;
    memcpy(c->parts + (ptrdiff_t)item * part, w->state, (size_t)nr * sf * sizeof(float));
    /* the group's last item merges its spans in span order, whoever runs it */
    if (atomic_fetch_sub(&c->left[group], 1) != 1)
        return SA_OK;
    for (int r = 0; r < nr; r++) {
        float *st = w->state + r * sf;
        state_reset(st, G, D);
        for (int j = 0; j < c->spans; j++) {
            const float *p = c->parts + ((ptrdiff_t)group * c->spans + j) * part + r * sf;
            for (int g = 0; g < G; g++)
                if (p[G + g] != 0.0f || p[g] != -INFINITY) /* a span this head read */
                    fold(st, G, D, g, p[g], p[G + g], p + 2 * G + (ptrdiff_t)g * D);
        }
    }
    write_rows(c, w->state, s, kh, r0, nr);
    return SA_OK;
}

/* ----------------------------------------------------------------- scratch */

static int worker_new(const call *c, worker **out)
{
    const size_t G = (size_t)c->G, D = (size_t)c->D, ng = (size_t)c->ng, qb = (size_t)c->qb;
    const size_t cells = CHUNK_CELLS, q8 = (size_t)c->q8;
    sa_carve l = {sizeof(worker), 0};
    const size_t o_qf = sa_carve_take(&l, qb * G, D, sizeof(float));
    const size_t o_qq = sa_carve_take(&l, qb * G, D * q8, 1);
    const size_t o_qd = sa_carve_take(&l, qb * G, ng * q8, sizeof(float));
    const size_t o_kf = sa_carve_take(&l, cells, D * !q8, sizeof(float));
    const size_t o_vf = sa_carve_take(&l, cells, D * !q8, sizeof(float));
    const size_t o_kq = sa_carve_take(&l, cells, D * q8, 1);
    const size_t o_vq = sa_carve_take(&l, cells, D * q8, 1);
    const size_t o_kd = sa_carve_take(&l, cells, ng * q8, sizeof(float));
    const size_t o_vd = sa_carve_take(&l, cells, ng * q8, sizeof(float));
    const size_t o_slot = sa_carve_take(&l, cells, 1, sizeof(int32_t));
    const size_t o_half = sa_carve_take(&l, cells > ng ? cells : ng, 1, sizeof(uint16_t));
    const size_t o_bias = sa_carve_take(&l, cells, 1, sizeof(float));
    const size_t o_run = sa_carve_take(&l, cells, 2, sizeof(int32_t));
    const size_t o_lo = sa_carve_take(&l, qb, 1, sizeof(int32_t));
    const size_t o_hi = sa_carve_take(&l, qb, 1, sizeof(int32_t));
    const size_t o_sc = sa_carve_take(&l, G, SCORE_STRIDE, sizeof(float));
    const size_t o_acc = sa_carve_take(&l, G, D, sizeof(float));
    const size_t o_mx = sa_carve_take(&l, G, 1, sizeof(float));
    const size_t o_z = sa_carve_take(&l, G, 1, sizeof(float));
    const size_t o_st = sa_carve_take(&l, qb, (size_t)state_floats(c->G, c->D), sizeof(float));
    const size_t o_sp = sa_carve_take(&l, G, 1, sizeof(float *));
    const size_t o_op = sa_carve_take(&l, G, 1, sizeof(float *));
    const size_t o_pp = sa_carve_take(&l, G, 1, sizeof(float *));
    if (l.overflow)
        return SA_ERR_SIZE;
    char *mem = aligned_alloc(64, (l.off + 63) & ~(size_t)63);
    if (!mem)
        return SA_ERR_NOMEM;
    worker *w = (worker *)mem;
    *w = (worker){
        .qf = (float *)(mem + o_qf), .qq = (int8_t *)(mem + o_qq), .qd = (float *)(mem + o_qd),
        .kf = (float *)(mem + o_kf), .vf = (float *)(mem + o_vf),
        .kq = (int8_t *)(mem + o_kq), .vq = (int8_t *)(mem + o_vq),
        .kd = (float *)(mem + o_kd), .vd = (float *)(mem + o_vd),
        .slot = (int32_t *)(mem + o_slot), .halves = (uint16_t *)(mem + o_half),
        .bias = (float *)(mem + o_bias),
        .run = (int32_t *)(mem + o_run), .lo = (int32_t *)(mem + o_lo),
        .hi = (int32_t *)(mem + o_hi), .scores = (float *)(mem + o_sc),
        .acc = (float *)(mem + o_acc), .mx = (float *)(mem + o_mx), .z = (float *)(mem + o_z),
        .state = (float *)(mem + o_st), .sp = (float **)(mem + o_sp),
        .op = (float **)(mem + o_op), .pp = (const float **)(mem + o_pp)};
    *out = w;
    return SA_OK;
}

/* 1 if every query row is finite with magnitudes below SA_VALUE_LIMIT
 * (spec §5: q is scanned, once, before anything is computed). */
static int queries_ok(const sa_ggml_tensor *q)
{
    for (int64_t s = 0; s < q->ne[3]; s++)
        for (int64_t h = 0; h < q->ne[2]; h++)
            for (int64_t r = 0; r < q->ne[1]; r++)
                if (!sa_values_ok((const float *)sa_ggml_row(q, r, h, s), q->ne[0]))
                    return 0;
    return 1;
}

int sa_ggml_flash_attn(const sa_ggml_attn *a, int threads)
{
    int rc = sa_ggml_flash_attn_check(a);
    if (rc)
        return rc;
    const sa_ggml_tensor *m = a->mask;
    if (!a->q.data || !a->k.data || !a->v.data || !a->out.data || (m && !m->data))
        return SA_ERR_NULL;
    const int kv_align = a->k.type == SA_GGML_F16 ? 2 : 1;
    if ((uintptr_t)a->q.data % 4 || (uintptr_t)a->out.data % 4 ||
        (uintptr_t)a->k.data % kv_align || (uintptr_t)a->v.data % kv_align ||
        (m && (uintptr_t)m->data % 2))
        return SA_ERR_LAYOUT;
    if (!queries_ok(&a->q))
        return SA_ERR_Q_VALUES;
    if (a->select && a->blocks) {
        const int64_t n = a->q.ne[3] * a->q.ne[1] * a->q.ne[2] * a->select->k_blocks;
        for (int64_t i = 0; i < n; i++)
            a->blocks[i] = -1;
    }

    call c = {.a = a, .kern = sa_active_kernels()};
    sa_ggml_choice choice;
    int sparse = 0;
    if (sa_ggml_sparse_call(a)) {
        rc = sa_ggml_choose(a, c.kern, threads, &choice, &sparse);
        if (rc)
            return rc;
        c.choice = sparse ? &choice : NULL;
    }
    c.D = (int)a->q.ne[0], c.n_q = (int)a->q.ne[1], c.H = (int)a->q.ne[2];
    c.ns = (int)a->q.ne[3], c.n_kv = (int)a->k.ne[1], c.Hkv = (int)a->k.ne[2];
    c.G = c.H / c.Hkv;
    c.q8 = a->k.type == SA_GGML_Q8_0;
    c.ng = c.q8 ? c.D / Q8_0_GROUP : 0;
    c.shared_mask = !m || m->ne[2] == 1;
    const int split = c.n_q <= SPLIT_ROWS;
    c.qb = split ? c.n_q : QUERY_BLOCK;
    c.n_qb = sa_ceil_div(c.n_q, c.qb);
    c.spans = split ? sa_ceil_div(c.n_kv, SPAN_CELLS) : 1;
    const int64_t groups = (int64_t)c.ns * c.Hkv * c.n_qb;
    const int64_t items = groups * c.spans;
    rc = items > INT_MAX ? SA_ERR_SIZE : SA_OK;
    if (!rc && c.spans > 1) {
        const size_t part = (size_t)c.qb * (size_t)state_floats(c.G, c.D);
        size_t bytes;
        if (__builtin_mul_overflow((size_t)items, part * sizeof(float), &bytes)) {
            rc = SA_ERR_SIZE;
        } else {
            c.parts = malloc(bytes);
            c.left = malloc((size_t)groups * sizeof *c.left);
            rc = c.parts && c.left ? SA_OK : SA_ERR_NOMEM;
        }
        for (int64_t g = 0; !rc && g < groups; g++)
            atomic_init(&c.left[g], c.spans);
    }
    const int workers = rc ? 0 : sa_workers_for((int)items, threads);
    if (!rc) {
        c.w = calloc((size_t)workers, sizeof *c.w);
        rc = c.w ? SA_OK : SA_ERR_NOMEM;
    }
    for (int i = 0; i < workers && !rc; i++)
        rc = worker_new(&c, &c.w[i]);
    if (!rc)
        rc = sa_parallel_for((int)items, workers, item_fn, &c);
    for (int i = 0; c.w && i < workers; i++)
        free(c.w[i]);
    free(c.w);
    free(c.parts);
    free(c.left);
    if (sparse)
        sa_ggml_choice_free(&choice);
    return rc;
}
