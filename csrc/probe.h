/* The probe of spec §2.2: per head and block, the largest dot of the query
 * with the block's sampled keys. */
#ifndef SA_PROBE_H
#define SA_PROBE_H

#include "scratch.h"

/* Floats of probe_tmp per head that sa_probe_group needs for a context of
 * seq_len rows: every sampled dot of the full blocks, or the last block's. */
size_t sa_probe_tmp_floats(int seq_len, int block_size, int n_probe);

/* probe[g*NB + b] for the G heads of KV head kh; the full blocks' samples
 * are read from `rows` (checked copies) when it is not NULL, else from K. */
void sa_probe_group(const sa_kernels *kern, sa_scratch *s, const sa_kv *k, int kh,
                    const float *qf, int seq_len, int block_size, int n_probe,
                    const sa_probe_rows *rows);

#endif
