/*
 * What a scattered block costs on this machine, apart from sparse_attn.
 *
 * Sparse decode reads the chosen blocks of K and V: at 4096 tokens with
 * k=32, 32 of 128 blocks per KV head, each 4 KB of q8 rows plus 512 bytes of
 * scales in another array.  On the development VM attention over 32
 * scattered blocks took about twice as long with the KV in DRAM as in cache,
 * while the same number of contiguous blocks lost ~10%, and software
 * prefetching did not help.  This program separates that from the package:
 * it reads BLOCKS blocks of DATA bytes (plus SCALE bytes from a second
 * array) out of a buffer far larger than the caches, contiguous or at random
 * block indices, doing a fixed amount of integer work per byte, and reports
 * microseconds per block:
 *
 *   none      plain loads
 *   ahead-N   the lines of the block N ahead prefetched while this one is
 *             processed (N = 1, as sparse_attn's rows.c does, 2 and 4)
 *
 * Build and run (any C11 compiler; on a board too):
 *
 *   cc -O2 -pthread -o scattered_blocks bench/scattered_blocks.c && ./scattered_blocks
 *   ./scattered_blocks [buffer_MB] [work_rounds] [huge|small] [threads]
 *                                               (defaults 1024, 1, huge and 1)
 *
 * With threads > 1 every thread reads its own blocks at once, as the
 * kernels' threads do, and "random GB/s" is what they read together.
 *
 * huge asks Linux for transparent huge pages (madvise MADV_HUGEPAGE), as
 * a KVCache does for its arrays (one mapping per capacity from 2 MiB on,
 * advised once a write fills three quarters of it; docs/design.md) when
 * the kernel's THP setting is "madvise" or "always"; small keeps 4 KB pages,
 * where every scattered block is also a TLB miss.  On a Zen 4 VM (THP
 * "madvise") random blocks with prefetch cost 1.65-1.74x contiguous ones
 * on huge pages and 2.2-2.7x on small pages.  Built with
 * -march=native, where the work keeps up with the memory as the AVX-512
 * kernels do, one thread read contiguous blocks at 0.15 us each (~32 GB/s,
 * the bench's one-thread floor) and random ones at 0.50-0.52 us with their
 * lines prefetched 1, 2 or 4 blocks ahead (0.83 with none), about 9 GB/s;
 * two threads at once read contiguous blocks at ~32 GB/s together (the
 * two-thread floor: one core nearly fills this VM's share) and random ones
 * at 15 GB/s together, 2.0x the time per byte (every pass reads fresh
 * blocks: a repeated set would be partly served from the L3).  Prefetching further ahead did not lower it, nor did
 * prefetching or loading only the first lines of the next 1-8 blocks to
 * start the hardware prefetchers (0.66-0.77 us): on that VM a jump costs
 * about what a block's read does, whatever the distance.
 *
 * One work round costs about what the avx2 kernels spend on a block (~0.5
 * us on the development VM).  A "random / contiguous" ratio near 1 means
 * scattered blocks cost what streaming does (the hardware or the prefetch
 * hides the jumps); well above 1 means every jump costs, and short contexts
 * gain less from sparsity.  The development VM printed 2.3x (1.8x with
 * prefetch), about the penalty sparse decode shows there at 4096 tokens.
 */
#define _POSIX_C_SOURCE 200112L   /* clock_gettime, pthreads under -std=c11 */
#define _DEFAULT_SOURCE           /* madvise */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

enum { DATA = 4096, SCALE = 512, BLOCKS = 8192, REPEATS = 5 };
enum { MAX_THREADS = 64 };

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15u;

