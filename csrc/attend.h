/* Exact attention of a KV head group over its chosen blocks (spec §2.6). */
#ifndef SA_ATTEND_H
#define SA_ATTEND_H

#include "scratch.h"

/* The next run of consecutive blocks chosen (s->chosen, s->NB blocks) by
 * the same set of heads, from block *b on: the heads into `heads`, count
 * returned (0 at the end), blocks [*b, *e).  With the list of the chosen
 * blocks (s->n_uni >= 0, made by sa_choose_group) a run costs a binary
 * search and its own blocks; without it (every block chosen) the marks of
 * every block from *b on are read. */
int sa_next_run(const sa_scratch *s, int *b, int *e, int *heads);

/* Exact attention of the G query rows qf over the blocks marked in
 * s->chosen (block size bs): head g's output row is out + g *
 * out_head_stride (written, not added to).  Leaves the softmax weights of
 * head g in s->scores + g * s->max_tok and the sums in s->z. */
void sa_attend_group(const sa_kernels *kern, sa_scratch *s, const sa_kv *k,
                     const sa_kv *v, int kh, const float *qf, int seq_len, int bs,
                     float scale, float *out, ptrdiff_t out_head_stride);

/* The rows the group attends to: every valid row of a block some head of
 * the group chose, once (the union split-KV decode cuts into chunks). */
int64_t sa_union_rows(const sa_scratch *s, int seq_len, int bs);

/* One chunk's partial result: per head its largest score (-Inf when it has
 * no rows in the chunk), its softmax sum, then its unnormalised output row. */
static inline ptrdiff_t sa_chunk_part_floats(int G, int D)
{
    return (ptrdiff_t)G * (2 + (ptrdiff_t)D);
}

/* sa_attend_group over the union rows [w0, w1) only, into part (G maxima,
 * G sums, G x D sums of weighted V rows, not divided). */
void sa_attend_chunk(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, const sa_kv *v,
                     int kh, const float *qf, int seq_len, int bs, float scale, int64_t w0,
                     int64_t w1, float *part);

/* out (G x D) from n_chunks parts in chunk order: every chunk's weights
 * rescaled to the largest maximum, summed in chunk order, divided once. */
void sa_merge_chunks(const float *parts, int n_chunks, int G, int D, float scale, float *out);

#endif
