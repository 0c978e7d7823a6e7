/* Probe, block choice and exact attention for one KV head group. */
#include <stdlib.h>
#include <string.h>

#include "attend.h"

/* One allocation, carved into aligned pieces. */
typedef struct { size_t off; } layout;

static size_t take(layout *l, size_t bytes)
{
    const size_t at = (l->off + 63) & ~(size_t)63;
    l->off = at + bytes;
    return at;
}

size_t sa_probe_tmp_floats(int seq_len, int block_size, int n_probe)
{
    int step;
    const int cnt = sa_probe_rows_geometry(block_size, n_probe, &step);
    /* The full blocks' sampled dots, cnt per block (the per-offset path,
     * taken only when cnt >= 2, needs NB <= full + 1 <= 2 * full per head),
     * or the last block's (at most min(block_size, seq_len)). */
    const size_t full = (size_t)sa_max(seq_len / block_size, 1) * (size_t)cnt;
    const size_t last = (size_t)sa_min(block_size, seq_len);
    return full > last ? full : last;
}

sa_scratch *sa_scratch_new(int G, int D, int group_size, int NB, int n_sel,
                           size_t probe_tmp_per_head, int max_tok)
{
    const size_t g = (size_t)G, ng = (size_t)(D / group_size), nb = (size_t)NB;
    layout l = {sizeof(sa_scratch)};
    size_t o_qq = take(&l, g * D), o_qd = take(&l, g * ng * sizeof(float));
    size_t o_qsub = take(&l, g * D * sizeof(float)), o_qqsub = take(&l, g * D);
    size_t o_qdsub = take(&l, g * ng * sizeof(float));
    size_t o_probe = take(&l, g * nb * sizeof(float));
    size_t o_qpos = take(&l, g * D * sizeof(float)), o_qneg = take(&l, g * D * sizeof(float));
    size_t o_ptmp = take(&l, g * probe_tmp_per_head * sizeof(float));
    size_t o_score = take(&l, nb * sizeof(double)), o_top = take(&l, nb * sizeof(int32_t));
    size_t o_used = take(&l, nb), o_sel = take(&l, (size_t)n_sel * sizeof(int32_t));
    size_t o_chosen = take(&l, g * nb);
    size_t o_scores = take(&l, g * (size_t)max_tok * sizeof(float));
    size_t o_sp = take(&l, g * sizeof(float *)), o_pp = take(&l, g * sizeof(float *));
    size_t o_op = take(&l, g * sizeof(float *)), o_z = take(&l, g * sizeof(float));
    size_t o_off = take(&l, g * sizeof(int)), o_heads = take(&l, g * sizeof(int));
    size_t o_heads2 = take(&l, g * sizeof(int));
    char *base = aligned_alloc(64, (l.off + 63) & ~(size_t)63);
    if (!base)
        return NULL;
    sa_scratch *s = (sa_scratch *)base;
    *s = (sa_scratch){
        .G = G, .D = D, .NB = NB, .n_sel = n_sel, .max_tok = max_tok,
        .qq = (int8_t *)(base + o_qq), .qd = (float *)(base + o_qd),
        .qsub = (float *)(base + o_qsub), .qqsub = (int8_t *)(base + o_qqsub),
        .qdsub = (float *)(base + o_qdsub), .probe = (float *)(base + o_probe),
        .qpos = (float *)(base + o_qpos), .qneg = (float *)(base + o_qneg),
        .probe_tmp = (float *)(base + o_ptmp), .score = (double *)(base + o_score),
        .top = (int32_t *)(base + o_top), .used = (uint8_t *)(base + o_used),
        .sel = (int32_t *)(base + o_sel), .chosen = (uint8_t *)(base + o_chosen),
        .scores = (float *)(base + o_scores),
        .sp = (float **)(base + o_sp), .pp = (const float **)(base + o_pp),
        .op = (float **)(base + o_op), .z = (float *)(base + o_z),
        .off = (int *)(base + o_off), .heads = (int *)(base + o_heads),
        .heads2 = (int *)(base + o_heads2),
    };
    return s;
}

void sa_scratch_free(sa_scratch *s) { free(s); }

sa_scratch **sa_scratch_array(int n_workers, int G, int D, int group_size, int NB,
                              int n_sel, size_t probe_tmp_per_head, int max_tok)
{
    sa_scratch **arr = calloc((size_t)n_workers, sizeof *arr);
    if (!arr)
        return NULL;
    for (int w = 0; w < n_workers; w++) {
        arr[w] = sa_scratch_new(G, D, group_size, NB, n_sel, probe_tmp_per_head, max_tok);
        if (!arr[w]) {
            sa_scratch_array_free(arr, n_workers);
            return NULL;
        }
    }
    return arr;
}

