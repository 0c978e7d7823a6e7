/*
 * Copies of the probe's sampled K rows (see sa_probe_rows in sparse_attn.h).
 *
 * The seed's probe reads 8 rows of every 32, but rows 128 bytes apart with
 * 384-byte gaps are not cheaper than all of them: the hardware prefetchers
 * fetch the gaps too, so on K itself the probe costs a full read of K.  A
 * cache that copies the sampled rows out as they are appended lets the probe
 * read a quarter of K's bytes, front to back.  The copies are byte copies of
 * K's rows, so the scores are bitwise those the probe reads from K.
 */
#include <string.h>

#include "probe_rows.h"

int sa_probe_rows_geometry(int block_size, int n_probe, int *step)
{
    *step = sa_max(1, block_size / n_probe);
    return sa_ceil_div(block_size, *step);
}

sa_kv sa_probe_rows_view(const sa_probe_rows *p, int blocks)
{
    int step;
    const int cnt = sa_probe_rows_geometry(p->block_size, p->n_probe, &step);
    sa_kv view = p->rows;
    view.n_rows = (int)((int64_t)blocks * cnt);   /* <= p->rows.n_rows, checked */
    return view;
}

/* The copies hold readable rows of K's dtype, heads, width and q8 group. */
static int same_layout(const sa_probe_rows *p, const sa_kv *k)
{
    const sa_kv *r = &p->rows;
    if (sa_check_kv(r) || r->dtype != k->dtype || r->n_kv_heads != k->n_kv_heads ||
        r->head_dim != k->head_dim)
        return 0;
    return k->dtype != SA_DTYPE_Q8 || r->group_size == k->group_size;
}

int sa_check_probe_rows(const sa_probe_rows *p, const sa_kv *k, int seq_len, int block_size,
                        int n_probe)
{
    if (!p)
        return SA_ERR_NULL;
    if (!same_layout(p, k) || p->block_size != block_size || p->n_probe != n_probe ||
        p->k_rows < seq_len)
        return SA_ERR_PROBE_ROWS;
    int step;
    const int cnt = sa_probe_rows_geometry(block_size, n_probe, &step);
    if ((int64_t)(seq_len / block_size) * cnt > p->rows.n_rows)
        return SA_ERR_PROBE_ROWS;
    return SA_OK;
}

void sa_probe_rows_copy(const sa_kv *k, int from_row, int to_row, sa_probe_rows *p)
{
    const int D = k->head_dim, bs = p->block_size;
    const int ng = k->dtype == SA_DTYPE_Q8 ? D / k->group_size : 0;
    int step;
    const int cnt = sa_probe_rows_geometry(bs, p->n_probe, &step);
    const sa_kv *dst = &p->rows;
    for (int r = from_row; r < to_row; r++) {
        const int off = r % bs;
        if (off % step || off / step >= cnt)
            continue;
        const int64_t at = (int64_t)(r / bs) * cnt + off / step;
        if (at >= dst->n_rows)
            break;                  /* rows of blocks beyond the copies' capacity */
        for (int kh = 0; kh < k->n_kv_heads; kh++) {
            /* The pointers are const in sa_kv because kernels only read;
             * the cache owns the copies and hands them over writable. */
            if (k->dtype == SA_DTYPE_F32) {
                memcpy((float *)sa_kv_f32_row(dst, kh, (int)at), sa_kv_f32_row(k, kh, r),
                       (size_t)D * sizeof(float));
            } else {
                memcpy((int8_t *)sa_kv_q8_row(dst, kh, (int)at), sa_kv_q8_row(k, kh, r),
                       (size_t)D);
                memcpy((float *)sa_kv_scale_row(dst, kh, (int)at), sa_kv_scale_row(k, kh, r),
                       (size_t)ng * sizeof(float));
            }
        }
    }
    p->k_rows = to_row;
}

int sa_check_probe_rows_update(const sa_kv *k, int from_row, int to_row,
                               const sa_probe_rows *p)
{
    int rc = sa_check_kv(k);
    if (rc)
        return rc;
    if (!p)
        return SA_ERR_NULL;
    if (p->block_size < 1 || p->n_probe < 1 || p->k_rows < 0)
        return SA_ERR_PARAM;
    if (from_row < 0 || to_row < from_row || to_row > k->n_rows)
        return SA_ERR_SEQ_LEN;
    if (!same_layout(p, k) || from_row > p->k_rows)
        return SA_ERR_PROBE_ROWS;
    return SA_OK;
}

int sa_probe_rows_update(const sa_kv *k, int from_row, int to_row, sa_probe_rows *p)
{
    const int rc = sa_check_probe_rows_update(k, from_row, to_row, p);
    if (rc)
        return rc;
    sa_probe_rows_copy(k, from_row, to_row, p);
    return SA_OK;
}
