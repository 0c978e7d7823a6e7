/* Kernel calls over KV rows for some of a group's query heads: the one
 * place that turns (KV head, first row, step, count) into kernel operands. */
#ifndef SA_ROWS_H
#define SA_ROWS_H

#include "scratch.h"

/* Quantise the G query rows at q (G x D compact) into s->qq / s->qd. */
void sa_quantize_group(sa_scratch *s, const float *q, int group_size);

/* Scores of the `cnt` heads listed in `heads` (indices into the G rows of qf,
 * or of s->qq/s->qd for q8) against n rows of K from `row` on, every `step`
 * rows; head j's scores go to s->sp[j]. */
void sa_score_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, int kh,
                   const float *qf, const int *heads, int cnt, int row, int step, int n);

/* s->op[j] += sum_t s->pp[j][t] * V[kh, r0 + t] for j < cnt, t < n. */
void sa_accumulate_rows(const sa_kernels *kern, sa_scratch *s, const sa_kv *v, int kh,
                        int cnt, int r0, int n);

#endif
