/*
 * Dropping a cache's last rows (sa_kv_truncate): the key bounds and the
 * channel copy of a now partial last block, the probe-row copies' extent,
 * the importance of the dropped rows.  A truncation is one call, checked
 * in full before the first byte is written and allocating nothing: the
 * Python layer reads the cache's length from the bounds' k_rows, so no
 * interrupt can leave the cache with its length and its metadata at two
 * different rows (as one Python step after another could).
 */
#include <string.h>

#include "bounds.h"
#include "channels.h"
#include "probe_rows.h"

int sa_kv_truncate(const sa_kv *k, int seq_len, sa_bounds *bounds, sa_probe_rows *probe_rows,
                   sa_channels *channels, float *importance, int64_t n_importance)
{
    int rc = sa_check_kv(k);
    if (rc)
        return rc;
    if (!bounds)
        return SA_ERR_NULL;
    /* the whole kept range: block size, shapes and extent of the bounds */
    if ((rc = sa_check_bounds_update(k, 0, seq_len, bounds)))
        return rc;
    const int old = bounds->k_rows;
    if (old < 0 || old > k->n_rows)
        return SA_ERR_BOUNDS;
    if (seq_len > old)
        return SA_ERR_SEQ_LEN;
    if (probe_rows) {
        if ((rc = sa_check_probe_rows_update(k, seq_len, seq_len, probe_rows)))
            return rc;
        if (probe_rows->k_rows != old)
            return SA_ERR_PROBE_ROWS;
    }
    if (channels) {
        if ((rc = sa_check_channels_update(k, 0, seq_len, channels)))
            return rc;
        if (channels->k_rows != old)
            return SA_ERR_CHANNELS;
    }
    if (importance && n_importance < old)
        return SA_ERR_IMPORTANCE;

    if (importance)
        memset(importance + seq_len, 0, (size_t)(old - seq_len) * sizeof(float));
    /* from the start of the block holding row seq_len: nothing when seq_len
     * ends a block, else that block, now partial, from its kept rows */
    sa_bounds_compute(k, seq_len / bounds->block_size * bounds->block_size, seq_len, bounds);
    if (probe_rows)
        probe_rows->k_rows = seq_len;   /* the copies of kept rows stay valid */
    if (channels)
        sa_channels_compute(k, seq_len / channels->block_size * channels->block_size, seq_len,
                            channels);
    return SA_OK;
}
