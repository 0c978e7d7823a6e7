/* The block choice (choose.h). */
#include <stdlib.h>
#include <string.h>

#include "choose.h"

/* Append to top the `want` best blocks b < NB by val[b] that are not
 * used[b] (used may be NULL: none is; larger first, ties to the lower
 * index), best first.  One pass; an insertion happens only when a block
 * beats the current worst, and a later (higher) index never beats an equal
 * value. */
static int rank_unused(const double *val, const uint8_t *used, int NB, int want, int32_t *top)
{
    int n = 0;
    double worst = 0.0;     /* val[top[want - 1]] once the list is full */
    if (want <= 0)
        return 0;
    for (int b = 0; b < NB; b++) {
        if (used && used[b])
            continue;
        const double v = val[b];
        if (n == want && !(v > worst))
            continue;
        int i = n < want ? n++ : n - 1;
        while (i > 0 && v > val[top[i - 1]]) {
            top[i] = top[i - 1];
            i--;
        }
        top[i] = b;
        worst = val[top[n - 1]];
    }
    return n;
}

/* Spec §2 steps 3-5 and §6 for one ranking `score` (NB values): the sinks,
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

/* uni (n ascending blocks) := its union with sel (n_sel ascending), through
 * tmp; returns the new length. */
static int merge_union(int32_t *uni, int n, const int32_t *sel, int n_sel, int32_t *tmp)
{
    int i = 0, j = 0, m = 0;
    while (i < n || j < n_sel) {
        const int32_t a = i < n ? uni[i] : INT32_MAX, b = j < n_sel ? sel[j] : INT32_MAX;
        tmp[m++] = a < b ? a : b;
        i += a <= b;
        j += b <= a;
    }
    memcpy(uni, tmp, (size_t)m * sizeof(int32_t));
    return m;
}

void sa_choose_group(sa_scratch *s, const sa_select_params *p, const sa_reserve *reserve,
                     int32_t *blocks)
{
    const int G = s->G, NB = s->NB, n_sel = s->n_sel;
    const int shared = p->share == SA_SHARE_GROUP;
    memset(s->chosen, 0, (size_t)G * NB);
    s->n_uni = 0;
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
        /* The attention walks this list, O(chosen) per run, instead of
         * every block's G marks (attend.c: sa_next_run).  s->top is free
         * once choose_one is done, and holds NB >= the union. */
        if (g == 0)
            memcpy(s->uni, s->sel, (size_t)(s->n_uni = n_sel) * sizeof(int32_t));
        else if (!shared)
            s->n_uni = merge_union(s->uni, s->n_uni, s->sel, n_sel, s->top);
        if (blocks)
            memcpy(blocks + (ptrdiff_t)g * n_sel, s->sel, (size_t)n_sel * sizeof(int32_t));
    }
}

int sa_reserve_rank(const double *sums, int NB, const sa_select_params *p, int n_sel,
                    int32_t *blocks)
{
    const int sinks = sa_min(p->sink_blocks, n_sel);
    const int want = sa_min(p->importance_blocks, n_sel - sinks);
    if (want <= 0)
        return 0;
    /* the blocks past the sinks (sinks < n_sel <= NB when want > 0) */
    const int n = rank_unused(sums + sinks, NULL, NB - sinks, want, blocks);
    for (int i = 0; i < n; i++)
        blocks[i] += sinks;
    return n;
}

/* Each block's sum runs over its rows in order, in double; four full
 * blocks side by side (one at a time is a chain of dependent additions,
 * bs latencies per block), the same sums either way. */
void sa_block_sums(const float *x, int n, int bs, int NB, double *sums)
{
    const int full = sa_min(n / bs, NB);
    int b = 0;
    for (; b <= full - 4; b += 4) {     /* not b + 4 <= full: full may be INT_MAX */
        const float *x0 = x + (ptrdiff_t)b * bs;
        const float *x1 = x0 + bs, *x2 = x1 + bs, *x3 = x2 + bs;
        double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
        for (int t = 0; t < bs; t++) {
            a0 += x0[t];
            a1 += x1[t];
            a2 += x2[t];
            a3 += x3[t];
        }
        sums[b] = a0;
        sums[b + 1] = a1;
        sums[b + 2] = a2;
        sums[b + 3] = a3;
    }
    for (; b < NB; b++) {
        double acc = 0.0;
        for (int t = sa_block_start(b, bs), e = sa_block_end(b, bs, n); t < e; t++)
            acc += x[t];
        sums[b] = acc;
    }
}

int sa_importance_reserve(const float *importance, int seq_len, const sa_select_params *p,
                          int n_sel, sa_reserve *out)
{
    const int NB = sa_ceil_div(seq_len, p->block_size);
    out->n = 0;
    out->blocks = NULL;
    if (sa_min(p->importance_blocks, n_sel - sa_min(p->sink_blocks, n_sel)) <= 0)
        return SA_OK;
    double *sums = malloc((size_t)NB * sizeof(double));
    out->blocks = malloc((size_t)n_sel * sizeof(int32_t));
    if (!sums || !out->blocks) {
        free(sums);
        free(out->blocks);
        out->blocks = NULL;
        return SA_ERR_NOMEM;
    }
    sa_block_sums(importance, seq_len, p->block_size, NB, sums);
    out->n = sa_reserve_rank(sums, NB, p, n_sel, out->blocks);
    free(sums);
    return SA_OK;
}
