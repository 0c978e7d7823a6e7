/* Copies of the probe's sampled K rows (sa_probe_rows in sparse_attn.h). */
#ifndef SA_PROBE_ROWS_H
#define SA_PROBE_ROWS_H

#include "internal.h"

/* The one statement of the probe's geometry for full blocks: rows kept per
 * block (returned) and the step between them (spec §2.2). */
int sa_probe_rows_geometry(int block_size, int n_probe, int *step);

/* The K view of the copies of the first `blocks` full blocks. */
sa_kv sa_probe_rows_view(const sa_probe_rows *p, int blocks);

/* SA_OK if the copies serve a probe of K's first seq_len rows with this
 * block_size and n_probe, else SA_ERR_PROBE_ROWS (SA_ERR_NULL for p NULL). */
int sa_check_probe_rows(const sa_probe_rows *p, const sa_kv *k, int seq_len, int block_size,
                        int n_probe);

/* The copies of K rows [from_row, to_row), no checks (sa_kv_append and
 * sa_probe_rows_update check first). */
void sa_probe_rows_copy(const sa_kv *k, int from_row, int to_row, sa_probe_rows *p);

/* The checks of sa_probe_rows_update, for sa_kv_append too. */
int sa_check_probe_rows_update(const sa_kv *k, int from_row, int to_row,
                               const sa_probe_rows *p);

#endif
