/* Kernel calls over KV rows for some of a group's query heads: the one
 * place that turns (KV head, first row, step, count) into kernel operands,
 * and the one place that decides what to prefetch. */
#ifndef SA_ROWS_H
#define SA_ROWS_H

#include "scratch.h"

/* Rows [row, row + n) of KV head kh of kv: what a pass reads after the
 * rows of a call (the next chosen run, or the first run of V after K). */
typedef struct sa_span {
    const sa_kv *kv;
    int kh, row, n;
} sa_span;

/* Quantise the G query rows at q (G x D compact) into s->qq / s->qd. */
void sa_quantize_group(sa_scratch *s, const float *q, int group_size);

/* Scores of the `cnt` heads listed in `heads` (indices into the G rows of qf,
 * or of s->qq/s->qd for q8) against n rows of K from `row` on, every `step`
 * rows; head j's scores go to s->sp[j].  Contiguous rows (step 1) are read
 * as a stream: each kernel call of STRETCH rows prefetches the STRETCH rows
 * that follow it (then the first rows of `next`, which may be NULL). */
void sa_score_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, int kh,
                   const float *qf, const int *heads, int cnt, int row, int step, int n,
                   const sa_span *next);

/* s->op[j] += sum_t s->pp[j][t] * V[kh, r0 + t] for j < cnt, t < n, read
 * as a stream like sa_score_rows. */
void sa_accumulate_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *v, int kh,
                        int cnt, int r0, int n, const sa_span *next);

#endif