void sa_scratch_array_free(sa_scratch **s, int n_workers)
{
    if (!s)
        return;
    for (int w = 0; w < n_workers; w++)
        sa_scratch_free(s[w]);
    free(s);
}

void sa_quantize_group(sa_scratch *s, const float *q, int group_size)
{
    const int ng = s->D / group_size;
    for (int g = 0; g < s->G; g++)
        sa_quantize_row(q + (ptrdiff_t)g * s->D, s->D, group_size,
                        s->qq + (ptrdiff_t)g * s->D, s->qd + (ptrdiff_t)g * ng);
}

void sa_score_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, int kh,
                       const float *qf, const int *heads, int cnt, int row, int step,
                       int n)
{
    const int D = s->D;
    const int all = cnt == s->G;
    if (k->dtype == SA_DTYPE_F32) {
        const float *q = qf;
        if (!all) {
            for (int j = 0; j < cnt; j++)
                memcpy(s->qsub + (ptrdiff_t)j * D, qf + (ptrdiff_t)heads[j] * D,
                       (size_t)D * sizeof(float));
            q = s->qsub;
        }
        kern->scores_f32(q, cnt, D, sa_kv_f32_row(k, kh, row), (ptrdiff_t)step * D, n,
                         s->sp);
    } else {
        const int ng = D / k->group_size;
        const int8_t *qq = s->qq;
        const float *qd = s->qd;
        if (!all) {
            for (int j = 0; j < cnt; j++) {
                memcpy(s->qqsub + (ptrdiff_t)j * D, s->qq + (ptrdiff_t)heads[j] * D,
                       (size_t)D);
                memcpy(s->qdsub + (ptrdiff_t)j * ng, s->qd + (ptrdiff_t)heads[j] * ng,
                       (size_t)ng * sizeof(float));
            }
            qq = s->qqsub;
            qd = s->qdsub;
        }
        kern->scores_q8(qq, qd, cnt, D, k->group_size, sa_kv_q8_row(k, kh, row),
                        sa_kv_scale_row(k, kh, row), (ptrdiff_t)step * D,
                        (ptrdiff_t)step * ng, n, s->sp);
    }
}

/* s->probe[g*NB + b] = the largest of the cnt dots d[b*cnt + i] of head g,
 * for the first `full` blocks; head g's dots start at s->sp[g]. */
static void block_max(sa_scratch *s, int full, int cnt)
{
    for (int g = 0; g < s->G; g++) {
        const float *d = s->sp[g];
        float *best = s->probe + (ptrdiff_t)g * s->NB;
        for (int b = 0; b < full; b++) {
            float m = d[(ptrdiff_t)b * cnt];
            for (int i = 1; i < cnt; i++)
                m = d[(ptrdiff_t)b * cnt + i] > m ? d[(ptrdiff_t)b * cnt + i] : m;
            best[b] = m;
        }
    }
}

