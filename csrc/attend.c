/*
 * Exact attention over chosen blocks, and the one place that prefetches.
 *
 * The chosen blocks of a group are walked as runs: consecutive blocks
 * chosen by the same set of heads, one kernel call per stretch of a run, so
 * sparse decode with every block chosen issues exactly dense decode's
 * calls.  Each pass (the scores of K, then the weighted sum of V) reads its
 * rows as one stream: the runs in block order, and after the last run of K
 * the first run of V.  Before each stretch of STRETCH rows the next STRETCH
 * rows of that stream are prefetched: more of the same run (where the
 * hardware prefetchers would mostly follow anyway) or, at the end of a run,
 * the first rows of the next one, which after a jump the hardware does not
 * fetch.  The kernels themselves never prefetch.  Splitting a run into
 * stretches changes no result (kernels.h: a token's score does not depend
 * on its batch, and V is added in token order either way).
 */
#include <string.h>

#include "attend.h"
#include "rows.h"

/* Rows per kernel call and prefetch distance: a block of the seed's geometry
 * (not the call's block size, which for dense decode is the whole context). */
#define STRETCH 32

void sa_prefetch_rows(const sa_kv *kv, int kh, int r0, int n)
{
    if (n <= 0)
        return;
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
        const uintptr_t hi = (uintptr_t)base[i] + len[i];
        for (uintptr_t a = (uintptr_t)base[i] & ~(uintptr_t)63; a < hi; a += 64)
            __builtin_prefetch((const void *)a, 0, 2);
    }
}

/* The next run of consecutive blocks chosen by the same set of heads, from
 * block *b on: the heads into `heads`, count returned (0 at the end), blocks
 * [*b, *e). */
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

/* One pass over the chosen runs: scores of K (pass 0) into s->scores, or
 * the weighted sum of V (pass 1) into out.  s->off[g] counts the tokens of
 * head g done so far.  `then`: the tensor read after this pass (V after K),
 * whose first run is prefetched at the end, or NULL. */
static void attend_pass(const sa_kernels *kern, sa_scratch *s, const sa_kv *kv, int kh,
                        const float *qf, int seq_len, int bs, int pass, float *out,
                        ptrdiff_t out_head_stride, const sa_kv *then)
{
    int *heads = s->heads, *next_heads = s->heads2;
    int b = 0, e = 0;
    int cnt = next_run(s, &b, &e, heads);
    while (cnt > 0) {
        int nb = e, ne = e;
        const int next_cnt = next_run(s, &nb, &ne, next_heads);
        /* rows after this run: the next run's, or the first run of `then` */
        const sa_kv *pf = next_cnt ? kv : NULL;
        if (!next_cnt && then) {
            nb = 0;
            if (next_run(s, &nb, &ne, next_heads))
                pf = then;
        }
        const int pr0 = pf ? sa_block_start(nb, bs) : 0;
        const int pr1 = pf ? sa_block_end(ne - 1, bs, seq_len) : 0;
        const int r0 = sa_block_start(b, bs), r1 = sa_block_end(e - 1, bs, seq_len);
        /* 64-bit: r1 may be INT_MAX, and t0 + STRETCH must not wrap */
        for (int64_t t64 = r0; t64 < r1; t64 += STRETCH) {
            const int t0 = (int)t64, t1 = t0 + sa_min(STRETCH, r1 - t0);
            const int ahead = sa_min(STRETCH, r1 - t1);
            sa_prefetch_rows(kv, kh, t1, ahead);
            if (pf && ahead < STRETCH)
                sa_prefetch_rows(pf, kh, pr0, sa_min(STRETCH - ahead, pr1 - pr0));
            for (int j = 0; j < cnt; j++) {
                const int g = heads[j];
                float *sc = s->scores + (ptrdiff_t)g * s->max_tok + s->off[g] + (t0 - r0);
                if (pass == 0) {
                    s->sp[j] = sc;
                } else {
                    s->pp[j] = sc;
                    s->op[j] = out + g * out_head_stride;
                }
            }
            if (pass == 0)
                sa_score_rows(kern, s, kv, kh, qf, heads, cnt, t0, 1, t1 - t0);
            else
                sa_accumulate_rows(kern, s, kv, kh, cnt, t0, t1 - t0);
        }
        for (int j = 0; j < cnt; j++)
            s->off[heads[j]] += r1 - r0;
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
