/*
 * stream_sum (kernels.h), the bandwidth probe's kernel, written once for the
 * SIMD families (x86/x86_common.h, arm/neon_common.h).  The includer defines
 * SA_ISA_ID and SA_STREAM_BYTES, the width of its ISA's widest loads (16 for
 * NEON, 32 for AVX2, 64 for AVX-512); GCC's vector extensions then compile
 * the one body to those loads under the including file's target.
 *
 * Four independent accumulators keep several loads in flight; the sum of
 * 64-bit words wraps, so the order of the additions cannot change it.
 */
#ifndef SA_STREAM_SUM_H
#define SA_STREAM_SUM_H

#include <stddef.h>
#include <stdint.h>

/* SA_STREAM_BYTES of words at any 8-byte aligned address. */
typedef uint64_t sa_stream_vec
    __attribute__((vector_size(SA_STREAM_BYTES), aligned(8), may_alias));

static uint64_t SA_FN(stream_sum)(const uint64_t *buf, size_t n_words)
{
    enum { W = SA_STREAM_BYTES / 8 }; /* words per vector */
    sa_stream_vec a0 = {0}, a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 4 * W <= n_words; i += 4 * W) {
        const sa_stream_vec *x = (const sa_stream_vec *)(buf + i);
        a0 += x[0], a1 += x[1], a2 += x[2], a3 += x[3];
    }
    const sa_stream_vec a = (a0 + a1) + (a2 + a3);
    uint64_t sum = 0;
    for (int j = 0; j < W; j++)
        sum += a[j];
    for (; i < n_words; i++)
        sum += buf[i];
    return sum;
}

#endif