void sa_probe_group(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, int kh,
                    const float *qf, int seq_len, int block_size, int n_probe,
                    const sa_probe_rows *rows)
{
    const int G = s->G, NB = s->NB;
    for (int g = 0; g < G; g++)
        s->heads[g] = g;
    /* Full blocks all sample the offsets j*step.  From copies of the probe
     * rows, the samples of all full blocks are one contiguous run of rows.
     * In K, when the samples tile the block evenly (the default 32 / 8:
     * every 4th row) they are one run of rows `step` apart; both are read
     * front to back in one kernel call.  Otherwise one call per offset j
     * takes that offset's row of every block.  The dots are the same either
     * way (kernels.h: a row's dot does not depend on the batch it is in). */
    const int full = seq_len / block_size;
    int step;
    const int cnt = sa_probe_rows_geometry(block_size, n_probe, &step);
    if (full > 0 && rows) {
        const sa_kv view = sa_probe_rows_view(rows, full);
        for (int g = 0; g < G; g++)
            s->sp[g] = s->probe_tmp + (ptrdiff_t)g * full * cnt;
        sa_score_rows(kern, s, &view, kh, qf, s->heads, G, 0, 1, full * cnt);
        block_max(s, full, cnt);
    } else if (full > 0 && cnt * step == block_size) {
        for (int g = 0; g < G; g++)
            s->sp[g] = s->probe_tmp + (ptrdiff_t)g * full * cnt;
        sa_score_rows(kern, s, k, kh, qf, s->heads, G, 0, step, full * cnt);
        block_max(s, full, cnt);
    } else {
        for (int j = 0; j < cnt && full > 0; j++) {
            for (int g = 0; g < G; g++)
                s->sp[g] = (j == 0 ? s->probe : s->probe_tmp) + (ptrdiff_t)g * NB;
            sa_score_rows(kern, s, k, kh, qf, s->heads, G, j * step, block_size, full);
            if (j == 0)
                continue;
            for (int g = 0; g < G; g++) {
                float *best = s->probe + (ptrdiff_t)g * NB;
                const float *d = s->probe_tmp + (ptrdiff_t)g * NB;
                for (int b = 0; b < full; b++)
                    best[b] = d[b] > best[b] ? d[b] : best[b];
            }
        }
    }
    if (full < NB) {
        /* The partial last block has its own step. */
        const int p0 = full * block_size, len = seq_len - p0;
        const int pstep = sa_max(1, len / n_probe), pcnt = sa_ceil_div(len, pstep);
        for (int g = 0; g < G; g++)
            s->sp[g] = s->probe_tmp + (ptrdiff_t)g * pcnt;
        sa_score_rows(kern, s, k, kh, qf, s->heads, G, p0, pstep, pcnt);
        for (int g = 0; g < G; g++) {
            const float *d = s->sp[g];
            float best = d[0];
            for (int i = 1; i < pcnt; i++)
                best = d[i] > best ? d[i] : best;
            s->probe[(ptrdiff_t)g * NB + full] = best;
        }
    }
}

/* Append to top the `want` best blocks b < NB by val[b] that are not
 * used[b] (used may be NULL: none is; larger first, ties to the lower
 * index), best first.  One pass; an
 * insertion happens only when a block beats the current worst, and a later
 * (higher) index never beats an equal value. */
static int rank_unused(const double *val, const uint8_t *used, int NB, int want, int32_t *top)
{
    int n = 0;
    if (want <= 0)
        return 0;
    for (int b = 0; b < NB; b++) {
        if (used && used[b])
            continue;
        const double v = val[b];
        if (n == want && !(v > val[top[n - 1]]))
            continue;
        int i = n < want ? n++ : n - 1;
        while (i > 0 && v > val[top[i - 1]]) {
            top[i] = top[i - 1];
            i--;
        }
        top[i] = b;
    }
    return n;
}

/* SPEC §2 steps 3-5 and §6 for one ranking `score` (NB values): the sinks,
 * the importance reserve (the same for every head, ranked once per call by
 * sa_importance_reserve), the score fill, recency.  Leaves the ascending
 * choice in s->sel. */
static void choose_one(sa_scratch *s, const sa_select_params *p, const sa_reserve *reserve,
                       const double *score)
{
    const int NB = s->NB, total = s->n_sel;
    const int sinks = sa_min(p->sink_blocks, total);
    memset(s->used, 0, (size_t)NB);
    memset(s->used, 1, (size_t)sinks);
    int n = sinks;
    for (int i = 0; reserve && i < reserve->n; i++, n++)
        s->used[reserve->blocks[i]] = 1;
    const int got = rank_unused(score, s->used, NB, total - n, s->top);
    /* Recency insurance: the last score pick is the lowest score (ties: the
     * higher index), exactly the last entry of the ranked list. */
    if (p->recency && got > 0 && !s->used[NB - 1]) {
        int last_in = 0;
        for (int i = 0; i < got; i++)
            last_in |= s->top[i] == NB - 1;
        if (!last_in)
            s->top[got - 1] = NB - 1;
    }
    for (int i = 0; i < got; i++)
        s->used[s->top[i]] = 1;
    /* The picks are distinct, so the marks in block order are the ascending
     * list: O(NB), no sort. */
    n = 0;
    for (int b = 0; b < NB; b++)
        if (s->used[b])
            s->sel[n++] = b;
}

