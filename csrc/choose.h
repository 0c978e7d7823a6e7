/* The block choice of spec §2 steps 3-5 and §6: sinks, importance reserve,
 * score fill, recency insurance. */
#ifndef SA_CHOOSE_H
#define SA_CHOOSE_H

#include "scratch.h"

/* The importance reserve of spec §2.3: the blocks that importance picks
 * after the sinks, best first.  It depends on nothing per head, so a call
 * ranks it once. */
typedef struct {
    int32_t *blocks; /* n of them, malloc'd (NULL when n == 0) */
    int n;
} sa_reserve;

/* Block sums of importance[0, seq_len) and the top
 * min(importance_blocks, n_sel - sinks) of them past the sinks, into *out
 * (free out->blocks).  SA_ERR_NOMEM or SA_OK. */
int sa_importance_reserve(const float *importance, int seq_len, const sa_select_params *p,
                          int n_sel, sa_reserve *out);

/* The reserve's ranking from block sums: the top min(importance_blocks,
 * n_sel - sinks) of blocks [sinks, NB) by sums[b] (ties to the lower
 * index), best first, into blocks; their count returned. */
int sa_reserve_rank(const double *sums, int NB, const sa_select_params *p, int n_sel,
                    int32_t *blocks);

/* sums[b] = the sum (in double, in row order) of x over block b's rows
 * [b*bs, min((b+1)*bs, n)), for b < NB. */
void sa_block_sums(const float *x, int n, int bs, int NB, double *sums);

/* Fill s->chosen for the G heads of a KV head from the scores in s->probe,
 * and write each head's ascending block list to blocks[g * n_sel] if blocks
 * != NULL.  reserve: the call's importance reserve, or NULL without
 * importance. */
void sa_choose_group(sa_scratch *s, const sa_select_params *sp, const sa_reserve *reserve,
                     int32_t *blocks);

#endif
