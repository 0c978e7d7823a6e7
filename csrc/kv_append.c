/*
 * Appending tokens to a cache (sa_kv_append): K and V rows, the key bounds
 * of the blocks they touch, the probe-row copies, the channel copy.  Everything is checked
 * (arguments, then both inputs' values: sa_kv_append_check) before the
 * first byte is written, and nothing allocates, so a refused append leaves
 * the cache as it was and one that returns SA_OK has written everything:
 * the Python layer reads the cache's length from the bounds' k_rows, so
 * this call is the append's commit.
 */
#include <string.h>

#include "bounds.h"
#include "channels.h"
#include "probe_rows.h"

/* Rows [at, at + T) of every KV head of dst from src [n_kv_heads, T, D]. */
static void write_rows(const sa_kv *dst, int at, const float *src, int T)
{
    const int D = dst->head_dim;
    for (int kh = 0; kh < dst->n_kv_heads; kh++) {
        const float *in = src + (ptrdiff_t)kh * T * D;
        /* The pointers are const in sa_kv because kernels only read; the
         * cache owns this memory and hands it over writable. */
        if (dst->dtype == SA_DTYPE_F32) {
            memcpy((float *)sa_kv_f32_row(dst, kh, at), in, (size_t)T * D * sizeof(float));
        } else {
            int8_t *q = (int8_t *)sa_kv_q8_row(dst, kh, at);
            float *sc = (float *)sa_kv_scale_row(dst, kh, at);
            const int ng = D / dst->group_size;
            for (int t = 0; t < T; t++)
                sa_quantize_row(in + (ptrdiff_t)t * D, D, dst->group_size, q + (ptrdiff_t)t * D,
                                sc + (ptrdiff_t)t * ng);
        }
    }
}

int sa_kv_append_check(const sa_kv *k, const sa_kv *v, int at, const float *k_new,
                       const float *v_new, int T, const sa_bounds *bounds,
                       const sa_probe_rows *probe_rows, const sa_channels *channels)
{
    int rc = sa_check_kv_pair(k, v);
    if (rc)
        return rc;
    if (!k_new || !v_new)
        return SA_ERR_NULL;
    if (T < 0 || at < 0 || (int64_t)at + T > k->n_rows || (int64_t)at + T > v->n_rows)
        return SA_ERR_SEQ_LEN;
    const int end = at + T;
    if (bounds) {
        if ((rc = sa_check_bounds_update(k, at, end, bounds)))
            return rc;
        if (bounds->k_rows != at || bounds->block_size < 1)
            return SA_ERR_BOUNDS;
    }
    if (probe_rows && (rc = sa_check_probe_rows_update(k, at, end, probe_rows)))
        return rc;
    if (channels) {
        if ((rc = sa_check_channels_update(k, at, end, channels)))
            return rc;
        if (channels->k_rows != at)
            return SA_ERR_CHANNELS;
    }
    const int64_t n = (int64_t)k->n_kv_heads * T * k->head_dim;
    if (!sa_values_ok(k_new, n))
        return SA_ERR_K_VALUES;
    if (!sa_values_ok(v_new, n))
        return SA_ERR_V_VALUES;
    return SA_OK;
}

int sa_kv_append(const sa_kv *k, const sa_kv *v, int at, const float *k_new,
                 const float *v_new, int T, sa_bounds *bounds, sa_probe_rows *probe_rows,
                 sa_channels *channels)
{
    const int rc = sa_kv_append_check(k, v, at, k_new, v_new, T, bounds, probe_rows, channels);
    if (rc)
        return rc;
    const int end = at + T;
    write_rows(k, at, k_new, T);
    write_rows(v, at, v_new, T);
    if (bounds)
        sa_bounds_compute(k, at, end, bounds);
    if (probe_rows)
        sa_probe_rows_copy(k, at, end, probe_rows);
    if (channels)
        sa_channels_compute(k, at, end, channels);
    return SA_OK;
}
