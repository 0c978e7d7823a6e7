/* The channel-major copy of K for scoring="channels" (sa_channels in
 * sparse_attn.h). */
#ifndef SA_CHANNELS_H
#define SA_CHANNELS_H

#include "scratch.h"

/* SA_OK if c is the copy of K's first seq_len rows in blocks of block_size,
 * else SA_ERR_CHANNELS. */
int sa_check_channels(const sa_channels *c, const sa_kv *k, int seq_len, int block_size);

/* The checks of sa_channels_update, and its work without them (for
 * sa_kv_append, which checks everything before writing anything). */
int sa_check_channels_update(const sa_kv *k, int from_row, int to_row, const sa_channels *c);
void sa_channels_compute(const sa_kv *k, int from_row, int to_row, sa_channels *c);

/* Spec §6's channel score of every block for the G heads of KV head kh,
 * into s->probe like the probe's scores: the group's n_channels channels
 * of largest summed |q| (ties to the lower channel), scored in ascending
 * channel order against the copy. */
void sa_channels_group(const sa_kernels *kern, sa_scratch *s, const sa_channels *c,
                       int n_channels, int kh, const float *qf, int seq_len);

#endif
