/*
 * Exact attention over chosen blocks (spec §2.6).
 *
 * The chosen blocks of a group are walked as runs: consecutive blocks
 * chosen by the same set of heads, so sparse decode with every block chosen
 * issues exactly dense decode's kernel calls.  Each pass (the scores of K,
 * then the weighted sum of V) hands rows.c one run at a time with the run
 * that follows it (after the last run of K, the first run of V), so the
 * stream of reads can be prefetched across the jumps between chosen blocks.
 */
#include <string.h>

#include "attend.h"
#include "rows.h"

/* The heads that chose block b, into heads; their count. */
static int heads_of(const sa_scratch *s, int b, int *heads)
{
    int cnt = 0;
    for (int g = 0; g < s->G; g++)
        if (s->chosen[(ptrdiff_t)g * s->NB + b])
            heads[cnt++] = g;
    return cnt;
}

/* 1 if block c was chosen by the same heads as block b. */
static int same_heads(const sa_scratch *s, int b, int c)
{
    for (int g = 0; g < s->G; g++)
        if (s->chosen[(ptrdiff_t)g * s->NB + c] != s->chosen[(ptrdiff_t)g * s->NB + b])
            return 0;
    return 1;
}

int sa_next_run(const sa_scratch *s, int *b, int *e, int *heads)
{
    const int NB = s->NB;
    if (s->n_uni >= 0) {
        /* the first listed block >= *b (binary search), then its run */
        int lo = 0, hi = s->n_uni;
        while (lo < hi) {
            const int mid = lo + (hi - lo) / 2;
            if (s->uni[mid] < *b)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo == s->n_uni)
            return 0;
        *b = s->uni[lo];
        int end = *b + 1;
        for (int i = lo + 1; i < s->n_uni && s->uni[i] == end && same_heads(s, *b, end); i++)
            end++;
        *e = end;
        return heads_of(s, *b, heads);
    }
    for (; *b < NB; (*b)++) {
        const int cnt = heads_of(s, *b, heads);
        if (!cnt)
            continue;
        int end = *b + 1;
        while (end < NB && same_heads(s, *b, end))
            end++;
        *e = end;
        return cnt;
    }
    return 0;
}

/* One pass over the chosen runs: scores of K (pass 0) into s->scores, or
 * the weighted sum of V (pass 1) into out.  s->off[g] counts the tokens of
 * head g done so far.  `then`: the tensor read after this pass (V after K),
 * whose first run follows the last one, or NULL. */
static void attend_pass(const sa_kernels *kern, sa_scratch *s, const sa_kv *kv, int kh,
                        const float *qf, int seq_len, int bs, int pass, float *out,
                        ptrdiff_t out_head_stride, const sa_kv *then)
{
    int *heads = s->heads, *next_heads = s->heads2;
    int b = 0, e = 0;
    int cnt = sa_next_run(s, &b, &e, heads);
    while (cnt > 0) {
        int nb = e, ne = e;
        const int next_cnt = sa_next_run(s, &nb, &ne, next_heads);
        sa_span next = {.kv = kv, .kh = kh}, *after = NULL;
        if (next_cnt) {
            after = &next;
        } else if (then) {
            nb = 0;
            if (sa_next_run(s, &nb, &ne, next_heads)) {
                next.kv = then;
                after = &next;
            }
        }
        if (after) {
            next.row = sa_block_start(nb, bs);
            next.n = sa_block_end(ne - 1, bs, seq_len) - next.row;
        }
        const int r0 = sa_block_start(b, bs), n = sa_block_end(e - 1, bs, seq_len) - r0;
        for (int j = 0; j < cnt; j++) {
            const int g = heads[j];
            float *sc = s->scores + (ptrdiff_t)g * s->score_stride + s->off[g];
            if (pass == 0) {
                s->sp[j] = sc;
            } else {
                s->pp[j] = sc;
                s->op[j] = out + g * out_head_stride;
            }
            s->off[g] += n;
        }
        if (pass == 0)
            sa_score_rows(kern, s, kv, kh, qf, heads, cnt, r0, 1, n, after);
        else
            sa_accumulate_rows(kern, s, kv, kh, cnt, r0, n, after);
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
        s->z[g] = kern->softmax_exp(s->scores + (ptrdiff_t)g * s->score_stride, s->off[g], scale);
        memset(out + g * out_head_stride, 0, (size_t)D * sizeof(float));
        s->off[g] = 0;
    }
    attend_pass(kern, s, v, kh, qf, seq_len, bs, 1, out, out_head_stride, NULL);
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++)
            out[g * out_head_stride + d] /= s->z[g];
}