static uint64_t next_u64(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

/* A fixed amount of integer work per byte (a vectorisable multiply-add per
 * byte and round), standing in for the int8 dot products of a kernel. */
static uint32_t work(const uint8_t *p, size_t n, int rounds, uint32_t acc)
{
    for (int r = 0; r < rounds; r++) {
        uint16_t s[32] = {0};
        for (size_t i = 0; i < n; i += 32)
            for (int j = 0; j < 32; j++)
                s[j] = (uint16_t)(s[j] + p[i + j] * (uint8_t)(r + 1));
        for (int j = 0; j < 32; j++)
            acc = acc * 31u + s[j];
    }
    return acc;
}

static void prefetch(const uint8_t *p, size_t n)
{
    for (size_t o = 0; o < n; o += 64)
        __builtin_prefetch(p + o, 0, 2);
}

/* One thread's share of a pass: n blocks at idx. */
typedef struct {
    const uint8_t *data, *scale;
    const size_t *idx;
    int rounds, ahead;
    uint32_t acc;
} pass_arg;

static void *pass(void *arg)
{
    pass_arg *a = arg;
    uint32_t acc = 0;
    for (int i = 0; i < BLOCKS; i++) {
        if (a->ahead && i + a->ahead < BLOCKS) {
            prefetch(a->data + a->idx[i + a->ahead] * DATA, DATA);
            prefetch(a->scale + a->idx[i + a->ahead] * SCALE, SCALE);
        }
        acc = work(a->scale + a->idx[i] * SCALE, SCALE, a->rounds, acc);
        acc = work(a->data + a->idx[i] * DATA, DATA, a->rounds, acc);
    }
    a->acc = acc;
    return NULL;
}

/* Best of REPEATS passes, each over BLOCKS blocks per thread, all threads
 * started together and the pass timed until the last one ends; pass `rep`
 * of thread k reads the blocks at idx[(rep * threads + k) * BLOCKS ...], a
 * set no earlier pass touched, so nothing comes from a cache an earlier pass
 * filled (8192 blocks are 36 MB: on a 32 MB L3 a repeated set was partly
 * served from it, which flattered the contiguous case most).  Returns the
 * microseconds per block of one thread. */
static double run(const uint8_t *data, const uint8_t *scale, const size_t *idx, int threads,
                  int rounds, int ahead, uint32_t *sink)
{
    double best = 1e30;
    pass_arg args[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    for (int rep = 0; rep < REPEATS; rep++) {
        const double t0 = now();
        for (int k = 0; k < threads; k++) {
            args[k] = (pass_arg){data, scale, idx + ((size_t)rep * threads + k) * BLOCKS,
                                 rounds, ahead, 0};
            if (k > 0 && pthread_create(&tid[k], NULL, pass, &args[k])) {
                fprintf(stderr, "could not start a thread\n");
                exit(1);
            }
        }
        pass(&args[0]);
        for (int k = 1; k < threads; k++)
            pthread_join(tid[k], NULL);
        const double t = now() - t0;
        best = t < best ? t : best;
        for (int k = 0; k < threads; k++)
            *sink += args[k].acc;
    }
    return best / BLOCKS * 1e6;
}

static int huge_advised = 0;

/* n bytes on 2 MiB boundaries; "huge": transparent huge pages asked for
 * (huge_advised says whether the kernel took the advice). */
static void *alloc_pages(size_t n, const char *pages)
{
    const size_t align = (size_t)2 << 20, size = (n + align - 1) / align * align;
    void *p = aligned_alloc(align, size);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (p && !strcmp(pages, "huge"))
        huge_advised = madvise(p, size, MADV_HUGEPAGE) == 0;
#else
    (void)pages;
#endif
    return p;
}

int main(int argc, char **argv)
{
    const size_t mb = argc > 1 ? (size_t)strtoul(argv[1], NULL, 10) : 1024;
    const int rounds = argc > 2 ? atoi(argv[2]) : 1;
    const char *pages = argc > 3 ? argv[3] : "huge";
    const int threads = argc > 4 ? atoi(argv[4]) : 1;
    const size_t n_blocks = mb * (1u << 20) / DATA;
    const int ok_threads = threads >= 1 && threads <= MAX_THREADS;
    /* every pass of every thread a fresh contiguous set */
    const size_t sets = (size_t)REPEATS * (ok_threads ? threads : 1) * BLOCKS;
    if (!ok_threads || n_blocks < sets || rounds < 1 ||
        (strcmp(pages, "huge") && strcmp(pages, "small"))) {
        fprintf(stderr, "usage: %s [buffer_MB >= %zu x threads] [work_rounds >= 1] "
                "[huge|small] [threads 1..%d]\n", argv[0],
                (size_t)REPEATS * BLOCKS * DATA >> 20, MAX_THREADS);
        return 2;
    }
    uint8_t *data = alloc_pages(n_blocks * DATA, pages), *scale = alloc_pages(n_blocks * SCALE, pages);
    size_t *contig = malloc(sets * sizeof *contig), *random = malloc(sets * sizeof *random);
    if (!data || !scale || !contig || !random) {
        fprintf(stderr, "out of memory for a %zu MB buffer\n", mb);
        return 1;
    }
    for (size_t i = 0; i < n_blocks * DATA; i++)
        data[i] = (uint8_t)(i * 7u);
    for (size_t i = 0; i < n_blocks * SCALE; i++)
        scale[i] = (uint8_t)(i * 3u);
    /* The contiguous sets walk on through the buffer (wrapping at its end),
     * the random ones are fresh indices. */
    const size_t start = next_u64() % n_blocks;
    for (size_t i = 0; i < sets; i++) {
        contig[i] = (start + i) % n_blocks;
        random[i] = next_u64() % n_blocks;
    }
    uint32_t sink = 0;
    printf("%d blocks of %d + %d bytes per thread out of %zu MB, %d work rounds per byte, "
           "%s pages%s, %d thread(s); us per block of one thread (best of %d)\n", BLOCKS, DATA,
           SCALE, mb, rounds, pages,
           strcmp(pages, "huge") || huge_advised ? "" : " (not granted: no MADV_HUGEPAGE)",
           threads, REPEATS);
    printf("%-10s %12s %12s %8s %14s\n", "", "contiguous", "random", "ratio", "random GB/s");
    for (int ahead = 0; ahead <= 4; ahead = ahead ? 2 * ahead : 1) {
        const double c = run(data, scale, contig, threads, rounds, ahead, &sink);
        const double r = run(data, scale, random, threads, rounds, ahead, &sink);
        char name[16];
        snprintf(name, sizeof name, ahead ? "ahead-%d" : "none", ahead);
        printf("%-10s %12.3f %12.3f %7.2fx %14.1f\n", name, c, r, r / c,
               threads * (DATA + SCALE) / r * 1e-3);
    }
    printf("(checksum %u)\n", sink);
    free(data), free(scale), free(contig), free(random);
    return 0;
}
