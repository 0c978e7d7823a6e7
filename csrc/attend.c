/*
 * Exact attention over chosen blocks (spec §2.6).
 *
 * The chosen blocks of a group are walked as runs: consecutive blocks
 * chosen by the same set of heads, so sparse decode with every block chosen
 * issues exactly dense decode's kernel calls.  Each pass (the scores of K,
 * then the weighted sum of V) hands rows.c one run at a time with the run
 * that follows it (after the last run of K, the first run of V), so the
 * stream of reads can be prefetched across the jumps between chosen blocks.
 *
 * A pass may be limited to a window of the group's attended rows (the
 * union of its heads' chosen blocks, ascending, counted once each): split-KV
 * decode (decode.c) cuts that union into chunks and attends each apart.
 * A run is then clipped to the window; the whole union is one window.
 */
#include <math.h>
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

int64_t sa_union_rows(const sa_scratch *s, int seq_len, int bs)
{
    int b = 0, e = 0;
    int64_t rows = 0;
    while (sa_next_run(s, &b, &e, s->heads) > 0) {
        rows += sa_block_end(e - 1, bs, seq_len) - sa_block_start(b, bs);
        b = e;
    }
    return rows;
}

/* Where a walk over the runs of a window stands: the next block to look at
 * and how many union rows lie before it. */
typedef struct {
    int b;
    int64_t u;
} cursor;

/* The next run inside the window [w0, w1) of union rows, clipped to it:
 * rows [*r0, *r0 + *n), its heads; their count, or 0 past the window. */
static int window_run(const sa_scratch *s, int seq_len, int bs, int64_t w0, int64_t w1,
                      cursor *at, int *r0, int *n, int *heads)
{
    for (;;) {
        int b = at->b, e = 0;
        const int cnt = sa_next_run(s, &b, &e, heads);
        if (!cnt || at->u >= w1)
            return 0;
        const int rs = sa_block_start(b, bs), len = sa_block_end(e - 1, bs, seq_len) - rs;
        const int64_t u = at->u;
        at->b = e;
        at->u += len;
        if (u + len <= w0)
            continue;
        const int lo = (int)(w0 > u ? w0 - u : 0);
        const int hi = (int)(w1 - u < len ? w1 - u : len);
        *r0 = rs + lo;
        *n = hi - lo;
        return cnt;
    }
}

/* One pass over the chosen runs inside [w0, w1): scores of K (pass 0) into
 * s->scores, or the weighted sum of V (pass 1) into out.  s->off[g] counts
 * the tokens of head g done so far.  `then`: the tensor read after this pass
 * (V after K), whose first run follows the last one, or NULL. */
static void attend_pass(const sa_kernels *kern, sa_scratch *s, const sa_kv *kv, int kh,
                        const float *qf, int seq_len, int bs, int64_t w0, int64_t w1,
                        int pass, float *out, ptrdiff_t out_head_stride, const sa_kv *then)
{
    int *heads = s->heads, *next_heads = s->heads2;
    cursor at = {0, 0};
    int r0 = 0, n = 0;
    int cnt = window_run(s, seq_len, bs, w0, w1, &at, &r0, &n, heads);
    while (cnt > 0) {
        sa_span next = {.kv = kv, .kh = kh}, *after = NULL;
        const int next_cnt = window_run(s, seq_len, bs, w0, w1, &at, &next.row, &next.n,
                                        next_heads);
        if (next_cnt) {
            after = &next;
        } else if (then) {
            cursor first = {0, 0};
            if (window_run(s, seq_len, bs, w0, w1, &first, &next.row, &next.n, next_heads)) {
                next.kv = then;
                after = &next;
            }
        }
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
        r0 = next.row, n = next.n, cnt = next_cnt;
    }
}

static void attend_window(const sa_kernels *kern, sa_scratch *s, const sa_kv *k,
                          const sa_kv *v, int kh, const float *qf, int seq_len, int bs,
                          float scale, int64_t w0, int64_t w1, float *out,
                          ptrdiff_t out_head_stride, float *max_out)
{
    const int G = s->G, D = s->D;
    for (int g = 0; g < G; g++)
        s->off[g] = 0;
    attend_pass(kern, s, k, kh, qf, seq_len, bs, w0, w1, 0, out, out_head_stride, v);
    for (int g = 0; g < G; g++) {
        float *sc = s->scores + (ptrdiff_t)g * s->score_stride;
        if (max_out)
            max_out[g] = -INFINITY; /* no rows of head g here */
        s->z[g] = s->off[g] ? kern->softmax_exp(sc, s->off[g], scale, max_out ? &max_out[g] : NULL)
                            : 0.0f;
        memset(out + g * out_head_stride, 0, (size_t)D * sizeof(float));
        s->off[g] = 0;
    }
    attend_pass(kern, s, v, kh, qf, seq_len, bs, w0, w1, 1, out, out_head_stride, NULL);
}

void sa_attend_group(const sa_kernels *kern, sa_scratch *s, const sa_kv *k,
                     const sa_kv *v, int kh, const float *qf, int seq_len, int bs,
                     float scale, float *out, ptrdiff_t out_head_stride)
{
    const int G = s->G, D = s->D;
    attend_window(kern, s, k, v, kh, qf, seq_len, bs, scale, 0, INT64_MAX, out,
                  out_head_stride, NULL);
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++)
            out[g * out_head_stride + d] /= s->z[g];
}

void sa_attend_chunk(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, const sa_kv *v,
                     int kh, const float *qf, int seq_len, int bs, float scale, int64_t w0,
                     int64_t w1, float *part)
{
    const int G = s->G, D = s->D;
    float *acc = part + 2 * (ptrdiff_t)G;
    attend_window(kern, s, k, v, kh, qf, seq_len, bs, scale, w0, w1, acc, D, part);
    memcpy(part + G, s->z, (size_t)G * sizeof(float));
}

void sa_merge_chunks(const float *parts, int n_chunks, int G, int D, float scale, float *out)
{
    const ptrdiff_t part_floats = sa_chunk_part_floats(G, D);
    for (int g = 0; g < G; g++) {
        /* the largest chunk maximum, NaN if one is NaN */
        float m = -INFINITY;
        int nan = 0;
        for (int c = 0; c < n_chunks; c++) {
            const float mc = parts[c * part_floats + g];
            m = mc > m ? mc : m;
            nan |= mc != mc;
        }
        if (nan)
            m = NAN;
        float *o = out + (ptrdiff_t)g * D;
        memset(o, 0, (size_t)D * sizeof(float));
        float z = 0.0f;
        for (int c = 0; c < n_chunks; c++) {
            const float *p = parts + c * part_floats;
            const float mc = p[g];
            if (mc == -INFINITY)
                continue; /* no rows of this head here, or weights that are all 0 */
            /* exp(scale * (s - m)) = exp(scale * (s - mc)) * exp(scale * (mc - m)) */
            const float w = mc == m ? 1.0f : expf(scale * (mc - m));
            const float *acc = p + 2 * G + (ptrdiff_t)g * D;
            z += w * p[G + g];
            for (int d = 0; d < D; d++)
                o[d] += w * acc[d];
        }
        for (int d = 0; d < D; d++)
            o[d] /= z;
    }
}
