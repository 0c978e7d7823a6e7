/* Per-block key bounds for scoring="minmax" (sa_bounds in sparse_attn.h). */
#ifndef SA_BOUNDS_H
#define SA_BOUNDS_H

#include "scratch.h"

/* SA_OK if b holds the bounds of K's first seq_len rows in blocks of
 * block_size, else SA_ERR_BOUNDS. */
int sa_check_bounds(const sa_bounds *b, const sa_kv *k, int seq_len, int block_size);

/* The checks of sa_bounds_update, and its work without them (for
 * sa_kv_append, which checks everything before writing anything). */
int sa_check_bounds_update(const sa_kv *k, int from_row, int to_row, const sa_bounds *b);
void sa_bounds_compute(const sa_kv *k, int from_row, int to_row, sa_bounds *b);

/* Quest's bound (spec §6) of every block for the G heads of KV head kh,
 * into s->probe like the probe's scores.  With `shared` (share="group")
 * head 0's row holds the group's summed bound, computed in one pass from the
 * heads' summed query signs, and the other rows are zero, so the group sum
 * sa_choose_group forms is that bound. */
void sa_minmax_group(const sa_kernels *kern, sa_scratch *s, const sa_bounds *b, int kh,
                     const float *qf, int shared);

#endif
