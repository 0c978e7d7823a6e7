/*
 * The memory-bandwidth probe the benchmark compares kernels with: a plain
 * streaming read of a buffer with the widest loads of the active ISA (the
 * table's stream_sum), split over threads like the kernels are.  Its sum is
 * returned so the reads cannot be optimised away.
 */
#include "internal.h"

typedef struct {
    const unsigned char *buf;
    int64_t n_bytes;
    int parts;
    const sa_kernels *kern;
    uint64_t *sums;
} stream_ctx;

static int read_part(void *arg, int part, int worker)
{
    (void)worker;
    stream_ctx *c = arg;
    const int64_t words = c->n_bytes / 8;
    /* Parts start on 64-byte lines (8 words) so no line is read twice. */
    const int64_t lines = words / 8;
    const int64_t w0 = lines * part / c->parts * 8;
    const int64_t w1 = part == c->parts - 1 ? words : lines * (part + 1) / c->parts * 8;
    c->sums[part] = c->kern->stream_sum((const uint64_t *)c->buf + w0, (size_t)(w1 - w0));
    return SA_OK;
}

int sa_stream_read(const void *buf, int64_t n_bytes, int threads, uint64_t *checksum)
{
    if (!buf || !checksum)
        return SA_ERR_NULL;
    if (n_bytes < 0 || ((uintptr_t)buf & 7))
        return SA_ERR_SHAPE;
    uint64_t sums[64] = {0};
    const int parts = sa_min(sa_max(threads, 1), 64);
    stream_ctx c = {buf, n_bytes, parts, sa_active_kernels(), sums};
    int rc = sa_parallel_for(parts, parts, read_part, &c);
    uint64_t total = 0;
    for (int p = 0; p < parts; p++)
        total += sums[p];
    /* the bytes after the last whole word */
    for (int64_t i = n_bytes / 8 * 8; i < n_bytes; i++)
        total += c.buf[i];
    *checksum = total;
    return rc;
}