void sa_choose_group(sa_scratch *s, const sa_select_params *p, const sa_reserve *reserve,
                     int32_t *blocks)
{
    const int G = s->G, NB = s->NB, n_sel = s->n_sel;
    const int shared = p->share == SA_SHARE_GROUP;
    memset(s->chosen, 0, (size_t)G * NB);
    for (int g = 0; g < G; g++) {
        if (!shared || g == 0) {
            /* share="group" ranks the sum of the group's scores, summed in
             * double in head order; otherwise each head ranks its own. */
            for (int b = 0; b < NB; b++) {
                double acc = s->probe[(ptrdiff_t)g * NB + b];
                if (shared)
                    for (int h = 1; h < G; h++)
                        acc += s->probe[(ptrdiff_t)h * NB + b];
                s->score[b] = acc;
            }
            choose_one(s, p, reserve, s->score);
        }
        for (int i = 0; i < n_sel; i++)
            s->chosen[(ptrdiff_t)g * NB + s->sel[i]] = 1;
        if (blocks)
            memcpy(blocks + (ptrdiff_t)g * n_sel, s->sel, (size_t)n_sel * sizeof(int32_t));
    }
}

/* The next run of consecutive blocks chosen by the same set of heads, from
 * block *b on: the heads into `heads`, count returned (0 at the end), blocks
 * [*b, *e).  Merging runs keeps kernel calls long, and makes sparse decode
 * with every block chosen issue exactly dense decode's calls. */
static int next_run(const sa_scratch *s, int *b, int *e, int *heads)
{
    const int G = s->G, NB = s->NB;
    for (; *b < NB; (*b)++) {
        int cnt = 0;
        for (int g = 0; g < G; g++)
            if (s->chosen[(ptrdiff_t)g * NB + *b])
                heads[cnt++] = g;
        if (!cnt)
            continue;
        int end = *b + 1;
        for (; end < NB; end++) {
            int same = 1;
            for (int g = 0; g < G && same; g++)
                same = s->chosen[(ptrdiff_t)g * NB + end] == s->chosen[(ptrdiff_t)g * NB + *b];
            if (!same)
                break;
        }
        *e = end;
        return cnt;
    }
    return 0;
}

void sa_accumulate_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *v, int kh,
                        int cnt, int r0, int n)
{
    const int D = s->D;
    if (v->dtype == SA_DTYPE_F32) {
        kern->accumulate_v_f32(s->op, s->pp, cnt, D, sa_kv_f32_row(v, kh, r0), D, n);
    } else {
        kern->accumulate_v_q8(s->op, s->pp, cnt, D, v->group_size, sa_kv_q8_row(v, kh, r0),
                              sa_kv_scale_row(v, kh, r0), D, D / v->group_size, n);
    }
}

/* Lines of rows [r0, r0 + n) of kv (and of their scales), prefetched into
 * L2 piece `p` of `pieces` at a time. */
static void prefetch_rows_part(const sa_kv *kv, int kh, int r0, int n, int p, int pieces)
{
    const int D = kv->head_dim;
    const char *base[2] = {NULL, NULL};
    size_t len[2] = {0, 0};
    if (kv->dtype == SA_DTYPE_F32) {
        base[0] = (const char *)sa_kv_f32_row(kv, kh, r0);
        len[0] = (size_t)n * D * sizeof(float);
    } else {
        base[0] = (const char *)sa_kv_q8_row(kv, kh, r0);
        len[0] = (size_t)n * D;
        base[1] = (const char *)sa_kv_scale_row(kv, kh, r0);
        len[1] = (size_t)n * (D / kv->group_size) * sizeof(float);
    }
    for (int i = 0; i < 2; i++) {
        if (!base[i])
            continue;
        /* whole lines: from the line holding byte lo to the one holding hi - 1 */
        const uintptr_t first = (uintptr_t)base[i] & ~(uintptr_t)63;
        const uintptr_t lo = (uintptr_t)base[i] + len[i] * (size_t)p / (size_t)pieces;
        const uintptr_t hi = (uintptr_t)base[i] + len[i] * (size_t)(p + 1) / (size_t)pieces;
        for (uintptr_t a = p ? (lo + 63) & ~(uintptr_t)63 : first; a < hi; a += 64)
            __builtin_prefetch((const void *)a, 0, 2);
    }
}

/* Kernel calls per run when reads follow it: the run's last PF_ROWS rows go
 * to the kernel in RUN_PIECES calls (the rows before them in one), and before
 * each of those a piece of the next run's first PF_ROWS rows is prefetched
 * (after the last run of K, the first rows of V).  A block read from DRAM
 * after a jump otherwise starts cold (the hardware prefetchers do not follow
 * the jump): on the development VM this took sparse decode at 4096 tokens,
 * seed k=32, 2 threads, KV in DRAM from ~330 to ~270 us per layer; 2 or 8
 * pieces, an L1 hint or every other line did worse or no better, and one
 * prefetch of the whole next block before the run did not help.  With the KV
 * in cache the extra calls cost ~30 of ~250 us.  Splitting a call changes
 * no result (kernels.h: a token's score does not depend on its batch, and V
 * is added in token order either way). */
