/*
 * The memory-bandwidth probe the benchmark compares kernels with: a plain
 * streaming read of a buffer, split over threads like the kernels are.  It
 * only sums 64-bit words (the sum is returned so the reads cannot be
 * optimised away); the compiler vectorises the loop with the baseline ISA,
 * which is already faster than DRAM.
 */
#include <string.h>

#include "internal.h"

typedef struct {
    const unsigned char *buf;
    int64_t n_bytes;
    int parts;
    uint64_t *sums;
} stream_ctx;

static int read_part(void *arg, int part, int worker)
{
    (void)worker;
    stream_ctx *c = arg;
    const int64_t words = c->n_bytes / 8;
    const int64_t w0 = words * part / c->parts, w1 = words * (part + 1) / c->parts;
    uint64_t acc[8] = {0};
    int64_t i = w0;
    for (; i + 8 <= w1; i += 8) {
        uint64_t w[8];
        memcpy(w, c->buf + i * 8, sizeof w);
        for (int j = 0; j < 8; j++)
            acc[j] += w[j];
    }
    for (; i < w1; i++) {
        uint64_t w;
        memcpy(&w, c->buf + i * 8, sizeof w);
        acc[0] += w;
    }
    c->sums[part] = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
    return SA_OK;
}

int sa_stream_read(const void *buf, int64_t n_bytes, int threads, uint64_t *checksum)
{
    if (!buf || !checksum)
        return SA_ERR_NULL;
    if (n_bytes < 0)
        return SA_ERR_SHAPE;
    uint64_t sums[64] = {0};
    const int parts = sa_min(sa_max(threads, 1), 64);
    stream_ctx c = {buf, n_bytes, parts, sums};
    int rc = sa_parallel_for(parts, parts, read_part, &c);
    uint64_t total = 0;
    for (int p = 0; p < parts; p++)
        total += sums[p];
    *checksum = total;
    return rc;
}