#define RUN_PIECES 4
/* Rows prefetched from the next run, and rows of the current run the
 * prefetch is spread over: a block of the seed's geometry.  Not the call's
 * block size, which for dense decode is the whole context. */
#define PF_ROWS 32

/* One pass over the chosen runs: scores of K (pass 0) into s->scores, or
 * the weighted sum of V (pass 1) into out.  s->off[g] counts the tokens of
 * head g done so far.  `then`: the rows read after this pass (V after K),
 * or NULL. */
static void attend_pass(const sa_kernels *kern, sa_scratch *s, const sa_kv *kv, int kh,
                        const float *qf, int seq_len, int bs, int pass, float *out,
                        ptrdiff_t out_head_stride, const sa_kv *then)
{
    int *heads = s->heads, *next_heads = s->heads2;
    int b = 0, e = 0;
    int cnt = next_run(s, &b, &e, heads);
    while (cnt > 0) {
        int nb = e, ne = e;
        int next_cnt = next_run(s, &nb, &ne, next_heads);
        const int r0 = b * bs, n = sa_min(e * bs, seq_len) - r0;
        /* the rows to prefetch: the next run's, or the first run of `then` */
        const sa_kv *pf = kv;
        int pb = nb, pe = ne;
        if (!next_cnt && then) {
            pf = then;
            pb = 0;
            if (!next_run(s, &pb, &pe, next_heads))
                pf = NULL;
        } else if (!next_cnt) {
            pf = NULL;
        }
        const int pr0 = pb * bs, pn = pf ? sa_min(sa_min(pe * bs, seq_len) - pr0, PF_ROWS) : 0;
        /* rows [0, head) in one call, then the last PF_ROWS in pieces */
        const int head = pf ? sa_max(0, n - PF_ROWS) : n;
        const int pieces = pf ? sa_min(RUN_PIECES, n - head) : 0;
        for (int p = -1; p < pieces; p++) {
            const int t0 = p < 0 ? 0 : head + (int)((int64_t)(n - head) * p / pieces);
            const int t1 = p < 0 ? head : head + (int)((int64_t)(n - head) * (p + 1) / pieces);
            if (t1 == t0)
                continue;
            if (p >= 0)
                prefetch_rows_part(pf, kh, pr0, pn, p, pieces);
            for (int j = 0; j < cnt; j++) {
                const int g = heads[j];
                float *sc = s->scores + (ptrdiff_t)g * s->max_tok + s->off[g] + t0;
                if (pass == 0) {
                    s->sp[j] = sc;
                } else {
                    s->pp[j] = sc;
                    s->op[j] = out + g * out_head_stride;
                }
            }
            if (pass == 0)
                sa_score_rows(kern, s, kv, kh, qf, heads, cnt, r0 + t0, 1, t1 - t0);
            else
                sa_accumulate_rows(kern, s, kv, kh, cnt, r0 + t0, t1 - t0);
        }
        for (int j = 0; j < cnt; j++)
            s->off[heads[j]] += n;
        if (!next_cnt)
            break;
        int *t = heads;
        heads = next_heads;
        next_heads = t;
        b = nb, e = ne, cnt = next_cnt;
    }
}

void sa_attend_group(const sa_kernels *kern, sa_scratch *s, const sa_kv *k,
                     const sa_kv *v, int kh, const float *qf, int seq_len, int bs,
                     float scale, float *out, ptrdiff_t out_head_stride)
{
    const int G = s->G, D = s->D;
    for (int g = 0; g < G; g++)
        s->off[g] = 0;
    attend_pass(kern, s, k, kh, qf, seq_len, bs, 0, out, out_head_stride, v);
    for (int g = 0; g < G; g++) {
        s->z[g] = kern->softmax_exp(s->scores + (ptrdiff_t)g * s->max_tok, s->off[g], scale);
        memset(out + g * out_head_stride, 0, (size_t)D * sizeof(float));
        s->off[g] = 0;
    }
    attend_pass(kern, s, v, kh, qf, seq_len, bs, 1, out, out_head_stride, NULL);
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++)
            out[g * out_head_stride + d] /= s->z[g];
}

int sa_importance_reserve(const float *importance, int seq_len, const sa_select_params *p,
                          int n_sel, sa_reserve *out)
{
    const int bs = p->block_size, NB = sa_ceil_div(seq_len, bs);
    const int sinks = sa_min(p->sink_blocks, n_sel);
    const int want = sa_min(p->importance_blocks, n_sel - sinks);
    out->n = 0;
    out->blocks = NULL;
    if (want <= 0)
        return SA_OK;
    double *sums = malloc((size_t)NB * sizeof(double));
    out->blocks = malloc((size_t)want * sizeof(int32_t));
    if (!sums || !out->blocks) {
        free(sums);
        free(out->blocks);
        out->blocks = NULL;
        return SA_ERR_NOMEM;
    }
    for (int b = 0; b < NB; b++) {
        double acc = 0.0;
        for (int t = b * bs; t < sa_min((b + 1) * bs, seq_len); t++)
            acc += importance[t];
        sums[b] = acc;
    }
    /* the blocks past the sinks (sinks < n_sel <= NB when want > 0) */
    out->n = rank_unused(sums + sinks, NULL, NB - sinks, want, out->blocks);
    for (int i = 0; i < out->n; i++)
        out->blocks[i] += sinks;
    free(sums);
    return SA_OK;
}

int sa_check_select_params(const sa_select_params *p)
{
    if (!p)
        return SA_ERR_NULL;
    if (p->block_size < 1 || p->k_blocks < 1 || p->n_probe < 1 || p->importance_blocks < 0 ||
        p->sink_blocks < 0 || (p->recency != 0 && p->recency != 1) ||
        (p->share != SA_SHARE_HEAD && p->share != SA_SHARE_GROUP) ||
        (p->scoring != SA_SCORING_PROBE && p->scoring != SA_SCORING_MINMAX))
        return SA_ERR_PARAM;
    return SA_OK;
}

int sa_check_bounds(const sa_bounds *b, const sa_kv *k, int seq_len, int block_size)
{
    if (!b || !b->mn || !b->mx || !b->scales)
        return SA_ERR_BOUNDS;
    if (b->n_kv_heads != k->n_kv_heads || b->head_dim != k->head_dim ||
        b->block_size != block_size || b->n_rows != seq_len ||
        b->head_stride < sa_ceil_div(seq_len, block_size) || b->group_size < 1 ||
        b->head_dim % b->group_size)
        return SA_ERR_BOUNDS;
    return SA_OK;
}

void sa_minmax_group(const sa_kernels *kern, sa_scratch *s, const sa_bounds *b, int kh,
                     const float *qf, int shared)
{
    const int G = s->G, D = s->D, NB = s->NB, ng = D / b->group_size;
    const ptrdiff_t at = (ptrdiff_t)kh * b->head_stride;
    /* Split each query row by sign; for a shared selection sum the heads'
     * parts (in head order), so one pass scores the group. */
    const int rows = shared ? 1 : G;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < D; i++) {
            const float x = qf[(ptrdiff_t)r * D + i];
            s->qpos[(ptrdiff_t)r * D + i] = x > 0.0f ? x : 0.0f;
            s->qneg[(ptrdiff_t)r * D + i] = x < 0.0f ? x : 0.0f;
        }
    for (int g = 1; shared && g < G; g++)
        for (int i = 0; i < D; i++) {
            const float x = qf[(ptrdiff_t)g * D + i];
            s->qpos[i] += x > 0.0f ? x : 0.0f;
            s->qneg[i] += x < 0.0f ? x : 0.0f;
        }
    for (int g = 0; g < rows; g++)
        s->sp[g] = s->probe + (ptrdiff_t)g * NB;
    kern->minmax_scores(s->qpos, s->qneg, rows, D, b->group_size, b->mn + at * D,
                        b->mx + at * D, b->scales + at * ng, D, NB, s->sp);
    if (shared)
        memset(s->probe + NB, 0, (size_t)(G - 1) * NB * sizeof(float));
}

int sa_check_query(const float *q, int n_heads, const sa_kv *k, int64_t n_rows_q)
{
    if (!q)
        return SA_ERR_NULL;
    if (n_heads < 1)
        return SA_ERR_SHAPE;
    if (n_heads % k->n_kv_heads)
        return SA_ERR_GQA;
    return sa_check_finite(q, n_rows_q * k->head_dim);
}
